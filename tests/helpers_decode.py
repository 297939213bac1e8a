"""Greedy decoding shared by the engine tests that compare a mode against the resident run
(test_expert_cache.py, test_lowmem_prefetch.py): the tokens and the last logits, bit for bit."""
from __future__ import annotations

import numpy as np

from engine.runtime.session import Session


def greedy(engine, toks, n: int, ctx: int = 64) -> tuple[list[int], np.ndarray]:
    """A new session of `engine` reads `toks`, then takes the argmax n times: (the n tokens, the
    logits after the last one, a copy)."""
    s = Session(engine, ctx)
    s.sync(list(toks))
    out = []
    for _ in range(n):
        t = int(np.argmax(s.logits))
        out.append(t)
        s.eval(t)
    return out, np.array(s.logits, copy=True)
