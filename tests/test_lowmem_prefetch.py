"""lowmem paging's read-ahead (engine/gguf/prefetch.py): the byte ranges it asks for, the thread
that asks, the per-step expert advice, and that none of it changes a token."""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest

from engine.backends.cpu import kernels
from engine.gguf import prefetch as P
from engine.gguf.gguf_file import GGUFFile
from engine.runtime.session import Engine, Session
from helpers_decode import greedy

PAGE = mmap.PAGESIZE


# -- ranges -------------------------------------------------------------------------------------
def test_page_ranges_align_sort_and_merge():
    spans = [(3 * PAGE + 10, 5), (100, 50), (PAGE - 1, 2), (10 * PAGE, 0), (5 * PAGE, PAGE)]
    # 100..150 and PAGE-1..PAGE+1 share page 0/1 -> [0, 2 PAGE); 3 PAGE+10 -> [3 PAGE, 4 PAGE);
    # 5 PAGE..6 PAGE is exact; the empty span is dropped
    assert P.page_ranges(spans) == [(0, 2 * PAGE), (3 * PAGE, 4 * PAGE), (5 * PAGE, 6 * PAGE)]
    assert P.page_ranges([(0, PAGE), (PAGE, PAGE)]) == [(0, 2 * PAGE)]       # touching: one range
    assert P.page_ranges([(0, 10 * PAGE), (PAGE, 1)]) == [(0, 10 * PAGE)]    # inside: absorbed
    assert P.page_ranges([]) == []


def test_pieces_stay_under_the_cap():
    got = P.pieces([(0, 10), (100, 125)], 8)
    assert got == [(0, 8), (8, 2), (100, 8), (108, 8), (116, 8), (124, 1)]
    cap = P.willneed_cap(os.open(__file__, os.O_RDONLY))
    assert cap >= PAGE and cap % PAGE == 0


def test_expert_slices_become_merged_page_ranges(tiny_q2):
    """Experts 5, 1, 2, 3 of the three expert tensors: each slice is covered, adjacent experts
    merge into one range, ranges are page-aligned, sorted and disjoint, and they waste less than
    a page at either end of a range."""
    with GGUFFile(tiny_q2) as g:
        ts = [g.tensors[f"blk.0.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")]
        spans = []
        for t in ts:
            per = t.nbytes // t.dims[2]
            spans += [(t.offset + e * per, per) for e in (5, 1, 2, 3)]
        got = P.page_ranges(spans)
        for lo, hi in got:
            assert lo % PAGE == 0 and hi % PAGE == 0 and lo < hi
        assert all(a[1] < b[0] for a, b in zip(got, got[1:]))                 # sorted, not touching
        for off, n in spans:
            assert any(lo <= off and off + n <= hi for lo, hi in got)
        assert sum(hi - lo for lo, hi in got) < sum(n for _, n in spans) + 2 * PAGE * len(got)
        # experts 1-3 of one tensor are contiguous bytes: never more than 2 ranges per tensor
        assert len(got) <= 2 * len(ts)
        # the same through GGUFFile._spans from the views the forward pass hands over
        whole = np.frombuffer(g._mm, dtype=np.uint8)
        assert list(g._spans([whole[off:off + n] for off, n in spans])) == spans
        del whole
        assert list(g._spans([np.zeros(8, np.uint8)])) == []                  # not the map's


# -- the thread ----------------------------------------------------------------------------------
def test_prefetcher_issues_pieces_in_order(tiny_q2):
    p = P.Prefetcher(str(tiny_q2), cap=2 * PAGE)
    try:
        p.trace = []
        ranges = [(0, 5 * PAGE), (8 * PAGE, 9 * PAGE)]
        p.submit(ranges)
        assert p.wait(10)
        assert p.trace == P.pieces(ranges, 2 * PAGE)
        assert p.issued == 6 * PAGE and p.skipped == 0
        p.trace = []
        p.issue([(PAGE, 4 * PAGE)])                 # in this thread: done when it returns
        assert p.trace == [(PAGE, 2 * PAGE), (3 * PAGE, PAGE)] and p.issued == 9 * PAGE
    finally:
        p.close()
    p.submit([(0, PAGE)])          # after close: ignored, not an error


