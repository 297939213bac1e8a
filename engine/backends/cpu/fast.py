"""Float32, vectorized versions of the reference's non-matmul ops, for the fast backends.

`FastOps` is a mixin placed before NumpyOps (class CpuOps(FastOps, NumpyOps)): it overrides the ops
whose reference form accumulates in float64 or pays NumPy call overhead per tiny array (attention,
rmsnorm, the hyper-connection mixes and Sinkhorn, RoPE); the indexer's scores stay the reference's. Each computes the same function as the
NumpyOps method up to float32 rounding (tests/test_ops_fast.py measures it); NumpyOps itself is
unchanged and stays the referee. Every op computes a token's row from that token's inputs alone, in
an order that does not depend on T (tested), so chunking does not change these ops' results; what
float32 gives up against the reference's float64 sums is independence of the ORDER in which the
model hands attention its keys (see FastOps.attention).
"""
from __future__ import annotations

import numpy as np

from ...model import numerics as N

_F32 = np.float32

# RoPE rotations (cos + i sin as complex64) of the angle tables this backend built, by the array
# object passed: a decode step rotates q, kv and the output of every layer with one pass's angles
# (Model._thetas hands every layer the same objects), and each rotation was ~8 NumPy calls, cold at
# decode (each kernel call streams the weights through the caches). Only views of a table that
# FastOps.rope_thetas made are kept: it made them read-only, so their values cannot change; any
# other array is rotated afresh. An entry holds its array, so the id is not reused while it is
# kept. A few entries: a pass has four such arrays.
_ROTATIONS: dict = {}
_ROTATION_KEEP = 8
# the newest angle tables FastOps.rope_thetas made, by id (each entry holds its table)
_TABLES: dict = {}
_TABLE_KEEP = 16


def _own(table: np.ndarray) -> np.ndarray:
    table.flags.writeable = False
    while len(_TABLES) >= _TABLE_KEEP:
        _TABLES.pop(next(iter(_TABLES)), None)            # the oldest
    _TABLES[id(table)] = table
    return table


def _rotation(thetas, th, shape, inverse, libm=False):
    entry = _ROTATIONS.get(id(thetas))
    if entry is not None and entry[0] is thetas:
        cs = entry[1].get((shape, inverse, libm))
        if cs is not None:
            return cs
    t = th.reshape(shape).astype(np.float64)
    cs = np.empty(t.shape, dtype=np.complex64)
    if libm:                                               # ds4 numerics: the C library's cosf / sinf
        cs.real, cs.imag = N.libm_cos_sin(th.reshape(shape))
    else:
        cs.real = np.cos(t)                                # float64 cos/sin rounded to float32, as the reference
        cs.imag = np.sin(t)
    if inverse:
        np.conjugate(cs, out=cs)                           # the negated angle: -sin
    root = thetas
    while isinstance(root, np.ndarray) and isinstance(root.base, np.ndarray):
        root = root.base
    if isinstance(thetas, np.ndarray) and thetas.dtype == _F32 and _TABLES.get(id(root)) is root:
        if entry is None or entry[0] is not thetas:
            while len(_ROTATIONS) >= _ROTATION_KEEP:
                _ROTATIONS.pop(next(iter(_ROTATIONS)), None)   # the oldest
            entry = _ROTATIONS[id(thetas)] = (thetas, {})
        cs.flags.writeable = False
        entry[1][(shape, inverse, libm)] = cs
    return cs


