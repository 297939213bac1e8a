"""The mlx backend's Metal kernels, run by host emulation (tests/metal_emu): each kernel body is
compiled as C++ against metal_compat.h and run on small shapes, one threadgroup at a time, and
compared with the NumPy reference. This proves the kernels' indexing, decoding and arithmetic;
not that Metal compiles them, nor their speed (docs/metal-kernels.md).

Errors are reported as max-abs and relative (max-abs over the reference's largest magnitude);
decoded weights must match bit for bit (one-hot inputs make each output one decoded value).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.mlx import metal
from engine.backends.numpy.ops import NumpyOps
from engine.gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parent / "metal_emu"))
import emu  # noqa: E402

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="g++ is not installed: the kernels' host emulation needs it")

KIND_TYPE = {"iq2_xxs": quants.IQ2_XXS, "q2_k": quants.Q2_K}


@pytest.fixture(scope="session")
def exe(tmp_path_factory):
    return emu.build(cache=tmp_path_factory.mktemp("metal_emu"))


def _report(name, got, ref):
    err = np.abs(got.astype(np.float64) - ref)
    rel = err.max() / max(np.abs(ref).max(), 1e-30)
    print(f"{name}: max-abs {err.max():.3g}, relative {rel:.3g}")
    return err.max(), rel


# -- gather_matvec ----------------------------------------------------------------------------
def _weights(kind, rng, E, n_out, n_in):
    t = KIND_TYPE[kind]
    nb = E * n_out * (n_in // 256)
    raw = quants.random_blocks(t, rng, nb, 0.02).reshape(E, n_out, -1)
    return raw, quants.dequantize(t, raw)                  # [E, n_out, row_bytes], [E, n_out, n_in]


def _gather(exe, form, kind, raw, x, experts, toks, tmp_path):
    E, n_out, row_bytes = raw.shape
    dims = np.array([n_out, x.shape[1], row_bytes], np.int32)
    P = len(experts)
    if form == "decode":
        R = metal.DECODE_ROWS_PER_TG
        inputs, grid, tg = [raw, x, experts, toks, dims], (32 * R * -(-n_out // R), P, 1), (32 * R, 1, 1)
    else:
        perm, chunks = metal.batch_plan(experts)
        inputs = [raw, x, experts, toks, perm, chunks, dims]
        grid, tg = (128 * -(-n_out // metal.BATCH_TILE_ROWS), len(chunks), 1), (128, 1, 1)
    entry = f"gather_matvec_{form}_{kind}"
    return emu.run(exe, entry, inputs, [((P, n_out), np.float32)], grid, tg, tmp_path / entry)[0]


def test_the_iq2xxs_grid_in_common_metal_is_ggmls():
    """common.metal's packed grid (2-bit indices into 8, 25, 43) against quants' table, every entry."""
    import re
    table = re.search(r"iq2xxs_grid2\[256\] = \{(.*?)\};", metal.source("common.metal"), re.S).group(1)
    packed = np.array([int(v, 16) for v in re.findall(r"0x[0-9a-f]+", table)])
    assert packed.shape == (256,)
    grid = np.array([8, 25, 43])[(packed[:, None] >> np.arange(0, 16, 2)) & 3]
    assert np.array_equal(grid, quants.IQ2XXS_GRID_BYTES)


@pytest.mark.parametrize("form", ["decode", "batched"])
@pytest.mark.parametrize("kind", ["iq2_xxs", "q2_k"])
def test_gather_matvec_decodes_bit_exactly(exe, tmp_path, form, kind):
    """x one-hot: out[p, r] is the single decoded value W[e, r, col] (adding zeros is exact). The
    pairs reach every position of a block (col mod 256) in both blocks of the row, all experts."""
    rng = np.random.default_rng(1)
    E, n_out, n_in = 3, 21, 512                # 21 rows: a partial row tile in both forms
    raw, W = _weights(kind, rng, E, n_out, n_in)
    cols = np.arange(256) + 256 * (np.arange(256) % 2)
    x = np.eye(n_in, dtype=np.float32)[cols]     # token i is one-hot at cols[i]
    toks = np.arange(256, dtype=np.int32)
    experts = rng.integers(0, E, 256).astype(np.int32)
    got = _gather(exe, form, kind, raw, x, experts, toks, tmp_path)
    ref = W[experts, :, cols]                      # [P, n_out]
    assert np.array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32)), \
        f"{np.sum(got != ref)} decoded values differ"


@pytest.mark.parametrize("form", ["decode", "batched"])
@pytest.mark.parametrize("kind", ["iq2_xxs", "q2_k"])
def test_gather_matvec_matches_the_reference(exe, tmp_path, form, kind):
    rng = np.random.default_rng(2)
    E, n_out, n_in, T, P = 5, 37, 768, 9, 40
    raw, W = _weights(kind, rng, E, n_out, n_in)
    x = rng.standard_normal((T, n_in), dtype=np.float32)
    experts = rng.integers(0, E, P).astype(np.int32)
    toks = rng.integers(0, T, P).astype(np.int32)
    got = _gather(exe, form, kind, raw, x, experts, toks, tmp_path)
    ref = np.einsum("poi,pi->po", W[experts].astype(np.float64), x[toks].astype(np.float64))
    _, rel = _report(f"gather_matvec {form} {kind}", got, ref)
    assert rel < 1e-5


def test_batch_plan_groups_pairs_by_expert():
    experts = np.array([3, 1, 3, 3, 0, 1, 3, 3, 3, 3, 3, 3, 3, 3], np.int32)   # expert 3: 11 pairs
    perm, chunks = metal.batch_plan(experts, tile_pairs=8)
    assert sorted(perm) == list(range(len(experts)))
    assert list(experts[perm]) == sorted(experts)
    assert chunks.tolist() == [[0, 1], [1, 2], [3, 8], [11, 3]]
    for s, c in chunks:
        assert len(set(experts[perm[s:s + c]])) == 1
    assert metal.use_batched(np.zeros(16, np.int32)) and not metal.use_batched(np.arange(16, dtype=np.int32))


# -- hc_split ---------------------------------------------------------------------------------
def test_hc_split_matches_the_reference(exe, tmp_path):
    rng = np.random.default_rng(3)
    T, n, iters, eps = 45, 4, 20, 1e-6             # 45 tokens: a partial threadgroup of 32
    mix = rng.standard_normal((T, 2 * n + n * n), dtype=np.float32)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    base = rng.standard_normal(2 * n + n * n, dtype=np.float32)
    inputs = [mix, scale, base, np.array([eps], np.float32), np.array([iters], np.int32), np.array([T], np.int32)]
    outs = [((T, n), np.float32), ((T, n), np.float32), ((T, n, n), np.float32)]
    got = emu.run(exe, "hc_split", inputs, outs, (T, 1, 1), (32, 1, 1), tmp_path / "hc")
    ref = NumpyOps().hc_split(mix, n, scale, base, np.float32(eps), iters)
    for name, g, r in zip(("pre", "post", "C"), got, ref):
        _, rel = _report(f"hc_split {name}", g, r.astype(np.float64))
        assert rel < 1e-5


# -- attention --------------------------------------------------------------------------------
@pytest.mark.parametrize("D,per_query", [(64, False), (512, False), (128, True)])
def test_attention_matches_the_reference(exe, tmp_path, D, per_query):
    rng = np.random.default_rng(4)
    T, H, K = 3, 4, 45
    q = rng.standard_normal((T, H, D), dtype=np.float32)
    keys = rng.standard_normal((T, K, D) if per_query else (K, D), dtype=np.float32)
    mask = rng.random((T, K)) < 0.7
    mask[1] = False                                 # a query that sees no key: the sink alone, out = 0
    sinks = rng.standard_normal(H).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    dims = np.array([T, H, D, K, int(per_query)], np.int32)
    inputs = [q, keys, mask.astype(np.uint8), sinks, np.array([scale], np.float32), dims]
    tg = 32 * metal.ATTN_SIMDGROUPS
    got = emu.run(exe, "attention", inputs, [((T, H, D), np.float32)], (tg, T * H, 1), (tg, 1, 1),
                  tmp_path / "attn")[0]
    ref = NumpyOps.attention(q, [(keys, mask)], sinks, scale).astype(np.float64)
    _, rel = _report(f"attention D={D} per_query={per_query}", got, ref)
    assert rel < 1e-5
    assert np.all(got[1] == 0)


# -- topk -------------------------------------------------------------------------------------
@pytest.mark.parametrize("C,k", [(50, 50), (1000, 1), (1000, 37), (4099, 512)])
def test_topk_matches_the_reference(exe, tmp_path, C, k):
    rng = np.random.default_rng(5)
    T = 3
    # few distinct values, so the k-th value is tied and the lowest indices must win
    scores = rng.integers(-20, 20, (T, C)).astype(np.float32) * np.float32(0.25)
    scores[0, ::7] = -np.inf
    scores[1, ::5] = -0.0                           # -0 ties with +0 (argsort of -x does too)
    scores[2, : C // 2] = np.float32(3.0)           # a long run of equal values
    got = emu.run(exe, "topk", [scores, np.array([T, C, k], np.int32)], [((T, k), np.int32)],
                  (metal.TOPK_THREADS, T, 1), (metal.TOPK_THREADS, 1, 1), tmp_path / "topk")[0]
    ref = NumpyOps.topk_lowest_index(scores, k)
    assert np.array_equal(got, ref), f"rows differ at {np.argwhere(got != ref)[:5].tolist()}"


def test_bodies_name_no_address_space():
    """MLX declares an input `constant` when it has under 8 elements and `device` otherwise, so a
    body that writes `const device float* p = x + i` fails to compile on Metal for a small x; the
    emulation (every space is plain memory) cannot see that, so the rule is checked here."""
    import re
    for file, _, _ in metal.KERNELS.values():
        code = re.sub(r"//[^\n]*", "", metal.source(file))
        assert not re.findall(r"\b(device|constant)\b", code), f"{file}: derive pointers with auto"


# -- the tests can fail -----------------------------------------------------------------------
MUTATIONS = {   # one wrong index per kernel, and the check it must break
    "q2_k": ("common.metal", ("qs[16 * half_ + l]", "qs[l]")),
    "batched": ("gather_matvec_batched.metal", ("xt[my_p * LD + k]", "xt[my_r % TP * LD + k]")),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_broken_index_fails_the_comparison(tmp_path, name):
    file, edit = MUTATIONS[name]
    exe = emu.build(emu.generate({file: edit}, only=("gather_matvec_batched_q2_k",)), tmp_path / "build", "-O0")
    rng = np.random.default_rng(6)
    raw, W = _weights("q2_k", rng, 2, 16, 256)
    x = rng.standard_normal((4, 256), dtype=np.float32)
    experts, toks = np.zeros(16, np.int32), (np.arange(16) % 4).astype(np.int32)
    got = _gather(exe, "batched", "q2_k", raw, x, experts, toks, tmp_path)
    ref = np.einsum("poi,pi->po", W[experts].astype(np.float64), x[toks].astype(np.float64))
    _, rel = _report(f"mutant {name}", got, ref)
    assert rel > 1e-2


FAULTS = {   # mistakes the emulation reports itself, instead of hanging or reading a neighbour
    "barrier": ("topk.metal", ("const uint thr = prefix;", "const uint thr = prefix;\nif (tid == 1) return;"),
                "topk", "only some"),
    "past_end": ("gather_matvec_decode.metal", ("out[ulong(p) * n_out + row] = acc;", "out[ulong(p) * n_out + row + 64] = acc;"),
                 "gather_matvec_decode_q2_k", "signal 11"),
    "missing_barrier": ("gather_matvec_batched.metal",
                        ("threadgroup_barrier(mem_flags::mem_threadgroup);   // the next block", "// the next block"),
                        "gather_matvec_batched_q2_k", "order threads run in"),
}


@pytest.fixture(scope="module")
def faulty_exe(tmp_path_factory):
    """One build with every fault (each in a different file, run through a different entry)."""
    patch = {file: edit for file, edit, _, _ in FAULTS.values()}
    assert len(patch) == len(FAULTS)
    only = tuple(entry for _, _, entry, _ in FAULTS.values())
    return emu.build(emu.generate(patch, only=only), tmp_path_factory.mktemp("faulty"), "-O0")


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_the_emulation_reports_divergent_or_missing_barriers_and_overruns(faulty_exe, tmp_path, name):
    file, edit, entry, message = FAULTS[name]
    exe = faulty_exe
    rng = np.random.default_rng(7)
    if entry == "topk":
        scores = rng.standard_normal((2, 300), dtype=np.float32)
        args = ([scores, np.array([2, 300, 5], np.int32)], [((2, 5), np.int32)], (64, 2, 1), (64, 1, 1))
    elif entry == "gather_matvec_decode_q2_k":
        raw, _ = _weights("q2_k", rng, 1, 8, 256)
        x = rng.standard_normal((2, 256), dtype=np.float32)
        e, t = np.zeros(3, np.int32), np.array([0, 1, 0], np.int32)
        args = ([raw, x, e, t, np.array([8, 256, 84], np.int32)], [((3, 8), np.float32)], (256, 3, 1), (128, 1, 1))
    else:   # three blocks per row: the tiles are rewritten while other threads still read them
        raw, _ = _weights("q2_k", rng, 1, 16, 768)
        x = rng.standard_normal((4, 768), dtype=np.float32)
        with pytest.raises(emu.EmulationError, match=message):
            _gather(exe, "batched", "q2_k", raw, x, np.zeros(16, np.int32), np.arange(16, dtype=np.int32) % 4, tmp_path)
        return
    with pytest.raises(emu.EmulationError, match=message):
        emu.run(exe, entry, *args, tmp_path / "run")
