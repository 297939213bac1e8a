"""The cupy backend beyond the conformance suite (which runs over it too, on its host emulation
where there is no GPU: tests/test_backend_conformance.py).

* The CuPy stand-in (engine/backends/cupy/standin.py) is as strict as CuPy about host and device
  arrays, so a host/device mistake in the backend or the model's glue fails here, not on a GPU.
* Registration: without a device `--backend cupy` is one line and exit 1; DS4_CUDA_EMULATE=1
  serves when named, and `auto` never takes the emulation.
* The array-op forms (DS4_CUDA_KERNELS=0) are the reference's own steps: bit for bit the numpy
  backend's exact-numerics logits.
* With the kernels (their host emulation), the CLI prints numpy's tokens, and the token-by-token
  logits stay within the oracle's thresholds of numpy's on synthetic models (3 seeds, 300 tokens:
  slow; a short one by default).

On a real GPU (scripts/gpu_check.sh) the stand-in tests still run (they need no device); the
emulation's are skipped there, the conformance suite running on the device instead.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine import Engine, Session
from engine.backends import registry as R
from engine.backends.cupy import device, standin as xp
from engine.errors import BackendError

from test_engine_oracle import stats

EMULATION = device.compiler() is not None and "cupy" not in R.available_names()
need_emulation = pytest.mark.skipif(not EMULATION, reason="a CUDA device serves here (or no C++ compiler "
                                    "for the emulation): the conformance suite runs on it instead")
THRESHOLDS = {"median": 0.2, "p90": 0.5, "top1": 0.85, "kl": 0.02}     # the oracle's


@pytest.fixture
def emulate(monkeypatch):
    """The backend on the stand-in, one thread order and launches in this process (the kernels'
    own tests run both orders and the guard pages: tests/test_cuda_kernels.py)."""
    monkeypatch.setenv(device.EMULATE_ENV, "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ORDERS", "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ISOLATE", "0")


# -- the stand-in ---------------------------------------------------------------------------------
def test_the_standin_refuses_host_arrays_as_cupy_does():
    host = np.arange(6, dtype=np.float32)
    dev = xp.asarray(host)
    host[0] = 99.0                                 # an upload is a copy
    assert float(dev[0]) == 0.0
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(dev)
    for bad in (lambda: dev + host, lambda: host + dev, lambda: xp.concatenate([dev, host]),
                lambda: dev[np.array([0, 1])], lambda: dev.__setitem__(slice(0, 6), host),
                lambda: xp.where(dev > 1, dev, host), lambda: np.exp(host) * dev):
        with pytest.raises(TypeError, match="Unsupported type"):
            bad()
    # what the backend does instead: upload, index with device arrays, copy out with get()
    idx = xp.asarray(np.array([4, 1]))
    assert dev[idx].get().tolist() == [4.0, 1.0]
    dev[0:6] = xp.asarray(host)
    assert isinstance(dev.sum(), xp.ndarray) and float(dev.sum()) == 99.0 + 15.0   # 0-d device arrays
    assert isinstance(np.exp(dev), xp.ndarray) and xp.asnumpy(np.exp(dev)).dtype == np.float32
    # CuPy's sorts are stable: ties keep their order (the top-k's lowest-index rule relies on it)
    ties = xp.asarray(np.array([1.0, 3.0, 3.0, 2.0, 3.0]))
    assert xp.argsort(-ties).get().tolist() == [1, 2, 4, 3, 0]


def test_standin_kernel_arguments_are_checked():
    fn = xp._Function(lambda grid, block, args, shared_mem=0: None, "k")
    a = xp.zeros((4, 4), dtype=xp.float32)
    fn((1, 1, 1), (32, 1, 1), (a, np.int32(3)))
    with pytest.raises(TypeError, match="NumPy scalar"):
        fn((1, 1, 1), (32, 1, 1), (a, 3))                      # CuPy would pass 64 bits
    with pytest.raises(ValueError, match="not C-contiguous"):
        fn((1, 1, 1), (32, 1, 1), (a.T, np.int32(3)))
    with pytest.raises(TypeError, match="Unsupported type"):
        fn((1, 1, 1), (32, 1, 1), (np.zeros(4, np.float32), np.int32(3)))


# -- registration -------------------------------------------------------------------------------
def test_without_a_device_cupy_is_one_line_and_exit_1(monkeypatch, capsys, small_model):
    from ds4agent.ds4_cli import main
    monkeypatch.delenv(device.EMULATE_ENV, raising=False)
    if "cupy" in R.available_names():
        pytest.skip("a CUDA device serves here")
    why = R.get("cupy").available()
    assert f"{device.EMULATE_ENV}=1" in why and "\n" not in why
    assert main(["-m", str(small_model), "--backend", "cupy", "-p", "hi", "-n", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: backend 'cupy' is not available:"), err


def test_the_emulation_serves_only_when_named(monkeypatch):
    monkeypatch.delenv("DS4_BACKEND", raising=False)
    monkeypatch.setenv(device.EMULATE_ENV, "1")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BackendError, match="needs a C\\+\\+ compiler"):
        R.pick("cupy")
    monkeypatch.undo()
    if not EMULATION:
        pytest.skip("no C++ compiler here (or a real device)")
    monkeypatch.setenv(device.EMULATE_ENV, "1")
    assert R.pick("cupy").name == "cupy" and "cupy" in R.available_names()
    assert R.pick("auto").name != "cupy"


# -- the forward pass ---------------------------------------------------------------------------
def _logits(path, backend, toks, numerics="exact", decode=()):
    with Engine.open(path, backend=backend, numerics=numerics) as e:
        s = Session(e, 128)
        pre = s.sync(toks, keep_logits=True)
        dec = np.array([s.eval(t).copy() for t in decode])
        return pre, dec, e


# since e41bbf3 (issue 33) the reference's ds4 numerics follow ds4's compiled float32 loops outside
# the matmuls (engine/model/ds4_float.py: F16 matvecs in index order, the HC split/sums/post, SwiGLU,
# the routed sum in slot order, attention's float32 loops); the cupy backend's forms do not yet, so
# its ds4 logits are within the oracle's thresholds but not the reference's bits. strict: this
# fails once they are, and the mark must go.
DS4_FLOAT_PENDING = pytest.mark.xfail(strict=True, reason="cupy does not yet follow ds4_float.py (e41bbf3)")


@need_emulation
@pytest.mark.parametrize("numerics", ["exact", pytest.param("ds4", marks=DS4_FLOAT_PENDING)])
def test_array_op_forms_are_the_reference_bit_for_bit(emulate, monkeypatch, two_layers, numerics):
    # ds4 numerics included: ds4's integer block dots (ds4_dot.py), its RMSNorm, its KV rounding
    monkeypatch.setenv("DS4_CUDA_KERNELS", "0")
    toks = list(range(3, 21))
    got_pre, got_dec, e = _logits(two_layers, "cupy", toks, numerics, decode=[7, 11])
    want_pre, want_dec, _ = _logits(two_layers, "numpy", toks, numerics, decode=[7, 11])
    assert np.array_equal(got_pre, want_pre) and np.array_equal(got_dec, want_dec)
    assert e.model.ops.k is None and e.bind_report.bytes > 0


@need_emulation
def test_weights_upload_once_with_progress(emulate, monkeypatch, small_model):
    from engine.backends.cupy.ops import CupyOps
    from engine.gguf.model_file import ModelFile
    seen = []
    ops = CupyOps("exact", xp, None, progress=lambda done, total: seen.append((done, total)))
    with ModelFile.open(small_model) as m:
        w, rep = ops.bind_weights(m)
    assert rep.bytes == seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    assert isinstance(w.layers[0].attn_norm, xp.ndarray) and isinstance(w.layers[0].q_a.data, xp.ndarray)
    comp = next(lw.comp for lw in w.layers if lw.comp is not None)
    assert isinstance(comp.ape, np.ndarray) and isinstance(comp.norm, xp.ndarray)   # ape stays on the host


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A compressed layer with the indexer (ratio 4) and a ratio-128 one: every kernel, quickly."""
    return _synth(tmp_path_factory.mktemp("cupy"), 7, ratios=[4, 128])


