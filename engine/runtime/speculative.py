"""Speculative decoding with a drafter (the MTP block, or a test's): several tokens a main-model
pass, with exactly the output of plain decoding.

A step: the next token y is chosen from the session's logits as plain decoding chooses it; the
drafter proposes d1..dN after it; the main model evaluates y, d1..dN in ONE pass
(Model.forward_verify: each weight read once, each row computed as its decode step computes it);
then the drafts are checked in order against the main model's own rows:

- greedy (temperature <= 0): d_i is kept while it is the argmax of the row before it;
- sampling: rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
  Speculative Decoding"): d_i ~ q_i is kept with probability min(1, p_i(d_i) / q_i(d_i)), where
  p_i is exactly the distribution plain sampling draws from (sampling.sample's temperature,
  top-k, top-p and min-p); at the first rejection the token is drawn from max(0, p_i - q_i)
  normalised, and becomes the next step's y. The tokens then follow plain sampling's law.

Rows past the kept ones are cut back in place (KVState.truncate: raw rows, compressed rows,
indexer rows and compressor frontiers, all addressed by position), so the session holds exactly
what plain decoding leaves: the same tokens, logits and state, snapshot bytes included. Nothing of
the drafter is persisted: a snapshot is the main timeline's alone.
"""
from __future__ import annotations

import time

import numpy as np

from ..mtp_options import MAX_DRAFT
from .sampling import Rng, SamplingParams, argmax, candidates, sample
from .session import ContextFull, Session


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling.sample draws from for these logits (float64 [vocab]): its own
    filters' weights (sampling.candidates), normalised; one-hot on the argmax for temperature <= 0."""
    logits = np.asarray(logits, dtype=np.float32)
    out = np.zeros(logits.shape[0], np.float64)
    c = candidates(logits, params)
    if c is None:
        out[argmax(logits)] = 1.0
        return out
    if c.ids is None:
        w = c.w.astype(np.float64)
        return w / w.sum()
    out[c.ids] = c.w
    return out / out.sum()


def draw(p: np.ndarray, rng: Rng) -> int:
    """One id from the distribution p (inverse CDF on one rng draw)."""
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, rng.f32() * cum[-1], side="right"))
    i = min(i, len(p) - 1)
    while p[i] <= 0:                         # (rounding at the top end: the last id with mass)
        i -= 1
    return i


def accept_drafts(p_rows, drafts, q_rows, rng: Rng | None, greedy=None) -> tuple[int, int | None]:
    """The rejection rule on distributions: p_rows[i] the target's distribution for the position
    of drafts[i], q_rows[i] the drafter's (None: it proposed deterministically, q one-hot).
    Returns (k, r): the first k drafts are kept; r is the token drawn at the first rejection
    (None when all were kept). rng None, or greedy[i] true: a greedy target there, no draws."""
    for i, d in enumerate(drafts):
        p = p_rows[i]
        q = None if q_rows is None else q_rows[i]
        qd = 1.0 if q is None else float(q[d])
        if rng is None or (greedy is not None and greedy[i]):
            if p[d] >= 1.0:
                continue
            return i, int(np.argmax(p))
        if qd > 0 and rng.f32() * qd < p[d]:
            continue
        res = p.copy()
        if q is None:
            res[d] = 0.0
        else:
            res = np.maximum(res - q, 0.0)
        if res.sum() <= 0:                   # p == q up to rounding: nothing to correct
            res = p
        return i, draw(res, rng)
    return len(drafts), None


