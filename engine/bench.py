"""`ds4-bench`: prefill and decode speed along one fixed token sequence (spec/testing.md §1.3).

The prompt file is tokenized as raw text with the model's own tokenizer. Frontiers run from
`--ctx-start` to `--ctx-max` (linear `--step-incr` or multiplicative `--step-mul`, ceil and at least
+1, the last one clamped to ctx-max). At each frontier:

1. incremental prefill: `Session.sync(tokens[:frontier])`, which evaluates only the suffix since
   the previous frontier (timed);
2. `snapshot()` in memory (untimed);
3. greedy decode of exactly `--gen-tokens` tokens with argmax excluding EOS, so every row does the
   same amount of work (timed);
4. `restore()` of the snapshot (untimed).

CSV on stdout (or `--csv FILE`): `ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,
kvcache_bytes`, kvcache_bytes being the snapshot's size.

Machine floors, measured once per run and reported on stderr per row:

- read floor: memory bandwidth B over a 512 MiB buffer (best of 5), read by every kernel thread
  (the C kernels' read_sum; a single-threaded NumPy sum without them). The
  decode floor per token is bytes_per_token / B, with bytes_per_token from
  `engine.gguf.inspect.report()` (its "short" or "long" case by context). The row prints
  floor_time / measured_time_per_token.
- GEMM floor: float32 2048x2048 matmul rate R (best of 5), BLAS on as many threads as the
  kernels (the cpu backend keeps BLAS on one thread while it runs). Prefill FLOPs per token are
      F = 2 * sum over present weight matrices (2-D or more, excluding the embedding, which is a
          row lookup, and the hash table, an index) of
          n_elements             for dense tensors,
          n_elements * n_used / n_expert  for routed-expert tensors,
  i.e. two FLOPs per multiply-add of the weights a token actually touches (attention score work
  and norms are left out). The row prints F * prefill_tps / R.

`--peer NAME` measures a second backend in the same run (engine/bench_peer.py): the same tokens,
frontiers, numerics, paging and threads, opened after the first one is closed (never both in
memory), against the same floors. The CSV then has a leading `backend` column (the measured
backend's rows, then the peer's), stderr prints each row's prefill and decode ratio against the
peer, and every backend's open line says its bind time and copy, its device (for mlx: MLX's default
device, the CPU off Apple Silicon) and its resident memory after the sweep.

`--plot FILE.svg` draws prefill and generation t/s against ctx_tokens (standard library only; both
backends with --peer). Bad input prints one `error:` line and exits 1.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from .console import console_main
from .errors import ModelFileError
from .gguf import expert_cache as X
from .gguf.gguf_file import check_model_path
from .options import EngineOptions, add_engine_flags
from .gguf.layout import EMBED, HASH, ROUTED
from .bench_peer import device_line, peer_options, ratio_lines, release_memory, rss_bytes
from .bench_svg import svg_plot
from . import bench_plan

HEADER = ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes"]
# The default text ships with the package (no folder of a particular machine): the opening ~216k
# characters (~69k DeepSeek tokens) of Manzoni's "I promessi sposi" (1840, public domain; Project
# Gutenberg #45334 without its header), the text ds4's own ds4-bench reads, so the frontiers are the
# same tokens and speed figures stay comparable. Gzipped: 86 KB in the wheel.
DEFAULT_TEXT = "data/promessi_sposi.txt.gz"
DEFAULT_TEXT_NAME = "the packaged excerpt of I promessi sposi"


class BenchError(Exception):
    pass


class BenchInterrupted(Exception):
    """Ctrl+C during a sweep, carrying the rows and greedy tokens measured before it."""

    def __init__(self, rows: list[dict], probes: list[list[int]]):
        super().__init__("interrupted")
        self.rows, self.probes = rows, probes


def default_text() -> str:
    """The benchmark text shipped with the package (DEFAULT_TEXT)."""
    import gzip
    from importlib.resources import files
    return gzip.decompress(files("engine").joinpath(DEFAULT_TEXT).read_bytes()).decode("utf-8")


def frontiers(start: int, stop: int, incr: int | None = None, mul: float | None = None) -> list[int]:
    """Frontiers from start to stop: +incr, or *mul (ceil, at least +1); the last clamped to stop."""
    if start < 1 or stop < start:
        raise BenchError(f"bad frontier range {start}..{stop}")
    out, f = [], start
    while f < stop:
        out.append(f)
        f = max(f + 1, math.ceil(f * mul)) if mul is not None else f + incr
    out.append(stop)
    return out


def flops_per_token(m) -> int:
    """2 * weights touched per token (see the module docstring)."""
    c = m.config
    total = 0
    for name, ti in m.layout.present.items():
        s = m.layout.specs[name]
        if len(ti.dims) < 2 or s.component in (EMBED, HASH):
            continue
        if s.component == ROUTED:
            total += ti.n_elements * c.n_expert_used // c.n_expert
        else:
            total += ti.n_elements
    return 2 * total


def measure_floors(read_mib: int = 512, gemm_n: int = 2048, reps: int = 5) -> dict:
    """Read bandwidth (bytes/s) and float32 GEMM rate (FLOP/s), best of `reps`, both on the
    kernels' thread count: the read by the C kernels' multi-threaded read_sum (NumPy's
    single-threaded sum without the extension), the GEMM by NumPy with BLAS on that many threads."""
    from threadpoolctl import threadpool_limits

    from .backends.cpu import kernels
    a = np.ones(read_mib * (1 << 20) // 4, np.float32)
    read = kernels._K.read_sum if kernels.available() else (lambda b: b.sum())
    read(a)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        read(a)
        best = min(best, time.perf_counter() - t0)
    bw = a.nbytes / max(best, 1e-9)
    del a
    rng = np.random.default_rng(0)
    x = rng.standard_normal((gemm_n, gemm_n), dtype=np.float32)
    y = rng.standard_normal((gemm_n, gemm_n), dtype=np.float32)
    best = math.inf
    with threadpool_limits(kernels.get_threads(), user_api="blas"):
        x @ y
        for _ in range(reps):
            t0 = time.perf_counter()
            x @ y
            best = min(best, time.perf_counter() - t0)
    return {"read_bytes_per_s": bw, "gemm_flops_per_s": 2.0 * gemm_n ** 3 / max(best, 1e-9)}


def greedy_no_eos(session, n: int, eos: int | None) -> list[int]:
    """Decode exactly n tokens, argmax over the logits with EOS excluded."""
    out = []
    for _ in range(n):
        lg = np.array(session.logits, dtype=np.float32, copy=True)
        if eos is not None and 0 <= eos < lg.shape[0]:
            lg[eos] = -np.inf
        t = int(np.argmax(lg))
        session.eval(t)
        out.append(t)
    return out


def run_bench(session, tokens: list[int], fronts: list[int], gen_tokens: int, eos: int | None,
              on_row=None, stats=None) -> tuple[list[dict], list[list[int]]]:
    """The sweep. Returns the CSV rows and the greedy tokens decoded at each frontier. `stats`:
    a callable whose value is taken around each decode (the expert cache's counters), kept in
    the row as (before, after) under "stats" (not a CSV column)."""
    rows, probes, prev = [], [], 0
    for f in fronts:
        try:
            t0 = time.perf_counter()
            session.sync(tokens[:f])
            pre_s = time.perf_counter() - t0
            blob = session.snapshot()
            st = stats() if stats else None
            t0 = time.perf_counter()
            gen = greedy_no_eos(session, gen_tokens, eos)
            gen_s = time.perf_counter() - t0
            st = (st, stats()) if stats else None
            session.restore(blob)
        except KeyboardInterrupt:       # the rows measured so far are still the run's result
            raise BenchInterrupted(rows, probes) from None
        row = {"ctx_tokens": f, "prefill_tokens": f - prev,
               "prefill_tps": (f - prev) / max(pre_s, 1e-9), "gen_tokens": gen_tokens,
               "gen_tps": gen_tokens / max(gen_s, 1e-9), "kvcache_bytes": len(blob)}
        if st is not None:
            row["stats"] = st
        rows.append(row)
        probes.append(gen)
        prev = f
        if on_row is not None:
            on_row(row)
    return rows, probes


def _cells(r: dict) -> list:
    return [r["ctx_tokens"], r["prefill_tokens"], f"{r['prefill_tps']:.2f}", r["gen_tokens"],
            f"{r['gen_tps']:.2f}", r["kvcache_bytes"]]


def format_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(HEADER)
    for r in rows:
        w.writerow(_cells(r))
    return buf.getvalue()


def format_csv_backends(sweeps: dict[str, list[dict]]) -> str:
    """With --peer: a leading `backend` column, the measured backend's rows then the peer's."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["backend", *HEADER])
    for name, rows in sweeps.items():
        for r in rows:
            w.writerow([name, *_cells(r)])
    return buf.getvalue()


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {s}")
    return v


def _mul(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}")
    if not math.isfinite(v) or v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 1: {s}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ds4-bench", description="ds4 prefill/decode speed sweep along one token sequence")
    from .cli_help import add_version_flag
    add_version_flag(p)
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    p.add_argument("--prompt-file", default=None,
                   help="raw text to tokenize (default: an excerpt of I promessi sposi shipped with the "
                        "package, ~69k tokens, the text of ds4's own benchmark)")
    p.add_argument("--ctx-start", type=_positive_int, default=2048,
                   help="the first frontier: context length of the first measured row, in tokens (default %(default)s)")
    p.add_argument("--ctx-max", type=_positive_int, default=32768,
                   help="the last frontier: the sweep stops at this context length, in tokens (default %(default)s)")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--step-incr", type=_positive_int, default=None, help="linear step (default 2048)")
    step.add_argument("--step-mul", type=_mul, default=None, help="multiplicative step F (ceil, at least +1)")
    p.add_argument("--gen-tokens", type=_positive_int, default=128,
                   help="tokens decoded at each frontier to measure decode speed (default %(default)s)")
    p.add_argument("--ctx", type=_positive_int, default=None, help="session context (default ctx-max + gen-tokens + 1)")
    add_engine_flags(p)
    from .runtime.session import DEFAULT_CHUNK
    p.add_argument("--chunk", type=_positive_int, default=None,
                   help=f"prefill chunk size in tokens (default {DEFAULT_CHUNK}, the engine's)")
    p.add_argument("--csv", default=None, help="write the CSV here instead of stdout")
    p.add_argument("--plot", default=None, help="write an SVG chart here")
    p.add_argument("--dump-tokens", default=None, help="write the greedy tokens of each frontier as JSON")
    p.add_argument("--isa", default=None, metavar="BUILD",
                   help="the cpu backend's kernel build: generic, avx2, avx512 or avx512vbmi (one this machine "
                        "runs; default: the best; env DS4_CPU_ISA does the same)")
    p.add_argument("--peer", default=None, metavar="NAME",
                   help="also measure backend NAME in the same run (same tokens, frontiers, numerics, "
                        "threads); print each row's ratio against it and add a backend column to the CSV")
    from .mtp_options import add_mtp_flags
    add_mtp_flags(p)        # --mtp: the verify step's costs and the expected speed-up (bench_mtp.py)
    p.add_argument("--mtp-reps", type=_positive_int, default=5, help="repetitions of each --mtp step measured (default %(default)s)")
    return p


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


@console_main
def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        raise                   # a reader that went away: console_main ends quietly
    except BenchError as e:
        return _err(str(e))
    except ModelFileError as e:
        return _err(str(e))
    except (ValueError, OSError) as e:
        return _err(f"{getattr(e, 'filename', None) or ''}{': ' if getattr(e, 'filename', None) else ''}"
                    f"{getattr(e, 'strerror', None) or e}")
    except KeyboardInterrupt:       # before the sweep's first row (a sweep's own keeps its rows)
        _err("interrupted")
        return 130


def _read_prompt(path: str | None) -> tuple[str, str]:
    """The prompt file's name (--prompt-file, else the packaged text's) and its text."""
    if path is None:
        return DEFAULT_TEXT_NAME, default_text()
    prompt = path
    try:
        return prompt, Path(prompt).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"{prompt}: cannot read the prompt: {getattr(e, 'strerror', None) or e}")


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    if a.step_incr is None and a.step_mul is None:
        a.step_incr = 2048
    options = EngineOptions.from_args(a)        # a bad value: ValueError, one line (main)
    peer = peer_options(options, a.peer)        # checked before the first sweep spends its time
    if a.isa is not None:           # an unknown build: ValueError, one line (main)
        from .backends.cpu import kernels
        kernels.set_isa(a.isa)
    check_model_path(a.model)       # "is a directory", "no such file": as every command says
    prompt, text = _read_prompt(a.prompt_file)
    if a.ctx_start > a.ctx_max:
        raise BenchError(f"--ctx-start {a.ctx_start} is above --ctx-max {a.ctx_max}")
    ctx = a.ctx if a.ctx is not None else a.ctx_max + a.gen_tokens + 1
    if a.mtp:
        from .bench_mtp import run as run_mtp
        return run_mtp(a, options, text)

    sweeps: dict[str, tuple[list[dict], list[list[int]]]] = {}
    try:
        name, plan, costs, rows, probes = _measure(a.model, options, a, ctx, text=text, prompt=prompt)
        sweeps[name] = (rows, probes)
        if peer is not None:
            release_memory()        # the first backend's weights go before the peer's arrive
            _, _, _, peer_rows, peer_probes = _measure(a.model, peer, a, ctx, plan=plan, costs=costs)
            for line in ratio_lines(name, rows, probes, peer.backend, peer_rows, peer_probes):
                print(line, file=sys.stderr)
            sweeps[peer.backend] = (peer_rows, peer_probes)
    except BenchInterrupted as e:   # Ctrl+C: what was measured is written, as a full run's would be
        sweeps[e.backend] = (e.rows, e.probes)
        where = f"in {a.csv}" if a.csv else "below"
        print(f"interrupted: {len(e.rows)} of {e.planned} frontiers measured on {e.backend}; "
              f"the rows measured are kept ({where})", file=sys.stderr)
        _write_outputs(a, sweeps, peer is not None)
        return 130
    _write_outputs(a, sweeps, peer is not None)
    return 0