def _cli_tokens(path, capsys):
    from ds4agent.ds4_cli import main
    out = {}
    for b in ("numpy", "cupy"):       # ds4 numerics, the default
        assert main(["-m", str(path), "--backend", b, "-p", "hi", "-n", "8", "--temp", "0"]) == 0
        out[b] = capsys.readouterr().out
    assert out["cupy"] == out["numpy"] and out["numpy"].strip()


@need_emulation
def test_the_cli_prints_numpys_tokens(emulate, capsys, two_layers):
    _cli_tokens(two_layers, capsys)


@pytest.mark.slow       # six layers through the emulated kernels: ~40 s
@need_emulation
def test_the_cli_prints_numpys_tokens_six_layers(emulate, capsys, small_model):
    _cli_tokens(small_model, capsys)


def _token_by_token(path, n, emulate_env):
    """Greedy tokens of numpy, then both backends' logits fed the same tokens one at a time."""
    with Engine.open(path, backend="numpy", numerics="ds4") as e:
        s = Session(e, n + 8)
        toks, ref = [1], []
        for _ in range(n):
            ref.append(s.eval(toks[-1]).copy())
            toks.append(int(np.argmax(ref[-1])))
    with Engine.open(path, backend="cupy", numerics="ds4") as e:
        s = Session(e, n + 8)
        got = np.array([s.eval(t).copy() for t in toks[:n]])
        launches = dict(e.model.ops.k.launches) if e.model.ops.k is not None else {}
    return stats(got, np.array(ref)), launches


