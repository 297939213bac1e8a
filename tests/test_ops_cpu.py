"""The `cpu` backend (C kernels for every weight matmul) against the NumPy reference and against
ds4 itself. The kernels accumulate in float32 (the reference in float64), so in exact numerics the
two agree to float32 rounding; in ds4 numerics a rounding difference can move an activation across
a Q8 step and routing near-ties amplify it, so there the referee is ds4's own logits, judged by the
same distribution thresholds as the reference (tests/test_engine_oracle.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine import Engine, Session
from engine.backends.cpu import kernels
from engine.gguf import quants as Q
from engine.backends.numpy.ops import NumpyOps

from conftest import ORACLE, need_shared
from test_engine_oracle import stats

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="engine.backends.cpu._kernels is not built (no C compiler at install)")


def _logits(path, backend, numerics, toks, *, decode=False):
    with Engine.open(path, backend=backend, numerics=numerics) as e:
        s = Session(e, len(toks) + 8)
        if decode:
            return np.array([s.eval(t).copy() for t in toks])
        return s.sync(toks, keep_logits=True)


@needs_kernels
def test_exact_mode_equals_reference_to_rounding(small_model):
    toks = list(range(5, 205))
    ref = _logits(small_model, "numpy", "exact", toks)
    got = _logits(small_model, "cpu", "exact", toks)
    err = np.abs(got - ref).max()
    rel = err / np.abs(ref).max()
    print(f"cpu vs numpy, exact numerics, 200-token prefill: max-abs {err:.3g}, relative {rel:.3g}")
    assert rel < 2e-5, (err, rel)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@needs_kernels
def test_exact_mode_decode_equals_prefill(small_model):
    toks = list(range(7, 71))
    pre = _logits(small_model, "cpu", "exact", toks)
    dec = _logits(small_model, "cpu", "exact", toks, decode=True)
    rel = np.abs(pre - dec).max() / np.abs(pre).max()
    assert rel < 2e-5, rel


@needs_kernels
def test_ds4_mode_matches_ds4_as_well_as_the_reference():
    d = ORACLE
    need_shared(d / "ds4_logits.npz")
    toks = json.loads((d / "tokens.json").read_text())["token_ids"]
    ds4 = np.load(d / "ds4_logits.npz")
    path = next(iter(sorted(d.glob("*.gguf"))))
    ours = _logits(path, "cpu", "ds4", toks, decode=True)
    st = stats(ours, ds4["decode_logits_all"])
    print("cpu backend, ds4 mode, token-by-token decode vs ds4:", st)
    assert st["median"] <= 0.2 and st["p90"] <= 0.5 and st["top1"] >= 0.85 and st["kl"] <= 0.02, st


def test_cpu_backend_without_kernels_is_a_clear_error(small_model, monkeypatch):
    monkeypatch.setattr(kernels, "_K", None)
    with pytest.raises(ValueError, match="C kernels"):
        Engine.open(small_model, backend="cpu")


def test_paging_modes(small_model):
    for mode in ("resident", "prefault", "lowmem", "none"):
        with Engine.open(small_model, paging=mode) as e:
            assert e.paging in ({mode} if mode != "prefault" else {"prefault", "willneed"})
            assert Session(e, 64).sync([1, 2, 3])
            assert (e.resident_seconds is not None) == (mode == "resident")
    with pytest.raises(ValueError, match="paging"):
        Engine.open(small_model, paging="sometimes")


def test_resident_copy_is_the_file_and_changes_no_result(small_model):
    """resident: every weight view points into one private copy of the file (not into the map),
    byte for byte the file's, and the logits are bit-identical to the mapped run's."""
    toks = list(range(3, 40))
    with Engine.open(small_model, paging="none", backend="numpy") as e:
        ref = Session(e, 64).sync(toks, keep_logits=True)
        mapped = e.file.gguf.tensor_bytes("output.weight").copy()
    with Engine.open(small_model, paging="resident", backend="numpy") as e:
        g = e.file.gguf
        assert g.resident and e.paging == "resident" and e.resident_seconds >= 0
        out = e.model.w.output.data
        map_view = np.frombuffer(g._mm, dtype=np.uint8)
        assert not np.shares_memory(out, map_view)
        assert np.array_equal(out.reshape(-1), mapped) and not out.flags.writeable
        assert np.array_equal(np.asarray(g._resident), np.fromfile(small_model, dtype=np.uint8))
        got = Session(e, 64).sync(toks, keep_logits=True)
        e.model.pager = None
        g.willneed([out])                 # no map to advise: ignored
    assert np.array_equal(got, ref)


def test_resident_copy_dropping_the_page_cache_is_the_same_copy(small_model):
    from engine.gguf.gguf_file import GGUFFile
    with GGUFFile(small_model) as a, GGUFFile(small_model) as b:
        a.load_resident(threads=1)
        b.load_resident(threads=3, drop_cache=True)
        assert np.array_equal(np.asarray(a._resident), np.asarray(b._resident))
        assert np.array_equal(a.tensor_bytes("output.weight"), b.tensor_bytes("output.weight"))


def test_resident_copy_of_a_file_cut_short_after_open(small_model, tmp_path):
    import shutil

    from engine.errors import ModelFileError
    from engine.gguf.gguf_file import GGUFFile
    p = tmp_path / "cut.gguf"
    shutil.copy(small_model, p)
    g = GGUFFile(p)
    try:
        with open(p, "r+b") as f:
            f.truncate(g.size // 2)
        with pytest.raises(ModelFileError, match="truncated"):
            g.load_resident(threads=2)
        assert not g.resident
    finally:
        g.close()


def test_auto_paging_by_size_and_backend(small_model, monkeypatch):
    from engine.runtime import session as S
    monkeypatch.delenv("DS4_PAGING", raising=False)
    monkeypatch.setattr(S, "mem_available", lambda: 1 << 40)
    with Engine.open(small_model, backend="numpy") as e:
        assert e.paging in ("prefault", "willneed")          # the reference: the map
    if kernels.available():
        monkeypatch.setattr(S, "_thp_available", lambda: True)
        with Engine.open(small_model, backend="cpu") as e:
            assert e.paging == "resident" and e.file.gguf.resident
        monkeypatch.setattr(S, "_thp_available", lambda: False)    # no huge pages: the map
        with Engine.open(small_model, backend="cpu") as e:
            assert e.paging in ("prefault", "willneed") and not e.file.gguf.resident
    monkeypatch.setattr(S, "mem_available", lambda: 1024)
    with Engine.open(small_model, backend="numpy") as e:
        assert e.paging == "lowmem" and not e.file.gguf.resident
    with pytest.raises(ValueError, match="resident.*available"):    # asked for, without the memory
        Engine.open(small_model, backend="numpy", paging="resident")


def test_lowmem_paging_hints(small_model):
    """lowmem mode asks the kernel to read ahead what each layer is about to use (its dense
    matrices one layer ahead, the head, the experts routing picked) and changes no result."""
    toks = [1, 2, 3, 4]
    with Engine.open(small_model, paging="none", backend="numpy") as e:
        assert e.model.pager is None
        ref = Session(e, 64).sync(toks, keep_logits=True)
    with Engine.open(small_model, paging="lowmem", backend="numpy") as e:
        real, calls = e.model.pager, []
        assert real is not None

        def spy(arrays):
            calls.append(arrays)
            real(arrays)

        e.model.pager = spy
        got = Session(e, 64).sync(toks, keep_logits=True)
        n_layer = len(e.model.w.layers)
        real([np.zeros(64, np.uint8), np.zeros(0, np.uint8)])      # not views of the map: ignored
        lw0 = e.model.w.layers[0]
        sizes = {t.expert(0).data.nbytes for t in (lw0.gate_exps, lw0.up_exps, lw0.down_exps)}
        assert calls[2] and all(a.nbytes in sizes for a in calls[2])       # layer 0's picked experts
    assert np.array_equal(ref, got)
    # dense of layer 0 before the loop, then one layer ahead (the head last), plus each layer's experts
    assert len(calls) == 2 * n_layer + 1
    assert all(len(c) > 0 for c in calls)
    head = e.model.w.output.data
    assert any(a.ctypes.data == head.ctypes.data for c in calls for a in c)


@needs_kernels
def test_ds4_mode_prefill_paths_agree_with_reference(small_model):
    """ds4 numerics, a 200-token prefill: the routed experts through the batched integer row
    kernels and through the integer GEMM form (where this machine has it) land on the reference
    (a rounding difference can cross a Q8 step and routing amplifies it, so the bounds are the
    statistical ones the reference meets against ds4 itself), and on each other bit for bit: both
    sum exact integer dots in float64 and round once, the same function."""
    from engine.backends.cpu import kernels as K
    C = K._K
    toks = list(range(11, 211))
    ref = _logits(small_model, "numpy", "ds4", toks)
    types = (Q.Q8_0, Q.IQ2_XXS, Q.Q2_K)
    prev = {t: C.q8_gemm_min_t(t) for t in types}
    paths = {"batched row kernels": 10**6}
    if any(prev.values()):
        paths["batched GEMM"] = 1
    got = {}
    try:
        for name, gemm_min in paths.items():
            for t in types:
                C.q8_gemm_min_t(t, gemm_min)
            got[name] = _logits(small_model, "cpu", "ds4", toks)
    finally:
        for t in types:
            C.q8_gemm_min_t(t, 0)
    for name, lg in got.items():
        st = stats(lg, ref)
        print(f"{name}: vs the NumPy reference {st}")
        # (p90 left out: one routing flip moves a token's logits a lot, and it moved 0.29-0.67 with
        # legitimate rounding changes; the median, top-1 and KL are what a wrong path moves)
        assert st["median"] <= 0.2 and st["top1"] >= 0.85 and st["kl"] <= 0.02, (name, st)
    names = list(got)
    for b in names[1:]:
        assert np.array_equal(got[names[0]], got[b]), (names[0], b)


def test_cpu_backend_keeps_freed_memory():
    """The cpu backend has glibc keep freed memory in the heap, so a large array allocated again
    after a free reuses resident pages instead of faulting in (and zeroing) fresh ones: by default
    every array over 32 MiB is a new mapping, returned to the kernel when freed (its RSS drops)."""
    import os
    from engine.backends.host import keep_freed_memory as _keep_freed_memory
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc/self/statm (Linux) to see resident memory")
    if not _keep_freed_memory():
        pytest.skip("no glibc mallopt in this process (another C library)")
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    n = 48 << 20
    a = np.empty(n, np.uint8)
    a[:] = 1                                          # every page resident
    before = rss()
    del a
    dropped = before - rss()
    assert dropped < n // 2, dropped                  # kept: a new mapping would drop by 48 MiB


@needs_kernels
def test_moe_in_one_region_equals_routed_plus_shared(small_model):
    """ds4 mode: the shared expert's matrices join the routed experts' two batched calls; each
    product is computed as alone, so the sum is bit for bit routed + shared as separate calls."""
    with Engine.open(small_model, backend="cpu", numerics="ds4") as e:
        ops, c = e.model.ops, e.config
        lw = next(lw for lw in e.model.w.layers if lw.tid2eid is None)
        if not (lw.sh_gate.type_id == Q.Q8_0 and ops._batched_experts(lw)):
            pytest.skip("the small model's shared expert is not Q8_0 / its experts have no integer kernel")
        rng = np.random.default_rng(0)
        limit = np.float32(c.swiglu_clamp[lw.il])
        for T in (1, 3, 40):
            u = rng.standard_normal((T, c.n_embd)).astype(np.float32)
            sel = np.stack([rng.choice(c.n_expert, c.n_expert_used, replace=False) for _ in range(T)])
            wsel = rng.random(sel.shape).astype(np.float32)
            got = ops.moe(lw, u, sel, wsel, limit)
            want = ops.routed(lw, u, sel, wsel, limit) + ops.shared_expert(lw, u, limit)
            assert np.array_equal(got, want), T
            # and the reference's function: the same Q8 roundings (a rounding difference may flip
            # an activation's Q8 step: a few elements move by about one step's worth)
            ref = NumpyOps("ds4").moe(lw, u, sel, wsel, limit)
            rel = np.abs(got - ref) / np.max(np.abs(ref))
            print(f"T={T}: max rel {rel.max():.2e}, median {np.median(rel):.2e}")
            assert np.median(rel) < 1e-6 and rel.max() < 2e-2, T


@needs_kernels
def test_batch_invariant_mode_makes_chunked_prefill_bit_identical(small_model):
    """With kernels.set_batch_invariant(True), a token's logits on the cpu backend in ds4 numerics
    do not depend on how the prompt was chunked, bit for bit: every op sums a token's values in
    one order whatever T (the integer row kernels at every T, no GEMM form; the indexer's picks
    attended in row order, as every visible row is when the indexer is skipped). Off, chunking
    moves logits by ds4-rounding noise (a Q8 step crossed, a routing flip)."""
    toks = np.random.default_rng(0).integers(0, 512, 300).tolist()   # the indexer picks from 67 on
    prev = kernels.set_batch_invariant(True)
    try:
        with Engine.open(small_model, backend="cpu", numerics="ds4") as e:
            full = Session(e, 512).sync(toks, keep_logits=True)
            for chunk in (7, 64):
                got = Session(e, 512, chunk=chunk).sync(toks, keep_logits=True)
                assert np.array_equal(got, full), (chunk, float(np.abs(got - full).max()))
            one = Session(e, 512)
            dec = np.array([one.eval(t).copy() for t in toks[:80]])          # decode = chunks of one
            assert np.array_equal(dec, full[:80])
    finally:
        kernels.set_batch_invariant(prev)
