"""The generation loop with MTP speculative decoding (engine.Speculator), for the agent and the
shim: the same tokens as generation.generate's plain loop under greedy sampling, the same law
when sampling, the same session state afterwards.

Each step adds the tokens the verify kept; they are fed to the DsmlStream one by one as the plain
loop feeds them. Where the plain loop would have stopped inside a step (the stream is done: a
closed tool block, a stop string) the tokens the step evaluated after that point are cut back
(Session.rewind: in place, the last kept token evaluated again as the decode step it was), so
the session holds exactly what the plain loop leaves. The agent samples greedily inside DSML
syntax: each draft is checked against the parameters the plain loop would have used at its
position (the stream's state after the tokens before it, on a copy of the stream).
"""
from __future__ import annotations

import copy
import time
import weakref

from engine import ContextFull, MTPDrafter, Speculator

_DRAFTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def speculator_for(session, n_draft: int) -> Speculator | None:
    """A Speculator on `session` when its engine has an MTP file and n_draft > 0, else None. The
    drafter (its MTP rows) lives as long as the session: never saved with it."""
    if n_draft <= 0 or getattr(session.engine, "mtp", None) is None:
        return None
    d = _DRAFTERS.get(session)
    if d is None:
        d = _DRAFTERS[session] = MTPDrafter(session.engine)
    return Speculator(session, d, n_draft)


def generate_speculative(session, stream, spec: Speculator, *, sampling, greedy, rng, limit: int,
                         eos_id: int, token_bytes, should_stop, before_token, on_events, result):
    """generation.generate's loop with speculation (`result`: its GenerationResult class)."""

    def params_at(prefix):
        if sampling.temperature <= 0:
            return sampling
        st = stream
        if prefix:
            st = copy.deepcopy(stream)
            for t in prefix:
                st.feed(token_bytes(t))
        return greedy if st.in_dsml_syntax else sampling

    n, finish = 0, "length"
    d0, a0 = spec.stats["drafted"], spec.stats["accepted"]
    t0 = time.perf_counter()
    while n < limit and finish == "length":
        if should_stop():
            finish = "cancelled"
            break
        if before_token is not None:
            before_token()
        try:
            out = spec.step(params_at, rng, limit=limit - n, stop=(eos_id,))
        except ContextFull:
            break
        for i, t in enumerate(out):
            if t == eos_id:
                finish = "stop"
                break
            n += 1
            on_events(stream.feed(token_bytes(t)))
            if stream.done:
                after = len(out) - i - 1 - (out[-1] == eos_id)     # evaluated past the stop
                if after:
                    session.rewind(after)
                finish = "stop"
                break
    spec.pending = None        # (a drawn token not emitted: the next call samples afresh, as plain does)
    on_events(stream.finish(None if finish == "stop" else "length"))
    return result(n, finish, time.perf_counter() - t0, spec.stats["drafted"] - d0, spec.stats["accepted"] - a0)
