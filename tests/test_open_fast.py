"""Opening does not wait for paging: the resident copy and the prefault run in background threads.

The weights are served from the map until the copy holds their bytes, then switched to the copy
(engine/gguf/paging.py). These tests pin the contract, not a time: the switch happens, logits are
bit-identical before, during and after it (with switches landing between and during the C
kernels' calls), close() in the middle of a copy ends it cleanly, a copy that fails leaves the
rest of the weights on the map, and the prefault populates the map from its thread.

The small test model is below paging.SYNC_BYTES (it would be copied at open), so each test lowers
the threshold and the piece and group sizes (64 KiB: ~150 pieces, ~150 switches).
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import gc
import os
import sys
import threading
import time

import numpy as np
import pytest

from engine import Engine, Session
from engine.backends.cpu import kernels
from engine.gguf import paging
from engine.gguf.gguf_file import GGUFFile
from engine.gguf.model_file import QTensor

TOKS = list(range(3, 40))
BACKENDS = ["numpy", pytest.param("cpu", marks=pytest.mark.skipif(
    not kernels.available(), reason="the cpu backend's C kernels are not built"))]


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(paging, "SYNC_BYTES", 0)
    monkeypatch.setattr(paging, "PIECE", 64 << 10)
    monkeypatch.setattr(paging, "GROUP", 64 << 10)


@functools.lru_cache(maxsize=4)
def _reference(path, backend):
    """The logits of TOKS with every weight on the map (no copy), read-only."""
    with Engine.open(path, paging="none", backend=backend) as e:
        out = Session(e, 64).sync(TOKS, keep_logits=True)
    out.flags.writeable = False
    return out


def _qtensors(obj) -> list[QTensor]:
    out = []
    for v in (obj if isinstance(obj, list) else [getattr(obj, f.name) for f in dataclasses.fields(obj)]):
        if isinstance(v, QTensor):
            out.append(v)
        elif isinstance(v, list) or dataclasses.is_dataclass(v):
            out += _qtensors(v)
    return out


def _where(e: Engine) -> tuple[int, int]:
    """How many weights point into the map and how many into the copy (every one is in one)."""
    g = e.file.gguf
    m0, c0 = g._map_address(), g._copy.array.ctypes.data
    on_map = on_copy = 0
    for qt in _qtensors(e.model.w):
        a = qt.data.ctypes.data
        if m0 <= a < m0 + g.size:
            on_map += 1
        else:
            assert c0 <= a < c0 + g.size, qt.name
            assert np.array_equal(qt.data.reshape(-1), g._copy.array[a - c0:a - c0 + qt.data.nbytes])
            on_copy += 1
    return on_map, on_copy


def _map_rss(g: GGUFFile) -> int:
    """Bytes of the map this process has paged in (/proc/self/smaps)."""
    start, rss, inside = f"{g._map_address():x}-", 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.startswith(start)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return rss


class _Gate:
    """Replaces ResidentCopy._read: each piece waits for one permit, or for stop() (then it
    reads, as a piece under way does), or 10 s (so a broken test cannot hang), then reads;
    `fail_at` raises an I/O error at that piece instead."""

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.permits, self.pieces, self.fail_at = threading.Semaphore(0), 0, fail_at
        real = paging.ResidentCopy._read

        def read(copy, lo, hi):
            for _ in range(1000):
                if self.permits.acquire(timeout=0.01) or copy._stop.is_set():
                    break
            self.pieces += 1
            if self.pieces == self.fail_at:
                raise OSError(errno.EIO, "Input/output error (injected)")
            real(copy, lo, hi)
        monkeypatch.setattr(paging.ResidentCopy, "_read", read)

    def allow(self, n: int) -> None:
        for _ in range(n):
            self.permits.release()


@pytest.mark.parametrize("backend", BACKENDS)
def test_open_serves_from_the_map_and_switches_each_weight_when_copied(small_model, small_pieces,
                                                                       monkeypatch, backend):
    ref = _reference(small_model, backend)
    gate = _Gate(monkeypatch)
    with Engine.open(small_model, paging="resident", backend=backend) as e:
        g = e.file.gguf
        n_pieces = len(g._copy._pieces)
        assert n_pieces > 50
        # before: nothing copied, every weight on the map, open did not wait
        assert e.paging == "resident" and not g.resident and e.resident_seconds is None
        assert _where(e)[1] == 0
        before = Session(e, 64).sync(TOKS, keep_logits=True)
        touched = _map_rss(g)
        # during: half the pieces in, weights on both
        gate.allow(n_pieces // 2)
        while gate.pieces < n_pieces // 2:
            g._copy.wait(0.01)
        g._copy.wait(0.2)               # (the last group's switch runs after its read)
        on_map, on_copy = _where(e)
        assert on_map > 0 and on_copy > 0, (on_map, on_copy)
        during = Session(e, 64).sync(TOKS, keep_logits=True)
        # after: every weight in the copy, the map's pages let go
        gate.allow(n_pieces)
        assert e.wait_resident() and g.resident and e.resident_seconds >= 0
        assert _where(e) == (0, on_map + on_copy)
        assert np.array_equal(g._copy.array, np.fromfile(small_model, dtype=np.uint8))
        released = _map_rss(g)
        after = Session(e, 64).sync(TOKS, keep_logits=True)
    print(f"{backend}: {n_pieces} pieces; map RSS {touched:,} B after a pass on it, {released:,} B once copied")
    assert touched > g.size // 4 and released < g.size // 20
    for got in (before, during, after):
        assert np.array_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_switches_during_the_forward_pass_change_no_logit(small_model, small_pieces, monkeypatch, backend):
    """The copy advances one piece per weight matmul, from its own thread: switches land between
    the ops' calls and during them (the C kernels run without the GIL), over several decode steps
    (16 KiB pieces: ~600 of them, about 150 matmuls a step)."""
    monkeypatch.setattr(paging, "PIECE", 16 << 10)
    monkeypatch.setattr(paging, "GROUP", 16 << 10)
    monkeypatch.setattr(paging, "NICE", 0)      # (the pacing, not the scheduler, decides when)
    toks = list(range(3, 23))
    ref_steps = []
    with Engine.open(small_model, paging="none", backend=backend) as e:
        s = Session(e, 64)
        for t in toks:
            ref_steps.append(s.eval(t).copy())
    gate = _Gate(monkeypatch)
    with Engine.open(small_model, paging="resident", backend=backend) as e:
        g = e.file.gguf
        ops = e.model.ops
        for name in ("linear", "linears"):
            real = getattr(ops, name)

            def paced(*a, _real=real, **k):
                # one piece per call, and the call starts once the worker has taken it: the
                # piece's read and its switch run while this call computes
                n = gate.pieces
                gate.allow(1)
                for _ in range(2000):
                    if gate.pieces > n or g._copy._done.is_set():
                        break
                    time.sleep(0.0005)
                return _real(*a, **k)
            setattr(ops, name, paced)
        s = Session(e, 64)
        ready = []
        for t, want in zip(toks, ref_steps):
            assert np.array_equal(s.eval(t), want)
            ready.append(len(g._copy.ready))
        gate.allow(len(g._copy._pieces))
        assert e.wait_resident()
    assert 0 < ready[0] < ready[-1] <= len(g.tensors), ready        # switches in the first step and later
    assert len(set(ready)) >= 3, ready        # the switches were spread over the steps


def test_close_during_the_copy_ends_it_cleanly(small_model, small_pieces, monkeypatch):
    gc.collect()                        # (maps of earlier tests, unreferenced but not yet freed)
    fds = len(os.listdir("/proc/self/fd"))
    gate = _Gate(monkeypatch)
    e = Engine.open(small_model, paging="resident", backend="numpy")
    copy = e.file.gguf._copy
    gate.allow(10)
    Session(e, 64).sync(TOKS[:5])
    e.close()                           # the worker waits for its 11th piece: stop() lets it end
    assert not any(t.is_alive() for t in copy._threads)
    assert copy.error is None and not copy.complete and copy._done.is_set()
    assert copy._next == 11 < len(copy._pieces)
    del e
    gc.collect()                        # (the map's own descriptor goes with its last view)
    assert len(os.listdir("/proc/self/fd")) == fds        # the copy's descriptor too


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_copy_leaves_the_rest_on_the_map(small_model, small_pieces, monkeypatch, backend):
    ref = _reference(small_model, backend)
    gate = _Gate(monkeypatch, fail_at=60)
    with Engine.open(small_model, paging="resident", backend=backend) as e:
        gate.allow(1 << 20)
        assert not e.wait_resident()
        g = e.file.gguf
        assert not g.resident and e.resident_seconds is None
        assert "cannot read" in str(g.resident_error) and "injected" in str(g.resident_error)
        on_map, on_copy = _where(e)
        assert on_map > 0 and on_copy > 0, (on_map, on_copy)
        assert np.array_equal(Session(e, 64).sync(TOKS, keep_logits=True), ref)


def test_resident_copy_of_a_file_cut_short_in_the_background(small_model, small_pieces, tmp_path):
    import shutil
    p = tmp_path / "cut.gguf"
    shutil.copy(small_model, p)
    with GGUFFile(p) as g:
        with open(p, "r+b") as f:
            f.truncate(g.size // 2)
        g.start_resident(threads=2)
        assert not g.wait_resident()
        assert "truncated" in str(g.resident_error)
        ready = [n for n in g.tensors if g.tensor_ready(n)]
        assert ready and all(g.tensors[n].offset + g.tensors[n].nbytes <= g.size // 2 for n in ready)


@pytest.mark.parametrize("threads", [1, 3])
def test_background_copy_is_the_file(small_model, small_pieces, threads):
    with GGUFFile(small_model) as g:
        seen = []
        g.start_resident(threads=threads, on_ready=seen.extend)
        assert g.wait_resident()
        assert sorted(seen) == sorted(g.tensors)       # each tensor reported once
        assert np.array_equal(g._resident, np.fromfile(small_model, dtype=np.uint8))
        assert all(g.tensor_ready(n) for n in g.tensors)


def test_prefault_populates_the_map_from_a_thread(small_model, monkeypatch):
    monkeypatch.setattr(paging.Populate, "CHUNK", 64 << 10)
    with GGUFFile(small_model) as g:
        cold = _map_rss(g)
        how = g.advise("prefault")
        if how == "willneed":
            pytest.skip("this kernel has no MADV_POPULATE_READ")
        pop = g._populate
        assert how == "prefault" and pop._thread is not None
        assert pop.wait(30) and pop.error is None
        warm = _map_rss(g)
    assert not pop.running
    print(f"map RSS {cold:,} B at open, {warm:,} B after the prefault ({g.size:,} B file)")
    assert cold < g.size // 4 and warm >= g.size - 4096


def test_close_during_the_prefault_stops_it(small_model, monkeypatch):
    monkeypatch.setattr(paging.Populate, "CHUNK", 4096)     # ~2,400 calls: still running at close
    g = GGUFFile(small_model)
    if g.advise("prefault") == "willneed":
        g.close()
        pytest.skip("this kernel has no MADV_POPULATE_READ")
    pop = g._populate
    g.close()
    assert not pop.running and pop.error is None


@pytest.mark.parametrize("mode", ["resident", "prefault", "lowmem", "none"])
def test_every_paging_mode_gives_the_same_logits(small_model, small_pieces, mode):
    backend = "cpu" if kernels.available() else "numpy"
    ref = _reference(small_model, backend)
    with Engine.open(small_model, paging=mode, backend=backend) as e:
        got = Session(e, 64).sync(TOKS, keep_logits=True)
        assert e.wait_resident() == (mode == "resident")
        again = Session(e, 64).sync(TOKS, keep_logits=True)
    assert np.array_equal(got, ref) and np.array_equal(again, ref)


def test_a_file_below_the_threshold_is_copied_before_open_returns(small_model):
    assert os.path.getsize(small_model) < paging.SYNC_BYTES
    with Engine.open(small_model, paging="resident", backend="numpy") as e:
        g = e.file.gguf
        assert g.resident and e.resident_seconds >= 0
        assert _where(e)[0] == 0                # the weights bound before the copy were switched
        assert np.array_equal(Session(e, 64).sync(TOKS, keep_logits=True), _reference(small_model, "numpy"))


def test_a_copy_that_cannot_start_is_an_error_and_leaves_the_map(small_model, small_pieces, tmp_path):
    import shutil

    from engine.errors import ModelFileError
    p = tmp_path / "gone.gguf"
    shutil.copy(small_model, p)
    with GGUFFile(p) as g, GGUFFile(small_model) as ref:
        p.unlink()                      # the map stays valid; a new descriptor cannot be had
        with pytest.raises(ModelFileError, match="cannot read"):
            g.start_resident()
        assert g._copy is None and not g.wait_resident()
        assert np.array_equal(g.tensor_bytes("output.weight"), ref.tensor_bytes("output.weight"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_background_threads_run_at_a_low_priority(small_model, small_pieces, monkeypatch):
    """The copy and the prefault take a core only when the compute threads leave it idle."""
    seen = []

    def spy(real):
        def f(self, *a):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return real(self, *a)
        return f
    monkeypatch.setattr(paging.ResidentCopy, "_read", spy(paging.ResidentCopy._read))
    monkeypatch.setattr(paging.Populate, "_chunk", spy(paging.Populate._chunk))
    with GGUFFile(small_model) as g:
        g.start_resident()
        assert g.wait_resident()
    with GGUFFile(small_model) as g:
        if g.advise("prefault") == "prefault":
            g._populate.wait(30)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and mine < paging.NICE and set(seen) <= {paging.NICE, mine}
    assert seen.count(paging.NICE) >= len(seen) - 1     # all but the prefault's probe, made by open
