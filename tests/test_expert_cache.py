"""The routed experts' bounded cache (engine/gguf/expert_cache.py, expert_reader.py): tokens equal
the resident run's at any budget, eviction policies on a routing trace, read errors and short
reads end a step with one ModelFileError, and the cache serves again afterwards."""
from __future__ import annotations

import errno
import os
import shutil
import time

import numpy as np
import pytest

from engine.backends.cpu import kernels
from engine.errors import ModelFileError
from engine.gguf import expert_cache as X
from engine.gguf.expert_reader import ALIGN, ExpertReader, Span, direct_read_speed
from engine.options import EngineOptions
from engine.runtime.session import Engine, Session
from helpers_decode import greedy

PROMPT = list(range(3, 15))


def _greedy(e, n=3, toks=PROMPT):
    return greedy(e, toks, n)


def _open(path, backend, cache):
    # mlx: its default paging (it binds the other weights into its own memory; no second copy)
    paging = "auto" if backend == "mlx" else "resident"
    return Engine.open(path, EngineOptions(backend=backend, paging=paging, expert_cache=cache))


def _mlx() -> bool:
    try:
        import mlx.core  # noqa: F401
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def reference(small_model):
    got = {}
    for b in ("numpy", "cpu", "mlx"):
        if (b == "cpu" and not kernels.available()) or (b == "mlx" and not _mlx()):
            continue
        with _open(small_model, b, None) as e:
            got[b] = _greedy(e)
            if b == "mlx":
                got["mlx-bound"] = e.bind_report.bytes
    return got


def _skip_unless(backend, reference):
    if backend not in reference:
        pytest.skip("the C kernels are not built" if backend == "cpu" else "mlx is not installed")


def _slots_are_what_the_kernels_read(e, c):
    """Nothing reads the experts whole: the host weights refuse `data`; mlx's expert weights are
    the cache's slot arrays (one expert per row), and its bound weights leave the experts out."""
    lw = e.model.w.layers[0]
    if e.backend != "mlx":
        with pytest.raises(RuntimeError, match="expert cache"):
            lw.gate_exps.data
        return
    from engine.backends.mlx.expert_slots import SlotWeight
    ws = [lw.gate_exps, lw.up_exps, lw.down_exps]
    assert all(type(w) is SlotWeight and w.w is a for w, a in zip(ws, c.store.arrays))
    assert all(w.w.shape[0] == c.n_slots for w in ws) and e.paging == "none"
    assert sum(w.w.nbytes for w in ws) == c.nbytes


@pytest.mark.parametrize("backend", ["numpy", "cpu", "mlx"])
@pytest.mark.parametrize("budget", ["zero", "one-more-slot", "larger-than-file"])
def test_tokens_and_logits_equal_the_resident_run(small_model, reference, backend, budget):
    """Budget 0 (the working set: one token's experts of one layer; the 12-token prefill runs in
    row groups that fit it), one slot more than that (eviction on every layer), and more than
    the file (nothing evicted): the greedy tokens and last logits are the resident run's, bit for
    bit, with the experts read from the file into the slots (the map's expert bytes unread).
    mlx: the slots are MLX arrays its kernels index by slot; at budget 0 a prefill's row groups
    refill the same slots within a layer, so a graph left unevaluated would read the next
    group's experts (ExpertCache.moe settles each group's result first)."""
    _skip_unless(backend, reference)
    with _open(small_model, backend, 0) as e:
        used, slot = e.config.n_expert_used, e.model.experts.slot_bytes
        size = os.path.getsize(small_model)
    cache = {"zero": 0, "one-more-slot": (used + 1) * slot, "larger-than-file": 2 * size}[budget]
    with _open(small_model, backend, cache) as e:
        c = e.model.experts
        assert c.n_slots == {"zero": used, "one-more-slot": used + 1}.get(budget, c.n_slots)
        toks, logits = _greedy(e)
        st = c.stats()
        _slots_are_what_the_kernels_read(e, c)
        if backend == "mlx":        # MLX memory: the other weights, the experts left to the slots
            assert e.bind_report.bytes + X.expert_bytes(e.file) <= reference["mlx-bound"]
    assert toks == reference[backend][0]
    assert np.array_equal(logits, reference[backend][1])
    assert st["misses"] > 0 and st["bytes_read"] >= st["misses"] * c.layers[0].bytes
    # hash layers' experts are read at the step's start: misses, read ahead, never hits
    assert st["misses_read_ahead"] > 0
    if budget == "larger-than-file":
        # every expert read at most once (compulsory misses only): the rest are hits
        assert st["misses"] <= e.config.n_layer * e.config.n_expert and st["hits"] > 0
    else:
        assert st["hit_rate"] < 0.5


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_the_shared_expert_computes_while_the_layers_reads_run(small_model, reference, backend):
    """A routed layer's missing experts are read while its shared expert computes (the host
    backends' moe is routed + shared_expert: the same bits apart, so the tokens and logits stay
    the resident run's). Each read takes 5 ms longer here, so they are still in flight."""
    _skip_unless(backend, reference)
    with _open(small_model, backend, 0) as e:
        c, ops = e.model.experts, e.model.ops
        seen, real = [], ops.shared_expert

        def shared(lw, u, limit):
            seen.append(any(k[0] == lw.il and not f.done() for k, f in c.pending.items()))
            return real(lw, u, limit)

        def pread(fd, view, off):
            time.sleep(0.005)
            return os.preadv(fd, [view], off)
        ops.shared_expert, c.reader.pread = shared, pread
        toks, logits = _greedy(e)
    assert any(seen)
    assert toks == reference[backend][0] and np.array_equal(logits, reference[backend][1])