class Speculator:
    """Speculative decoding on one Session with a drafter (`propose(session, y, n, hc)` ->
    (drafts, q_rows or None); `commit(pos_after, kept)`; `reset()`; see mtp_drafter.MTPDrafter).

    `step(params, rng, limit, stop)` adds at least one token and returns the tokens it added:
    every one is evaluated into the session (a token in `stop` ends the list and is not
    evaluated, as plain decoding never evaluates EOS). `params` may be a function of the tokens
    this step has added before the position (the agent samples greedily inside DSML syntax): the
    rule then checks each draft against the parameters plain decoding would have used there."""

    def __init__(self, session: Session, drafter, n_draft: int = 2):
        if not 0 <= n_draft <= MAX_DRAFT:
            raise ValueError(f"--mtp-draft is 1..{MAX_DRAFT} tokens (got {n_draft})")
        self.session, self.drafter, self.n_draft = session, drafter, int(n_draft)
        self.pending: int | None = None
        self.stats = {"steps": 0, "drafted": 0, "accepted": 0, "tokens": 0, "seconds": 0.0}

    @property
    def acceptance(self) -> float | None:
        d = self.stats["drafted"]
        return self.stats["accepted"] / d if d else None

    def step(self, params: SamplingParams, rng: Rng, limit: int = 1 << 30, stop=()) -> list[int]:
        s = self.session
        t0 = time.perf_counter()
        at = params if callable(params) else (lambda prefix: params)
        y = self.pending if self.pending is not None else sample(s.logits, at([]), rng)
        self.pending = None
        if y in stop:
            return [y]
        P = s.pos
        if P + 1 >= s.ctx:
            raise ContextFull(f"the context of {s.ctx} tokens is full")
        n = max(0, min(self.n_draft, limit - 1, s.ctx - P - 2, s.rewind_cap))
        drafts, q_rows = self.drafter.propose(s, y, n) if n else ([], None)
        drafts = [int(d) for d in drafts[:n]]
        rows, hc = self._verify([y] + drafts)
        prm = [at([y] + drafts[:i]) for i in range(len(drafts))]
        greedy = [float(p.temperature) <= 0 for p in prm]
        p_rows = [target_probs(rows[i], prm[i]) for i in range(len(drafts))]
        k, r = accept_drafts(p_rows, drafts, q_rows, rng, greedy)
        out = [y] + drafts[:k]
        hit = next((i for i, t in enumerate(out) if t in stop), None)
        if hit is not None:
            out = out[:hit + 1]
        kept = len(out) - (hit is not None)
        self._cut(P, 1 + len(drafts), kept, rows)
        self.drafter.commit(s, kept, hc[kept - 1] if kept and hc is not None else None)
        if hit is None and k < len(drafts) and not greedy[k]:
            self.pending = r                    # the residual draw is the next token (else: sample)
        st = self.stats
        st["steps"] += 1
        st["drafted"] += len(drafts)
        st["accepted"] += k
        st["tokens"] += len(out)
        st["seconds"] += time.perf_counter() - t0
        return out

    def _verify(self, toks: list[int]):
        """One main-model pass over toks at the session's next positions: (logits rows on the host
        [len, vocab], the final HC rows or None)."""
        s = self.session
        eng = s.engine
        model = eng.model
        t0 = time.perf_counter()
        with eng.lock:
            keep = model.keep_hc
            model.keep_hc = max(keep, len(toks))
            try:
                rows = model.ops.logits_to_host(model.forward_verify(np.asarray(toks), s.pos, s.state))
                hc = model.last_hc[-len(toks):] if model.last_hc is not None else None
            finally:
                model.keep_hc = keep
        s._tokens.extend(toks)
        key = "decode" if len(toks) == 1 else "prefill"
        s.stats[key + "_tokens"] += len(toks)
        s.stats[key + "_s"] += time.perf_counter() - t0
        return np.asarray(rows, np.float32).reshape(len(toks), -1), hc

    def _cut(self, P: int, evaluated: int, kept: int, rows: np.ndarray):
        """Keep the first `kept` of the `evaluated` tokens past P; the logits become the last kept
        row's (what plain decoding's eval of that token left)."""
        s = self.session
        T, new_len = P + evaluated, P + kept
        if new_len < T:
            if s.state.can_truncate(T, new_len):
                s.state.truncate(T, new_len)
                del s._tokens[new_len:]
            else:                               # (rings too small to cut back: rebuild)
                keep = s._tokens[:new_len]
                s.reset()
                s.sync(keep)
                return
        s._logits = rows[kept - 1].copy() if kept else (None if not s._tokens else s._logits)

    def reset(self):
        self.pending = None
        self.drafter.reset()
