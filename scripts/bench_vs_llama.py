#!/usr/bin/env python3
"""Side-by-side benchmark: `ds4-bench --backend cpu` against llama.cpp's `llama-bench`, same file.

Issue 22's acceptance: decode and prefill stay >= 2x llama.cpp, measured in the same run on the same
file, and decode reaches >= 85 % of the read floor that ds4-bench measures in that run.

    python scripts/bench_vs_llama.py -m f.gguf [--rounds 3] [--threads 2] [--work-dir DIR] [--keep-copy]
                                     [--isa avx2]

--isa avx2 compares the AVX2 builds on a machine with AVX-512 (issue 36): llama.cpp is built with
AVX-512 off (-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_AVX512=OFF, into its own cache folder, ...-avx2) and ds4-bench runs with --isa avx2 (the cpu
kernels' AVX2 build, kernels.set_isa).

What it does:

1. Builds `llama-bench` once, into ~/.cache/ds4-peers/llama.cpp-<ver>/ (never into the repository):
   `pip download --no-binary :all: --no-deps llama-cpp-python==<ver>` gives the sdist, whose
   vendor/llama.cpp has `deepseek4` support; CMake with -DGGML_NATIVE=ON -DLLAMA_CURL=OFF, target
   llama-bench only. About 6 minutes on 2 free cores, longer on a busy machine.
2. Writes a copy of the file that llama.cpp's loader accepts: its deepseek4 loader requires
   `deepseek4.expert_gating_func` (u32; 4 = sqrt-softplus, the score function ds4 hard-codes) and
   reads `deepseek4.context_length` as u32 only. ds4's own files carry neither (context_length is
   u64 there, and ds4 reads it only as u64), and our synthesizer writes what ds4's files hold, so
   the edit stays here, in a copy, and engine/gguf/synth.py is not changed for a peer's loader.
   Only the key/value section changes; the tensor infos and the tensor bytes are copied verbatim
   (copy_file_range), and the copy's data section is checked to have the source's length.
   BOTH tools then run on that copy, so "the same file" holds to the byte and only one copy of
   the weights sits in the page cache (two 9.5 GB copies plus ds4's resident one would not fit
   in 24 GiB). The copy is deleted at the end unless --keep-copy.
3. Runs the two benchmarks alternately, ABBA order (ds4 first in odd rounds, llama first in even
   ones) so that a drift of the machine's speed falls on both alike:
       ds4-bench -m COPY --backend cpu --threads T --ctx-start 512 --ctx-max 512 --gen-tokens 64
       llama-bench -m COPY -t T -p 512 -n 64 -d 0,512 --repack 0 -r 1 -o json
   `-d 0,512` adds llama.cpp's decode after 512 tokens of context, which is what ds4-bench's
   decode row measures (ds4-bench decodes right after its 512-token prefill); its pp512 at
   depth 0 matches ds4-bench's prefill. `--repack 0` because llama.cpp's AMX repack path aborts
   on this model. llama-bench's prompt is random tokens, ds4-bench's is text: the routing
   differs, the work per token does not.
   Before each run it waits (at most --quiet-wait s) until others keep at most --quiet-busy of the
   CPUs busy and memory is free for the run, then reads the file once through the page cache: with
   2 threads on 2 cores any other busy process stalls both tools' thread barriers, and a cold cache
   would fall on ds4-bench's prefill (its first timed step) but be hidden by llama-bench's warm-up.
4. Prints, per round, the load average before each run, both tools' prefill and decode t/s,
   the ratios ds4/llama, and ds4's decode as a fraction of the read floor from its own stderr;
   then the median and range over rounds. The decode ratio is taken against llama's tg at an empty
   context (the issue's command, the harder comparison for ds4) and, beside it, after --ctx-depth.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_VER = "0.3.36"
GATING_SQRT_SOFTPLUS = 4          # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
ARCH = "deepseek4"

# GGUF value types (gguf spec): id -> struct format of one scalar; 8 = string, 9 = array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
           12: "<d"}
T_U32, T_STRING, T_ARRAY, T_U64 = 4, 8, 9, 10


# ---------------------------------------------------------------- llama-bench build

def llama_bench_path(cache: Path) -> Path:
    return cache / "build" / "bin" / "llama-bench"


#: CMake flags of llama.cpp's CPU build per --isa
ISA_FLAGS = {"native": ["-DGGML_NATIVE=ON"],
             "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                      "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
                      "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF",
                      "-DGGML_AMX_INT8=OFF"]}


def build_llama_bench(cache: Path, jobs: int, isa: str = "native") -> Path:
    """Download the sdist, unpack vendor/llama.cpp, build only llama-bench. Reuses a finished build."""
    exe = llama_bench_path(cache)
    if exe.exists():
        return exe
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / "src"
    if not (src / "CMakeLists.txt").exists():
        sdist = cache / f"llama_cpp_python-{LLAMA_VER}.tar.gz"
        if not sdist.exists():
            _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                  f"llama-cpp-python=={LLAMA_VER}", "-d", str(cache)])
        prefix = f"llama_cpp_python-{LLAMA_VER}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            tar.extractall(src, members=members, filter="data")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(src), "-B", str(cache / "build"), *gen, "-DCMAKE_BUILD_TYPE=Release",
          *ISA_FLAGS[isa], "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    t0 = time.time()
    _run(["cmake", "--build", str(cache / "build"), "--target", "llama-bench", f"-j{jobs}"])
    print(f"built {exe} in {time.time() - t0:.0f} s", file=sys.stderr)
    return exe


def _run(cmd):
    print("+ " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


# ---------------------------------------------------------------- the header llama.cpp loads

class _Reader:
    def __init__(self, f):
        self.f = f

    def take(self, fmt):
        n = struct.calcsize(fmt)
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("truncated GGUF header")
        return struct.unpack(fmt, b)[0]

    def skip_value(self, vtype):
        if vtype == T_STRING:
            self.f.seek(self.take("<Q"), os.SEEK_CUR)
        elif vtype == T_ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALAR:    # fixed-size elements: one seek
                self.f.seek(struct.calcsize(_SCALAR[etype]) * count, os.SEEK_CUR)
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            self.f.seek(struct.calcsize(_SCALAR[vtype]), os.SEEK_CUR)


def _kv_bytes(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def scan_header(path: str) -> dict:
    """The byte spans of the header: each KV (key, type, raw bytes), the tensor infos, data start."""
    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
        kvs, alignment = [], 32
        for _ in range(n_kv):
            start = f.tell()
            key = f.read(r.take("<Q")).decode()
            vtype = r.take("<I")
            vstart = f.tell()
            if key == "general.alignment" and vtype == T_U32:
                alignment = r.take("<I")
            else:
                r.skip_value(vtype)
            end = f.tell()
            f.seek(vstart)
            value = f.read(end - vstart)
            f.seek(start)
            kvs.append((key, vtype, f.read(end - start), value))
        ti_start = f.tell()
        for _ in range(n_tensors):
            f.seek(r.take("<Q"), os.SEEK_CUR)              # name
            f.seek(8 * r.take("<I") + 4 + 8, os.SEEK_CUR)  # dims, type, offset
        ti_end = f.tell()
        f.seek(ti_start)
        tensor_infos = f.read(ti_end - ti_start)
    data_start = -(-ti_end // alignment) * alignment
    return {"version": version, "n_tensors": n_tensors, "kvs": kvs, "tensor_infos": tensor_infos,
            "alignment": alignment, "data_start": data_start, "size": os.path.getsize(path)}


def llama_edits(h: dict) -> tuple[list[bytes], list[str]]:
    """The KV section llama.cpp's deepseek4 loader accepts, and what was changed to get it."""
    out, changed, keys = [], [], {k for k, *_ in h["kvs"]}
    for key, vtype, raw, value in h["kvs"]:
        if key == f"{ARCH}.context_length" and vtype != T_U32:
            v = struct.unpack(_SCALAR[vtype], value)[0]
            if not 0 < v < 1 << 32:
                raise ValueError(f"{key} = {v} does not fit a u32")
            out.append(_kv_bytes(key, T_U32, struct.pack("<I", v)))
            changed.append(f"{key}: type {vtype} -> u32 ({v})")
        else:
            out.append(raw)
    if f"{ARCH}.expert_gating_func" not in keys:
        out.append(_kv_bytes(f"{ARCH}.expert_gating_func", T_U32, struct.pack("<I", GATING_SQRT_SOFTPLUS)))
        changed.append(f"{ARCH}.expert_gating_func added (u32 {GATING_SQRT_SOFTPLUS}, sqrt-softplus)")
    return out, changed