def _write_outputs(a, sweeps: dict[str, tuple[list[dict], list[list[int]]]], with_peer: bool):
    """The CSV (stdout or --csv), the plot and the token dump, of full or interrupted sweeps."""
    from .atomic import atomic_write

    def write(path: str, text: str):
        atomic_write(path, [text.encode("utf-8")])

    rows = {name: r for name, (r, _) in sweeps.items()}
    first_rows, first_probes = next(iter(sweeps.values()))
    out = format_csv(first_rows) if not with_peer else format_csv_backends(rows)
    if a.csv:
        write(a.csv, out)
    else:
        sys.stdout.write(out)
        sys.stdout.flush()
    if a.plot:
        write(a.plot, svg_plot(first_rows if not with_peer else rows, f"ds4-bench: {Path(a.model).name}"))
    if a.dump_tokens:
        dump = [{"ctx_tokens": r["ctx_tokens"], "tokens": p} for r, p in zip(first_rows, first_probes)]
        if with_peer and len(sweeps) > 1:
            for d, p in zip(dump, list(sweeps.values())[1][1]):
                d["peer_tokens"] = p
        write(a.dump_tokens, json.dumps(dump) + "\n")


def _open(model: str, options: EngineOptions):
    from .runtime.session import Engine
    try:
        t0 = time.perf_counter()
        eng = Engine.open(model, options)
    except ValueError as e:          # an unknown or unbuilt backend
        raise BenchError(str(e)) from None
    return eng, time.perf_counter() - t0


