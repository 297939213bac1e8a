"""ds4's float32 loops outside the matmuls, in the order its compiled CPU path runs them (issue 33).

ds4 (github antirez/ds4, ``ds4.c``) is built with ``-O3 -ffast-math -march=native`` (GCC 12 on
x86-64 with AVX-512, the build of the oracles in tests/oracles). Under ``-ffast-math`` GCC fuses
``a * b + c`` into FMAs and reassociates short sums, so the literal C is not the arithmetic: each
function here follows the x86 code of ds4's object (``objdump -d -l`` of ``ds4_cpu.o``, read
line by line), and was checked bit for bit against ds4's own intermediates, dumped by a debug
build (``scripts/build_ds4_oracle.py dump``, compared by ``scripts/ds4_dump_compare.py``).
docs/numerics.md lists every rule with its ds4 function and the test that pins it.

libm: ``expf`` and ``log1pf`` are modelled as correctly rounded (float64, rounded once), which
glibc's are on all but a vanishing fraction of inputs. ``fma`` is the float64 product of two
float32 values (exact) plus the addend, rounded to float32 (one rounding in all but ~2^-29 of
cases).
"""
from __future__ import annotations

import numpy as np

from . import numerics as N

_F32 = np.float32
_ONE = _F32(1.0)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def fma(a, b, c) -> np.ndarray:
    """fmaf(a, b, c): the exact a * b + c rounded once to float32."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(_F32)


def expf(x) -> np.ndarray:
    return np.exp(np.asarray(x, np.float64)).astype(_F32)


def log1pf(x) -> np.ndarray:
    """The C library's ``log1pf`` (glibc's is not correctly rounded: one ulp off now and then,
    which moves a router weight and so a Q8_K code); correctly rounded where no libm loads."""
    x = _f32(x)
    f = N.libm_ufunc("log1pf")
    if f is None or x.size == 0:
        return np.log1p(x.astype(np.float64)).astype(_F32)
    return f(x).astype(_F32)


def sigmoid_stable(x) -> np.ndarray:
    """ds4.c ``sigmoid_stable``: ``1 / (1 + expf(-x))`` for x >= 0, ``e / (1 + e)`` with
    ``e = expf(x)`` below (each step rounded to float32)."""
    x = _f32(x)
    e = expf(-np.abs(x))
    den = (_ONE + e).astype(_F32)
    return np.where(x >= 0, _ONE / den, e / den).astype(_F32)


def silu(x) -> np.ndarray:
    """ds4.c ``silu``: ``x * sigmoid_stable(x)``."""
    x = _f32(x)
    return (x * sigmoid_stable(x)).astype(_F32)


def softplus(x) -> np.ndarray:
    """ds4.c ``softplus_stable``: x above 20, ``expf(x)`` below -20, else ``log1pf(expf(x))``."""
    x = _f32(x)
    e = expf(x)
    mid = log1pf(e)
    return np.where(x > 20.0, x, np.where(x < -20.0, e, mid)).astype(_F32)


# elements of the [T, out, in] products one F16 matvec chunk holds (~64 MB of float32)
_F16_CHUNK = 1 << 24


def f16_matvec(w16: np.ndarray, x) -> np.ndarray:
    """ds4.c ``matvec_f16`` / ``dot_f16_row`` on x86: ``acc += f16_to_f32(w[i]) * x[i]`` with
    the product and every partial sum rounded to float32, in index order (GCC does not vectorize
    the loop: its software ``f16_to_f32`` has a branch; ``vmulss`` then ``vaddss``, no FMA).
    w16 [out, in] float16, x [T, in] -> [T, out]. ``np.add.accumulate`` adds strictly in order."""
    x = _f32(x)
    w = np.asarray(w16).astype(_F32)
    T, (n_out, n_in) = x.shape[0], w.shape
    out = np.empty((T, n_out), dtype=_F32)
    step = max(1, _F16_CHUNK // max(1, n_out * n_in))
    for t0 in range(0, T, step):
        prod = (x[t0:t0 + step, None, :] * w[None, :, :]).astype(_F32)
        out[t0:t0 + step] = np.add.accumulate(prod, axis=-1, dtype=_F32)[..., -1]
    return out


def _sum4(v, axis: int, order=((0, 1), (2, 3))) -> np.ndarray:
    """A sum of 4 terms along `axis` as GCC's code pairs them: (v[a] + v[b]) + (v[c] + v[d])."""
    (a, b), (c, d) = order
    t = lambda i: np.take(v, i, axis=axis)
    return ((t(a) + t(b)).astype(_F32) + (t(c) + t(d)).astype(_F32)).astype(_F32)