def write_llama_copy(src: str, dst: Path) -> tuple[str, list[str]]:
    """`src` itself if llama.cpp loads it as it is, else a copy at `dst` with the edited KV section."""
    h = scan_header(src)
    kvs, changed = llama_edits(h)
    if not changed:
        return src, []
    head = (b"GGUF" + struct.pack("<IQQ", h["version"], h["n_tensors"], len(kvs)) + b"".join(kvs)
            + h["tensor_infos"])
    head += b"\0" * (-len(head) % h["alignment"])     # tensor offsets are relative to this start
    data_len = h["size"] - h["data_start"]
    tmp = dst.with_name(dst.name + ".part")
    t0 = time.time()
    with open(src, "rb") as fi, open(tmp, "wb") as fo:
        fo.write(head)
        fi.seek(h["data_start"])
        left = data_len
        while left:
            n = os.copy_file_range(fi.fileno(), fo.fileno(), min(left, 1 << 30))
            if n <= 0:
                raise OSError(f"copy_file_range stopped with {left} bytes left")
            left -= n
    if os.path.getsize(tmp) - len(head) != data_len:
        raise OSError("the copy's data section differs in length from the source's")
    os.replace(tmp, dst)
    print(f"llama.cpp copy: {dst} ({os.path.getsize(dst):,} B, {time.time() - t0:.1f} s); "
          + "; ".join(changed), file=sys.stderr)
    return str(dst), changed