def _measure(model: str, options: EngineOptions, a, ctx: int, *, text=None, prompt=None, plan=None, costs=None):
    """Open one backend, sweep, close. The first run plans the frontiers and measures the floors;
    a peer's run takes both. Returns (backend, plan, costs, rows, probes); the engine is dropped
    with this frame, so the next backend's weights never join it in memory."""
    eng, open_s = _open(model, options)
    try:
        plan = plan or _plan(eng, text, prompt, a, ctx)
        costs = costs or _floors(eng)
        rows, probes = _sweep(eng, open_s, *plan, a, ctx, costs)
        return eng.backend, plan, costs, rows, probes
    except BenchInterrupted as e:
        e.backend, e.planned = eng.backend, len(plan[1])
        raise
    finally:
        eng.close()


def _plan(eng, text: str, prompt: str, a, ctx: int) -> tuple[list[int], list[int]]:
    """The prompt's tokens and the frontiers they and --ctx allow (one note when clamped)."""
    tokens = eng.tokenizer.encode(text)
    ctx_max = min(a.ctx_max, len(tokens), ctx - a.gen_tokens - 1)
    if len(tokens) < a.ctx_start:
        raise BenchError(f"{prompt}: the text has {len(tokens)} tokens, fewer than --ctx-start {a.ctx_start}")
    if ctx_max < a.ctx_start:
        raise BenchError(f"--ctx {ctx} leaves room for frontiers up to {ctx - a.gen_tokens - 1} tokens, "
                         f"below --ctx-start {a.ctx_start}")
    if ctx_max < a.ctx_max:
        why = "the text has" if ctx_max == len(tokens) else "--ctx allows"
        print(f"note: ctx-max clamped to {ctx_max} ({why} {ctx_max} tokens)", file=sys.stderr)
    return tokens, frontiers(a.ctx_start, ctx_max, a.step_incr, a.step_mul)


