"""Token sampling as ds4 does it (spec/protocol.md §4.4), with ds4's xorshift64* generator.

Defaults are ds4's: temperature 1.0, top_k off, top_p 1.0, min_p 0.05. Temperature <= 0 is argmax
with the lowest id winning ties. min_p keeps tokens whose weight is at least min_p times the top
token's; top_p then keeps the smallest prefix (by descending logit) reaching that mass. With the
same seed and logits the choice matches ds4's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

MASK64 = (1 << 64) - 1
TOP_K_CAP = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0
    min_p: float = 0.05
    seed: int | None = None  # None or 0: seeded from the OS


class Rng:
    """ds4's xorshift64* stream: next() and f32() in [0, 1) with 24 random bits."""

    def __init__(self, seed: int | None = None):
        if not seed:
            seed = int.from_bytes(np.random.default_rng().bytes(8), "little") or 1
        self.state = seed & MASK64

    def next(self) -> int:
        x = self.state or 0x9E3779B97F4A7C15
        x ^= x >> 12
        x ^= (x << 25) & MASK64
        x ^= x >> 27
        self.state = x
        return (x * 0x2545F4914F6CDD1D) & MASK64

    def f32(self) -> float:
        return float(np.float32(((self.next() >> 40) & 0xFFFFFF) / 16777216.0))


def argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # first maximum = lowest id


class Candidates(NamedTuple):
    """What sample() draws from after its filters: `w` float32 weights (unnormalised); `ids` the
    ids they belong to in the order the draw walks them, or None when `w` covers the whole
    vocabulary in id order (no top-k, no top-p: the min-p filter alone)."""
    ids: np.ndarray | None
    w: np.ndarray


def candidates(logits: np.ndarray, params: SamplingParams) -> Candidates | None:
    """sample()'s filters (temperature, top-k, min-p, top-p) without the draw; None where it takes
    the argmax (temperature <= 0, or no finite logit). speculative.target_probs normalises the
    same weights: the distribution the rejection rule compares drafts with is sample()'s own."""
    logits = np.asarray(logits, dtype=np.float32)
    T = float(params.temperature)
    if T <= 0:
        return None
    top_p = params.top_p if 0 < params.top_p <= 1 else 1.0
    min_p = max(0.0, float(params.min_p))
    finite = np.isfinite(logits)
    if not finite.any():
        return None
    k = min(int(params.top_k), TOP_K_CAP)
    if k <= 0 and top_p >= 1.0:
        # whole vocabulary in id order, relative-to-max filter
        mx = np.max(logits[finite])
        w = np.where(finite, np.exp((logits - mx) / np.float32(T)), 0.0).astype(np.float32)
        return Candidates(None, np.where(w >= np.float32(min_p), w, 0.0).astype(np.float32))
    ids = np.nonzero(finite)[0]
    order = ids[np.argsort(-logits[ids], kind="stable")]
    if k > 0:
        order = order[:k]
    lg = logits[order]
    w = np.exp((lg - lg[0]) / np.float32(T)).astype(np.float32)
    p = w / w.sum(dtype=np.float32)
    keep = 1
    cum = p[0]
    while keep < len(p) and cum < top_p and p[keep] >= p[0] * min_p:
        cum += p[keep]
        keep += 1
    return Candidates(order[:keep], p[:keep])


def sample(logits: np.ndarray, params: SamplingParams, rng: Rng) -> int:
    c = candidates(logits, params)
    if c is None:
        return argmax(logits)
    if c.ids is None:
        w = c.w
        r = np.float32(rng.f32()) * np.float32(w.sum(dtype=np.float32))
        cum = np.cumsum(w, dtype=np.float32)
        hit = np.nonzero((r - cum <= 0) & (w > 0))[0]
        return int(hit[0]) if len(hit) else argmax(logits)
    p = c.w
    r = np.float32(rng.f32()) * np.float32(p.sum(dtype=np.float32))
    for i, pi in enumerate(p):
        r -= pi
        if r <= 0:
            return int(c.ids[i])
    return int(c.ids[0])


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely ids with their log-probabilities, most likely first (lowest id on ties)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    lse = m + np.log(np.sum(np.exp(x - m)))
    k = min(k, len(x))
    idx = np.argsort(-x, kind="stable")[:k]
    return [(int(i), float(x[i] - lse)) for i in idx]


def logprob_of(logits: np.ndarray, token: int) -> float:
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    return float(x[token] - m - np.log(np.sum(np.exp(x - m))))