def _synth(tmp_path, seed, ratios=(0, 4, 128, 4)):
    from engine.gguf.synth import config_for, write_synthetic
    cfg, vocab = config_for("tiny", n_layer=len(ratios), ratios=list(ratios), vocab=300)
    return write_synthetic(tmp_path / f"s{seed}.gguf", cfg, recipe="q2", vocab=vocab, seed=seed).path


@need_emulation
def test_emulated_logits_within_the_oracle_thresholds_short(emulate, two_layers):
    st, launches = _token_by_token(two_layers, 10, emulate)
    print("emulated cupy vs numpy, 2 layers, 10 tokens:", st)
    assert all(st[k] <= v for k, v in THRESHOLDS.items() if k != "top1") and st["top1"] >= THRESHOLDS["top1"]
    # the kernels ran: ds4's dot products for the experts and the Q8_0 weights (ds4 numerics),
    # attention, the norms (not the rope kernel: in ds4 numerics a rotation takes the host's libm
    # cosf/sinf tables, ops.rope, where the kernel would compute the device's own)
    assert launches.get("rope", 0) == 0, launches
    # the compressors' pooling too (compress_pool, through Model._compress_store's ops hook: the
    # ratio-4 layer closes windows at positions 3 and 7)
    for name in ("ds4_matvec_q2_k", "ds4_matvec_iq2_xxs", "attn_segment", "attn_finish", "ds4_matvec_q8_0",
                 "compress_pool"):
        assert launches.get(name, 0) > 0, (name, launches)


@pytest.mark.slow       # 3 models x 300 tokens through the emulated kernels: ~10 min each
@need_emulation
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_emulated_logits_within_the_oracle_thresholds(emulate, tmp_path, seed):
    # three layers, one of each kind (sliding window only, ratio 4 with the indexer, ratio 128);
    # past 64 tokens the indexer picks its top 16 rows, and the 16-row window wraps
    st, launches = _token_by_token(_synth(tmp_path, seed, ratios=(0, 4, 128)), 300, emulate)
    print(f"emulated cupy vs numpy, seed {seed}, 300 tokens:", st, "launches:", sum(launches.values()))
    assert launches.get("indexer_scores", 0) > 0 and launches.get("topk", 0) > 0
    assert launches.get("compress_pool", 0) > 0
    assert all(st[k] <= v for k, v in THRESHOLDS.items() if k != "top1") and st["top1"] >= THRESHOLDS["top1"]
