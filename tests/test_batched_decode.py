"""Sessions of one Engine on several threads, and the batched decode step across sessions
(Model.forward_batch, engine/runtime/batcher.py): the same tokens as each session run alone."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine import Engine, Session


@pytest.fixture(scope="module")
def eng(small_model):
    with Engine.open(small_model, numerics="ds4") as e:
        yield e


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    # different lengths: some sessions cross the indexer's top-k (16 rows = 64 tokens), some not
    rng = np.random.default_rng(seed)
    lens = [5, 40, 90, 130, 17, 70][:n]
    return [rng.integers(0, 465, k).tolist() for k in lens]


def _greedy(s: Session, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    s.sync(prompt)
    out, rows = [], []
    for _ in range(steps):
        t = int(np.argmax(s.logits))
        out.append(t)
        rows.append(s.eval(t).copy())
    return out, np.array(rows)


def test_sessions_on_threads_equal_alone(eng):
    """One session per thread on one Engine: each gets exactly what it gets alone (every forward
    pass of the Engine is serialized; nothing of one pass leaks into another)."""
    prompts = _prompts(4)
    alone = [_greedy(Session(eng, 256, chunk=32), p, 12) for p in prompts]
    got: list = [None] * len(prompts)

    def run(i):
        got[i] = _greedy(Session(eng, 256, chunk=32), prompts[i], 12)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (ta, la), (tg, lg) in zip(alone, got):
        assert ta == tg
        assert np.array_equal(la, lg)
