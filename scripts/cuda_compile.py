#!/usr/bin/env python3
"""Compiles every CUDA kernel (cuda_kernels/*.cu) with NVRTC for sm_80, sm_89, sm_90 and sm_120,
with no GPU and no driver, runs `ptxas -v` on each, and writes the register / shared-memory /
spill table into docs/cuda.md (between its ptxas-table markers).

NVRTC comes from the nvidia-cuda-nvrtc-cu12 wheel (libnvrtc through ctypes), cuda_fp16.h from
nvidia-cuda-runtime-cu12's headers, ptxas from nvidia-cuda-nvcc-cu12 (pyproject's `cuda-build`
extra). NVRTC emits PTX for compute_XX; ptxas assembles it for sm_XX, as the driver would.

    python scripts/cuda_compile.py            # compile, check, rewrite the table in docs/cuda.md
    python scripts/cuda_compile.py --check    # compile, check, fail if docs/cuda.md's table is stale

Fails (exit 1) on a compile error, on a spill in a kernel that must not spill (the decode
matvecs, ds4's GEMM and the attention: NO_SPILL below), or where the tensor-core kernels' PTX lacks
their mma instruction (MMA below).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "cuda_kernels"
DOC = ROOT / "docs" / "cuda.md"
ARCHS = ("sm_80", "sm_89", "sm_90", "sm_120")
NO_SPILL = ("matvec_", "ds4_matvec_", "ds4_gemm_", "attn_")   # kernel name prefixes that must not spill
# files whose PTX must hold a tensor-core instruction on every architecture (the mma path, not its
# sm < 80 trap, is what the arch guard selects)
MMA = {"ds4_mma.cu": "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"}
BEGIN, END = "<!-- ptxas-table:begin (scripts/cuda_compile.py) -->", "<!-- ptxas-table:end -->"


class CompileError(RuntimeError):
    pass


def _wheel_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def tools() -> tuple[Path, Path, Path]:
    """(libnvrtc, the CUDA runtime include dir, ptxas) from the nvidia-*-cu12 wheels."""
    found = []
    for mod, rel in (("nvidia.cuda_nvrtc", "lib"), ("nvidia.cuda_runtime", "include"), ("nvidia.cuda_nvcc", "bin")):
        d = _wheel_dir(mod)
        if d is None or not (d / rel).is_dir():
            raise CompileError(f"{mod} is not installed: pip install -e '.[cuda-build]'")
        found.append(d / rel)
    libs = sorted(found[0].glob("libnvrtc.so*"))
    libs = [p for p in libs if ".alt." not in p.name] or libs
    if not libs:
        raise CompileError(f"no libnvrtc.so in {found[0]}")
    return libs[0], found[1], found[2] / "ptxas"


class Nvrtc:
    def __init__(self, lib: Path):
        self.lib = ctypes.CDLL(str(lib))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CompileError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def ptx(self, src: str, name: str, arch: str, include: list[Path]) -> str:
        """PTX of src for compute_XX (arch = sm_XX); CompileError with NVRTC's log on failure."""
        prog = ctypes.c_void_p()
        self._ok(self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None),
                 "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture=compute_{arch[3:]}", "--std=c++17", *[f"-I{d}" for d in include]]
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            if rc != 0:
                raise CompileError(f"{name} ({arch}): {self.lib.nvrtcGetErrorString(rc).decode()}\n"
                                   + log.value.decode(errors="replace"))
            self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self._ok(self.lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            return buf.value.decode()
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptxas(tool: Path, ptx: str, arch: str, label: str) -> dict[str, dict]:
    """`ptxas -v` of one PTX: kernel -> {regs, smem, stack, spill}."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([str(tool), "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"ptxas {label} ({arch}):\n{r.stderr[-4000:]}")
    out, cur = {}, None
    for line in r.stderr.splitlines():
        if m := _ENTRY.search(line):
            cur = out.setdefault(m.group(1), {"regs": 0, "smem": 0, "stack": 0, "spill": 0})
        elif cur is not None and (m := _PROPS.search(line)):
            cur["stack"], cur["spill"] = int(m.group(1)), int(m.group(2)) + int(m.group(3))
        elif cur is not None and (m := _USED.search(line)):
            cur["regs"], cur["smem"] = int(m.group(1)), int(m.group(2) or 0)
    return out


def compile_all(sources: dict[str, str] | None = None, archs=ARCHS) -> dict[str, dict[str, dict]]:
    """{arch: {kernel: stats}} for every .cu (sources: name -> text, default the files)."""
    lib, include, tool = tools()
    nv = Nvrtc(lib)
    sources = sources or {p.name: p.read_text() for p in sorted(KERNELS.glob("*.cu"))}
    if not sources:
        raise CompileError(f"no .cu files in {KERNELS}")
    jobs = [(name, arch) for name in sources for arch in archs]

    def one(job):
        name, arch = job
        ptx = nv.ptx(sources[name], name, arch, [KERNELS, include])
        if name in MMA and MMA[name] not in ptx:
            raise CompileError(f"{name} ({arch}): no {MMA[name]} in its PTX (the tensor-core path is not compiled)")
        return arch, name, ptxas(tool, ptx, arch, name)

    table: dict[str, dict[str, dict]] = {a: {} for a in archs}
    with ThreadPoolExecutor(max_workers=2) as ex:
        for arch, name, stats in ex.map(one, jobs):
            for k, v in stats.items():
                table[arch][k] = {**v, "file": name}
    return table


def spills(table) -> list[str]:
    return [f"{k} spills {v['spill']} bytes on {arch}" for arch, ks in table.items() for k, v in ks.items()
            if v["spill"] and k.startswith(NO_SPILL)]


def render(table) -> str:
    kernels = sorted({k for ks in table.values() for k in ks}, key=lambda k: (table[ARCHS[0]][k]["file"], k))
    lines = [BEGIN, "",
             "| file | kernel | registers " + " / ".join(a[3:] for a in ARCHS) + " | shared memory (bytes) "
             "| stack (bytes) | spills (bytes) |", "|---|---|---|---|---|---|"]
    for k in kernels:
        row = [table[a][k] for a in ARCHS]
        smem = sorted({r["smem"] for r in row})
        lines.append(f"| {row[0]['file']} | `{k}` | {' / '.join(str(r['regs']) for r in row)} | "
                     f"{'/'.join(map(str, smem))} | {max(r['stack'] for r in row)} | {max(r['spill'] for r in row)} |")
    return "\n".join(lines + ["", END])


def current_table(doc: str) -> str | None:
    if BEGIN not in doc or END not in doc:
        return None
    return doc[doc.index(BEGIN):doc.index(END) + len(END)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/cuda.md's table is not current")
    args = ap.parse_args(argv)
    try:
        table = compile_all()
    except CompileError as e:
        print(f"cuda_compile: {e}", file=sys.stderr)
        return 1
    bad = spills(table)
    if bad:
        print("cuda_compile: " + "; ".join(bad), file=sys.stderr)
        return 1
    new = render(table)
    doc = DOC.read_text()
    old = current_table(doc)
    if args.check:
        if old != new:
            print("cuda_compile: docs/cuda.md's ptxas table is not current: run scripts/cuda_compile.py",
                  file=sys.stderr)
            return 1
        print(f"cuda_compile: {sum(len(v) for v in table.values())} kernel builds, table current")
        return 0
    if old is None:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
    tmp = DOC.with_name(DOC.name + ".tmp")
    tmp.write_text(doc.replace(old, new))
    tmp.replace(DOC)
    print(f"cuda_compile: {sum(len(v) for v in table.values())} kernel builds; table written to {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