class FastOps:
    # -- RoPE tables: the reference's values, in tables this backend owns ------------------------
    def rope_thetas(self, pos, n_rot, base, yarn, query=False):
        """The reference's angles, as a read-only table whose rotations `rope` may keep."""
        return _own(super().rope_thetas(pos, n_rot, base, yarn, query))

    # -- norms ---------------------------------------------------------------------------------
    @staticmethod
    def rmsnorm(x, w, eps):
        # the sum of squares as a float32 BLAS dot per row (np.vecdot): no float64 copy of x (the
        # reference's cost: the op is 3-10x faster at T = 256) and as accurate (~1e-7 relative on
        # 16384 values; a float32 einsum, which sums sequentially, is ~1e-6). 1/sqrt is taken in
        # float64 on the [T] (or [T, H]) vector, as the reference does, so only the sum differs.
        x = np.asarray(x, dtype=_F32)
        ms = np.vecdot(x, x).astype(np.float64) / x.shape[-1]
        inv = (1.0 / np.sqrt(ms + eps)).astype(_F32)
        y = x * inv[..., None]
        if w is not None:
            y *= w                      # rounded product by product, as the reference's (y * w)
        return y

    # -- RoPE ----------------------------------------------------------------------------------
    @staticmethod
    def rope(x, thetas, inverse=False, inplace=False, libm=False):
        """N.apply_rope with the (cos, sin) of each angle table computed once (cached, see
        _rotation). With the C kernels (kernels.rope): the reference's float32 lanes, bit for bit
        (x0 c - x1 s and x0 s + x1 c, each product rounded), one pass. Without them: each (even,
        odd) pair of the tail viewed as one complex64 number and rotated by one multiply with
        cos + i sin, equal to the reference up to float32 rounding (NumPy's complex multiply
        differs in the last bit for ~11% of values: in ds4 numerics one ulp before a Q8 quantizer
        flips a code now and then, and the cpu backend's pass drifts from the reference's).
        libm: the C library's cosf / sinf (ds4 numerics, NumpyOps.rope_ds4), on the C kernel only."""
        plan = _PLANS.get((id(thetas), getattr(x, "shape", None), inverse, libm))
        if plan is not None and plan[0] is thetas and type(x) is np.ndarray and x.dtype == _F32:
            return _rope_planned(x, plan, inplace)
        x = np.asarray(x, dtype=_F32)
        th = np.asarray(thetas, dtype=_F32)
        npair = th.shape[-1]
        lead_t, lead_x = th.shape[:-1], x.shape[:-1]
        if 2 * npair > x.shape[-1] or len(lead_t) > len(lead_x) or \
                (lead_t != lead_x[:len(lead_t)] and any(a != b and a != 1 for a, b in zip(lead_t, lead_x))):
            return N.apply_rope(x, thetas, inverse, libm)  # raises the reference's error
        got = _rope_c(x, thetas, th, inverse, inplace, libm)
        if got is not None:
            return got
        if libm:
            return N.apply_rope(x, thetas, inverse, libm)
        if x.ndim == 0 or x.strides[-1] != 4:
            x = np.ascontiguousarray(x)                    # the complex view needs unit-stride lanes
        cs = _rotation(thetas, th, lead_t + (1,) * (len(lead_x) - len(lead_t)) + (npair,), inverse)
        r = x.shape[-1] - 2 * npair
        if inplace and x.flags.writeable and x.flags.c_contiguous:
            out = x                                        # (the caller drops x: no copy of the head dims)
        else:
            out = np.empty_like(x)
            out[..., :r] = x[..., :r]
        np.multiply(x[..., r:].view(np.complex64), cs, out=out[..., r:].view(np.complex64))
        return out

    # -- attention -----------------------------------------------------------------------------
    @staticmethod
    def attention(q, segments, sinks, scale):
        """NumpyOps.attention in float32 on BLAS GEMMs, one query at a time.

        q [T, H, D]; segments: (keys, mask), keys [K, D] shared or [T, K, D] per query, mask [T, K]
        (True = attend); the sink logit enters the denominator only; K = V.

        Per query, each segment is cut to the span from its first to its last attended key (a
        masked key adds exp(-inf) = 0 to the reference's sums, so dropping it is the same
        function): the model's 256-query blocks see the window's raw keys as one 383-key segment
        with a band mask, of which each query attends 128. Then one [H, D] x [D, K] GEMM for the
        scores and one [H, K] x [K, D] for the output. Measured against 32-query GEMMs with the
        union of their spans (single-thread BLAS, real shapes) this is as fast or faster (no
        masked FLOPs, little Python per query), and a query's result depends only on its own
        query, attended keys and their order: bit-identical whatever T or the other queries. (Not
        whatever the order: the model hands a ratio-4 layer's compressed rows over in row order
        when all visible rows are used, in indexer-score order when the indexer picks them, and
        float32 sums in two orders differ by rounding; the reference's float64 sums almost never
        show it after rounding to float32.)
        """
        q = np.asarray(q, dtype=_F32)
        T, H, D = q.shape
        qs = q * _F32(scale)                        # scale folded into q: one pass over [T, H, D]
        sinks = np.asarray(sinks, dtype=_F32)
        spans = []
        for keys, mask in segments:
            keys, mask = np.asarray(keys, dtype=_F32), np.asarray(mask, dtype=bool)
            if mask.shape[1] == 0:
                continue                            # no rows yet (e.g. compressed rows before the first)
            n = mask.sum(axis=1)
            lo = mask.argmax(axis=1)                                           # first attended key
            hi = np.where(n > 0, mask.shape[1] - mask[:, ::-1].argmax(axis=1), 0)   # one past the last
            spans.append((keys, mask, lo.tolist(), hi.tolist(), (n == hi - lo).tolist()))
        o = np.empty((T, H, D), dtype=_F32)

        def run(ts):
            for t in ts:
                o[t] = _attend_one(qs[t], t, spans, sinks)
        n = _threads() if T >= 8 else 1
        if n <= 1:
            run(range(T))
        else:   # queries are independent: strided shares on n threads (BLAS and ufuncs release the
            # GIL, so the shares overlap; BLAS kept at one thread per caller)
            list(_query_pool(n).map(run, [range(i, T, n) for i in range(n)]))
        return o

    # -- experts -------------------------------------------------------------------------------
    @staticmethod
    def swiglu(g, v, limit):
        """NumpyOps.swiglu with the same float32 operations in the same order (bit-identical), in
        place on two fresh arrays instead of seven temporaries and two copies."""
        g = np.minimum(g, limit)
        s = np.negative(g)
        with np.errstate(over="ignore"):            # exp(-g) = inf for g < -88: sigmoid 0, as meant
            np.exp(s, out=s)
        s += 1.0
        np.divide(1.0, s, out=s)                    # sigmoid(g)
        s *= g                                      # silu(g)
        s *= np.clip(v, -limit, limit)
        return s

    # -- indexer -------------------------------------------------------------------------------
    # none: NumpyOps.indexer_scores, the reference's own float64 einsums. Its scores go straight to
    # a top-k with ties to the lowest index, and the FP4-quantized queries and keys tie exactly at
    # the k-th place often (4 % of the decisions on a tiny model): only the same float64 sums in
    # the same order pick the same rows. Measured against the float32 GEMMs this replaced, it was
    # no slower at decode or prefill (docs/cpu-kernels.md, "Float kernels").

    # -- hyper-connections ---------------------------------------------------------------------
    @staticmethod
    def hc_pre_mix(pre, X):
        # [T, 1, n] x [T, n, E]: one tiny GEMM per token, float32 (the reference: float64 einsum)
        pre = np.asarray(pre, dtype=_F32)
        return np.matmul(pre[:, None, :], np.asarray(X, dtype=_F32))[:, 0]

    @staticmethod
    def hc_post(y, X, post, C):
        # post[k] * y + sum_j C[j, k] * X[j] as ONE batched matmul per token: y is appended as an
        # extra stream and post as its column, [C^T | post] [T, n, n+1] x [X; y] [T, n+1, E]
        # (7-9x the float64 einsum at T = 256, 2x a matmul followed by a separate post * y pass).
        X = np.asarray(X, dtype=_F32)
        T, n, E = X.shape
        A = np.empty((T, n, n + 1), dtype=_F32)
        A[:, :, :n] = np.swapaxes(C, 1, 2)
        A[:, :, n] = post
        B = np.empty((T, n + 1, E), dtype=_F32)
        B[:, :n] = X
        B[:, n] = y
        return np.matmul(A, B)

    def hc_split(self, mix, n, scale, base, eps, iters):
        """NumpyOps.hc_split with the per-call overhead cut (the same float32 operations in the same
        order, so bit-identical today). At decode the arrays are [1, 4, 4] and the reference's three
        NumPy calls (sum, + eps, divide) per half-round x 39 half-rounds are most of the HC cost.
        Here C lives transposed, [i, j, t], in an (n+1) x (n+1) x T buffer whose extra row and column
        hold eps: a sum over a whole axis is then `sum + eps` (rows 0..n-1 added in order, then eps),
        so a half-round is one reduce into a preallocated buffer plus one in-place divide, and with
        t innermost every op runs over contiguous T-long lanes (a [T, 5, 5] layout is slower than
        the reference for a 256-token chunk)."""
        mix = np.asarray(mix, dtype=_F32)
        T = mix.shape[0]
        # the three scales spread over the columns: one multiply-add for pre, post and logits
        sc = np.repeat(np.asarray(scale, dtype=_F32)[:3], (n, n, n * n))
        z = mix * sc + base
        g = 1.0 / (1.0 + np.exp(-z[:, :2 * n]))                 # sigmoid, float32 as the reference
        pre = g[:, :n] + eps
        post = 2.0 * g[:, n:]
        logits = z[:, 2 * n:].T.reshape(n, n, T)                # [i, j, t]
        mx = np.max(logits, axis=1, keepdims=True)              # softmax over j
        mx = np.where(np.isfinite(mx), mx, 0.0)
        e = np.exp(logits - mx)
        A = np.empty((n + 1, n + 1, T), dtype=_F32)
        A[n] = eps
        A[:, n] = eps
        Cv = A[:n, :n]
        np.divide(e, np.sum(e, axis=1, keepdims=True), Cv)
        Cv += eps
        col, row = np.empty((n + 1, T), dtype=_F32), np.empty((n + 1, 1, T), dtype=_F32)
        colv, rowv = col[:n], row[:n]
        red, div = np.add.reduce, np.divide                     # positional out: cheaper calls
        red(A, 0, None, col)
        div(Cv, colv, Cv)                                       # columns first
        for _ in range(iters - 1):
            red(A, 1, None, row, True)
            div(Cv, rowv, Cv)                                   # rows
            red(A, 0, None, col)
            div(Cv, colv, Cv)                                   # columns
        return pre, post, np.ascontiguousarray(Cv.transpose(2, 0, 1))