def test_mlx_exact_numerics_reads_the_slots_too(small_model):
    """mlx's float32 path (exact numerics here; ds4 numerics on a Mac's GPU): pairs grouped by
    expert id, their gathered bytes taken from the slots (quant.gather_matmul's twin decode);
    at budget 0 the tokens and logits are the resident run's, bit for bit."""
    if not _mlx():
        pytest.skip("mlx is not installed")
    got = []
    for cache in (None, 0):
        with Engine.open(small_model, EngineOptions(backend="mlx", numerics="exact", expert_cache=cache)) as e:
            got.append(_greedy(e))
            if cache is not None:
                assert e.model.experts.stats()["misses"] > 0
    assert got[0][0] == got[1][0] and np.array_equal(got[0][1], got[1][1])


def test_mlx_refuses_experts_it_would_repack(tmp_path):
    """Q4_K experts are bound in MLX's own layout, not the file's bytes: one clear line."""
    if not _mlx():
        pytest.skip("mlx is not installed")
    from engine.gguf.synth import config_for, write_synthetic
    cfg, vocab = config_for("tiny", n_layer=2, ratios=[0, 4], vocab=300)
    p = write_synthetic(tmp_path / "q4.gguf", cfg, recipe="q4", vocab=vocab, seed=1).path
    with pytest.raises(ValueError, match="reads IQ2_XXS and Q2_K experts .* is Q4_K; use the cpu backend"):
        Engine.open(p, EngineOptions(backend="mlx", expert_cache=0))


def test_expert_cache_option_parses_and_refuses():
    assert X.parse_size("8G") == 8 << 30 and X.parse_size("512MiB") == 512 << 20
    assert X.parse_size("auto") == "auto" and X.parse_size("0") == 0
    assert EngineOptions(expert_cache="1.5G").expert_cache == int(1.5 * (1 << 30))
    for bad in ("lots", "-1G", "8X"):
        with pytest.raises(ValueError, match="--expert-cache takes a size"):
            EngineOptions(expert_cache=bad)


def test_auto_leaves_the_resident_weights_and_a_margin(small_model):
    with Engine.open(small_model, paging="none") as e:
        m = e.file
        ex = X.expert_bytes(m)
        assert 0 < ex < m.gguf.size
        assert X.auto_size(m, m.gguf.size + X.MARGIN + 1000) == ex + 1000
        assert X.auto_size(m, 10) == 0
        # mlx copied the other weights at bind: the memory read after it has them counted already
        assert X.auto_size(m, ex + X.MARGIN + 1000, bound=True) == ex + 1000
    with Engine.open(small_model, EngineOptions(expert_cache="auto")) as e:
        assert e.model.experts.n_slots >= e.config.n_expert_used
        # the other weights fit: a resident copy of them alone, the experts' bytes left out
        assert e.paging == "resident" and e.file.gguf.resident
        ready = e.file.gguf._copy.ready
        assert ready and not any(n.endswith("_exps.weight") for n in ready)
        assert X.expert_names(e.file) | ready == set(e.file.gguf.tensors)
    assert X.paging_for(e.file, "auto", 10) == "lowmem"                 # they would not fit
    with pytest.raises(ValueError, match="prefault"):
        Engine.open(small_model, EngineOptions(expert_cache=0, paging="prefault"))


