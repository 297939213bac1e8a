"""Timeline invariants of the engine: causality, chunking, rewind, snapshots, progress."""
from __future__ import annotations

import numpy as np
import pytest

from engine import ContextFull, Engine, Session, SnapshotError
from engine.model.kv_state import PosRing, frontier_start


@pytest.fixture(scope="module")
def eng(small_model):
    with Engine.open(small_model, numerics="ds4") as e:
        yield e


@pytest.fixture(scope="module")
def toks():
    # 300 tokens: 75 ratio-4 rows (indexer selecting 16 of them from position 67 on), 2 ratio-128 rows
    return np.random.default_rng(0).integers(0, 512, 300).tolist()


@pytest.fixture(scope="module")
def full(eng, toks):
    """The logits of one full prefill of `toks` (read-only: three tests compare with it)."""
    return Session(eng, 512).sync(toks, keep_logits=True)


@pytest.fixture(scope="module")
def blob250(eng, toks):
    """A session prefilled with toks[:250] and its snapshot, made once for the snapshot tests."""
    s = Session(eng, 512)
    s.sync(toks[:250])
    return s, s.snapshot()


def test_later_tokens_never_change_earlier_logits(eng, toks, full):
    a = full
    other = toks[:200] + list(np.random.default_rng(1).integers(0, 512, 100))
    b = Session(eng, 512).sync(other, keep_logits=True)
    assert np.abs(a[:200] - b[:200]).max() < 1e-4
    assert np.abs(a[200:] - b[200:]).max() > 0.1


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_equals_full_prefill_in_ds4_mode(eng, toks, full, chunk):
    """float64 accumulation makes a token's math independent of its batch, so even with ds4's
    activation rounding (where one ulp can flip a Q8 step) chunking changes nothing but noise."""
    got = Session(eng, 512, chunk=chunk).sync(toks, keep_logits=True)
    d = np.abs(full - got).max(axis=1)
    assert np.median(d) < 1e-4 and (full.argmax(1) == got.argmax(1)).all()


def test_snapshot_restore_continue_is_bit_exact(eng, toks, blob250):
    s, blob = blob250                     # the last user of the session: it goes on from 250
    tail = toks[250:266]   # crosses a ratio-4 boundary and the 256 ratio-128 boundary
    straight = np.array([s.eval(t).copy() for t in tail])
    r = Session(eng, 512)
    r.restore(blob)
    assert r.tokens == toks[:250] and r.pos == 250
    resumed = np.array([r.eval(t).copy() for t in tail])
    assert np.array_equal(straight, resumed)


