"""The mlx backend's Apple path end to end, off Apple: `mx.fast.metal_kernel` is replaced by a fake
with MLX's calling convention that runs each kernel body through the C++ host emulation
(tests/metal_emu), and `metal.available()` says True. That runs what test_metal_kernels.py cannot
reach: metal.py's glue (argument order, casts, grid and threadgroup sizes, template values, output
shapes, batch_plan) and MlxOps' dispatch to it, first op by op against the MLX-ops twins, then in a
whole forward pass (prefill and decode) against the same model on the twin path.

Errors are reported as max-abs and relative (max-abs over the twin's largest magnitude).
"""
from __future__ import annotations

import functools
import operator
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")

from engine.backends.mlx import metal, quant  # noqa: E402
from engine.backends.mlx.ops import MlxOps  # noqa: E402
from engine.gguf import quants as Q  # noqa: E402
from engine.gguf.model_file import QTensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "metal_emu"))
import emu  # noqa: E402

pytestmark = pytest.mark.skipif(emu.compiler() is None,
                                reason="g++ is not installed: the kernels' host emulation needs it")

# the dtypes MLX hands a kernel as they arrive on the host (np.array of an mx array keeps its dtype)
_NP_OF_MX = {mx.float32: np.float32, mx.int32: np.int32, mx.uint8: np.uint8}
_MAX_TG_THREADS = 1024            # Metal's maxTotalThreadsPerThreadgroup on Apple GPUs


class FakeMetal:
    """mx.fast.metal_kernel's stand-in: the kernel must be one of metal.KERNELS with the very source
    the emulator compiles; each call runs it in the emulator and records (entry, grid, threadgroup,
    input shapes). both_orders: emu.run's check that no result depends on the threads' order (the
    forward pass skips it: test_metal_kernels.py makes it, and it doubles the time)."""

    def __init__(self, exe: Path, workdir: Path):
        self.exe, self.workdir = exe, workdir
        self.both_orders = True
        self.calls: list[tuple[str, tuple, tuple, list]] = []

    def __call__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
        file, ins, outs = metal.KERNELS[name]
        assert (tuple(input_names), tuple(output_names)) == (ins, outs), f"{name}: signature differs from KERNELS"
        assert source == metal.source(file) and header == metal.source("common.metal"), \
            f"{name}: not the source the emulator compiles"
        assert ensure_row_contiguous and not atomic_outputs
        return functools.partial(self._launch, name, ins, outs)

    def _launch(self, name, ins, outs, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                template=None, init_value=None, verbose=False, stream=None):
        # what MLX itself would refuse or do differently
        assert len(inputs) == len(ins), f"{name}: {len(inputs)} inputs for {ins}"
        assert len(output_shapes) == len(output_dtypes) == len(outs), f"{name}: outputs for {outs}"
        assert init_value is None, "the emulator starts outputs as 0xFF bytes: init_value is not emulated"
        templ = {}
        for k, v in template or []:
            # MLX's binding takes a Python bool or int or an mx.Dtype; a NumPy integer is rejected
            assert type(v) in (int, bool), f"{name}: template {k} = {v!r} is a {type(v).__name__}"
            templ[k] = v
        grid, tg = tuple(map(operator.index, grid)), tuple(map(operator.index, threadgroup))
        assert len(grid) == 3 and len(tg) == 3 and min(grid) >= 1 and min(tg) >= 1, (grid, tg)
        assert np.prod(tg) <= _MAX_TG_THREADS, f"{name}: threadgroup {tg} is over {_MAX_TG_THREADS} threads"
        entry = [e for e, (k, t) in emu.ENTRIES.items() if k == name and t == templ]
        assert entry, f"{name} with template {templ}: no emulator entry"
        host = [np.array(a if isinstance(a, mx.array) else mx.array(a)) for a in inputs]
        shapes = [tuple(map(operator.index, s)) for s in output_shapes]
        out_spec = [(s, _NP_OF_MX[d]) for s, d in zip(shapes, output_dtypes)]
        got = emu.run(self.exe, entry[0], host, out_spec, grid, tg, self.workdir / entry[0], self.both_orders)
        self.calls.append((entry[0], grid, tg, [a.shape for a in host]))
        return [mx.array(a) for a in got]

    def entries(self) -> set[str]:
        return {c[0] for c in self.calls}