def hc_split(mix, n: int, scale, base, eps, iters: int):
    """ds4.c ``hc_split_sinkhorn_one`` as compiled inside ``hc_pre_from_state_one_scratch``
    (n = 4): mix [T, 2n + n*n] -> pre [T, n], post [T, n], C [T, n, n] (C[t, a, b]: the
    combine weight mix[2n + a*n + b] after Sinkhorn).

    - ``z = fma(mix, scale, base)``; pre ``1 / (1 + expf(-z)) + eps``; post ``2 / (1 + expf(-z))``.
    - Rows of C: ``expf(c - max)``, the row sum paired (0+1)+(2+3), ``fma(c, 1/sum, eps)``.
    - Columns: ``c *= 1 / (sum + eps)``, the column sum paired (0+1)+(2+3).
    - Then iters - 1 rounds of rows, columns, each ``c *= 1 / (sum + eps)``; in these rounds
      GCC pairs the LAST row's sum (1+2)+(0+3), every other sum (0+1)+(2+3).
    """
    if n != 4:
        raise ValueError(f"ds4's compiled HC split is the 4-stream one (n_hc = {n})")
    mix, scale, base, eps = _f32(mix), _f32(scale), _f32(base), _F32(eps)
    T = mix.shape[0]
    z = fma(mix, np.repeat(scale, [n, n, n * n]), base)
    pre = (_ONE / (_ONE + expf(-z[:, :n])) + eps).astype(_F32)
    post = (_F32(2.0) / (_ONE + expf(-z[:, n:2 * n]))).astype(_F32)
    C = z[:, 2 * n:].reshape(T, n, n)
    C = expf(C - C.max(axis=2, keepdims=True))
    C = fma(C, (_ONE / _sum4(C, 2))[:, :, None], eps)
    C = (C * (_ONE / (_sum4(C, 1) + eps))[:, None, :]).astype(_F32)
    last = [((0, 1), (2, 3))] * (n - 1) + [((1, 2), (0, 3))]
    for _ in range(iters - 1):
        rows = np.stack([_sum4(C[:, r], 1, last[r]) for r in range(n)], axis=1)
        C = (C * (_ONE / (rows + eps))[:, :, None]).astype(_F32)
        C = (C * (_ONE / (_sum4(C, 1) + eps))[:, None, :]).astype(_F32)
    return pre, post, C


def hc_weighted_sum(w, X) -> np.ndarray:
    """ds4.c ``hc_weighted_sum_one`` (n = 4) as compiled: ``fma(x0, w0, x1 * w1) +
    fma(x2, w2, x3 * w3)``. w [T, 4], X [T, 4, E] -> [T, E]."""
    w, X = _f32(w)[:, :, None], _f32(X)
    if X.shape[1] != 4:
        raise ValueError("ds4's compiled HC sum is the 4-stream one")
    a = fma(X[:, 0], w[:, 0], (X[:, 1] * w[:, 1]).astype(_F32))
    b = fma(X[:, 2], w[:, 2], (X[:, 3] * w[:, 3]).astype(_F32))
    return (a + b).astype(_F32)


def hc_post(y, X, post, C) -> np.ndarray:
    """ds4.c ``hc_post_one`` (n = 4) as compiled: output stream k is
    ``fma(C[3,k], x3, fma(post[k], y, C[0,k] * x0) + fma(C[1,k], x1, C[2,k] * x2))``.
    y [T, E], X [T, 4, E], post [T, 4], C [T, 4, 4] -> [T, 4, E]."""
    y, X, post, C = _f32(y)[:, None, :], _f32(X), _f32(post)[:, :, None], _f32(C)
    if X.shape[1] != 4:
        raise ValueError("ds4's compiled HC post is the 4-stream one")
    c = lambda j: C[:, j, :, None]                        # [T, k, 1]: input stream j's weights
    x = lambda j: X[:, j][:, None, :]                     # [T, 1, E]
    a = fma(post, y, (c(0) * x(0)).astype(_F32))
    b = fma(c(1), x(1), (c(2) * x(2)).astype(_F32))
    return fma(c(3), x(3), (a + b).astype(_F32))


