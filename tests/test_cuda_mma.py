"""The tensor-core prefill of `ds4` numerics (cuda_kernels/ds4_mma.cu: ds4's quantized dot products
with the integer part on int8 mma.sync m16n8k32) under the host emulation, whose mma follows the
PTX fragment layout (engine/backends/cupy/emu_support/cuda_emu.h), and on a CUDA device where CuPy
sees one (scripts/gpu_check.sh): bit for bit with engine/model/ds4_matmul.py. The integer dots are
exact on either, and the float32 steps are ds4's, in block order, so no tolerance is needed.
Also ds4's other roundings the `ds4` numerics run as kernels before and after those products:
the activation codes (quantize.cu) and the KV rows' FP8/F16 rounding (kv.cu), bit for bit; and
scripts/cuda_kernel_bench.py, which gpu_check.sh runs on a device, run on the emulation.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.cupy import emu
from engine.model import ds4_matmul as DM

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
from harness import FORMATS, Kernels, cupy_device, weights  # noqa: E402

# on the emulation, and on the device where CuPy sees one; emulation-only tests skip without g++
# (the harness's Kernels(runner="emu")), so a GPU machine without it still compares on the device
RUNNERS = (["emu"] if emu.compiler() is not None else []) + (["cupy"] if cupy_device() else [])
pytestmark = pytest.mark.skipif(not RUNNERS, reason="neither g++ (the CUDA emulation) nor a CUDA device")
need_gxx = pytest.mark.skipif(emu.compiler() is None, reason="g++ is not installed: the CUDA emulation needs it")


@pytest.fixture(scope="module", params=RUNNERS)
def K(request):
    return Kernels(runner=request.param)


def _pairs(rng, n_experts, n_tok):
    """45 pairs: expert 0 has 37 (a chunk of 32 and one of 5), shuffled; tokens repeat."""
    experts = np.array([0] * 37 + [n_experts - 1] * 5 + [1 % n_experts] * 3, np.int32)[rng.permutation(45)]
    return experts, rng.integers(0, n_tok, 45).astype(np.int32)


def _reference(fmt, raw, act, experts, toks):
    if fmt == "q8_0":
        return np.stack([DM.q8_0_matmul(raw[e], act[t:t + 1])[0] for e, t in zip(experts, toks)])
    return np.stack([DM.q8_k_matmul(FORMATS[fmt], raw[e], act[t:t + 1])[0] for e, t in zip(experts, toks)])


@pytest.mark.parametrize("fmt", ["q8_0", "iq2_xxs", "q2_k"])
def test_ds4_gemm_bit_for_bit_with_the_reference(K, fmt):
    rng = np.random.default_rng(40)
    n_in = 32 * 5 if fmt == "q8_0" else 512                 # several blocks: the block order matters
    raw, _ = weights(fmt, rng, 3, 70, n_in, any_bytes=True)  # 70 rows: a partial tile of 64
    x = rng.standard_normal((6, n_in), dtype=np.float32) * np.float32(2)
    act = DM.q8_0_act(x) if fmt == "q8_0" else DM.q8_k_act(x)
    experts, toks = _pairs(rng, 3, 6)
    got = K.ds4_gemm(fmt, raw, act.q.reshape(6, -1), act.d, experts, toks)
    assert got.tobytes() == _reference(fmt, raw, act, experts, toks).tobytes()


# the fragment layout and the block order are what the comparison above proves: a kernel that
# loads A's second and third registers swapped, sums the Q8_0 blocks' terms in another rounding,
# or drops IQ2_XXS's per-group multiplier must fail it
@pytest.mark.parametrize("fmt,old,new", [
    ("q2_k", "a[1] = ld_s4(t + (r0 + g + 8) * LD + 4 * tq);", "a[1] = ld_s4(t + (r0 + g) * LD + 16 + 4 * tq);"),
    ("q8_0", "term = __fmul_rn(__fmul_rn(sd[rr], dx), float(isum[j][i]));",
     "term = __fmul_rn(sd[rr], __fmul_rn(dx, float(isum[j][i])));"),
    ("iq2_xxs", "smul[16 * warp + g + 8 * (i >> 1)] * d[i]", "smul[16 * warp + g] * d[i]"),
])
def test_a_broken_mma_kernel_fails_the_comparison(fmt, old, new):
    from harness import KDIR
    assert (KDIR / "ds4_mma.cu").read_text().count(old) == 1      # the patch applies (the comparison fails)
    with pytest.raises(AssertionError):
        test_ds4_gemm_bit_for_bit_with_the_reference(Kernels(patch={"ds4_mma.cu": (old, new)}), fmt)


# -- scripts/cuda_kernel_bench.py (what gpu_check.sh runs on a device), on the host emulation ----------
def _bench():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import cuda_kernel_bench
    return cuda_kernel_bench


@need_gxx
def test_the_kernel_bench_runs_and_checks_itself_on_the_emulation(monkeypatch, capsys):
    monkeypatch.setenv("DS4_CUDA_EMULATE", "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ORDERS", "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ISOLATE", "0")
    assert _bench().main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("bit for bit") == 2 and "MISMATCH" not in out and "ds4_gemm_q2_k" in out


@need_gxx
@pytest.mark.slow        # two engine opens and a few decode steps on the emulation: ~20 s
def test_the_graphs_check_runs_on_the_emulation(monkeypatch, capsys, tmp_path):
    from engine.gguf.synth import config_for, write_synthetic
    monkeypatch.setenv("DS4_CUDA_EMULATE", "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ORDERS", "1")
    monkeypatch.setenv("DS4_CUDA_EMU_ISOLATE", "0")
    cfg, vocab = config_for("tiny", n_layer=2, ratios=[4, 128], vocab=300)
    path = write_synthetic(tmp_path / "g.gguf", cfg, recipe="q2", vocab=vocab, seed=5).path
    assert _bench().main(["--graphs", str(path), "--graph-tokens", "3"]) == 0
    assert "logits bit for bit: ok" in capsys.readouterr().out


# -- quantize.cu: ds4's activation codes ------------------------------------------------------------
def _activation_rows(rng, n):
    """Rows with the quantizers' edge cases: random, an all-zero block, a tiny block (127 / amax
    overflows), ties of |x| across signs (Q8_K takes the first), a NaN, halves (rint's ties)."""
    x = rng.standard_normal((6, n), dtype=np.float32) * np.float32(4)
    x[1, :32] = 0.0
    x[2, :64] = np.float32(1e-38) * rng.standard_normal(64, dtype=np.float32)
    x[3, 5], x[3, 9] = -100.0, 100.0           # the block's largest |x|, twice: m = -100
    x[3, 300 % n] = np.nan
    x[4] = np.round(x[4] * 2) / 2
    return x


@pytest.mark.parametrize("block", [32, 256])
def test_quantize_is_the_reference_bit_for_bit(K, block):
    from engine.model import numerics as N
    x = _activation_rows(np.random.default_rng(9), 512)
    q, d = K.quantize(block, x)
    wq, wd = (N.q8_0_quantize if block == 32 else N.q8_k_quantize)(x)
    assert q.tobytes() == wq.reshape(6, -1).tobytes() and d.tobytes() == wd.tobytes()


def test_a_quantizer_that_takes_the_last_tie_fails_the_comparison():
    from harness import KDIR
    old, new = "(ob == best && oi < bi)", "(ob == best && oi > bi)"
    assert (KDIR / "quantize.cu").read_text().count(old) == 1
    with pytest.raises(AssertionError):
        test_quantize_is_the_reference_bit_for_bit(Kernels(patch={"quantize.cu": (old, new)}), 256)


# -- kv.cu: ds4's KV-row rounding (FP8 E4M3 blocks of 64, then F16) ---------------------------------
def test_kv_store_is_the_reference_bit_for_bit(K):
    from engine.model import numerics as N
    rng = np.random.default_rng(12)
    x = rng.standard_normal((7, 192), dtype=np.float32) * np.float32(5)
    x[1, :64] = 0.0                                          # amax below the 1e-4 floor
    x[2, :64] *= np.float32(1e-6)
    x[3, :64] = np.float32(448.0) * np.round(rng.random(64).astype(np.float32) * 16) / 16    # scale 1: E4M3 ties
    x[4, 128:] = rng.choice([65519.0, 65520.0, 7e4, 1e-8, 2.0 ** -25, 3 * 2.0 ** -25,    # F16 edges in the tail,
                             1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -11)], 64)  # and its ties
    x[5] *= np.float32(1e4)
    x[6, :64] = -x[6, :64]
    got = K.kv_store(x, 128)
    assert got.tobytes() == N.f16_round(N.fp8_e4m3_roundtrip(x, 128)).tobytes()


def test_a_kv_rounding_without_ties_to_even_fails_the_comparison():
    from harness import KDIR
    old, new = "(a + 0xFFFu + ((a >> 13) & 1u))", "(a + 0xFFFu + 1u)"
    assert (KDIR / "kv.cu").read_text().count(old) == 1
    with pytest.raises(AssertionError):
        test_kv_store_is_the_reference_bit_for_bit(Kernels(patch={"kv.cu": (old, new)}))