# ---------------------------------------------------------------- the two benchmarks

def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def _stat():
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return v[3] + v[4], sum(v)          # idle + iowait, total (clock ticks over all CPUs)


def cpu_busy(seconds: float = 2.0) -> float:
    """Fraction of all CPUs busy over `seconds` (from /proc/stat): others' work on a shared machine."""
    i0, t0 = _stat()
    time.sleep(seconds)
    i1, t1 = _stat()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def run_timed(cmd, timeout):
    """Run `cmd`; also return the share of the CPUs others used meanwhile (all busy time minus the
    child's own user+system time): a run with others at 10 % or more is not a clean measurement."""
    i0, t0 = _stat()
    r0 = os.times()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    i1, t1 = _stat()
    r1 = os.times()
    hz = os.sysconf("SC_CLK_TCK")
    child = (r1.children_user + r1.children_system - r0.children_user - r0.children_system) * hz
    others = max(0.0, ((t1 - t0) - (i1 - i0) - child) / max(t1 - t0, 1))
    return p, others


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def warm(path: str) -> str:
    """Read the file through the page cache once, so that neither tool's timed part pays for the disk.

    Others' files compete for the cache on a shared machine; llama-bench's warm-up runs would hide a
    cold cache and ds4-bench's prefill (first after open) would not. Returns the read's rate: a few
    GB/s means it was cached already."""
    t0, n = time.time(), 0
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(64 << 20)
        while (k := f.readinto(buf)):
            n += k
    dt = time.time() - t0
    return f"warm read {n / dt / 1e9:.1f} GB/s"


def wait_quiet(a, need_bytes: int) -> str:
    """Wait (at most a.quiet_wait s) until others leave the CPUs and enough memory free; say what it was."""
    t0 = time.time()
    while True:
        busy, avail = cpu_busy(1.0), mem_available()
        if (busy <= a.quiet_busy and avail >= need_bytes) or time.time() - t0 >= a.quiet_wait:
            break
        time.sleep(0.5)
    waited = f", waited {time.time() - t0:.0f} s" if time.time() - t0 > 3 else ""
    return f"load {loadavg()}, busy {busy:.0%}, avail {avail / 2**30:.1f} GiB{waited}, {warm(a.model_path)}"


def ds4_bench_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ds4-bench")
    return [str(exe)] if exe.exists() else [shutil.which("ds4-bench") or "ds4-bench"]