def _clamp(g, u, limit):
    g, u, limit = _f32(g), _f32(u), _F32(limit)
    if limit > _F32(1.0e-6):
        g = np.minimum(g, limit)
        u = np.maximum(np.minimum(u, limit), -limit)
    return g, u


def swiglu(g, u, limit) -> np.ndarray:
    """ds4.c ``swiglu`` (the shared expert) as compiled: the clamps, then
    ``sigmoid_stable(g) * (g * u)`` (GCC multiplies g by u before the sigmoid's factor)."""
    g, u = _clamp(g, u, limit)
    return (sigmoid_stable(g) * (g * u).astype(_F32)).astype(_F32)


def routed_mid(g, u, w, limit) -> np.ndarray:
    """ds4.c ``matvec_iq2_xxs_mid_worker`` (a routed expert's weighted SwiGLU) as compiled: the
    clamps, then ``(sigmoid_stable(g) * u) * (g * weight)``."""
    g, u = _clamp(g, u, limit)
    return ((sigmoid_stable(g) * u).astype(_F32) * (g * _f32(w)).astype(_F32)).astype(_F32)


def _dot128(q, k) -> np.ndarray:
    """ds4.c ``dot_f32`` over 128 values as GCC vectorizes it (AVX-512, 16 lanes): per lane,
    chunks c0..c7 of 16 combine as ``(fma(c6, q6, c7 q7) + fma(c4, q4, c5 q5)) +
    (fma(c0, q0, c1 q1) + fma(c2, q2, c3 q3))``, then the 16 lanes fold in halves (8, 4, 2, 1).
    q [..., 128], k [..., 128] broadcast against each other."""
    p = lambda j: (q[..., 16 * j:16 * j + 16], k[..., 16 * j:16 * j + 16])
    f = lambda a, b: fma(*p(a), (np.multiply(*p(b))).astype(_F32))
    v = ((f(6, 7) + f(4, 5)).astype(_F32) + (f(0, 1) + f(2, 3)).astype(_F32)).astype(_F32)
    for half in (8, 4, 2, 1):
        v = (v[..., :half] + v[..., half:2 * half]).astype(_F32)
    return v[..., 0]


# elements of a [T, H, K, 16] lane block one attention chunk holds
_ATT_CHUNK = 1 << 22
# query rows attention takes at once (a block's keys: the union of what its rows see)
_ATT_ROWS = 32


def attention(q, segments, sinks, kq_scale) -> np.ndarray:
    """ds4.c ``layer_attention_rows_one`` / ``layer_attention_mixed_one_decode_scratch`` (head
    dim 128, the width the form was read at): per head, scores ``dot_f32(q, k) * kq_scale``
    (``_dot128``; kq_scale the float32 ``1 / sqrtf(dim)``), the max over the sink and the scores,
    ``denom = expf(sink - max)`` then ``denom += w`` and ``o = fma(w, k, o)`` for each key in
    order (``w = expf(s - max)``; masked keys are skipped), then ``o * (1 / denom)``.
    q [T, H, D]; segments: (keys [K, D] or [T, K, D], mask [T, K]) in ds4's order (raw rows,
    then compressed rows); sinks [H] -> [T, H, D]."""
    q, sinks, kq_scale = _f32(q), _f32(sinks), _F32(kq_scale)
    T, H, D = q.shape
    segs = [(_f32(k), np.broadcast_to(m, (T, k.shape[-2]))) for k, m in segments]
    o = np.empty((T, H, D), dtype=_F32)
    # Rows in blocks, each over only the keys some row of the block sees (a prefill's causal and
    # windowed masks leave most keys out): a key no row of the block sees has weight 0 there, and
    # ds4 skips masked keys, so dropping it changes no bit (a +0 added to the positive denom, an
    # fma(0, k, o) that returns o); the scores are elementwise, the same for any subset.
    for t0 in range(0, T, _ATT_ROWS):
        t1 = min(T, t0 + _ATT_ROWS)
        ks, ms = [], []
        for k, m in segs:
            cols = np.flatnonzero(m[t0:t1].any(axis=0))
            kk = k[cols] if k.ndim == 2 else k[t0:t1, cols]
            ks.append(np.broadcast_to(kk, (t1 - t0,) + kk.shape[-2:]) if kk.ndim == 2 else kk)
            ms.append(m[t0:t1, cols])
        o[t0:t1] = _attend_rows(q[t0:t1], np.concatenate(ks, axis=1), np.concatenate(ms, axis=1), sinks, kq_scale)
    return o


