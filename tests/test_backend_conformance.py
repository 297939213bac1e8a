"""The conformance suite: every registered backend that can serve here, against the NumPy
reference. A backend gets all of it by registering (engine/backends/registry.py):

* the registry's contract: unknown and unavailable names are one-line BackendErrors, an ops
  object missing an operation fails at open and names it;
* every protocol operation on random inputs, for every weight format, against NumpyOps;
* the whole forward pass on the tiny models: exact numerics within the golden tolerance of
  transformers' logits, ds4 numerics within the oracle's thresholds of ds4's own (where
  ../shared/ds4-oracle exists);
* snapshot -> restore within the backend and across backends (saved on one, resumed on another).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from engine import Engine, Session
from engine.backends import registry as R
from engine.backends.cupy import device as cupy_device
from engine.backends.numpy.ops import NumpyOps
from engine.backends.protocol import OPERATIONS, BindReport, Ops
from engine.errors import BackendError
from engine.gguf import quants as Q
from engine.gguf.model_file import QTensor

from conftest import ORACLE, need_shared
from test_engine_golden import GOLDEN, TOL
from test_engine_oracle import stats
from test_kernels import FORMATS, NAMES, abs_weights, weights

# every backend that can serve here, and the cupy backend on its host emulation (the CuPy
# stand-in, the CUDA kernels as host C++) where there is no GPU but a C++ compiler; a whole
# forward pass through the emulated kernels takes minutes, so those tests of it are slow ones
EMULATED = ("cupy",) if "cupy" not in R.available_names() and cupy_device.compiler() else ()
BACKENDS = R.available_names() + EMULATED
WHOLE_PASS = [*R.available_names(), *(pytest.param(n, marks=pytest.mark.slow) for n in EMULATED)]
NUMERICS = ("exact", "ds4")
# routed-expert formats of the real and tiny models (the shared expert and the rest are Q8_0)
EXPERT_FORMATS = [Q.Q2_K, Q.IQ2_XXS, Q.MXFP4, Q.Q4_K, Q.Q8_0]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if EMULATED:            # (for the whole test: it may resume on cupy what another backend saved)
        monkeypatch.setenv(cupy_device.EMULATE_ENV, "1")
        # one thread order, launches in this process: the kernels' own tests run both orders
        # and the guard pages (tests/test_cuda_kernels.py); here the backend's use of them
        monkeypatch.setenv("DS4_CUDA_EMU_ORDERS", "1")
        monkeypatch.setenv("DS4_CUDA_EMU_ISOLATE", "0")
    return request.param


def _ops(name, numerics):
    return R.make_ops(R.pick(name), numerics)


def _h(x):
    """A host copy of an op's result: a device array (CuPy, the stand-in) is copied out with
    .get(), as nothing converts it implicitly; host and MLX arrays go through np.asarray."""
    return x.get() if hasattr(x, "get") and not isinstance(x, (np.ndarray, dict)) else np.asarray(x)


def _close(got, ref, tol, what):
    got, ref = _h(got), np.asarray(ref)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all() == np.isfinite(ref).all(), what
    fin = np.isfinite(ref)
    assert (got[~fin] == ref[~fin]).all(), what
    scale = max(1.0, float(np.abs(ref[fin]).max(initial=0.0)))
    err = float(np.abs(got[fin].astype(np.float64) - ref[fin]).max(initial=0.0))
    assert err <= tol * scale, f"{what}: max-abs {err:.3g} over {tol * scale:.3g}"


# -- the registry ------------------------------------------------------------------------------
def test_registry_names_the_builtin_backends_best_first():
    from engine.backends.mlx.backend import apple_silicon
    # mlx leads on Apple Silicon (the GPU); elsewhere it has only MLX's CPU device, last
    best = ("mlx", "cupy", "cpu", "numpy") if apple_silicon() else ("cupy", "cpu", "numpy", "mlx")
    assert R.names()[:4] == best
    assert "numpy" in BACKENDS
    for n in R.names():
        line = R.describe(n)
        assert line.startswith(n + ": ") and "\n" not in line


def test_auto_picks_the_best_available(monkeypatch):
    monkeypatch.delenv("DS4_BACKEND", raising=False)
    assert R.pick("auto").name == BACKENDS[0]
    monkeypatch.setenv("DS4_BACKEND", "numpy")
    assert R.pick("auto").name == "numpy"
    monkeypatch.setenv("DS4_BACKEND", "nosuch")        # the line says where the name came from
    with pytest.raises(BackendError, match="^DS4_BACKEND: unknown backend 'nosuch'"):
        R.pick("auto")
    monkeypatch.setenv("DS4_BACKEND", "auto")          # means what no variable means
    assert R.pick("auto").name == BACKENDS[0]


@pytest.mark.parametrize("name", ["nosuch", "mlx", "cupy"])
def test_a_backend_that_cannot_serve_is_one_line(name, small_model):
    if name in R.available_names():
        pytest.skip(f"{name} can serve here")
    with pytest.raises(BackendError) as err:
        Engine.open(small_model, backend=name)
    msg = str(err.value)
    assert "\n" not in msg and name in msg
    if name != "nosuch":
        assert "not installed" in msg or "no CUDA device" in msg


def test_register_checks_the_entry_and_auto_says_when_nothing_serves(monkeypatch):
    monkeypatch.setattr(R, "_entries", dict(R._entries))
    ok = dict(summary="x", available=lambda: None, make_ops=NumpyOps)
    for bad in ("auto", "Big", "two words", ""):
        with pytest.raises(ValueError, match="lower-case identifier"):
            R.register(R.Backend(name=bad, **ok))
    with pytest.raises(ValueError, match="not operations.*'rmsnrom'"):
        R.register(R.Backend(name="typo", reference_ops=frozenset({"rmsnrom"}), **ok))
    monkeypatch.delenv("DS4_BACKEND", raising=False)
    for n in R.names():
        R._entries[n] = R.Backend(name=n, summary="x", available=lambda n=n: f"no {n} here", make_ops=NumpyOps)
    with pytest.raises(BackendError, match="no backend is available: .*no numpy here") as err:
        R.pick("auto")
    assert "\n" not in str(err.value)


def _auto_on(monkeypatch, system: str, machine: str, serving: set[str]) -> str:
    """What `auto` picks on a made-up platform where exactly `serving` can serve: the mlx entry is
    rebuilt (its module reloaded) under that platform's name, the registry copied, the module
    restored after the test."""
    import dataclasses
    import importlib
    import platform

    import engine.backends.mlx.backend as mb
    monkeypatch.setattr(R, "_entries", dict(R._entries))
    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.delenv("DS4_BACKEND", raising=False)
    try:
        entry = importlib.reload(mb).BACKEND
    finally:
        monkeypatch.undo()              # the real platform again, and the module rebuilt under it
        importlib.reload(mb)
    monkeypatch.setattr(R, "_entries", dict(R._entries))
    monkeypatch.delenv("DS4_BACKEND", raising=False)
    R._entries["mlx"] = entry
    for n in R.names():
        R._entries[n] = dataclasses.replace(R._entries[n], available=(
            (lambda: None) if n in serving else (lambda n=n: f"no {n} here")))
    return R.pick("auto").name


@pytest.mark.parametrize("system,machine", [("Darwin", "arm64"), ("Linux", "x86_64"), ("Linux", "aarch64"),
                                            ("Darwin", "x86_64"), ("Windows", "AMD64")])
def test_auto_picks_mlx_on_apple_silicon_only(monkeypatch, system, machine):
    apple = (system, machine) == ("Darwin", "arm64")
    assert _auto_on(monkeypatch, system, machine, {"mlx", "cpu", "numpy"}) == ("mlx" if apple else "cpu")
    assert R.get("mlx").priority == (40 if apple else 5)
    # without the C kernels, off Apple the NumPy reference still comes first (MLX's CPU device is slower)
    assert _auto_on(monkeypatch, system, machine, {"mlx", "numpy"}) == ("mlx" if apple else "numpy")
    assert _auto_on(monkeypatch, system, machine, {"mlx", "cupy", "cpu", "numpy"}) == ("mlx" if apple else "cupy")
    # named, it serves on any platform where mlx is installed: how CI tests it on Linux
    assert R.pick("mlx").name == "mlx"


def _register(monkeypatch, name, cls, reference_ops=frozenset()):
    entry = R.Backend(name=name, summary="a test backend", available=lambda: None,
                      make_ops=lambda numerics: cls(numerics), reference_ops=frozenset(reference_ops))
    R.names()                                                # (the builtin entries loaded first)
    monkeypatch.setattr(R, "_entries", dict(R._entries))     # a copy, undone after the test: the
    R.register(entry)                                        # entry never reaches the real registry
    return entry


class _Forgetful(NumpyOps):
    """Overrides every operation but one, which it would inherit from the reference by accident."""
    name = "forgetful"


for _op in OPERATIONS:
    if _op != "hc_post":
        setattr(_Forgetful, _op, vars(NumpyOps)[_op])


class _Bare:
    """No reference to inherit from, and no moe."""
    name, xp = "bare", np

    def __init__(self, numerics):
        self.numerics = numerics


for _op in OPERATIONS:
    if _op != "moe":
        setattr(_Bare, _op, vars(NumpyOps)[_op])


def test_an_incomplete_backend_fails_at_open_naming_the_operation(monkeypatch, small_model):
    _register(monkeypatch, "forgetful", _Forgetful)
    with pytest.raises(BackendError, match="backend 'forgetful' lacks operation 'hc_post'"):
        Engine.open(small_model, backend="forgetful")
    _register(monkeypatch, "bare", _Bare)
    with pytest.raises(BackendError, match="backend 'bare' lacks operation 'moe'"):
        Engine.open(small_model, backend="bare")
    # declared as taken from the reference on purpose: it serves, and gives the reference's logits
    _register(monkeypatch, "forgetful", _Forgetful, {"hc_post"})
    toks = [3, 1, 4, 1, 5]
    with Engine.open(small_model, backend="forgetful", numerics="exact") as e:
        got = Session(e, 16).sync(toks, keep_logits=True)
    with Engine.open(small_model, backend="numpy", numerics="exact") as e:
        ref = Session(e, 16).sync(toks, keep_logits=True)
    assert np.array_equal(got, ref)


class _Counting(NumpyOps):
    """The reference, counting the calls of the hooks the engine must go through."""
    name = "counting"
    calls: dict = {}

    def _count(self, what):
        _Counting.calls[what] = _Counting.calls.get(what, 0) + 1

    def bind_weights(self, model_file):
        self._count("bind_weights")
        return NumpyOps.bind_weights(self, model_file)

    def new_state(self, config, ctx, rewind_cap):
        self._count("new_state")
        return NumpyOps.new_state(self, config, ctx, rewind_cap)

    def state_to_host(self, state):
        self._count("state_to_host")
        return NumpyOps.state_to_host(state)

    def state_from_host(self, host):
        self._count("state_from_host")
        return NumpyOps.state_from_host(host)

    def embed(self, embd, tokens):
        self._count("embed")
        return NumpyOps.embed(embd, tokens)

    def logits_to_host(self, logits):
        self._count("logits_to_host")
        return NumpyOps.logits_to_host(logits)


def test_the_engine_goes_through_the_backends_hooks(monkeypatch, small_model):
    hooks = {"bind_weights", "new_state", "state_to_host", "state_from_host", "embed", "logits_to_host"}
    _register(monkeypatch, "counting", _Counting, set(OPERATIONS) - hooks)
    _Counting.calls = {}
    monkeypatch.setenv("DS4_BACKEND", "counting")              # auto takes it, as any caller would
    with Engine.open(small_model, numerics="exact") as e:
        assert e.backend == "counting" and e.bind_report.bytes == 0 and e.bind_report.time_s >= 0
        s = Session(e, 32)
        s.sync([1, 2, 3])
        s.eval(4)
        s.restore(s.snapshot())
    assert _Counting.calls == {"bind_weights": 1, "new_state": 1, "state_to_host": 1, "state_from_host": 1,
                               "embed": 2, "logits_to_host": 2}


def test_every_backend_declares_only_what_it_inherits(backend):
    ops = _ops(backend, "ds4")
    assert isinstance(ops, Ops) and ops.name == backend
    assert ops.numerics == "ds4" and not hasattr(ops, "ds4")     # numerics has one name
    for op in R.pick(backend).reference_ops:
        assert getattr(type(ops), op) is getattr(NumpyOps, op), f"{backend} declares {op} but defines its own"


# -- every op against the reference, on random inputs -----------------------------------------
def _qt(t, rng, n_rows, n_in, n_expert=0):
    rows = n_rows * max(1, n_expert)
    dims = (n_in, n_rows, n_expert) if n_expert else (n_in, n_rows)
    return QTensor(f"w.{NAMES.get(t, t)}", t, dims, weights(t, rng, rows, n_in))


def _linear_tol(t, w, x, ref):
    """|error| <= 1e-5 of sum |w| |x| per output (float32 against float64 sums)."""
    bound = np.asarray(x, np.float64).__abs__() @ abs_weights(t, w).T
    return 1e-5 * bound + 1e-30


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("t", FORMATS, ids=lambda t: NAMES[t])
def test_linear_ops(backend, numerics, t):
    rng = np.random.default_rng(t)
    ops, ref = _ops(backend, numerics), NumpyOps(numerics)
    n_in = 512
    w = _qt(t, rng, 64, n_in)
    for T in (1, 5, 40):
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        for rows in (None, slice(16, 48)):
            want = ref.linear(w, x, rows)
            got = _h(ops.linear(w, x, rows))
            wd = w.data if rows is None else w.data[rows]
            assert (np.abs(got - want) <= _linear_tol(t, wd, ref_in(ref, w, x), want)).all(), (T, rows)
        w2 = _qt(t, rng, 32, n_in)
        for g, r in zip(map(_h, ops.linears([w, w2], x)), ref.linears([w, w2], x)):
            assert g.shape == r.shape and np.allclose(g, r, rtol=1e-3, atol=1e-3 * np.abs(r).max())
        wg = _qt(t, rng, 64, n_in // 2)
        got, want = _h(ops.grouped_linear(wg, x, 2)), ref.grouped_linear(wg, x, 2)
        assert got.shape == want.shape and np.allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def ref_in(ref, w, x):
    """The input the reference multiplies (ds4 rounds a Q8_0 weight's input first)."""
    from engine.model import numerics as N
    return N.q8_0_round(x) if ref.numerics == "ds4" and w.type_id == Q.Q8_0 else x


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("t", EXPERT_FORMATS, ids=lambda t: NAMES[t])
def test_moe(backend, numerics, t):
    rng = np.random.default_rng(100 + t)
    ops, ref = _ops(backend, numerics), NumpyOps(numerics)
    E, F, n_exp, k = 256, 256, 8, 3
    lw = SimpleNamespace(
        gate_exps=_qt(t, rng, F, E, n_exp), up_exps=_qt(t, rng, F, E, n_exp), down_exps=_qt(t, rng, E, F, n_exp),
        sh_gate=_qt(Q.Q8_0, rng, F, E), sh_up=_qt(Q.Q8_0, rng, F, E), sh_down=_qt(Q.Q8_0, rng, E, F))
    for T in (1, 6, 40):
        u = rng.standard_normal((T, E)).astype(np.float32)
        sel = np.array([rng.choice(n_exp, k, replace=False) for _ in range(T)], np.int64)
        wsel = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
        want = ref.moe(lw, u, sel, wsel, np.float32(7.0))
        # ds4 numerics round the experts' inputs to Q8 blocks: a float32 difference in a SwiGLU
        # output may move one across a step, so the bound is a few quantization steps of the sums
        _close(ops.moe(lw, u, sel, wsel, np.float32(7.0)), want, 1e-4 if numerics == "exact" else 2e-2,
               f"moe {NAMES[t]} T={T}")


@pytest.mark.parametrize("numerics", NUMERICS)
def test_elementwise_norm_and_kv_ops(backend, numerics):
    rng = np.random.default_rng(7)
    ops, ref = _ops(backend, numerics), NumpyOps(numerics)
    x = (rng.standard_normal((9, 4, 256)) * 3).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    for wt in (None, w):
        _close(ops.rmsnorm(x, wt, 1e-6), ref.rmsnorm(x, wt, 1e-6), 1e-6, "rmsnorm")
    big = (x * 10).astype(np.float32)
    with np.errstate(over="ignore"):                           # exp(-x) of large negative x
        _close(ops.sigmoid(big), ref.sigmoid(big), 1e-6, "sigmoid")
    _close(ops.softplus(big), ref.softplus(big), 1e-6, "softplus")
    masked = np.where(rng.random(x.shape) < 0.2, -np.inf, x).astype(np.float32)
    masked[:, 0, :] = masked[..., 0] = 1.0                      # no row all masked on either axis
    for axis in (-1, 1):
        _close(ops.softmax(masked, axis=axis), ref.softmax(masked, axis=axis), 1e-6, "softmax")
    rows = rng.standard_normal((12, 512)).astype(np.float32)
    _close(ops.store_kv(rows, 448), ref.store_kv(rows, 448), 0, "store_kv")
    idx = rng.standard_normal((12, 128)).astype(np.float32)
    _close(ops.store_index(idx), ref.store_index(idx), 0, "store_index")
    _close(ops.index_qat(idx), ref.index_qat(idx), 0, "index_qat")
    scores = rng.standard_normal((5, 300))
    scores[:, 7] = scores[:, 9]                                 # a tie: the lower index first
    assert np.array_equal(_h(ops.topk_lowest_index(scores, 16)), ref.topk_lowest_index(scores, 16))


@pytest.mark.parametrize("numerics", NUMERICS)
def test_rope_and_attention(backend, numerics):
    rng = np.random.default_rng(11)
    ops, ref = _ops(backend, numerics), NumpyOps(numerics)
    T, H, D, n_rot = 7, 8, 128, 64
    pos = np.arange(100, 100 + T)
    yarn = dict(factor=16.0, orig_ctx=64, beta_fast=32.0, beta_slow=1.0)
    for y in (None, yarn):
        th = ops.rope_thetas(pos, n_rot, 10000.0, y)
        _close(th, ref.rope_thetas(pos, n_rot, 10000.0, y), 0, "rope_thetas")
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    for inverse in (False, True):
        want = ref.rope(q, _h(th)[:, None, :], inverse=inverse)
        _close(ops.rope(q.copy(), th[:, None, :], inverse=inverse, inplace=True), want, 1e-6, "rope")
    kv = rng.standard_normal((T, D)).astype(np.float32)
    _close(ops.rope(kv, th), ref.rope(kv, _h(th)), 1e-6, "rope 2-D")
    shared = rng.standard_normal((20, D)).astype(np.float32)
    per_q = rng.standard_normal((T, 5, D)).astype(np.float32)
    m1 = rng.random((T, 20)) < 0.7
    m1[:, 0] = True
    m2 = rng.random((T, 5)) < 0.5
    sinks = rng.standard_normal(H).astype(np.float32)
    for segs in ([(shared, m1)], [(shared, m1), (per_q, m2)]):
        _close(ops.attention(q, segs, sinks, 0.1), ref.attention(q, segs, sinks, 0.1), 1e-5, "attention")
    keys = rng.standard_normal((30, 128)).astype(np.float32)
    qi = rng.standard_normal((T, 4, 128)).astype(np.float32)
    wts = rng.standard_normal((T, 4)).astype(np.float32)
    _close(ops.indexer_scores(qi, keys, wts), ref.indexer_scores(qi, keys, wts), 1e-5, "indexer_scores")


@pytest.mark.parametrize("numerics", NUMERICS)
def test_hyper_connection_ops(backend, numerics):
    rng = np.random.default_rng(13)
    ops, ref = _ops(backend, numerics), NumpyOps(numerics)
    T, n, E = 6, 4, 256
    mix = rng.standard_normal((T, 2 * n + n * n)).astype(np.float32)
    scale = rng.uniform(0.5, 2, 3).astype(np.float32)
    base = rng.standard_normal(2 * n + n * n).astype(np.float32)
    for g, r in zip(ops.hc_split(mix, n, scale, base, np.float32(1e-6), 20),
                    ref.hc_split(mix, n, scale, base, np.float32(1e-6), 20)):
        _close(g, r, 1e-5, "hc_split")
    pre, post, C = ref.hc_split(mix, n, scale, base, np.float32(1e-6), 20)
    X = rng.standard_normal((T, n, E)).astype(np.float32)
    y = rng.standard_normal((T, E)).astype(np.float32)
    _close(ops.hc_pre_mix(pre.astype(np.float32), X), ref.hc_pre_mix(pre.astype(np.float32), X), 1e-6, "hc_pre_mix")
    P, CC = post.astype(np.float32), C.astype(np.float32)
    _close(ops.hc_post(y, X, P, CC), ref.hc_post(y, X, P, CC), 1e-6, "hc_post")


def test_glue_ops(backend, small_model):
    from engine.gguf.model_file import ModelFile
    ops, ref = _ops(backend, "ds4"), NumpyOps("ds4")
    with ModelFile.open(small_model) as m:
        w, rep = ops.bind_weights(m)
        assert isinstance(rep, BindReport) and rep.time_s >= 0 and rep.bytes >= 0
        toks = np.array([0, 5, 5, m.config.n_vocab - 1])
        assert np.array_equal(_h(ops.embed(w.embd, toks)), ref.embed(ref.bind_weights(m)[0].embd, toks))
        st, st_ref = ops.new_state(m.config, 64, 16), ref.new_state(m.config, 64, 16)
        assert st.nbytes() == st_ref.nbytes() and len(st.layers) == m.config.n_layer
        logits = ops.logits_to_host(ops.xp.asarray(np.arange(5, dtype=np.float32)))
        assert isinstance(logits, np.ndarray) and logits.dtype == np.float32


# -- the whole forward pass --------------------------------------------------------------------
@pytest.mark.parametrize("backend", WHOLE_PASS, indirect=True)
@pytest.mark.parametrize("recipe", ["q2", "q4", "mxfp4"])
def test_exact_forward_within_the_golden_tolerance(backend, recipe, tmp_path):
    from engine.gguf.synth import config_for, write_synthetic
    d = np.load(GOLDEN / f"tf_tiny_{recipe}.npz")
    a = json.loads(str(d["synth_args"]))
    cfg, vocab = config_for(a["preset"], vocab=a["vocab"], **a["overrides"])
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, cfg, recipe=a["recipe"], vocab=vocab, seed=a["seed"])
    toks, ref = d["token_ids"].tolist(), d["logits"]
    with Engine.open(path, backend=backend, numerics="exact") as e:
        ours = Session(e, 1024).sync(toks, keep_logits=True)
    err = np.abs(ours - ref).max()
    print(f"{backend} {recipe}: exact forward vs transformers, max-abs {err:.2e}")
    assert err <= TOL and (ours.argmax(1) == ref.argmax(1)).all()