def test_a_split_ranks_layers_only(small_model):
    """--layers (a split rank holds some layers; the others are None): attach leaves the None
    layers alone, keys the cache by layer index, and a held expert's slot bytes are the file's;
    auto_size subtracts the rank's own dense bytes where given."""
    with Engine.open(small_model, EngineOptions(backend="numpy", paging="none")) as e:
        whole = [lw.gate_exps.expert_data(3).copy() for lw in e.model.w.layers]
        e.model.w.layers[0] = None
        c = X.attach(e.model, e.file, 64 << 20, dense=0)
        assert sorted(c.layers) == list(range(1, e.config.n_layer))
        c.hold(2, [3])
        assert np.array_equal(e.model.w.layers[2].gate_exps.expert_data(3), whole[2])
        c.release()
        c.begin_step(e.model.w.layers, np.array([5]))          # (hash layers of the rank only)
        c.close()
    ex = X.expert_bytes(e.file)
    assert X.auto_size(e.file, ex + X.MARGIN + 1000, dense=0) == ex + 1000


def test_resident_groups_leave_the_skipped_tensors_out(small_model):
    from engine.gguf import paging as PG
    from engine.gguf.gguf_file import GGUFFile
    with GGUFFile(small_model) as g:
        ts = list(g.tensors.values())
        skip = {t.name for t in ts if t.name.endswith("_exps.weight")}
        whole = PG.plan_groups(ts, g.size)
        part = PG.plan_groups(ts, g.size, skip)
        assert whole[0][0] == 0 and whole[-1][1] == g.size                # unchanged without skip
        named = [n for _, _, names in part for n in names]
        assert sorted(named) == sorted(set(g.tensors) - skip)
        for t in ts:
            inside = [(lo, hi) for lo, hi, _ in part if lo < t.offset + t.nbytes and t.offset < hi]
            assert bool(inside) == (t.name not in skip)                   # no group touches an expert


# -- eviction on a routing trace -------------------------------------------------------------------
def test_replay_counts_hits_by_hand():
    trace = [(0, [1, 2]), (0, [1, 2]), (1, [1, 2]), (0, [1, 2])]
    assert X.replay(trace, 2, "lru") == 2 / 8           # layer 1 evicts both of layer 0's
    assert X.replay(trace, 4, "lru") == 4 / 8
    assert X.replay(trace, 4, "slru") == 4 / 8


def test_slru_keeps_reused_experts_through_a_scan_where_lru_does_not():
    """Experts 0-1 used every token, each token also one expert never seen again: with 3 slots
    LRU keeps the hot pair too (recency suffices); a burst of 3 one-off experts in one request
    flushes LRU's hot pair but not SLRU's protected segment."""
    hot = [(0, [0, 1])] * 4
    scan = [(0, [10, 11, 12])]
    trace = hot + scan + hot
    # after the scan LRU misses the hot pair once more; SLRU's protected pair is evicted too
    # (the scan needs every slot at once), so both miss: the scan needs all 3 slots
    assert X.replay(trace, 3, "lru") == X.replay(trace, 3, "slru")
    trace = hot + [(0, [10]), (0, [11]), (0, [12])] + hot
    assert X.replay(trace, 4, "slru") > X.replay(trace, 4, "lru")


def test_the_trace_records_what_each_layer_held(small_model):
    with _open(small_model, "numpy", "auto") as e:
        e.model.experts.trace = []
        _greedy(e, 2, PROMPT[:3])
        tr = e.model.experts.trace
    n_layer, used = e.config.n_layer, e.config.n_expert_used
    assert len(tr) == 3 * n_layer                           # the prefill (3 rows: fits) + 2 steps
    assert [il for il, _ in tr[:n_layer]] == list(range(n_layer))
    assert all(len(ex) == used for il, ex in tr[n_layer:])


# -- the reader -------------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [False, True])
def test_reader_puts_the_file_bytes_at_the_span(tmp_path, direct):
    p = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 256, 5 * ALIGN + 123, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    import mmap
    mem = mmap.mmap(-1, 4 * ALIGN)
    r = ExpertReader(str(p), memoryview(mem), direct=direct, depth=2)
    spans = [Span(ALIGN + 7, 1000, 0), Span(5 * ALIGN + 100, 23, 2 * ALIGN)]   # the last ends at EOF
    r.submit(spans).result()
    buf = np.frombuffer(mem, np.uint8)
    for s in spans:
        assert np.array_equal(buf[s.dst + s.skip:s.dst + s.skip + s.n], data[s.off:s.off + s.n])
    with pytest.raises(ModelFileError, match="truncated"):
        r.submit([Span(5 * ALIGN + 100, 100, 2 * ALIGN)]).result()      # past the end
    r.close()