@pytest.fixture(scope="module")
def emu_exe(tmp_path_factory):
    return emu.build(cache=tmp_path_factory.mktemp("metal_emu"))     # (~2 s; no cache shared with other runs)


@pytest.fixture
def fake(emu_exe, tmp_path, monkeypatch):
    """The Apple path on this machine: metal.available() is True and every kernel runs emulated."""
    f = FakeMetal(emu_exe, tmp_path / "emu")
    monkeypatch.setattr(mx.fast, "metal_kernel", f)
    monkeypatch.setattr(metal, "available", lambda: True)
    metal._kernel.cache_clear()          # kernels are built once per name: build them with the fake
    yield f
    metal._kernel.cache_clear()


def _pair(fake, numerics="exact"):
    """(MlxOps on the Metal path, MlxOps on the MLX-ops twins)."""
    on = MlxOps(numerics)
    assert on.metal is metal, "MlxOps did not pick up metal.available()"
    off = MlxOps(numerics)
    off.metal = None
    return on, off


def _report(name, got, ref):
    got, ref = np.array(got, dtype=np.float64), np.array(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    err = float(np.abs(got - ref).max()) if got.size else 0.0
    rel = err / max(float(np.abs(ref).max()), 1e-30)
    print(f"{name}: max-abs {err:.3g}, relative {rel:.3g}")
    return err, rel


# -- op by op --------------------------------------------------------------------------------------
def _experts(kind, rng, E, n_out, n_in):
    tid = {"iq2_xxs": Q.IQ2_XXS, "q2_k": Q.Q2_K}[kind]
    raw = Q.random_blocks(tid, rng, E * n_out * (n_in // 256), 0.02).reshape(E * n_out, -1)
    return quant.repack(QTensor(f"ffn_{kind}_exps", tid, (n_in, n_out, E), raw))


@pytest.mark.parametrize("kind", ["iq2_xxs", "q2_k"])
@pytest.mark.parametrize("form,P", [("decode", 6), ("batched", 24)])
def test_gather_matvec_matches_the_twin(fake, kind, form, P):
    """MlxOps._gmm (moe's gathered matmul) on the kernel and on the twin; P = 6 distinct-ish pairs
    is a decode step's launch, P = 24 over 3 experts the batched one (metal.use_batched)."""
    rng = np.random.default_rng(11)
    E, n_out, n_in, T = (8, 37, 512, 3) if form == "decode" else (3, 37, 512, 6)
    w = _experts(kind, rng, E, n_out, n_in)
    x = mx.array(rng.standard_normal((T, n_in), dtype=np.float32))
    experts = np.sort(rng.choice(E, P, replace=form == "batched")).astype(np.int32)   # moe sorts them
    toks = rng.integers(0, T, P).astype(np.int32)
    assert metal.use_batched(experts) == (form == "batched")
    on, off = _pair(fake)
    got = on._gmm(w, x, mx.array(experts), mx.array(toks))
    ref = off._gmm(w, x, mx.array(experts), mx.array(toks))
    assert fake.entries() == {f"gather_matvec_{form}_{kind}"}
    _, rel = _report(f"gather_matvec {form} {kind}", got, ref)
    assert rel < 1e-5


def test_hc_split_matches_the_twin(fake):
    rng = np.random.default_rng(12)
    T, n, iters, eps = 5, 4, 20, np.float32(1e-6)
    mix = mx.array(rng.standard_normal((T, 2 * n + n * n), dtype=np.float32))
    scale = mx.array(rng.uniform(0.5, 2.0, 3).astype(np.float32))
    base = mx.array(rng.standard_normal(2 * n + n * n, dtype=np.float32))
    on, off = _pair(fake)
    got = on.hc_split(mix, n, scale, base, eps, iters)
    ref = off.hc_split(mix, n, scale, base, eps, iters)
    assert fake.entries() == {"hc_split"}
    for name, g, r in zip(("pre", "post", "C"), got, ref):
        _, rel = _report(f"hc_split {name}", g, r)
        assert rel < 1e-5


def test_decode_attention_over_two_segments_matches_the_twin(fake):
    """A decode query over a shared window [K1, D] and a per-query segment [1, K2, D] (the two forms
    the forward pass hands attention), joined by MlxOps as the kernel takes them."""
    rng = np.random.default_rng(13)
    H, D, K1, K2 = 8, 128, 19, 6
    q = mx.array(rng.standard_normal((1, H, D), dtype=np.float32))
    k1 = rng.standard_normal((K1, D), dtype=np.float32)
    k2 = rng.standard_normal((1, K2, D), dtype=np.float32)
    m1, m2 = rng.random((1, K1)) < 0.8, rng.random((1, K2)) < 0.5
    m1[0, 0], m2[0, -1] = False, True                 # a masked key in each, one live key at least
    sinks = mx.array(rng.standard_normal(H).astype(np.float32))
    segs = [(mx.array(k1), mx.array(m1)), (mx.array(k2), mx.array(m2))]
    on, off = _pair(fake)
    got = on.attention(q, segs, sinks, 1.0 / np.sqrt(D))
    ref = off.attention(q, segs, sinks, 1.0 / np.sqrt(D))
    assert fake.entries() == {"attention"}
    _, rel = _report("attention decode, two segments", got, ref)
    assert rel < 1e-5


def test_topk_with_ties_matches_the_twin_exactly(fake):
    rng = np.random.default_rng(14)
    T, C, k = 3, 300, 37
    # few distinct values: the k-th is tied and the lowest indices must win
    scores = rng.integers(-6, 6, (T, C)).astype(np.float32) * np.float32(0.5)
    scores[1, ::4] = -np.inf
    on, off = _pair(fake)
    got = np.array(on.topk_lowest_index(mx.array(scores), k))
    ref = np.array(off.topk_lowest_index(mx.array(scores), k))
    assert fake.entries() == {"topk"}
    assert got.dtype == np.int32 and np.array_equal(got, ref), f"rows differ at {np.argwhere(got != ref)[:5].tolist()}"


def test_an_empty_launch_is_no_launch(fake):
    w = _experts("q2_k", np.random.default_rng(15), 2, 8, 256)
    out = metal.gather_matvec("q2_k", w.w, mx.zeros((1, 256)), mx.zeros((0,), mx.int32), mx.zeros((0,), mx.int32))
    assert out.shape == (0, 8) and not fake.calls


# -- the whole forward pass ------------------------------------------------------------------------
PROMPT, STEPS = 40, 4


@pytest.fixture(scope="module")
def model3(models_dir):
    """Three layers that reach every kernel: a sliding-window layer routed by hash, a ratio-4 layer
    whose indexer picks (idx_topk 4 < the 10 rows 40 tokens compress to: the top-k kernel, and
    decode attention over the window plus the picked rows), a ratio-128 layer; the last two
    routed by the top-k kernel. q2 recipe: IQ2_XXS and Q2_K experts."""
    from engine.gguf.synth import config_for, write_synthetic
    cfg, vocab = config_for("tiny", n_layer=3, ratios=[0, 4, 128], vocab=465, idx_n_head=16, idx_topk=4,
                            n_hash_layer=1)
    return Path(write_synthetic(models_dir / "metal-path-3l.gguf", cfg, recipe="q2", vocab=vocab, seed=5).path)


def _run(model_path, numerics, fed=None, backend="mlx"):
    """Prefill PROMPT tokens (logits at every position), then STEPS decode steps feeding `fed`
    (default: this run's own greedy picks). Returns (logits [PROMPT + STEPS, V], fed, ops.metal)."""
    from engine.runtime.session import Engine, Session
    with Engine.open(model_path, backend=backend, numerics=numerics) as eng:
        s = Session(eng, ctx=64)
        prompt = (np.arange(PROMPT) * 37 + 11) % eng.config.n_vocab     # fixed, spread over the vocabulary
        rows = [s.sync(prompt.tolist(), keep_logits=True)]
        fed = [] if fed is None else list(fed)
        for i in range(STEPS):
            if len(fed) <= i:
                fed.append(int(np.argmax(rows[-1][-1])))
            rows.append(s.eval(fed[i])[None])
        return np.concatenate(rows).astype(np.float64), fed, getattr(eng.model.ops, "metal", None)


@pytest.mark.parametrize("numerics", ["exact", "ds4"])
def test_the_forward_pass_on_the_metal_path_matches_the_twin_path(fake, model3, monkeypatch, numerics):
    """The same prompt and decode tokens on both paths, every kernel having run. Exact numerics:
    within float32 summation error. ds4 numerics round activations (Q8) and KV rows (FP8) to a
    grid, so a one-ulp difference before a rounding moves a value by a grid step and the logits
    drift by a few hundredths: the greedy token must agree at 90 % of positions (measured
    2026-12-07: 41 of 44, 93 %), and the typical (median over positions) difference from the
    twin path must be within twice the twin path's own from the NumPy reference in the same
    numerics. Both paths run the GPU's float32 forms (on
    the CPU device ds4 numerics would otherwise take the reference's own steps: ds4_ref.py)."""
    from engine.backends.mlx import ds4_dot
    monkeypatch.setattr(ds4_dot, "cpu_float64", lambda: False)
    monkeypatch.setattr(metal, "available", lambda: False)
    ref, fed, m = _run(model3, numerics)
    assert m is None and not fake.calls
    monkeypatch.setattr(metal, "available", lambda: True)
    fake.both_orders = False
    got, _, m = _run(model3, numerics, fed)
    assert m is metal
    print(f"{numerics}: {len(fake.calls)} kernel launches: {sorted(fake.entries())}")
    assert {f"gather_matvec_{f}_{k}" for f in ("decode", "batched") for k in ("iq2_xxs", "q2_k")} \
        | {"hc_split", "attention", "topk"} == fake.entries()
    topk_cols = {c[3][0][1] for c in fake.calls if c[0] == "topk"}
    assert 8 in topk_cols and len(topk_cols) > 1, f"the router's and the indexer's top-k: columns {topk_cols}"
    assert np.isfinite(got).all()
    err, _ = _report(f"forward {numerics} logits", got, ref)
    agree = np.argmax(got, -1) == np.argmax(ref, -1)
    print(f"{numerics}: same argmax at {agree.mean():.1%} of {len(ref)} positions")
    if numerics == "exact":
        assert err <= 1e-4, f"max-abs {err:.3g}"
        assert agree.all()
    else:
        assert agree.mean() >= 0.90
        host, _, _ = _run(model3, numerics, fed, backend="numpy")
        typical = float(np.median(np.abs(got - ref).max(-1)))
        twin_typical = float(np.median(np.abs(ref - host).max(-1)))
        print(f"ds4: median per-position max-abs {typical:.3g} from the twin path; the twin path's "
              f"from the NumPy reference {twin_typical:.3g} (max-abs {np.abs(ref - host).max():.3g})")
        assert typical <= 2 * twin_typical


# -- the comparisons can fail ----------------------------------------------------------------------
GLUE_MUTANTS = {   # one wrong argument, size or order per metal.py function, and the test that must catch it
    "decode operands swapped": ("gather_matvec", "inputs = [raw, x, experts, toks, dims]",
                                "inputs = [raw, x, toks, experts, dims]", "gather_decode"),
    "batched chunk dropped": ("gather_matvec", "len(chunks), 1)", "len(chunks) - 1, 1)", "gather_batched"),
    "scale and base swapped": ("hc_split", "scale.astype(mx.float32), base.astype(mx.float32)",
                               "base.astype(mx.float32), scale.astype(mx.float32)", "hc_split"),
    "one head per query": ("attention", "grid=(tg, T * H, 1)", "grid=(tg, T, 1)", "attention"),
    "last column unseen": ("topk", "dims = mx.array([T, C, k]", "dims = mx.array([T, C - 1, k]", "topk"),
}
_CHECKS = {
    "gather_decode": lambda f: test_gather_matvec_matches_the_twin(f, "q2_k", "decode", 6),
    "gather_batched": lambda f: test_gather_matvec_matches_the_twin(f, "iq2_xxs", "batched", 24),
    "hc_split": test_hc_split_matches_the_twin,
    "attention": test_decode_attention_over_two_segments_matches_the_twin,
    "topk": test_topk_with_ties_matches_the_twin_exactly,
}


@pytest.mark.parametrize("name", sorted(GLUE_MUTANTS))
def test_a_broken_glue_fails_its_comparison(fake, monkeypatch, name):
    """metal.py's function recompiled with one edit (its source text, in its own module's names)."""
    import inspect
    fn, old, new, check = GLUE_MUTANTS[name]
    src = inspect.getsource(getattr(metal, fn))
    assert src.count(old) == 1, f"{old!r} is not once in metal.{fn}"
    ns = dict(vars(metal))
    exec(compile(src.replace(old, new), metal.__file__, "exec"), ns)
    monkeypatch.setattr(metal, fn, ns[fn])
    with pytest.raises((AssertionError, emu.EmulationError)) as caught:
        _CHECKS[check](fake)
    print(f"{name}: {str(caught.value).splitlines()[0][:160]}")