def _floors(eng) -> dict:
    """The machine's floors and the file's costs per token, measured and printed once per run."""
    from .gguf.inspect import report
    floors = measure_floors()
    rep = report(eng.file)
    c = {"bpt": rep["bytes_per_token"], "long_from": rep["long_context_from"], "flops": flops_per_token(eng.file),
         "bw": floors["read_bytes_per_s"], "gemm": floors["gemm_flops_per_s"]}
    print(f"floors: read {c['bw'] / 1e9:.2f} GB/s, gemm {c['gemm'] / 1e9:.2f} GFLOP/s; "
          f"weights read per token {c['bpt']['short']} B (short) / {c['bpt']['long']} B (long, from "
          f"{c['long_from']}); prefill FLOPs per token {c['flops']}", file=sys.stderr)
    if eng.model.experts is not None:       # the disk floor's speed: O_DIRECT reads of the file
        if eng.paging == "resident":
            eng.wait_resident()             # (the copy's reads would share the disk with it)
        c["disk"] = X.direct_read_speed(eng.file.path)
        d = eng.model.experts
        print(f"expert cache: {d.n_slots} slots of {d.slot_bytes:,} B ({d.nbytes / 2**30:.2f} GiB), "
              f"{'O_DIRECT' if d.reader.direct else 'buffered'} reads; disk direct-read "
              + (f"{c['disk'] / 1e9:.2f} GB/s" if c["disk"] else "speed unknown (O_DIRECT refused)"), file=sys.stderr)
    return c