def test_direct_read_speed_is_measured(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"\1" * (8 << 20))
    got = direct_read_speed(str(p), 8 << 20, 1 << 20, 2)
    assert got is None or got > 0                # None: this file system refuses O_DIRECT


# -- errors: one ModelFileError, no crash, the session's save still loads ---------------------------
def _faulty(kind):
    state = {"on": True}

    def pread(fd, view, off):
        if state["on"]:
            if kind == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return 0                               # a short read: the end of the file
        return os.preadv(fd, [view], off)
    return pread, state


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_read_fault_ends_the_step_with_one_error(small_model, reference, kind, backend):
    _skip_unless(backend, reference)
    pread, state = _faulty(kind)
    with _open(small_model, backend, 0) as e:
        state["on"] = False
        e.model.experts.reader.pread = pread
        s = Session(e, 64)
        s.sync(PROMPT)
        saved = s.snapshot()
        state["on"] = True
        with pytest.raises(ModelFileError, match="routed expert" if kind == "eio" else "truncated"):
            s.eval(int(np.argmax(s.logits)))
        assert not e.model.experts.held and not e.model.experts.pending
        state["on"] = False                        # the disk is back: the cache serves again
        s2 = Session(e, 64)
        s2.restore(saved)
        outs = []
        for sess in (s2, s):                       # the saved state, and the session that failed
            out = []
            for _ in range(3):
                t = int(np.argmax(sess.logits))
                out.append(t)
                sess.eval(t)
            outs.append((out, np.array(sess.logits, copy=True)))
    for out, logits in outs:
        assert out == reference[backend][0] and np.array_equal(logits, reference[backend][1])


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_a_file_truncated_under_the_engine_is_one_error(small_model, reference, tmp_path, backend):
    """The file cut short while the engine runs (the other weights are in a resident copy, or
    mlx's own memory with its host tables copied; the experts' reads are preads, which return
    short where a map's fault would be SIGBUS)."""
    _skip_unless(backend, reference)
    p = tmp_path / "m.gguf"
    shutil.copyfile(small_model, p)
    with _open(p, backend, 0) as e:
        s = Session(e, 64)
        s.sync(PROMPT[:4])
        first = e.model.experts.layers[0].spans[0][0]
        os.truncate(p, first + 10)
        with pytest.raises(ModelFileError, match="truncated"):
            s.eval(1)


# -- what the bench and the status bar print ---------------------------------------------------------
def test_floor_line_divides_missed_bytes_by_the_disk_speed():
    d = X.stats_delta({"hits": 0, "misses": 0, "bytes_read": 0, "stall_s": 0.0},
                      {"hits": 3, "misses": 1, "bytes_read": 4_000_000, "stall_s": 0.5})
    assert d["hit_rate"] == 0.75
    # 2 tokens in 2 s: 2 MB/token at 1 GB/s is 2 ms, compute (2 - 0.5 s) / 2 = 750 ms: floor 752 ms
    line = X.floor_line(d, 2, 2.0, 1e9)
    assert "hit 75.0%" in line and "read 2.00 MB/token" in line and "stall 250.0 ms/token" in line
    assert "decode = 75% of disk floor (1.00 GB/s" in line
    assert "disk floor" not in X.floor_line(d, 2, 2.0, None)


@pytest.mark.slow      # (two bench runs with their probes: ~15 s on 2 loaded cores)
def test_bench_rows_print_the_cache_and_the_disk_floor(small_model, tmp_path, capsys, monkeypatch):
    from engine import bench
    monkeypatch.setattr(bench, "measure_floors", lambda: {"read_bytes_per_s": 1e10, "gemm_flops_per_s": 1e10})
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(400)))
    argv = ["-m", str(small_model), "--prompt-file", str(text), "--ctx-start", "16", "--ctx-max", "16",
            "--gen-tokens", "3", "--numerics", "exact"]
    dumps = []
    for extra in ([], ["--expert-cache", "0"]):
        dumps.append(tmp_path / f"d{len(dumps)}.json")
        assert bench.main(argv + extra + ["--dump-tokens", str(dumps[-1])]) == 0
    err = capsys.readouterr().err
    assert "expert cache: " in err and "slots of" in err
    assert "ctx 16: experts: hit " in err and "MB/token" in err and "ms/token" in err
    assert ("of disk floor" in err) == ("O_DIRECT refused" not in err)
    assert dumps[0].read_text() == dumps[1].read_text()        # the same greedy tokens


