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

`--plot FILE.svg` draws prefill and generation t/s against ctx_tokens (standard library only).
Bad input prints one `error:` line and exits 1.
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
from xml.sax.saxutils import escape

import numpy as np

from .errors import ModelFileError
from .options import EngineOptions, add_engine_flags
from .gguf.layout import EMBED, HASH, ROUTED

HEADER = ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes"]
_DATA = Path("shared") / "ds4-data" / "promessi_sposi.txt"
DEFAULT_PROMPTS = [Path(__file__).resolve().parents[2] / _DATA, Path("/work") / _DATA]


class BenchError(Exception):
    pass


def default_prompt_file() -> str | None:
    for p in DEFAULT_PROMPTS:
        if p.is_file():
            return str(p)
    return None


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
              on_row=None) -> tuple[list[dict], list[list[int]]]:
    """The sweep. Returns the CSV rows and the greedy tokens decoded at each frontier."""
    rows, probes, prev = [], [], 0
    for f in fronts:
        t0 = time.perf_counter()
        session.sync(tokens[:f])
        pre_s = time.perf_counter() - t0
        blob = session.snapshot()
        t0 = time.perf_counter()
        gen = greedy_no_eos(session, gen_tokens, eos)
        gen_s = time.perf_counter() - t0
        session.restore(blob)
        row = {"ctx_tokens": f, "prefill_tokens": f - prev,
               "prefill_tps": (f - prev) / max(pre_s, 1e-9), "gen_tokens": gen_tokens,
               "gen_tps": gen_tokens / max(gen_s, 1e-9), "kvcache_bytes": len(blob)}
        rows.append(row)
        probes.append(gen)
        prev = f
        if on_row is not None:
            on_row(row)
    return rows, probes


def format_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(HEADER)
    for r in rows:
        w.writerow([r["ctx_tokens"], r["prefill_tokens"], f"{r['prefill_tps']:.2f}", r["gen_tokens"],
                    f"{r['gen_tps']:.2f}", r["kvcache_bytes"]])
    return buf.getvalue()


