"""`ds4-bench --mtp FILE`: what speculative decoding can gain on this machine and model.

At the context --ctx-start (the prompt's first tokens prefilled), it measures:
- the verify step's cost at T = 1, 2, 3, 4 and 5 tokens (Model.forward_verify, then the rows cut
  back: the state is the same before every repetition), the median of --mtp-reps runs;
- one MTP draft step's cost;
- the acceptance of the MTP's drafts over --gen-tokens greedy tokens (Speculator, --mtp-draft N);
- each step's CPU time beside its wall time (on a machine others load, what the step itself cost)
  and its read floor: the bytes a step must read, the routed experts the union of its rows' picks
  (random tokens route near-uniformly: T rows touch up to T times a row's experts);
- the same steps with every row given the first row's routing (rows that share their experts);
- greedy tokens per second with the true continuation as drafts (ContinuationDrafter: acceptance
  100 %, drafts free) at --mtp-draft 1..4, against plain decoding: what the verify steps allow.

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


class RouteProbe:
    """For the step-cost runs: wraps the backend's ops.moe to count the distinct experts each layer's
    rows pick (the union a T-row step must read), and with share=True gives every row of a step
    the first row's picks and weights (a routing where the rows share their experts, as a text's
    rows may: a cost measurement only, the rows are cut back after it)."""

    def __init__(self, ops, share: bool = False):
        self.ops, self.share, self.unions = ops, share, []

    def __enter__(self):
        self._own = self.ops.__dict__.get("moe")      # an instance's own moe, put back after
        inner = self.ops.moe

        def moe(lw, u, sel, wsel, limit):
            host = _host(sel)
            if self.share:
                xp = self.ops.xp
                host = np.repeat(host[:1], host.shape[0], axis=0)
                sel = xp.asarray(host)
                wsel = xp.asarray(np.repeat(_host(wsel)[:1], host.shape[0], axis=0))
            self.unions.append(len(np.unique(host)))
            return inner(lw, u, sel, wsel, limit)
        self.ops.moe = moe
        return self

    def __exit__(self, *exc):
        if self._own is not None:
            self.ops.moe = self._own
        else:
            del self.ops.moe        # the class's method again


def _host(a) -> np.ndarray:
    """A backend's small array on the host, mid-pass (cupy: .get(); mlx and NumPy: as an array;
    ops.logits_to_host would end the pass's graph or rotations)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def expert_bytes(model_file) -> tuple[int, list]:
    """(the bytes a one-token step reads but its routed experts, [one expert's bytes per layer]):
    the read floor of a step of T rows is the first plus each layer's union of experts times the
    second (engine/gguf/inspect.py's accounting; a step's extra embedding and hash rows are ~0)."""
    from .gguf.inspect import per_token_layer_bytes, report
    from .gguf.layout import ROUTED
    c = model_file.config
    layers = [per_token_layer_bytes(model_file, il, False) for il in range(c.n_layer)]
    fixed = report(model_file)["bytes_per_token"]["short"] - sum(lb[ROUTED] for lb in layers)
    return fixed, [lb[ROUTED] // c.n_expert_used for lb in layers]


def step_costs(session, reps: int, sizes=STEP_TOKENS, share: bool = False) -> dict:
    """{T: (median seconds, median CPU seconds of the process, read floor in bytes)} of a verify
    step of T tokens at the session's position. One round over every size first, not timed (the
    first touch of a page of the map faults it in), then `reps` rounds, the sizes interleaved in
    each (a loaded machine's drift spreads over all sizes alike instead of landing on one). CPU
    time beside wall time: on a machine others load, it is what the step itself cost."""
    eng = session.engine
    model, pos = eng.model, session.pos
    fixed, per_expert = expert_bytes(eng.file)
    L = len(per_expert)
    rng = np.random.default_rng(0)
    times: dict = {T: ([], [], []) for T in sizes}
    for r in range(reps + 1):
        for T in sizes:
            toks = rng.integers(0, eng.config.n_vocab, T)
            with eng.lock, RouteProbe(model.ops, share) as probe:
                t0, c0 = time.perf_counter(), time.process_time()
                model.ops.logits_to_host(model.forward_verify(toks, pos, session.state))
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                session.state.truncate(pos + T, pos)     # back to where it was
            if r:
                floor = fixed + sum(u * per_expert[i % L] for i, u in enumerate(probe.unions))
                for lst, v in zip(times[T], (dt, dc, floor)):
                    lst.append(v)
    return {T: tuple(statistics.median(v) for v in ts) for T, ts in times.items()}


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


class ContinuationDrafter:
    """Proposes the known greedy continuation (acceptance 100 %, no draft cost): with it a
    Speculator's tokens per second at --mtp-draft N is what the verify steps alone allow."""

    def __init__(self, truth: list, start: int):
        self.truth, self.start = truth, start      # truth[0] is the token at position start

    def propose(self, s, y, n):
        i = s.pos - self.start + 1
        return [self.truth[j] if j < len(self.truth) else 0 for j in range(i, i + n)], None

    def commit(self, s, kept, hc):
        pass

    def reset(self):
        pass


def continuation_rates(session, n_tokens: int, drafts=(1, 2, 3, 4)) -> dict:
    """{N: tokens per second} of greedy decoding n_tokens from the session's state: N = 0 plain
    steps, else a Speculator with the ContinuationDrafter at --mtp-draft N."""
    from .runtime.sampling import Rng, SamplingParams
    from .runtime.speculative import Speculator
    greedy = SamplingParams(temperature=0)
    s = session.fork()
    truth = []
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        truth.append(s.sample(greedy))
        s.eval(truth[-1])
    rates = {0: n_tokens / (time.perf_counter() - t0)}
    for n in drafts:
        sp = Speculator(session.fork(), ContinuationDrafter(truth, session.pos), n)
        done, t0 = 0, time.perf_counter()
        while done < n_tokens:
            done += len(sp.step(greedy, Rng(1), limit=n_tokens - done))
        rates[n] = done / (time.perf_counter() - t0)
    return rates


def run(a, options, text: str, out=None) -> int:
    from .runtime.session import Engine, Session
    eng = Engine.open(a.model, options, mtp=a.mtp)
    try:
        tokens = eng.tokenizer.encode(text)[:a.ctx_start]
        s = Session(eng, a.ctx_start + a.gen_tokens + 32)
        s.sync(tokens)
        costs = step_costs(s, a.mtp_reps)
        shared = step_costs(s, a.mtp_reps, share=True)
        d = draft_cost(s, a.mtp_reps)
        rates = continuation_rates(s, a.gen_tokens)
        acc, tps = acceptance(s, a.mtp_draft, a.gen_tokens)
        print(format_table(eng.backend, len(tokens), costs, shared, d, acc, a.mtp_draft, tps, rates),
              file=out or sys.stdout)
    finally:
        eng.close()
    return 0


def _cost_rows(costs: dict) -> list:
    w1, c1, f1 = costs[1]
    return ["tokens,ms,x_one_token,cpu_ms,x_cpu,floor_MB,x_floor"] + [
        f"{T},{1e3 * w:.2f},{w / w1:.3f},{1e3 * c:.2f},{c / c1:.3f},{f / 1e6:.1f},{f / f1:.3f}"
        for T, (w, c, f) in costs.items()]


def format_table(backend: str, ctx: int, costs: dict, shared: dict, draft_s: float, acc, n_draft: int,
                 tps: float, rates: dict) -> str:
    """costs / shared: step_costs's {T: (s, cpu s, floor bytes)} with the rows' own routing and with
    the rows sharing the first row's experts; rates: continuation_rates's."""
    wall = {T: c[0] for T, c in costs.items()}
    base = wall[1]
    lines = [f"MTP on {backend} at {ctx} tokens of context: verify step cost (median; floor: the bytes "
             "read, the routed experts the union of the rows')", "random tokens, each row its own routing:"]
    lines += _cost_rows(costs)
    lines.append("the same rows sharing the first row's experts (its routing recorded and given to all):")
    lines += _cost_rows(shared)
    lines.append(f"draft step: {1e3 * draft_s:.2f} ms ({draft_s / base:.3f} x a one-token step)")
    lines.append("expected speed-up (drafts N, acceptance a: E tokens a step over its cost)")
    lines.append("N," + ",".join(f"a={r}" for r in RATES))
    for n in (1, 2, 4):
        if n + 1 in wall:
            lines.append(f"{n}," + ",".join(f"{expected_speedup(wall, draft_s, n, r):.2f}" for r in RATES))
    lines.append("the true continuation as drafts (acceptance 100 %, drafts free): --mtp-draft N")
    lines.append("N,tokens_per_s,x_plain")
    lines += [f"{n},{r:.3f},{r / rates[0]:.3f}" for n, r in rates.items()]
    a_txt = "no drafts" if acc is None else f"{100 * acc:.1f} %"
    lines.append(f"measured acceptance with --mtp-draft {n_draft}: {a_txt} ({tps:.2f} tokens/s with MTP)")
    return "\n".join(lines)
