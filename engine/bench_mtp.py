"""`ds4-bench --mtp FILE`: what speculative decoding can gain on this machine and model.

At the context --ctx-start (the prompt's first tokens prefilled), it measures:
- the verify step's cost at T = 1, 2, 3, 4 and 5 tokens (Model.forward_verify, then the rows cut
  back: the state is the same before every repetition), the median of --mtp-reps runs;
- one MTP draft step's cost;
- the acceptance of the MTP's drafts over --gen-tokens greedy tokens (Speculator, --mtp-draft N).

From those, for N drafts a step and a per-draft acceptance a (independent drafts), a step yields
E = (1 - a^(N+1)) / (1 - a) tokens and costs verify(N+1) + N * draft, against E plain steps of
verify(1): the expected speed-up is E * verify(1) / (verify(N+1) + N * draft). It is printed for
a = 0.6, 0.8 and 0.9 (what DeepSeek and vLLM report for real weights is 0.8-0.9) beside the
measured acceptance (about 0 on random weights).
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

STEP_TOKENS = (1, 2, 3, 4, 5)
RATES = (0.6, 0.8, 0.9)


def expected_tokens(n_draft: int, a: float) -> float:
    """Tokens a step yields with n_draft drafts each accepted with probability a (in a row)."""
    return float(n_draft + 1) if a >= 1 else (1 - a ** (n_draft + 1)) / (1 - a)


def expected_speedup(costs: dict, draft_s: float, n_draft: int, a: float) -> float:
    return expected_tokens(n_draft, a) * costs[1] / (costs[n_draft + 1] + n_draft * draft_s)


def step_costs(session, reps: int, sizes=STEP_TOKENS) -> dict:
    """Median seconds of a verify step of T tokens at the session's position, for each T. One
    round over every size first, not timed (the first touch of a page of the map faults it in),
    then `reps` rounds, the sizes interleaved in each (a loaded machine's drift spreads over all
    sizes alike instead of landing on one)."""
    eng = session.engine
    model, pos = eng.model, session.pos
    rng = np.random.default_rng(0)
    times: dict = {T: [] for T in sizes}
    for r in range(reps + 1):
        for T in sizes:
            toks = rng.integers(0, eng.config.n_vocab, T)
            with eng.lock:
                t0 = time.perf_counter()
                model.ops.logits_to_host(model.forward_verify(toks, pos, session.state))
                dt = time.perf_counter() - t0
                session.state.truncate(pos + T, pos)     # back to where it was
            if r:
                times[T].append(dt)
    return {T: statistics.median(ts) for T, ts in times.items()}


def draft_cost(session, reps: int) -> float:
    from .runtime.mtp_drafter import MTPDrafter
    d = MTPDrafter(session.engine)
    H = session.engine.model.last_hc[-1]
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        with session.engine.lock:
            session.engine.model.ops.logits_to_host(d.block.step(d.state, H, 1, session.pos - 1 + i)[0])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def acceptance(session, n_draft: int, n_tokens: int) -> tuple[float | None, float]:
    """(the MTP's greedy acceptance, tokens per second) over n_tokens from the session's state."""
    from .runtime.mtp_drafter import MTPDrafter
    from .runtime.sampling import Rng, SamplingParams
    from .runtime.speculative import Speculator
    sp = Speculator(session.fork(), MTPDrafter(session.engine), n_draft)
    done = 0
    t0 = time.perf_counter()
    while done < n_tokens:
        done += len(sp.step(SamplingParams(temperature=0), Rng(1), limit=n_tokens - done))
    return sp.acceptance, done / (time.perf_counter() - t0)


def run(a, options, text: str, out=None) -> int:
    from .runtime.session import Engine, Session
    eng = Engine.open(a.model, options, mtp=a.mtp)
    try:
        tokens = eng.tokenizer.encode(text)[:a.ctx_start]
        s = Session(eng, a.ctx_start + a.gen_tokens + 32)
        s.sync(tokens)
        costs = step_costs(s, a.mtp_reps)
        d = draft_cost(s, a.mtp_reps)
        acc, tps = acceptance(s, a.mtp_draft, a.gen_tokens)
        print(format_table(eng.backend, len(tokens), costs, d, acc, a.mtp_draft, tps), file=out or sys.stdout)
    finally:
        eng.close()
    return 0


def format_table(backend: str, ctx: int, costs: dict, draft_s: float, acc, n_draft: int, tps: float) -> str:
    base = costs[1]
    lines = [f"MTP on {backend} at {ctx} tokens of context: verify step cost (median)",
             "tokens,ms,x_one_token"]
    lines += [f"{T},{1e3 * c:.2f},{c / base:.3f}" for T, c in costs.items()]
    lines.append(f"draft step: {1e3 * draft_s:.2f} ms ({draft_s / base:.3f} x a one-token step)")
    lines.append("expected speed-up (drafts N, acceptance a: E tokens a step over its cost)")
    lines.append("N," + ",".join(f"a={r}" for r in RATES))
    for n in (1, 2, 4):
        if n + 1 in costs:
            lines.append(f"{n}," + ",".join(f"{expected_speedup(costs, draft_s, n, r):.2f}" for r in RATES))
    a_txt = "no drafts" if acc is None else f"{100 * acc:.1f} %"
    lines.append(f"measured acceptance with --mtp-draft {n_draft}: {a_txt} ({tps:.2f} tokens/s with MTP)")
    return "\n".join(lines)