def _oracle():
    d = need_shared(ORACLE / "ds4_logits.npz").parent
    toks = json.loads((d / "tokens.json").read_text())["token_ids"]
    return next(iter(sorted(d.glob("*.gguf")))), toks, np.load(d / "ds4_logits.npz")


@pytest.mark.parametrize("backend", WHOLE_PASS, indirect=True)
def test_ds4_prefill_within_the_oracle_thresholds(backend):
    path, toks, ds4 = _oracle()
    with Engine.open(path, backend=backend, numerics="ds4") as e:
        ours = Session(e, len(toks) + 16).sync(toks, keep_logits=True)[ds4["positions"]]
    st = stats(ours, ds4["prefill_logits_at_positions"])
    print(f"{backend}, ds4 numerics, prefill vs ds4 prefill at checkpoints:", st)
    # the oracle's thresholds but top-1, which over 17 checkpoints moves 6 % a position (numpy: 14 of
    # 17); the token-by-token test below holds all four over every position (slow)
    assert st["median"] <= 0.2 and st["p90"] <= 0.5 and st["kl"] <= 0.02, st


@pytest.mark.parametrize("backend", WHOLE_PASS, indirect=True)
@pytest.mark.slow       # token by token: 20-40 s a backend (the default backend's is test_engine_oracle's)
def test_ds4_decode_within_the_oracle_thresholds(backend):
    path, toks, ds4 = _oracle()
    with Engine.open(path, backend=backend, numerics="ds4") as e:
        s = Session(e, len(toks) + 16)
        ours = np.array([s.eval(t).copy() for t in toks])
    st = stats(ours, ds4["decode_logits_all"])
    print(f"{backend}, ds4 numerics, decode vs ds4:", st)
    assert st["median"] <= 0.2 and st["p90"] <= 0.5 and st["top1"] >= 0.85 and st["kl"] <= 0.02, st