def _rope_c(x, thetas, th, inverse, inplace, libm=False):
    """kernels.rope over x's rows with the cached (cos, sin) table; None without the kernels or
    where the angles do not line up with a prefix of x's leading axes ([T] with x [T, W], [T, 1]
    with x [T, H, W], ...): the complex64 form takes the rest."""
    from . import kernels
    npair = th.shape[-1]
    lead_t, lead_x = th.shape[:-1], x.shape[:-1]
    lead = lead_t
    while lead and lead[-1] == 1:
        lead = lead[:-1]                           # [T, 1] angles: every head of token t at row t
    if x.ndim == 0 or x.size == 0 or lead != lead_x[:len(lead)] or not kernels.available():
        return None
    cs = _rotation(thetas, th, lead_t + (1,) * (len(lead_x) - len(lead_t)) + (npair,), inverse, libm)
    per = int(np.prod(lead_x[len(lead):], dtype=np.int64))          # x rows per angle row
    W = x.shape[-1]
    if not cs.flags.writeable:
        # a kept rotation (of a table this backend owns, so its values cannot change): the next
        # call with these angles and x's shape goes straight to the kernel (_rope_planned)
        while len(_PLANS) >= _PLAN_KEEP:
            _PLANS.pop(next(iter(_PLANS)), None)            # the oldest
        _PLANS[(id(thetas), x.shape, inverse, libm)] = (thetas, cs.reshape(-1, npair).view(_F32), per, W, kernels._K)
    if inplace and x.flags.writeable and x.flags.c_contiguous:
        kernels.rope(x.reshape(-1, W), cs.reshape(-1, npair), per, x.reshape(-1, W))
        return x                                   # (the caller drops x: no copy of the head dims)
    x2 = np.ascontiguousarray(x).reshape(-1, W)
    return kernels.rope(x2, cs.reshape(-1, npair), per, np.empty_like(x2)).reshape(x.shape)