def run_ds4(model: str, a) -> dict:
    cmd = [*ds4_bench_cmd(), "-m", model, "--backend", "cpu", "--threads", str(a.threads),
           "--ctx-start", str(a.ctx), "--ctx-max", str(a.ctx), "--gen-tokens", str(a.gen), *a.ds4_arg]
    load = wait_quiet(a, a.need_ds4)
    p, others = run_timed(cmd, a.timeout)
    if p.returncode:
        raise RuntimeError(f"ds4-bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    row = next(csvrow for csvrow in _csv_rows(p.stdout) if int(csvrow["ctx_tokens"]) == a.ctx)
    err = p.stderr
    floor = re.search(r"floors: read ([\d.]+) GB/s, gemm ([\d.]+) GFLOP/s", err)
    dec = re.search(r"decode [\d.]+ t/s = ([\d.]+)% of read floor", err)
    opened = re.search(r"open: ([\d.]+) s, paging (\w+)", err)
    return {"cmd": cmd, "load": load, "others": others, "prefill": float(row["prefill_tps"]), "decode": float(row["gen_tps"]),
            "read_floor_gbs": float(floor.group(1)), "gemm_floor": float(floor.group(2)),
            "decode_of_floor": float(dec.group(1)) / 100, "open_s": float(opened.group(1)),
            "paging": opened.group(2), "stderr": err}


def _csv_rows(text: str):
    lines = [ln for ln in text.splitlines() if ln.strip()]
    head = lines[0].split(",")
    return [dict(zip(head, ln.split(","))) for ln in lines[1:]]


def run_llama(exe: Path, model: str, a) -> dict:
    depths = "0" if a.ctx_depth == 0 else f"0,{a.ctx_depth}"
    cmd = [str(exe), "-m", model, "-t", str(a.threads), "-p", str(a.ctx), "-n", str(a.gen), "-d", depths,
           "--repack", str(a.repack), "-r", "1", "-o", "json", *a.llama_arg]
    load = wait_quiet(a, a.need_llama)
    p, others = run_timed(cmd, a.timeout)
    if p.returncode:
        raise RuntimeError(f"llama-bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    tests = json.loads(p.stdout)
    pick = {(t["n_prompt"], t["n_gen"], t["n_depth"]): t["avg_ts"] for t in tests}
    out = {"cmd": cmd, "load": load, "others": others, "prefill": pick[(a.ctx, 0, 0)], "decode_d0": pick[(0, a.gen, 0)],
           "build": tests[0].get("build_commit", "?"), "cpu": tests[0].get("cpu_info", "?")}
    # ds4-bench decodes after its prefill, so the like-for-like llama figure is tg at depth ctx
    out["decode"] = pick.get((0, a.gen, a.ctx_depth), out["decode_d0"])
    return out


# ---------------------------------------------------------------- report

def _fmt_range(xs, fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def report(rounds: list[dict], a) -> str:
    d = a.ctx_depth
    lines = [f"| round | order | ds4 prefill {a.ctx} | llama pp{a.ctx} | ratio | ds4 decode {a.gen} after {a.ctx} "
             f"| llama tg{a.gen} (empty ctx) | ratio | llama tg{a.gen} after {d} | ratio "
             f"| ds4 decode / read floor | read floor GB/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rounds, 1):
        s, l = r["ds4"], r["llama"]
        lines.append(f"| {i} | {' '.join(r)} | {s['prefill']:.2f} | {l['prefill']:.2f} "
                     f"| {s['prefill'] / l['prefill']:.2f}x | {s['decode']:.2f} | {l['decode_d0']:.2f} "
                     f"| {s['decode'] / l['decode_d0']:.2f}x | {l['decode']:.2f} | {s['decode'] / l['decode']:.2f}x "
                     f"| {s['decode_of_floor']:.1%} | {s['read_floor_gbs']:.1f} |")
    lines += ["", "machine before each run (others' CPU use over 1 s, MemAvailable, the warm read) and during it:"]
    lines += [f"  round {i} {who}: {x['load']}; others used {x['others']:.0%} of the CPUs during the run"
              for i, r in enumerate(rounds, 1) for who, x in r.items()]
    col = lambda who, k: [r[who][k] for r in rounds]
    pre_ratio = [r["ds4"]["prefill"] / r["llama"]["prefill"] for r in rounds]
    dec_ratio = [r["ds4"]["decode"] / r["llama"]["decode_d0"] for r in rounds]
    dec_ratio_d = [r["ds4"]["decode"] / r["llama"]["decode"] for r in rounds]
    lines += ["", f"median (range) over {len(rounds)} rounds:",
              f"  ds4 prefill {_fmt_range(col('ds4', 'prefill'))} t/s, llama {_fmt_range(col('llama', 'prefill'))}"
              f" t/s, ratio {_fmt_range(pre_ratio)}x",
              f"  ds4 decode {_fmt_range(col('ds4', 'decode'))} t/s; llama {_fmt_range(col('llama', 'decode_d0'))}"
              f" t/s (empty context), ratio {_fmt_range(dec_ratio)}x; llama after {d}: "
              f"{_fmt_range(col('llama', 'decode'))} t/s, ratio {_fmt_range(dec_ratio_d)}x",
              f"  ds4 decode as a fraction of its read floor: {_fmt_range(col('ds4', 'decode_of_floor'), '{:.1%}')}"
              f"; read floor {_fmt_range(col('ds4', 'read_floor_gbs'), '{:.1f}')} GB/s",
              f"  ds4 paging {rounds[0]['ds4']['paging']}, open {_fmt_range(col('ds4', 'open_s'))} s; "
              f"llama.cpp build {rounds[0]['llama']['build']}, cpu {rounds[0]['llama']['cpu']}",
              "commands:", "  " + " ".join(rounds[0]["ds4"]["cmd"]), "  " + " ".join(rounds[0]["llama"]["cmd"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", required=True, help="the GGUF file (ds4's layout)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=512, help="prefill length (ds4 frontier, llama -p)")
    p.add_argument("--gen", type=int, default=64, help="decoded tokens (ds4 --gen-tokens, llama -n)")
    p.add_argument("--ctx-depth", type=int, default=None,
                   help="llama tg depth to compare ds4's decode with (default --ctx; 0 = empty context)")
    p.add_argument("--repack", type=int, default=0, help="llama-bench --repack (default 0)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "ds4-peers" / f"llama.cpp-{LLAMA_VER}")
    p.add_argument("--jobs", type=int, default=2, help="build jobs")
    p.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native",
                   help="avx2: both tools' AVX2 builds (llama.cpp with AVX-512 off, ds4-bench --isa avx2)")
    p.add_argument("--work-dir", type=Path, default=None, help="where the edited copy goes (default $TMPDIR or /tmp)")
    p.add_argument("--keep-copy", action="store_true", help="keep the edited copy for later runs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark run")
    p.add_argument("--ds4-arg", action="append", default=[], help="extra ds4-bench argument (repeatable)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-bench argument (repeatable)")
    p.add_argument("--quiet-busy", type=float, default=0.25,
                   help="before each run wait until others keep at most this fraction of the CPUs busy")
    p.add_argument("--quiet-wait", type=float, default=600, help="wait at most this long (s), then run anyway")
    p.add_argument("--json", type=Path, default=None, help="also write every round's figures here")
    a = p.parse_args(argv)
    a.ctx_depth = a.ctx if a.ctx_depth is None else a.ctx_depth
    if a.isa != "native":
        a.cache = a.cache.with_name(f"{a.cache.name}-{a.isa}")
        a.ds4_arg += ["--isa", a.isa]

    exe = build_llama_bench(a.cache, a.jobs, a.isa)
    work = a.work_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    dst = work / f"{Path(a.model).stem}.llama.gguf"
    fresh = dst.exists() and a.keep_copy and dst.stat().st_mtime >= Path(a.model).stat().st_mtime
    model, changed = (str(dst), ["(copy reused)"]) if fresh else write_llama_copy(a.model, dst)
    # ds4's resident paging holds a copy of the weights beside the file's page cache; llama.cpp maps
    size = os.path.getsize(model)
    a.model_path = model
    a.need_ds4, a.need_llama = 2 * size + (1 << 30), size + (1 << 30)
    rounds = []
    try:
        for i in range(a.rounds):
            order = ("ds4", "llama") if i % 2 == 0 else ("llama", "ds4")
            r = {}
            for who in order:
                r[who] = run_ds4(model, a) if who == "ds4" else run_llama(exe, model, a)
                x = r[who]
                print(f"round {i + 1} {who}: {x['load']}, prefill {x['prefill']:.2f} t/s, "
                      f"decode {x['decode']:.2f} t/s, others {x['others']:.0%} during", file=sys.stderr)
            rounds.append(r)
    finally:
        if model != a.model and not a.keep_copy:
            os.unlink(model)
    print(f"file: {a.model} (both tools ran on {'it' if model == a.model else 'its llama.cpp copy'};"
          f" {'; '.join(changed) or 'no header change'})")
    print(report(rounds, a))
    if a.json:
        a.json.write_text(json.dumps(rounds, indent=1))   # ds4-bench's stderr too: its floors, open, memory
    return 0


if __name__ == "__main__":
    sys.exit(main())