def test_the_status_bar_shows_the_cache(small_model):
    from ds4agent import events as E
    from ds4agent.tui_widgets import fit_status, status_fields
    with Engine.open(small_model, paging="none") as e:
        assert e.expert_status == ""
    with _open(small_model, "numpy", 0) as e:
        _greedy(e, 1, PROMPT[:2])
        text = e.expert_status
    assert text.startswith("experts ") and "% hit" in text and "GB read" in text and "s stall" in text
    st = E.Status("m", "numpy", 10, 100, 5.0, 2.0, "s1", "off", experts=text)
    assert text in fit_status(status_fields(st, "idle"), 300).plain
    assert "experts" not in fit_status(status_fields(E.Status("m", "numpy", 10, 100, 5.0, 2.0, "s1", "off"), "idle"), 300).plain


@pytest.mark.slow      # (the agent's system prompt: a 3.7k-token prefill unless cached, ~15 s)
def test_an_agent_turn_with_a_read_fault_ends_with_one_error(agent_model, hello_project, sessions_root):
    """A read fault mid-turn: one error notice, the turn ends "error", the timeline and the
    transcript are the turn's start again, the saved session is untouched; the next turn runs."""
    from ds4agent import events as E
    from helpers_agent import start_agent
    with Engine.open(agent_model, EngineOptions(numerics="exact", expert_cache=0)) as e:
        slot = e.model.experts.slot_bytes
    with Engine.open(agent_model, EngineOptions(numerics="exact", expert_cache=8 * slot)) as e:
        agent, rec = start_agent(e, hello_project, sessions_root)
        agent.submit("hello")
        saved = {p: p.read_bytes() for p in sessions_root.rglob("*") if p.is_file()}
        tokens, n_msgs = agent.session.tokens, len(agent.transcript)
        pread, state = _faulty("eio")
        e.model.experts.reader.pread = pread
        got = agent.submit("and again")
        assert got.finish_reason == "error"
        errors = [n.text for n in rec.of(E.Notice) if n.level == "error"]
        assert len(errors) == 1 and "routed expert" in errors[0] and "Traceback" not in errors[0]
        assert agent.session.tokens == tokens and len(agent.transcript) == n_msgs
        assert {p: p.read_bytes() for p in sessions_root.rglob("*") if p.is_file()} == saved
        state["on"] = False
        assert agent.submit("and again").finish_reason != "error"


def test_empty_forgets_every_expert_and_keeps_the_counters(small_model, reference):
    with _open(small_model, "numpy", "1G") as e:
        c = e.model.experts
        _greedy(e, 1, PROMPT[:3])
        before = c.stats()
        assert c.where
        c.empty()
        assert not c.where and not c.pending and len(c.free) == c.n_slots and c.stats() == before
        toks, logits = _greedy(e)
        assert c.stats()["misses"] > before["misses"]                  # read again
    assert toks == reference["numpy"][0] and np.array_equal(logits, reference["numpy"][1])


def test_split_spans_lay_the_same_bytes_at_the_same_places(tmp_path):
    from engine.gguf.expert_reader import split
    p = tmp_path / "f.bin"
    data = np.random.default_rng(1).integers(0, 256, 9 * ALIGN, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    import mmap
    for direct in (False, True):
        mem = mmap.mmap(-1, 8 * ALIGN)
        r = ExpertReader(str(p), memoryview(mem), direct=direct, depth=4)
        s = Span(ALIGN + 100, 5 * ALIGN + 7, ALIGN)
        parts = split(s, 2 * ALIGN)
        assert len(parts) == 3 and parts[0].off == s.off and sum(x.n for x in parts) == s.n
        assert all(x.skip == 0 for x in parts[1:])
        r.submit(parts).result()
        buf = np.frombuffer(mem, np.uint8)
        assert np.array_equal(buf[s.dst + s.skip:s.dst + s.skip + s.n], data[s.off:s.off + s.n])
        r.close()
    assert split(s, 0) == [s] and split(s, 64 * ALIGN) == [s]