def _attend_rows(q, keys, mask, sinks, kq_scale) -> np.ndarray:
    """attention's work on a block of rows: q [b, H, D], keys [b, K, D], mask [b, K]."""
    T, H, D = q.shape
    K = keys.shape[1]
    if K == 0:                      # nothing visible: the sink alone, an output of zeros
        return np.zeros((T, H, D), dtype=_F32)
    s = np.empty((T, H, K), dtype=_F32)
    step = max(1, _ATT_CHUNK // max(1, H * K * 16))
    for t0 in range(0, T, step):
        s[t0:t0 + step] = (_dot128(q[t0:t0 + step, :, None, :], keys[t0:t0 + step, None, :, :]) * kq_scale).astype(_F32)
    s = np.where(mask[:, None, :], s, -np.inf).astype(_F32)
    m = np.maximum(s.max(axis=2), sinks[None, :])                                # [T, H]
    w = np.where(mask[:, None, :], expf(s - m[..., None]), _F32(0.0))           # [T, H, K]
    den = np.concatenate([expf(sinks[None, :] - m)[..., None], w], axis=2)
    den = np.add.accumulate(den, axis=2, dtype=_F32)[..., -1]
    o = np.zeros((T, H, D), dtype=_F32)
    for r in range(K):
        o = fma(w[:, :, r, None], keys[:, None, r, :], o)
    return (o * (_ONE / den)[..., None]).astype(_F32)


def hc_head(mix, scale, base, eps, X) -> np.ndarray:
    """ds4.c ``output_logits_one_decode_scratch``'s HC collapse as compiled: weights
    ``sigmoid_stable(fma(mix, scale, base)) + eps``, then ``hc_weighted_sum_one`` inlined there
    with another pairing, ``fma(x0, w0, x3 * w3) + fma(x1, w1, x2 * w2)``.
    mix [T, 4], X [T, 4, E] -> [T, E]."""
    w = (sigmoid_stable(fma(_f32(mix), _f32(scale), _f32(base))) + _F32(eps)).astype(_F32)[:, :, None]
    X = _f32(X)
    a = fma(X[:, 0], w[:, 0], (X[:, 3] * w[:, 3]).astype(_F32))
    b = fma(X[:, 1], w[:, 1], (X[:, 2] * w[:, 2]).astype(_F32))
    return (b + a).astype(_F32)


def expert_weights(w, scale, hashed: bool) -> np.ndarray:
    """The routed experts' weights from their router probabilities w [T, k] (ds4.c
    ``layer_hash_router_weights_from_probs`` / ``layer_topk_selected_experts_from_probs``):
    ``sum = max(sum w, 2^-14)``, then ``w / sum * scale``. As compiled for k = 4 (both inlined
    into the decode path): the sum paired (0+1)+(2+3) (hash layers) or (0+2)+(1+3) (top-k
    layers), then ``(w * scale) * (1 / sum)``. Other k: the literal form (checked at k = 2)."""
    w, scale = _f32(w), _F32(scale)
    floor = _F32(6.103515625e-5)
    if w.shape[-1] == 4:
        s = _sum4(w, 1, ((0, 1), (2, 3)) if hashed else ((0, 2), (1, 3)))
        inv = (_ONE / np.maximum(s, floor)).astype(_F32)
        return ((w * scale).astype(_F32) * inv[:, None]).astype(_F32)
    s = np.add.accumulate(w, axis=1, dtype=_F32)[:, -1]
    return (w / np.maximum(s, floor)[:, None] * scale).astype(_F32)
