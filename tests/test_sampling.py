"""Sampling (ds4's algorithm and generator) and log-probabilities."""
from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.sampling import Rng, SamplingParams, argmax, logprob_of, sample, top_logprobs


def test_temperature_zero_is_argmax_with_lowest_id_on_ties():
    logits = np.array([0.5, 2.0, -1.0, 2.0], np.float32)
    assert sample(logits, SamplingParams(temperature=0), Rng(1)) == 1
    assert argmax(logits) == 1


def test_xorshift_stream_is_deterministic_and_uniform():
    a, b = Rng(42), Rng(42)
    xs = [a.f32() for _ in range(20000)]
    assert xs[:5] == [b.f32() for _ in range(5)]
    assert 0 <= min(xs) and max(xs) < 1 and abs(np.mean(xs) - 0.5) < 0.01
    # first output by the xorshift64* definition, computed by hand for seed 1
    x = 1
    x ^= x >> 12
    x ^= (x << 25) & (2**64 - 1)
    x ^= x >> 27
    assert Rng(1).next() == (x * 0x2545F4914F6CDD1D) % 2**64


@pytest.mark.parametrize("params", [SamplingParams(min_p=0.0), SamplingParams(top_k=5, min_p=0.0),
                                    SamplingParams(top_p=0.999, min_p=0.0)])
def test_frequencies_follow_the_softmax(params):
    logits = np.array([1.0, 0.0, -1.0, 0.5, -3.0], np.float32)
    rng = Rng(7)
    n = 20000
    counts = np.bincount([sample(logits, params, rng) for _ in range(n)], minlength=5)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert np.abs(counts / n - p).max() < 0.015


def test_min_p_top_k_top_p_truncate():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.04, 0.01], np.float32))
    rng = Rng(3)
    seen = {sample(logits, SamplingParams(min_p=0.1), rng) for _ in range(3000)}
    assert seen == {0, 1, 2}                             # 0.04 and 0.01 are below 0.1 * 0.5
    seen = {sample(logits, SamplingParams(top_k=2, min_p=0), rng) for _ in range(3000)}
    assert seen == {0, 1}
    seen = {sample(logits, SamplingParams(top_p=0.7, min_p=0), rng) for _ in range(3000)}
    assert seen == {0, 1}                                # 0.5 + 0.3 reaches 0.7
    hot = {sample(logits, SamplingParams(temperature=100, min_p=0), rng) for _ in range(3000)}
    assert hot == {0, 1, 2, 3, 4}


def test_same_seed_same_tokens():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    p = SamplingParams(seed=11)
    a = [sample(logits, p, r) for r in [Rng(11)] for _ in range(50)]
    r = Rng(11)
    assert a == [sample(logits, p, r) for _ in range(50)]


def test_top_logprobs_and_logprob_of():
    logits = np.array([1.0, 3.0, 3.0, -2.0], np.float32)
    top = top_logprobs(logits, 3)
    assert [i for i, _ in top] == [1, 2, 0]
    lse = np.log(np.exp(logits.astype(np.float64)).sum())
    assert top[0][1] == pytest.approx(3.0 - lse) and logprob_of(logits, 3) == pytest.approx(-2.0 - lse)
    assert np.exp([lp for _, lp in top_logprobs(logits, 4)]).sum() == pytest.approx(1.0)
