"""Session.fork: a second timeline from the state's arrays, copied (no prefill, no serialization).
Both go on independently and each equals a session that prefilled its own tokens from scratch."""
from __future__ import annotations

import numpy as np
import pytest

from engine import Engine, Session


@pytest.fixture(scope="module")
def engine(small_model):
    with Engine.open(small_model, backend="numpy") as e:
        yield e


def test_a_fork_goes_on_on_its_own_and_equals_a_fresh_prefill(engine):
    a = Session(engine, 256, chunk=16)
    prompt = list(range(5, 45))
    a.sync(prompt)
    before = a.stats["prefill_tokens"]
    b = a.fork()
    assert b.tokens == a.tokens and np.array_equal(b.logits, a.logits)
    assert b.stats["prefill_tokens"] == 0 and a.stats["prefill_tokens"] == before
    la = [a.eval(t).copy() for t in (7, 8, 9)]
    lb = [b.eval(t).copy() for t in (60, 61)]
    assert a.tokens == prompt + [7, 8, 9] and b.tokens == prompt + [60, 61]
    for toks, got in ((prompt + [7, 8, 9], la[-1]), (prompt + [60, 61], lb[-1])):
        fresh = Session(engine, 256, chunk=16)
        fresh.sync(toks[:-1])
        np.testing.assert_array_equal(fresh.eval(toks[-1]), got)
    # the fork's arrays are its own: cutting one back leaves the other as it was
    b.rewind(2)
    assert a.tokens == prompt + [7, 8, 9]
    np.testing.assert_array_equal(a.eval(10), _logits_after(engine, prompt + [7, 8, 9, 10]))


def _logits_after(engine, toks):
    s = Session(engine, 256, chunk=16)
    s.sync(toks[:-1])
    return s.eval(toks[-1]).copy()


def test_an_empty_session_forks_empty(engine):
    b = Session(engine, 64).fork()
    assert b.tokens == [] and b.pos == 0
    b.sync([3, 4, 5])
    assert b.pos == 3