def test_prefetcher_drops_what_an_earlier_step_left_queued(tiny_q2, monkeypatch):
    """The thread is held inside its first call; a new step begins; the rest of that request and
    a second request of the old step are skipped, a request of the new step is issued."""
    entered, release = threading.Event(), threading.Event()
    real = os.posix_fadvise

    def slow(fd, off, n, advice):
        if not entered.is_set():
            entered.set()
            release.wait(10)
        return real(fd, off, n, advice)

    monkeypatch.setattr(P.os, "posix_fadvise", slow)
    p = P.Prefetcher(str(tiny_q2), cap=PAGE)
    try:
        p.trace = []
        p.submit([(0, 4 * PAGE)])
        p.submit([(10 * PAGE, 12 * PAGE)])
        assert entered.wait(10)
        p.begin_step()
        p.submit([(20 * PAGE, 21 * PAGE)])
        release.set()
        assert p.wait(10)
        assert p.trace == [(0, PAGE), (20 * PAGE, PAGE)]
        assert p.skipped == 5 * PAGE
    finally:
        release.set()
        p.close()


# -- the engine ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_lowmem_with_prefetch_gives_the_resident_tokens(small_model, backend):
    """Greedy tokens and the last logits of lowmem (prefetch thread, per-step expert advice) are
    the resident run's, bit for bit; the hash layers' experts of each decode step are asked for,
    and the experts are MADV_RANDOM during decode, MADV_NORMAL during a long prefill."""
    if backend == "cpu" and not kernels.available():
        pytest.skip("the C kernels are not built")
    toks = list(range(3, 3 + P.EXPERT_HINT_TOKENS + 2))        # a long chunk first
    with Engine.open(small_model, backend=backend, paging="resident") as e:
        ref = greedy(e, toks, 3)
    with Engine.open(small_model, backend=backend, paging="lowmem") as e:
        g = e.file.gguf
        assert e.paging == "lowmem" and g.prefetcher is not None
        assert any(lw.tid2eid is not None for lw in e.model.w.layers)
        s = Session(e, 64)
        s.sync(toks)
        assert g._experts[1] == mmap.MADV_NORMAL                   # the long chunk: read-around
        out = []
        for step in range(3):
            t = int(np.argmax(s.logits))
            assert g.prefetcher.wait(10)
            g.prefetcher.trace = []
            s.eval(t)
            out.append(t)
            assert g._experts[1] == mmap.MADV_RANDOM               # decode: every expert asked for
            assert g.prefetcher.wait(10)
            issued = P.page_ranges(g.prefetcher.trace)
            for lw in e.model.w.layers:
                if lw.tid2eid is None:
                    continue
                for ex in np.unique(lw.tid2eid[[t]]):
                    for w in (lw.gate_exps, lw.up_exps, lw.down_exps):
                        (off, n), = g._spans([w.expert_data(int(ex))])
                        assert any(lo <= off and off + n <= hi for lo, hi in issued), (lw.il, ex)
        logits = np.array(s.logits, copy=True)
    assert out == ref[0]
    assert np.array_equal(logits, ref[1])


def test_lowmem_engine_closes_its_thread(small_model):
    e = Engine.open(small_model, backend="numpy", paging="lowmem")
    p = e.file.gguf.prefetcher
    e.close()
    assert p._closed and not p._thread.is_alive()


# -- threads -------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity mask on this platform")
def test_default_threads_are_the_cpus_this_process_may_use(monkeypatch):
    """The decision of issue 22: the cpu backend's default thread count is the CPUs in this
    process's affinity mask (taskset, cgroup cpusets), not the machine's CPUs or physical cores;
    DS4_KERNEL_THREADS overrides it."""
    monkeypatch.delenv("DS4_KERNEL_THREADS", raising=False)
    monkeypatch.setattr(kernels.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    monkeypatch.setattr(kernels.os, "cpu_count", lambda: 64)
    assert kernels._default_threads() == 3
    monkeypatch.setenv("DS4_KERNEL_THREADS", "7")
    assert kernels._default_threads() == 7
    monkeypatch.setenv("DS4_KERNEL_THREADS", "lots")
    assert kernels._default_threads() == 3