# rope's plans: (angle table object, x's shape, inverse) -> (the table, its rotation as float32
# (cos, sin) pairs [rows, 2 * npair], x rows per angle row, W, the extension): what _rope_c derives
# from its arguments, which at decode was most of a rotation's cost (12 a token, each a dozen small
# NumPy calls for one C call). Keyed by id with the table held, as _ROTATIONS; a pass needs ~12.
_PLANS: dict = {}
_PLAN_KEEP = 32


def _rope_planned(x, plan, inplace):
    """_rope_c's result, from a plan: only x's layout is looked at (the extension checks every
    argument again and raises ValueError on a mismatch)."""
    _, cs, per, W, ext = plan
    if inplace and x.flags.writeable and x.flags.c_contiguous:
        x2 = x.reshape(-1, W)
        ext.rope(x2, cs, per, x2)
        return x
    x2 = np.ascontiguousarray(x).reshape(-1, W)
    out = np.empty_like(x2)
    ext.rope(x2, cs, per, out)
    return out.reshape(x.shape)


_POOLS: dict = {}


def _threads() -> int:
    from . import kernels  # the engine's thread count (kernels.set_threads)
    return kernels.get_threads()


def _query_pool(n: int):
    if n not in _POOLS:
        from concurrent.futures import ThreadPoolExecutor
        _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="ds4-attn")
    return _POOLS[n]


def _attend_one(qt, t, spans, sinks):
    """Query t (pre-scaled, [H, D]) over its key spans; segments are never concatenated: the max
    and the denominator are combined across segments, each segment's probabilities multiply its
    own keys."""
    m = sinks                                       # running max, starting from the sink logit
    parts = []
    for keys, mask, lo, hi, dense in spans:
        a, b = lo[t], hi[t]
        if a >= b:
            continue                                # this query attends nothing in the segment
        kt = keys[a:b] if keys.ndim == 2 else keys[t, a:b]
        s = qt @ kt.T                                                           # [H, K]
        if not dense[t]:
            s[:, ~mask[t, a:b]] = -np.inf           # holes inside the span
        m = np.maximum(m, s.max(axis=1))
        parts.append((s, kt))
    den = np.exp(sinks - m)                                                     # [H]
    if not parts:                                   # only the sink: 0 (NaN where it is -inf, as the reference)
        return np.zeros((1, qt.shape[1]), dtype=_F32) / den[:, None]
    o = None
    for s, kt in parts:
        s -= m[:, None]
        np.exp(s, out=s)                                                        # masked -> 0
        den += s.sum(axis=1)
        if o is None:
            o = s @ kt
        else:
            o += s @ kt
    o /= den[:, None]
    return o