# -- snapshot -> restore -----------------------------------------------------------------------
TOKS = list(range(3, 60))
MORE = [7, 11, 13, 17, 19]


def _resume(path, backend, payload):
    with Engine.open(path, backend=backend, numerics="exact") as e:
        s = Session(e, 128)
        s.restore(payload)
        return np.array([s.eval(t).copy() for t in MORE])


_STRAIGHT: dict = {}


def _straight(path, backend):
    """(snapshot after TOKS, logits of MORE after it) on `backend`, computed once a test run."""
    if (path, backend) not in _STRAIGHT:
        _STRAIGHT[path, backend] = _run_straight(path, backend)
    return _STRAIGHT[path, backend]


def _run_straight(path, backend):
    with Engine.open(path, backend=backend, numerics="exact") as e:
        s = Session(e, 128)
        s.sync(TOKS)
        return s.snapshot(), np.array([s.eval(t).copy() for t in MORE])


@pytest.mark.parametrize("backend", WHOLE_PASS, indirect=True)
def test_snapshot_restore_within_and_across_backends(backend, small_model):
    payload, want = _straight(small_model, backend)
    assert np.array_equal(_resume(small_model, backend, payload), want), "restore changed the timeline"
    for other in BACKENDS:
        if other == backend:
            continue
        _, theirs = _straight(small_model, other)
        got = _resume(small_model, other, payload)
        rel = np.abs(got - theirs).max() / np.abs(theirs).max()
        print(f"saved on {backend}, resumed on {other}: relative {rel:.2e}")
        assert rel < 2e-5 and (got.argmax(-1) == theirs.argmax(-1)).all()


def test_an_mlx_that_cannot_import_is_one_line(monkeypatch, small_model):
    # (a Linux 'pip install mlx' without [cpu]: the package is there, mlx.core will not load)
    import importlib.util
    import sys
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "mlx" else real(n, *a))
    monkeypatch.setitem(sys.modules, "mlx.core", None)          # import raises ImportError
    with pytest.raises(BackendError, match=r"^backend 'mlx' is not available: mlx cannot be imported") as err:
        Engine.open(small_model, backend="mlx")
    assert "\n" not in str(err.value)