def test_snapshot_is_canonical_and_sized_as_ds4(eng, toks, blob250):
    c = eng.config
    blob = blob250[1]
    r = Session(eng, 512)
    r.restore(blob)
    assert r.snapshot() == blob
    T, R = 250, min(c.n_swa, 512)
    size = 52 + 4 * T + 4 * c.n_vocab + 8 * c.n_layer + c.n_layer * R * 4 * c.head_dim
    for il in range(c.n_layer):
        ratio = c.ratio(il)
        if ratio == 4:
            size += 4 * c.head_dim * (T // 4) + 2 * 4 * 8 * 2 * c.head_dim
            size += 4 * c.idx_head_dim * (T // 4) + 2 * 4 * 8 * 2 * c.idx_head_dim
        elif ratio == 128:
            size += 4 * c.head_dim * (T // 128) + 2 * 4 * 128 * c.head_dim
    assert len(blob) == size
    assert np.frombuffer(blob[:52], "<u4").tolist()[:2] == [0x34565344, 1]


def test_bad_snapshots_are_rejected_and_lose_nothing(eng, toks):
    s = Session(eng, 512)
    s.sync(toks[:100])
    blob = s.snapshot()
    before = s.logits.copy()
    for bad, words in [(b"XXXX" + blob[4:], "not a DSV4"), (blob[:1000], "truncated"),
                       (blob + b"\0", "trailing"), (b"\1\2", "shorter than")]:
        with pytest.raises(SnapshotError, match=words):
            s.restore(bad)
        assert s.pos == 100 and np.array_equal(s.logits, before)
    small = Session(eng, 64)
    with pytest.raises(SnapshotError, match="context"):
        small.restore(blob)


def test_rewind_then_reeval_reproduces_bitwise(eng, toks):
    s = Session(eng, 512)
    s.sync(toks[:100])                                  # the indexer selects from position 67 on
    ref = np.array([s.eval(t).copy() for t in toks[100:130]])
    s.rewind(17)                                        # back across ratio-4 window ends
    assert s.pos == 113 and np.array_equal(s.logits, ref[12])
    again = np.array([s.eval(t).copy() for t in toks[113:130]])
    assert np.array_equal(again, ref[13:])


def test_sync_keeps_common_prefix_and_rebuilds_past_the_rewind_window(eng, toks):
    s = Session(eng, 512, rewind_cap=8)
    s.sync(toks[:200])
    calls = []
    s.sync(toks[:196] + toks[250:260], progress=lambda d, t: calls.append((d, t)))
    assert calls == [(10, 10)]                     # only the new suffix was prefilled
    ref = Session(eng, 512).sync(toks[:196] + toks[250:260], keep_logits=True)[-1]
    assert np.abs(s.logits - ref).max() < 1e-3
    s.sync(toks[:100])                              # 106 back: more than the rings hold -> rebuild
    assert s.tokens == toks[:100]
    ref = Session(eng, 512).sync(toks[:100], keep_logits=True)[-1]
    assert np.abs(s.logits - ref).max() < 1e-3


def test_progress_and_cancel_between_chunks(eng, toks):
    s = Session(eng, 512, chunk=64)
    seen = []

    def stop_after_two(done, total):
        seen.append((done, total))
        return len(seen) < 2
    assert s.sync(toks, progress=stop_after_two) is False
    assert seen == [(64, 300), (128, 300)] and s.pos == 128
    assert s.sync(toks) is True and s.pos == 300


def test_bad_tokens_and_full_context(eng):
    s = Session(eng, 32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.sync([1, 2, 99999])
    with pytest.raises(ContextFull):
        s.sync(list(range(32)))
    assert s.pos == 0
    s.sync(list(range(30)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.eval(-1)
    s.eval(5)
    with pytest.raises(ContextFull):
        s.eval(6)
    assert s.pos == 31


def test_kv_bytes_grow_with_ctx(eng):
    a, b = Session(eng, 256).kv_bytes(), Session(eng, 4096).kv_bytes()
    assert 0 < a < b


def test_frontier_start():
    assert frontier_start(0, 4) == 0 and frontier_start(9, 4) == 4 and frontier_start(3, 4) == 0
    assert frontier_start(300, 128) == 256


@pytest.mark.parametrize("mirror", [0, 3, 7])
def test_pos_ring_reads_and_writes_by_position(mirror):
    """The ring against a plain position-indexed model: writes that wrap, that exceed the ring
    (only the newest cap rows survive), reads that wrap; read returns a copy, window a read-only
    view wherever the rows lie in one slice (always, for mirror + 1 rows or fewer), and
    write_window the window with the written rows at its end."""
    rng = np.random.default_rng(mirror)
    cap, width = 7, 3
    ring, model, pos = PosRing(cap, width, mirror=mirror), {}, 0
    views = 0
    for _ in range(300):
        n = int(rng.integers(1, 2 * cap + 2))
        rows = rng.standard_normal((n, width)).astype(np.float32)
        lo = int(rng.integers(max(0, pos - cap), pos + 1)) if rng.random() < 0.5 else None
        if lo is not None:
            got = ring.write_window(lo, pos, rows)
        else:
            ring.write(pos, rows)
        model.update({pos + i: rows[i] for i in range(n)})
        pos += n
        if lo is not None:
            want = np.array([model[p] for p in range(lo, pos)], np.float32).reshape(-1, width)
            assert np.array_equal(got, want), (lo, pos)
        lo = int(rng.integers(max(0, pos - cap), pos + 1))
        want = np.array([model[p] for p in range(lo, pos)], np.float32).reshape(-1, width)
        got = ring.read(lo, pos)
        assert np.array_equal(got, want), (lo, pos)
        win = ring.window(lo, pos)
        assert np.array_equal(win, want), (lo, pos)
        if len(got):
            got[:] = 0                        # a copy: the ring keeps its rows
            assert np.array_equal(ring.read(lo, pos), want)
        if np.shares_memory(win, ring.rows):
            views += 1
            assert not win.flags.writeable
        elif 0 < pos - lo <= mirror + 1:
            raise AssertionError(f"{pos - lo} rows with mirror {mirror} were copied")
    assert views > (100 if mirror == 7 else 0)
    with pytest.raises(RuntimeError):
        ring.read(pos - cap - 1, pos)
