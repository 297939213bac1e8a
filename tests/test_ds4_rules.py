"""ds4's own dot products, bit for bit: the reference's `ds4` numerics against ds4's compiled code.

`tests/golden/ds4_cpu_dots.npz` holds the outputs of ds4's CPU-path functions themselves (ds4.c
at 8d57664 built with its Makefile's flags; tests/golden/README.md). The reference must give the
same float32 bits, and the rule each test pins must matter: the exact sum rounded once (the rule
before issue 33, NumpyOps(q8_dot="exact")) differs from ds4 at some of these outputs.
docs/numerics.md lists every rule with its ds4 function.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends.numpy.ops import NumpyOps
from engine.gguf import quants as Q
from engine.model import ds4_float as F
from engine.model import ds4_matmul as D

FIX = np.load(Path(__file__).parent / "golden" / "ds4_cpu_dots.npz")
FORMATS = {"q8_0": Q.Q8_0, "iq2_xxs": Q.IQ2_XXS, "q2_k": Q.Q2_K}


def _matmul(ops: NumpyOps, name: str) -> np.ndarray:
    w = SimpleNamespace(type_id=FORMATS[name], data=FIX[f"{name}_w"])
    if name == "q8_0":
        return ops.linear(w, FIX["x"])
    return ops.expert_linear(w, ops.expert_act(w, FIX["x"]))


@pytest.mark.parametrize("name", list(FORMATS))
def test_reference_matmuls_are_ds4s_bit_for_bit(name):
    got = _matmul(NumpyOps("ds4"), name)
    want = FIX[f"{name}_y"]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, np.abs(got - want).max())


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_exact_sum_is_not_ds4s(name):
    """What the fixture can tell apart: the exact sum rounded once misses ds4's bits somewhere."""
    exact = _matmul(NumpyOps("ds4", q8_dot="exact"), name)
    assert (exact.view(np.uint32) != FIX[f"{name}_y"].view(np.uint32)).any(), name


def test_q2_k_fuses_the_scale_term():
    """ds4's Q2_K line as GCC compiles it (one FMA, the minimum term reassociated) is what gives
    ds4's bits; the source read literally (two rounded products) does not, at some outputs."""
    a = D.q8_k_act(FIX["x"])
    b = D._blocks(FIX["q2_k_w"], Q.Q2_K)
    isum = D._idots(a.q, D._decode_int(Q.Q2_K, D._with_scales(b, (80, 82), (1.0, 0.0)))).astype(np.float32)
    summs = -D._idots(a.q, D._decode_int(Q.Q2_K, D._with_scales(b, (80, 82), (0.0, 1.0)))).astype(np.float32)
    d, dmin = D._f16(b[..., 80:82]), D._f16(b[..., 82:84])
    literal = np.zeros(FIX["q2_k_y"].shape, np.float32)
    for k in range(a.q.shape[1]):
        literal += (a.d[:, k, None] * d[None, :, k]) * isum[k] - (a.d[:, k, None] * dmin[None, :, k]) * summs[k]
    assert (literal.view(np.uint32) != FIX["q2_k_y"].view(np.uint32)).any()


def test_q8_act_selects_tokens():
    a = D.q8_0_act(FIX["x"])
    assert a.shape == FIX["x"].shape and a[1:].q.shape[0] == 2
    with pytest.raises(ValueError):
        D.q8_k_matmul(Q.Q4_K, FIX["q2_k_w"], D.q8_k_act(FIX["x"]))


