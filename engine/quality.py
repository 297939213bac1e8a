"""The array side of `ds4 --perplexity` and `--kl-base`: which tokens a run scores, their
log-probabilities from a Session's logits, and how two runs' distributions differ.

Scoring. The text's tokens are cut into windows of at most `ctx` tokens; a window is evaluated
from an empty state and the token at index j is scored by the logits after tokens[start..j-1].
Default: independent chunks, every token after a chunk's first scored. `stride`: a window starts
every `stride` tokens and scores only the tokens no earlier window scored (each then has up to
ctx - stride tokens of context). `second_half`: only the second half of each chunk is scored, as
llama-perplexity does (every scored token has at least ctx/2 tokens of context).

The KL base keeps, per scored position, the top-k log-probabilities of one run. A later run is
compared on the same positions: KL(base || new) over the base's top k ids plus one bucket for all
the other ids. Merging ids into a bucket can only lower a KL, so this is a lower bound of the full
KL (close to it when the top k hold nearly all the mass, as they do for a trained model).
"""
from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass, field

import numpy as np

from .atomic import atomic_open

BASE_SCHEMA = "ds4-agent-kl-base-v1"
ROW_BLOCK = 64          # rows of float64 log-softmax at a time (a real vocabulary row is 1 MB)


def plan_windows(n: int, ctx: int, stride: int = 0, second_half: bool = False) -> list[tuple[int, int, int]]:
    """[(start, end, first)]: tokens[start:end] is one window, tokens[first:end] are scored.
    ValueError (one line) when the text cannot be scored this way."""
    if ctx < 2:
        raise ValueError("--ctx must be at least 2 tokens to score one")
    if n < 2:
        raise ValueError(f"the text has {n} token{'' if n == 1 else 's'}: at least 2 are needed to score one")
    if stride and second_half:
        raise ValueError("--ppl-stride and --ppl-second-half are two ways to give tokens context: pick one")
    if stride and not 1 <= stride <= ctx - 1:
        raise ValueError(f"--ppl-stride must be between 1 and --ctx - 1 ({ctx - 1}), not {stride}")
    out, scored_to, start = [], 1, 0
    while start < n - 1:
        end = min(start + ctx, n)
        if stride:
            first = max(scored_to, start + 1)
        else:
            first = start + (ctx // 2 if second_half else 1)
        if first < end:
            out.append((start, end, first))
        scored_to = end
        if end == n:
            break
        start += stride or ctx
    if not out:
        raise ValueError(f"the text's {n} tokens leave nothing to score with --ctx {ctx} (second half: "
                         f"a chunk needs more than {ctx // 2} tokens)")
    return out


@dataclass
class Scores:
    """Per scored position: its index in the text, the log-probability of the token there, the
    run's top-k ids and log-probabilities, and (when compared) the log-probabilities it gives the
    base's top-k ids. Rows arrive in parts, each added by one list append, so an interrupt leaves
    whole parts only."""
    k: int
    parts: list = field(default_factory=list)

    def __len__(self):
        return sum(len(p[0]) for p in self.parts)

    def arrays(self) -> dict:
        names = ("pos", "token_lp", "top_ids", "top_lp", "at_base")
        types = (np.int64, np.float64, np.int32, np.float32, np.float64)
        shapes = ((0,), (0,), (0, self.k), (0, self.k), (0, self.k))
        out = {}
        for i, (name, dt, shape) in enumerate(zip(names, types, shapes)):
            got = [p[i] for p in self.parts if p[i] is not None]
            out[name] = np.concatenate(got).astype(dt) if got else np.zeros(shape, dt)
        return out

    def nll(self) -> np.ndarray:
        return -self.arrays()["token_lp"]


def log_softmax_rows(rows: np.ndarray) -> np.ndarray:
    x = np.asarray(rows, dtype=np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def _add_rows(scores: Scores, logits: np.ndarray, pos: np.ndarray, targets: np.ndarray, base_ids):
    """Score logits rows (each predicting the token at `pos`) into `scores`, ROW_BLOCK at a time."""
    tlp, ids, tops, at = [], [], [], []
    for b in range(0, len(pos), ROW_BLOCK):
        lp = log_softmax_rows(logits[b:b + ROW_BLOCK])
        r = np.arange(len(lp))[:, None]
        kk = min(scores.k, lp.shape[1])
        idx = np.argpartition(-lp, kk - 1, axis=1)[:, :kk]
        idx = idx[r, np.argsort(-lp[r, idx], axis=1, kind="stable")]
        tlp.append(lp[r[:, 0], targets[b:b + ROW_BLOCK]])
        ids.append(idx)
        tops.append(lp[r, idx])
        if base_ids is not None:
            at.append(lp[r, base_ids[b:b + ROW_BLOCK]])
    scores.parts.append((pos, np.concatenate(tlp), np.concatenate(ids), np.concatenate(tops),
                         np.concatenate(at) if base_ids is not None else None))


def score_window(session, tokens, window, scores: Scores, *, piece: int, base_ids=None, stop_at=None,
                 on_piece=None):
    """Evaluate one window from an empty state, `piece` tokens at a time, adding its scored
    positions to `scores` after every piece (an interrupt keeps every whole piece). base_ids:
    the base's top-k ids for the positions this window scores. stop_at: score no position from it on.
    on_piece(n_scored_in_this_piece) is called after each piece."""
    start, end, first = window
    if stop_at is not None:
        end = min(end, stop_at)
    seq = [int(t) for t in tokens[start:end - 1]]     # the last token is only predicted
    session.reset()
    for c in range(0, len(seq), piece):
        rows = session.sync(seq[:c + piece], keep_logits=True)
        pos = np.arange(start + c + 1, start + c + 1 + len(rows))     # the token each row predicts
        keep = pos >= first
        if keep.any():
            p = pos[keep]
            tgt = np.asarray(tokens, dtype=np.int64)[p]
            bids = None if base_ids is None else base_ids.take_for(p)
            _add_rows(scores, rows[keep], p, tgt, bids)
        if on_piece is not None:
            on_piece(int(keep.sum()))


class BaseIds:
    """The base's top-k ids, looked up by text position."""

    def __init__(self, pos: np.ndarray, ids: np.ndarray):
        self.row = {int(p): i for i, p in enumerate(pos)}
        self.ids = ids

    def take_for(self, positions: np.ndarray) -> np.ndarray:
        return self.ids[[self.row[int(p)] for p in positions]]


def ppl(nll: np.ndarray) -> tuple[float, float]:
    """(perplexity, its standard error): exp of the mean negative log-likelihood, and the error of
    that mean carried through exp (llama-perplexity's estimate)."""
    n = len(nll)
    if n == 0:
        return float("nan"), float("nan")
    mean = float(np.mean(nll))
    err = float(np.std(nll, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return math.exp(mean), math.exp(mean) * err


def token_digest(tokens) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


def save_base(path, meta: dict, scores: Scores):
    """Write a run's top-k log-probabilities (an .npz, through a temp file)."""
    a = scores.arrays()
    blob = json.dumps(dict(meta, schema=BASE_SCHEMA), sort_keys=True).encode("utf-8")
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(blob, np.uint8), pos=a["pos"], token_lp=a["token_lp"],
                        top_ids=a["top_ids"], top_lp=a["top_lp"])
    with atomic_open(path) as f:
        f.write(buf.getvalue())


def load_base(path) -> tuple[dict, dict]:
    """(meta, arrays) of a saved base; ValueError (one line) for a file that is not one."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode("utf-8"))
            arrays = {k: z[k] for k in ("pos", "token_lp", "top_ids", "top_lp")}
    except (OSError, ValueError, KeyError, UnicodeDecodeError, EOFError) as e:
        raise ValueError(f"{path}: not a --kl-base file ({e})") from None
    if meta.get("schema") != BASE_SCHEMA:
        raise ValueError(f"{path}: not a --kl-base file (schema {meta.get('schema')!r})")
    return meta, arrays


def compare(base: dict, new: Scores, worst: int = 5) -> dict:
    """KL(base || new) per position over the base's top k plus an "other ids" bucket, top-1
    agreement, both perplexities on the shared positions and the `worst` positions by KL."""
    a = new.arrays()
    m = len(a["pos"])
    if not np.array_equal(base["pos"][:m], a["pos"]):
        raise ValueError("the two runs scored different positions: use the same text, --ctx and scoring options")
    lp_b = base["top_lp"][:m].astype(np.float64)
    lp_n = a["at_base"]
    p = np.exp(lp_b)
    rest_p = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
    rest_q = np.clip(1.0 - np.exp(lp_n).sum(axis=1), 1e-300, 1.0)
    tail = np.where(rest_p > 1e-12, rest_p * (np.log(np.maximum(rest_p, 1e-300)) - np.log(rest_q)), 0.0)
    kl = np.maximum((p * (lp_b - lp_n)).sum(axis=1) + tail, 0.0)
    top1 = base["top_ids"][:m, 0] == a["top_ids"][:, 0]
    order = np.argsort(-kl, kind="stable")[:worst]
    return {"n": m, "kl_mean": float(kl.mean()) if m else float("nan"),
            "kl_err": float(kl.std(ddof=1) / math.sqrt(m)) if m > 1 else float("nan"),
            "kl_p99": float(np.percentile(kl, 99)) if m else float("nan"),
            "kl_max": float(kl.max()) if m else float("nan"),
            "top1": float(top1.mean()) if m else float("nan"),
            "ppl_base": ppl(-base["token_lp"][:m])[0], "ppl_new": ppl(-a["token_lp"])[0],
            "worst": [{"pos": int(a["pos"][i]), "kl": float(kl[i]), "base_top": int(base["top_ids"][i, 0]),
                       "new_top": int(a["top_ids"][i, 0])} for i in order]}