def svg_plot(rows: list[dict], title: str = "ds4-bench") -> str:
    """Prefill and generation t/s against ctx_tokens: two polylines, axes, ticks and a legend."""
    W, H, L, R, T, B = 720, 420, 70, 150, 40, 50
    pw, ph = W - L - R, H - T - B
    xs = [r["ctx_tokens"] for r in rows]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x1 = x0 + 1
    ymax = max([r["prefill_tps"] for r in rows] + [r["gen_tps"] for r in rows] + [1e-9]) * 1.1

    def px(x):
        return L + (x - x0) / (x1 - x0) * pw

    def py(y):
        return T + ph - y / ymax * ph

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2:.1f}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
             f'<line x1="{L}" y1="{T + ph}" x2="{L + pw}" y2="{T + ph}" stroke="black"/>',
             f'<line x1="{L}" y1="{T}" x2="{L}" y2="{T + ph}" stroke="black"/>']
    for i in range(6):
        xv, yv = x0 + (x1 - x0) * i / 5, ymax * i / 5
        parts.append(f'<line x1="{px(xv):.1f}" y1="{T + ph}" x2="{px(xv):.1f}" y2="{T + ph + 5}" stroke="black"/>')
        parts.append(f'<text x="{px(xv):.1f}" y="{T + ph + 18}" text-anchor="middle">{xv:.0f}</text>')
        parts.append(f'<line x1="{L - 5}" y1="{py(yv):.1f}" x2="{L + pw}" y2="{py(yv):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{L - 8}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
    parts.append(f'<text x="{L + pw / 2:.1f}" y="{H - 10}" text-anchor="middle">ctx_tokens</text>')
    parts.append(f'<text x="16" y="{T + ph / 2:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {T + ph / 2:.1f})">tokens/s</text>')
    for i, (key, label, color) in enumerate((("prefill_tps", "prefill t/s", "#1f77b4"),
                                             ("gen_tps", "gen t/s", "#d62728"))):
        pts = " ".join(f"{px(r['ctx_tokens']):.1f},{py(r[key]):.1f}" for r in rows)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
        for r in rows:
            parts.append(f'<circle cx="{px(r["ctx_tokens"]):.1f}" cy="{py(r[key]):.1f}" r="3" fill="{color}"/>')
        ly = T + 10 + 20 * i
        parts.append(f'<line x1="{L + pw + 15}" y1="{ly}" x2="{L + pw + 40}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{L + pw + 45}" y="{ly + 4}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


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
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    p.add_argument("--prompt-file", default=None,
                   help="raw text to tokenize (default: shared/ds4-data/promessi_sposi.txt if present)")
    p.add_argument("--ctx-start", type=_positive_int, default=2048)
    p.add_argument("--ctx-max", type=_positive_int, default=32768)
    step = p.add_mutually_exclusive_group()
    step.add_argument("--step-incr", type=_positive_int, default=None, help="linear step (default 2048)")
    step.add_argument("--step-mul", type=_mul, default=None, help="multiplicative step F (ceil, at least +1)")
    p.add_argument("--gen-tokens", type=_positive_int, default=128)
    p.add_argument("--ctx", type=_positive_int, default=None, help="session context (default ctx-max + gen-tokens + 1)")
    add_engine_flags(p)
    p.add_argument("--chunk", type=_positive_int, default=None, help="prefill chunk size")
    p.add_argument("--csv", default=None, help="write the CSV here instead of stdout")
    p.add_argument("--plot", default=None, help="write an SVG chart here")
    p.add_argument("--dump-tokens", default=None, help="write the greedy tokens of each frontier as JSON")
    return p


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BenchError as e:
        return _err(str(e))
    except ModelFileError as e:
        return _err(str(e))
    except (ValueError, OSError) as e:
        return _err(f"{getattr(e, 'filename', None) or ''}{': ' if getattr(e, 'filename', None) else ''}"
                    f"{getattr(e, 'strerror', None) or e}")
    except KeyboardInterrupt:
        return _err("interrupted")


def _read_prompt(path: str | None) -> tuple[str, str]:
    """The prompt file's path (--prompt-file, else the default text) and its text."""
    prompt = path or default_prompt_file()
    if prompt is None:
        raise BenchError("no --prompt-file given and the default promessi_sposi.txt is absent")
    try:
        return prompt, Path(prompt).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"{prompt}: cannot read the prompt: {getattr(e, 'strerror', None) or e}")


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    if a.step_incr is None and a.step_mul is None:
        a.step_incr = 2048
    options = EngineOptions.from_args(a)        # a bad value: ValueError, one line (main)
    if not Path(a.model).is_file():
        raise BenchError(f"{a.model}: no such model file")
    prompt, text = _read_prompt(a.prompt_file)
    if a.ctx_start > a.ctx_max:
        raise BenchError(f"--ctx-start {a.ctx_start} is above --ctx-max {a.ctx_max}")
    ctx = a.ctx if a.ctx is not None else a.ctx_max + a.gen_tokens + 1

    from .gguf.inspect import report
    from .runtime.session import DEFAULT_CHUNK, Engine, Session

    try:
        t_open = time.perf_counter()
        eng = Engine.open(a.model, options)
    except ValueError as e:          # an unknown or unbuilt backend
        raise BenchError(str(e)) from None
    open_s = time.perf_counter() - t_open
    try:
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
        fronts = frontiers(a.ctx_start, ctx_max, a.step_incr, a.step_mul)

        floors = measure_floors()
        rep = report(eng.file)
        bpt, long_from = rep["bytes_per_token"], rep["long_context_from"]
        flops = flops_per_token(eng.file)
        bw, gemm = floors["read_bytes_per_s"], floors["gemm_flops_per_s"]
        print(f"floors: read {bw / 1e9:.2f} GB/s, gemm {gemm / 1e9:.2f} GFLOP/s; "
              f"weights read per token {bpt['short']} B (short) / {bpt['long']} B (long, from {long_from}); "
              f"prefill FLOPs per token {flops}", file=sys.stderr)

        res = (f" (resident copy of {eng.file.gguf.size:,} B in {eng.resident_seconds:.2f} s)"
               if eng.resident_seconds is not None else "")
        print(f"open: {open_s:.2f} s, paging {eng.paging}{res}, backend {eng.backend}", file=sys.stderr)
        first = []

        def on_row(r):
            if not first:       # open + the first frontier's prefill + one decoded token
                first.append(open_s + r["prefill_tokens"] / max(r["prefill_tps"], 1e-9)
                             + 1 / max(r["gen_tps"], 1e-9))
                print(f"first-token latency {first[0]:.2f} s", file=sys.stderr)
            b = bpt["long" if r["ctx_tokens"] >= long_from else "short"]
            dec = (b / bw) * r["gen_tps"]
            pre = flops * r["prefill_tps"] / gemm
            print(f"ctx {r['ctx_tokens']}: decode {r['gen_tps']:.2f} t/s = {dec:.1%} of read floor; "
                  f"prefill {r['prefill_tps']:.2f} t/s = {pre:.1%} of GEMM floor", file=sys.stderr)

        session = Session(eng, ctx, chunk=a.chunk or DEFAULT_CHUNK)
        rows, probes = run_bench(session, tokens, fronts, a.gen_tokens, eng.tokenizer.eos_id, on_row)
    finally:
        eng.close()

    out = format_csv(rows)
    if a.csv:
        Path(a.csv).write_text(out)
    else:
        sys.stdout.write(out)
        sys.stdout.flush()
    if a.plot:
        Path(a.plot).write_text(svg_plot(rows, f"ds4-bench: {Path(a.model).name}"))
    if a.dump_tokens:
        Path(a.dump_tokens).write_text(json.dumps(
            [{"ctx_tokens": f, "tokens": p} for f, p in zip(fronts, probes)]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