def _experts(rng, E=256, F=256, n=4):
    """q2-recipe experts (IQ2_XXS gate/up, Q2_K down) as the ops read them (.expert(e))."""
    def qt(t, rows, cols):
        data = Q.random_blocks(t, rng, n * rows * cols // 256, 0.05).reshape(n, rows, -1)
        return SimpleNamespace(type_id=t, data=data, expert=lambda e: SimpleNamespace(type_id=t, data=data[e]))
    return SimpleNamespace(gate_exps=qt(Q.IQ2_XXS, F, E), up_exps=qt(Q.IQ2_XXS, F, E), down_exps=qt(Q.Q2_K, E, F))


def test_routed_expert_weights_the_swiglu_output_before_its_q8_k_rounding():
    """ds4 (matvec_iq2_xxs_mid_worker, then quantize_mid_pairs_worker): mid = silu(gate) * up *
    weight, clamped gate <= c and |up| <= c first, then Q8_K-rounded for the down projection.
    Weighting after the down projection (transformers' order) gives other bits."""
    rng = np.random.default_rng(3)
    lw, ops = _experts(rng), NumpyOps("ds4")
    u = rng.standard_normal((2, 256)).astype(np.float32) * 3
    we = np.array([[0.37], [1.21]], np.float32)
    xe = ops.expert_act(lw.gate_exps, u)
    got = ops.expert_out(lw, 1, xe, we, np.float32(10.0))
    g = ops.expert_linear(lw.gate_exps.expert(1), xe)
    v = ops.expert_linear(lw.up_exps.expert(1), xe)
    mid = F.routed_mid(g, v, we, np.float32(10.0))      # (sig(g) * u) * (g * weight), as compiled
    want = D.q8_k_matmul(Q.Q2_K, lw.down_exps.data[1], D.q8_k_act(mid))
    assert np.array_equal(got, want)
    after = ops.expert_linear(lw.down_exps.expert(1), ops.expert_act(lw.down_exps, mid / we)) * we
    assert not np.array_equal(got, after)


def test_topk_ties_go_to_the_lowest_index():
    """ds4's topk_desc and its indexer selection: repeated argmax with a strict '>', so among
    equal scores the lowest index wins."""
    s = np.array([[1.0, 3.0, 3.0, 0.5, 3.0]], np.float32)
    assert NumpyOps.topk_lowest_index(s, 2).tolist() == [[1, 2]]


def test_rmsnorm_is_ds4s_bit_for_bit():
    """ds4.c rms_norm_weight: float64 sum of squares, then a float32 scale 1 / sqrtf(ss/n + eps),
    then (x * w) * scale. The float64 scale rounded once and (x * scale) * w (the exact-numerics
    form) miss ds4's bits at many values."""
    got = NumpyOps("ds4").rmsnorm(FIX["x"], FIX["rms_w"], 1e-6)
    assert np.array_equal(got.view(np.uint32), FIX["rms_y"].view(np.uint32))
    assert (NumpyOps.rmsnorm(FIX["x"], FIX["rms_w"], 1e-6) != FIX["rms_y"]).mean() > 0.1


def test_cpu_rmsnorm_follows_in_ds4_numerics():
    from engine.backends.cpu import kernels as K
    from engine.backends.cpu.ops import CpuOps
    if K._K is None:
        pytest.skip("engine.backends.cpu._kernels is not built")
    rng = np.random.default_rng(9)
    cpu, ref = CpuOps("ds4"), NumpyOps("ds4")
    for shape in ((1, 256), (5, 4, 128), (3, 1024)):
        x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        for ww in (None, w):
            assert np.array_equal(cpu.rmsnorm(x, ww, 1e-6), ref.rmsnorm(x, ww, 1e-6)), (shape, ww is None)


# -- ds4's float32 loops outside the matmuls, against ds4's own decode intermediates ---------------
# tests/golden/ds4_decode_dump.npz: what a debug build of ds4 wrote (scripts/build_ds4_oracle.py
# dump s101-q2, edit 7; keys p{pos}_l{layer}_{tag}) while it decoded the first 3 tokens of oracle
# s101-q2, all through its decode path; saved by scripts/ds4_dump_compare.py --save. Each test
# feeds ds4's own inputs of one op to the reference and wants ds4's output bit for bit, and shows
# the form it replaced (exact numerics' op) misses ds4's bits: the rule matters.

DUMP_PATH = Path(__file__).parent / "golden" / "ds4_decode_dump.npz"


@pytest.fixture(scope="module")
def dump(models_dir):
    """(ds4's records, the s101-q2 model's Engine in ds4 numerics)."""
    import hashlib
    from engine import Engine
    from engine.gguf.gguf_cli import main as gguf_main
    z = np.load(DUMP_PATH)
    path = models_dir / "rules-s101-q2.gguf"
    if not path.exists():
        assert gguf_main(["synth", str(path), *[str(a) for a in z["synth"]]]) == 0
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(z["gguf_sha256"]), "synth changed: re-save the dump"
    e = Engine.open(path, backend="numpy", numerics="ds4", threads=1)
    yield {k: z[k] for k in z.files}, e
    e.close()


def _same(a, b) -> bool:
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _cases(d, e, tags=("hc_in",)):
    for p in range(3):
        for il, lw in enumerate(e.model.w.layers):
            if all(f"p{p}_l{il}_{t}" in d for t in tags):
                yield p, il, lw, (lambda t, p=p, il=il: d[f"p{p}_l{il}_{t}"])


def _hc_pre(ops, c, hc, X):
    flat = ops.rmsnorm(X.reshape(1, -1), None, c.rms_eps)
    pre, post, C = ops.hc_split(ops.linear(hc.fn, flat), c.n_hc, hc.scale, hc.base, np.float32(c.hc_eps), c.sinkhorn_iters)
    return ops.hc_pre_mix(pre, X.reshape(1, c.n_hc, -1)), post, C


def test_hc_pre_is_ds4s_bit_for_bit(dump):
    """hc_pre_from_state_one_scratch: the F16 matvec in index order (matvec_f16), the split with
    fma(mix, scale, base) and GCC's pairings of the Sinkhorn sums (hc_split_sinkhorn_one), the
    stream sum fma(x0, w0, x1 w1) + fma(x2, w2, x3 w3) (hc_weighted_sum_one)."""
    d, e = dump
    ops, c, old = e.model.ops, e.config, NumpyOps("exact")
    n = 0
    for p, il, lw, g in _cases(d, e):
        for hc, inp, kind in ((lw.hc_attn, "hc_in", "attn"), (lw.hc_ffn, "after_attn", "ffn")):
            x, post, C = _hc_pre(ops, c, hc, g(inp))
            assert _same(post, g(f"{kind}_post")) and _same(C, g(f"{kind}_comb")) and _same(x, g(f"{kind}_x")), (p, il, kind)
            xo, _, Co = _hc_pre(old, c, hc, g(inp))
            n += (not _same(Co, g(f"{kind}_comb"))) + (not _same(xo, g(f"{kind}_x")))
    assert n > 0


def test_f16_matvec_adds_in_index_order():
    """dot_f16_row on x86 (not vectorized): acc += w[i] * x[i], each product and sum in float32."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 300)).astype(np.float16)
    x = rng.standard_normal((2, 300)).astype(np.float32)
    want = np.zeros((2, 3), np.float32)
    for i in range(300):
        want = (want + (x[:, None, i] * w[None, :, i].astype(np.float32)).astype(np.float32)).astype(np.float32)
    assert _same(F.f16_matvec(w, x), want)
    assert not _same(x.astype(np.float64) @ w.astype(np.float64).T, want)


def test_hc_post_is_ds4s_bit_for_bit(dump):
    """hc_post_one as compiled: fma(C3k, x3, fma(post_k, y, C0k x0) + fma(C1k, x1, C2k x2))."""
    d, e = dump
    n = 0
    for p, il, lw, g in _cases(d, e):
        for y, X, post, C, out in (("attn_out", "hc_in", "attn_post", "attn_comb", "after_attn"),
                                   (None, "after_attn", "ffn_post", "ffn_comb", "out_hc")):
            yv = g(y) if y else (g("ffn_moe") + g("ffn_shared")).astype(np.float32)
            args = (yv[None], g(X).reshape(1, 4, -1), g(post)[None], g(C).reshape(1, 4, 4))
            assert _same(e.model.ops.hc_post(*args), g(out)), (p, il, out)
            n += not _same(NumpyOps.hc_post(*args), g(out))
    assert n > 0


def test_experts_are_ds4s_bit_for_bit(dump):
    """The FFN's experts from ds4's ffn_norm: router probs sqrt(softplus(F16 logits)) with glibc's
    log1pf, the weights' normalization, the shared SwiGLU sig(g) * (g u) (swiglu), the routed
    mid (sig(g) u) (g w) (matvec_iq2_xxs_mid_worker) and the slot-order sum."""
    d, e = dump
    ops, c, n = e.model.ops, e.config, 0
    tok = d["token_ids"]
    for p, il, lw, g in _cases(d, e, ("ffn_norm",)):
        u, limit = g("ffn_norm")[None], np.float32(c.swiglu_clamp[lw.il])
        assert _same(ops.shared_expert(lw, u, limit), g("ffn_shared")), (p, il)
        pr = np.sqrt(ops.softplus(ops.linear(lw.gate_inp, u)))
        sel = (lw.tid2eid[tok[p:p + 1]].astype(np.int64) if lw.tid2eid is not None
               else ops.topk_lowest_index(pr + lw.bias if lw.bias is not None else pr, c.n_expert_used))
        w = ops.expert_weights(np.take_along_axis(pr, sel, axis=1), c.expert_weights_scale, lw.tid2eid is not None)
        assert _same(ops.routed(lw, u, sel, w, limit), g("ffn_moe")), (p, il)
        m = (NumpyOps.silu(ops, np.minimum(ops.linear(lw.sh_gate, u), limit)) * np.clip(ops.linear(lw.sh_up, u), -limit, limit))
        n += not _same(ops.linear(lw.sh_down, m), g("ffn_shared"))
    assert n > 0


def test_attention_is_ds4s_bit_for_bit(dump):
    """layer_attention_rows_one (the uncompressed layers): dot_f32 as GCC vectorizes it, times
    1/sqrtf(128), denominator and fma(w, k, o) key by key, o * (1 / denom)."""
    d, e = dump
    from engine.model import numerics as N
    c, n = e.config, 0
    for p, il, lw, g in _cases(d, e, ("q", "heads")):
        if lw.ratio:
            continue
        keys = N.f16_round(np.stack([d[f"p{j}_l{il}_kv"] for j in range(p + 1)]))
        segs = [(keys, np.ones((1, p + 1), bool))]
        q = g("q").reshape(1, c.n_head, c.head_dim)
        scale = 1.0 / np.sqrt(c.head_dim)
        assert _same(e.model.ops.attention(q, segs, lw.sinks, scale), g("heads")), (p, il)
        n += not _same(NumpyOps.attention(q, segs, lw.sinks, scale), g("heads"))
    assert n > 0


def test_output_head_collapse_is_ds4s_bit_for_bit(dump):
    """output_logits_one_decode_scratch: sigmoid_stable(fma(mix, scale, base)) + eps, then the
    stream sum as inlined there: fma(x0, w0, x3 w3) + fma(x1, w1, x2 w2)."""
    d, e = dump
    m, c, n = e.model, e.config, 0
    for p in range(3):
        X = d[f"p{p}_l{c.n_layer - 1}_out_hc"].reshape(1, c.n_hc, -1)
        mix = m.ops.linear(m.w.hc_head_fn, m.ops.rmsnorm(X.reshape(1, -1), None, c.rms_eps))
        assert _same(m.ops.hc_head(mix, m.w.hc_head_scale[0], m.w.hc_head_base, c.hc_eps, X), d[f"p{p}_l0_head_x"]), p
        pre = NumpyOps.sigmoid(mix * m.w.hc_head_scale[0] + m.w.hc_head_base) + np.float32(c.hc_eps)
        n += not _same(F.hc_weighted_sum(pre, X), d[f"p{p}_l0_head_x"])
    assert n > 0


def test_query_rope_is_ds4s_bit_for_bit(dump):
    """rope_tail_ext_inplace at the query's call site: glibc's cosf/sinf, and at YaRN pairs the
    blend fma(fs e, 1 - ramp, ramp e) (the KV row's copy factors it: e (fs r + 1 - r))."""
    d, e = dump
    m, c, n = e.model, e.config, 0
    for p, il, lw, g in _cases(d, e, ("qr_norm", "q")):
        q = m.ops.rmsnorm(m.ops.linear(lw.q_b, g("qr_norm")[None]).reshape(1, c.n_head, c.head_dim), None, c.rms_eps)
        m._theta_cache = {}
        th = m._thetas(lw.ratio, np.array([p]), c.n_rot, heads=True, query=True)
        assert _same(m.ops.rope(q, th), g("q")), (p, il)
        # the KV row's angles (the factored blend) miss ds4's query bits somewhere
        n += not _same(m.ops.rope(q, m._thetas(lw.ratio, np.array([p]), c.n_rot, heads=True)), g("q"))
    assert n > 0