def _sweep(eng, open_s: float, tokens, fronts, a, ctx: int, c: dict):
    """One backend's sweep, its open, device and memory lines, and each row against the floors."""
    from .runtime.session import DEFAULT_CHUNK, Session
    # the resident copy fills in the background after open: the sweep measures the copy's speed,
    # so it waits for it (the wait is printed, not counted in the rows)
    t0 = time.perf_counter()
    if eng.paging == "resident":
        eng.wait_resident()
    res = (f" (resident copy of {eng.file.gguf.size:,} B in {eng.resident_seconds:.2f} s, "
           f"waited {time.perf_counter() - t0:.2f} s after open)" if eng.resident_seconds is not None else "")
    bind = eng.bind_report
    print(f"open: {open_s:.2f} s, paging {eng.paging}{res}, backend {eng.backend}, "
          f"bind {bind.time_s:.2f} s ({bind.bytes:,} B copied)", file=sys.stderr)
    print(device_line(eng), file=sys.stderr)
    chunk = a.chunk or DEFAULT_CHUNK
    eos = eng.tokenizer.eos_id
    print(bench_plan.plan_line(fronts, a.gen_tokens), file=sys.stderr)
    speeds = bench_plan.probe(lambda n: Session(eng, n, chunk=chunk), greedy_no_eos, tokens, a.gen_tokens, eos)
    if eng.model.experts is not None:
        eng.model.experts.empty()       # (the probe decoded the rows' tokens: its experts would be hits)
    print(bench_plan.estimate_line(fronts, a.gen_tokens, *speeds), file=sys.stderr)
    first = []

    def on_row(r):
        if not first:       # open + the first frontier's prefill + one decoded token
            first.append(open_s + r["prefill_tokens"] / max(r["prefill_tps"], 1e-9)
                         + 1 / max(r["gen_tps"], 1e-9))
            print(f"first-token latency {first[0]:.2f} s", file=sys.stderr)
        b = c["bpt"]["long" if r["ctx_tokens"] >= c["long_from"] else "short"]
        dec = (b / c["bw"]) * r["gen_tps"]
        pre = c["flops"] * r["prefill_tps"] / c["gemm"]
        print(f"ctx {r['ctx_tokens']}: {eng.backend} decode {r['gen_tps']:.2f} t/s = {dec:.1%} of read floor; "
              f"prefill {r['prefill_tps']:.2f} t/s = {pre:.1%} of GEMM floor"
              f"{bench_plan.left_text(fronts, fronts.index(r['ctx_tokens']) + 1, a.gen_tokens, r)}", file=sys.stderr)
        if "stats" in r:        # --expert-cache: hit rate, reads, stall, the disk floor
            print(f"ctx {r['ctx_tokens']}: " + X.floor_line(X.stats_delta(*r["stats"]), a.gen_tokens,
                  a.gen_tokens / r["gen_tps"], c.get("disk")), file=sys.stderr)

    session = Session(eng, ctx, chunk=chunk)
    cache = eng.model.experts
    out = run_bench(session, tokens, fronts, a.gen_tokens, eos, on_row, cache.stats if cache else None)
    rss, what = rss_bytes()
    print(f"memory: {eng.backend} {what} {rss / 2**20:,.0f} MiB after the sweep", file=sys.stderr)
    return out

if __name__ == "__main__":
    sys.exit(main())
