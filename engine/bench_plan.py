"""ds4-bench's plan: the frontiers and a time estimate printed before the sweep, and the time left
after each row. A default sweep on a slow backend runs for many minutes; the user sees up front
what it will measure and about how long it takes, and can pick a shorter --ctx-max instead."""
from __future__ import annotations

import time

PROBE_TOKENS = 128      # prefill of the probe: short, so it costs little next to the sweep
PROBE_GEN = 4


def plan_line(fronts: list[int], gen_tokens: int) -> str:
    """One line: the frontiers (a long list shortened in the middle) and the work they mean."""
    shown = [str(f) for f in fronts]
    if len(shown) > 12:
        shown = shown[:5] + ["..."] + shown[-3:]
    return (f"plan: {len(fronts)} frontiers {', '.join(shown)}; {fronts[-1]} tokens to prefill, "
            f"{len(fronts)} x {gen_tokens} tokens to decode")


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def seconds_for(fronts: list[int], done: int, gen_tokens: int, prefill_tps: float, gen_tps: float) -> float:
    """The time the frontiers after the first `done` take at these speeds (prefill is incremental:
    each frontier evaluates only the tokens since the one before)."""
    prev = fronts[done - 1] if done else 0
    left = len(fronts) - done
    return (fronts[-1] - prev) / max(prefill_tps, 1e-9) + left * gen_tokens / max(gen_tps, 1e-9)


def probe(session_factory, greedy, tokens: list[int], gen_tokens: int, eos) -> tuple[float, float]:
    """Prefill and decode speed on a short scratch session (its KV is dropped with it)."""
    n, g = min(len(tokens), PROBE_TOKENS), min(gen_tokens, PROBE_GEN)
    s = session_factory(n + g + 1)
    t0 = time.perf_counter()
    s.sync(tokens[:n])
    pre = n / max(time.perf_counter() - t0, 1e-9)
    t0 = time.perf_counter()
    greedy(s, g, eos)
    return pre, g / max(time.perf_counter() - t0, 1e-9)


def estimate_line(fronts: list[int], gen_tokens: int, prefill_tps: float, gen_tps: float) -> str:
    total = seconds_for(fronts, 0, gen_tokens, prefill_tps, gen_tps)
    return (f"estimate: about {duration(total)} (a {PROBE_TOKENS}-token probe: prefill {prefill_tps:.2f} t/s, "
            f"decode {gen_tps:.2f} t/s; longer contexts run slower, so more; Ctrl+C keeps the rows measured)")


def left_text(fronts: list[int], done: int, gen_tokens: int, row: dict) -> str:
    """'; 3/16, about 5 min left' after a row, at the speeds that row measured."""
    if done >= len(fronts):
        return f"; {done}/{len(fronts)}"
    left = seconds_for(fronts, done, gen_tokens, row["prefill_tps"], row["gen_tps"])
    return f"; {done}/{len(fronts)}, about {duration(left)} left"
