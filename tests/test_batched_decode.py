"""Sessions of one Engine on several threads, and the batched decode step across sessions
(Model.forward_batch, engine/runtime/batcher.py): the same tokens as each session run alone.

The model: 4 layers (sliding window, ratio 4 with the indexer, ratio 128, ratio 4), an indexer
top-k of 4 (it starts selecting at position 20, so a batch mixes sessions below and above it),
one hash layer, q2 experts. On numpy and mlx a batched row is bit-identical to the row alone;
on cpu too with kernels.set_batch_invariant(True) (default off: the float kernels sum a single
row in another order than several, so rows differ by rounding; measured below)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine import ContextFull, Engine, Session
from engine.backends import registry as R
from engine.gguf.synth import config_for, write_synthetic

BACKENDS = ["numpy", "cpu", "mlx"]


@pytest.fixture(scope="module")
def batch_model(models_dir):
    cfg, vocab = config_for("tiny", n_layer=4, ratios=[0, 4, 128, 4], vocab=465, idx_n_head=16,
                            idx_topk=4, n_hash_layer=1)
    return write_synthetic(models_dir / "batch-q2.gguf", cfg, recipe="q2", vocab=vocab, seed=7).path


def _open(path, backend):
    why = R.get(backend).available()
    if why is not None:
        pytest.skip(f"backend {backend} cannot run here: {why}")
    return Engine.open(path, backend=backend, numerics="ds4")


@pytest.fixture(scope="module", autouse=True)
def one_kernel_thread():
    """The cpu kernels on one thread: these tests are about results, and on a loaded machine two
    OpenMP threads per pass beside the test's own threads ran ~10x slower."""
    from engine.backends.cpu import kernels as K
    prev = K.get_threads()
    K.set_threads(1)
    yield
    K.set_threads(prev)


@pytest.fixture
def invariant():
    """cpu kernels that give a row the same sums whatever the batch (restored after)."""
    from engine.backends.cpu import kernels as K
    prev = K.set_batch_invariant(True)
    yield
    K.set_batch_invariant(prev)


@pytest.fixture(scope="module")
def cpu_eng(batch_model):
    with _open(batch_model, "cpu") as e:
        yield e


@pytest.fixture(scope="module")
def alone10(cpu_eng):
    """Each prompt greedy for 10 steps alone, batch-invariant kernels on: the reference of the four
    batched-threads tests, computed once (read-only)."""
    from engine.backends.cpu import kernels as K
    prev = K.set_batch_invariant(True)
    try:
        return [_greedy(Session(cpu_eng, 128, chunk=8), p, 10) for p in PROMPTS]
    finally:
        K.set_batch_invariant(prev)


PROMPTS = [[7, 3, 9], list(range(40, 52)), list(range(100, 130)), [5] * 21]   # 3, 12, 30, 21 tokens
LONG = np.random.default_rng(11).integers(0, 465, 120).tolist()   # its steps close a ratio-128 window


def _greedy(s: Session, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    s.sync(prompt)
    out, rows = [], []
    with s.generating():
        for _ in range(steps):
            t = int(np.argmax(s.logits))
            out.append(t)
            rows.append(s.eval(t).copy())
    return out, np.array(rows)


def _threads(fns, park: bool = False, timeout: float = 120):
    """Run each fn on its own thread; exceptions come back as results. park: the threads never
    end (MLX can abort the process when a thread that ran MLX work exits; the shim parks too)."""
    res: list = [None] * len(fns)
    done = [threading.Event() for _ in fns]

    def body(i):
        try:
            res[i] = fns[i]()
        except BaseException as e:      # (the test reads it)
            res[i] = e
        done[i].set()
        if park:
            threading.Event().wait()

    for i in range(len(fns)):
        threading.Thread(target=body, args=(i,), daemon=True).start()
    for d in done:
        assert d.wait(timeout), "a thread did not finish"
    return res


# -- Model.forward_batch ------------------------------------------------------------------------
def _lockstep(eng, steps: int, forced=None, prompts=PROMPTS):
    """Every prompt prefilled alone, then `steps` decode steps of all of them as one forward_batch
    (greedy, or the tokens `forced`). Returns per session (tokens, logits rows)."""
    m, ops = eng.model, eng.model.ops
    PROMPTS = prompts
    states = [ops.new_state(eng.config, 256, 32) for _ in PROMPTS]
    last = [ops.logits_to_host(m.forward(np.array(p), 0, st)).copy() for p, st in zip(PROMPTS, states)]
    toks, rows = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    for i in range(steps):
        ts = [int(np.argmax(lg)) if forced is None else forced[b][i] for b, lg in enumerate(last)]
        out = ops.logits_to_host(m.forward_batch(ts, [len(p) + i for p in PROMPTS], states))
        last = [out[b].copy() for b in range(len(PROMPTS))]
        for b in range(len(PROMPTS)):
            toks[b].append(ts[b])
            rows[b].append(last[b])
    return [(t, np.array(r)) for t, r in zip(toks, rows)]


def _alone(eng, steps: int, forced=None, prompts=PROMPTS):
    m, ops = eng.model, eng.model.ops
    out = []
    for b, p in enumerate(prompts):
        st = ops.new_state(eng.config, 256, 32)
        lg = ops.logits_to_host(m.forward(np.array(p), 0, st)).copy()
        toks, rows = [], []
        for i in range(steps):
            t = int(np.argmax(lg)) if forced is None else forced[b][i]
            lg = ops.logits_to_host(m.forward(np.array([t]), len(p) + i, st)).copy()
            toks.append(t)
            rows.append(lg)
        out.append((toks, np.array(rows)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_batch_bit_identical_to_alone(batch_model, backend, invariant):
    """Sessions of different lengths (3..30 tokens; 12 steps take two of them across the
    indexer's start and each across a ratio-4 window every 4 steps; on cpu and mlx a fifth of 120
    tokens closes a ratio-128 window in the batch), greedy: the same tokens and the same logits
    bit for bit as each session alone. (The NumPy reference's prefill of 120 tokens is slow.)"""
    prompts = PROMPTS + ([LONG] if backend != "numpy" else [])
    with _open(batch_model, backend) as eng:
        alone = _alone(eng, 12, prompts=prompts)
        got = _lockstep(eng, 12, prompts=prompts)
    for (ta, la), (tg, lg) in zip(alone, got):
        assert ta == tg
        assert np.array_equal(la, lg), np.abs(la - lg).max()


@pytest.mark.parametrize("numerics", ["exact", "ds4"])
def test_forward_batch_on_cpu_default_kernels_equal_to_rounding(batch_model, numerics):
    """Without batch invariance (the default) the cpu float kernels (the F16 matrices: HC,
    router, compressors, indexer) sum one row in another order than several. The same tokens
    forced into both: in exact numerics the logits agree to float32 rounding; in ds4 numerics an
    ulp before a Q8 quantizer flips a code now and then and the step drifts as chunking does
    (measured on this model: rows bit-equal until a flip, then up to 0.087 of logits of ~4.3,
    top-1 equal on 47 of 48 rows)."""
    with Engine.open(batch_model, backend="cpu", numerics=numerics) as eng:
        alone = _alone(eng, 12)
        got = _lockstep(eng, 12, forced=[t for t, _ in alone])
    la = np.concatenate([r for _, r in alone])
    lg = np.concatenate([r for _, r in got])
    d, scale = np.abs(la - lg).max(axis=1), np.abs(la).max()
    if numerics == "exact":
        assert d.max() < 1e-5 * scale, (d.max(), scale)
    else:
        assert d.max() < 0.05 * scale and (la.argmax(1) == lg.argmax(1)).mean() >= 0.9, (d.max(), scale)


def test_forward_batch_refuses_bad_arguments(cpu_eng):
    m, ops = cpu_eng.model, cpu_eng.model.ops
    st = ops.new_state(cpu_eng.config, 64, 8)
    with pytest.raises(ValueError, match="one position and one state per token"):
        m.forward_batch([1, 2], [0], [st])
    with pytest.raises(ValueError, match="one state twice"):
        m.forward_batch([1, 2], [0, 0], [st, st])


# -- sessions on threads -----------------------------------------------------------------------
def test_sessions_on_threads_equal_alone_without_batching(cpu_eng):
    """One session per thread on one Engine, batching off: each gets exactly what it gets alone
    (every forward pass of the Engine is serialized; nothing of one pass leaks into another)."""
    alone = [_greedy(Session(cpu_eng, 128, chunk=8), p, 10) for p in PROMPTS]
    got = _threads([lambda p=p: _greedy(Session(cpu_eng, 128, chunk=8), p, 10) for p in PROMPTS])
    for (ta, la), (tg, lg) in zip(alone, got):
        assert ta == tg and np.array_equal(la, lg)


@pytest.mark.parametrize("window_ms,max_batch,jitter", [(0.0, None, 0), (2.0, None, 1), (50.0, 2, 2), (1000.0, None, 0)])
def test_batched_sessions_on_threads_equal_alone(cpu_eng, invariant, alone10, window_ms, max_batch, jitter):
    """Batching on, four threads, greedy: each thread's tokens and logits are those of its
    session alone, whatever batches form (no window, short, long; at most 2 a batch; threads
    that pause at random between steps)."""
    alone = alone10
    b = cpu_eng.start_batching(window_ms=window_ms, prefill_chunk=8, max_batch=max_batch)
    rng = np.random.default_rng(jitter)
    pauses = rng.uniform(0, 0.004, (len(PROMPTS), 10)) if jitter else np.zeros((len(PROMPTS), 10))

    def run(i):
        s = Session(cpu_eng, 128, chunk=8)
        s.sync(PROMPTS[i])
        out, rows = [], []
        with s.generating():
            for k in range(10):
                t = int(np.argmax(s.logits))
                out.append(t)
                rows.append(s.eval(t).copy())
                threading.Event().wait(pauses[i, k])
        return out, np.array(rows)

    try:
        got = _threads([lambda i=i: run(i) for i in range(len(PROMPTS))])
    finally:
        cpu_eng.stop_batching()
    for (ta, la), (tg, lg) in zip(alone, got):
        assert ta == tg and np.array_equal(la, lg)
    assert b.stats["decode_rows"] == 40 and b.stats["max_batch"] <= (max_batch or 4)
    if window_ms >= 50:
        assert b.stats["max_batch"] >= 2        # (shorter windows batch only by chance)


def test_all_generating_sessions_step_together(cpu_eng, invariant):
    """Sessions registered as generating and a window long enough: every step is one batch of
    all four (the batcher waits for each registered session, not for the window)."""
    b = cpu_eng.start_batching(window_ms=5000.0, trace=100)
    go = threading.Barrier(len(PROMPTS))

    def run(i):
        s = Session(cpu_eng, 128)
        s.sync(PROMPTS[i])
        with s.generating():
            go.wait()
            for _ in range(6):
                s.eval(int(np.argmax(s.logits)))
        return s.tokens

    try:
        got = _threads([lambda i=i: run(i) for i in range(len(PROMPTS))])
    finally:
        cpu_eng.stop_batching()
    decodes = [n for kind, _, n in b.trace if kind == "decode"]
    assert decodes == [4] * 6
    alone = [_greedy(Session(cpu_eng, 128), p, 6)[0] for p in PROMPTS]
    assert [g[len(p):] for g, p in zip(got, PROMPTS)] == alone


def test_a_prefill_interleaves_with_decode(cpu_eng, invariant):
    """A 60-token prefill in chunks of 8 beside a generating session: the decode steps run
    between the chunks (not after the whole prefill), and both results equal the sessions alone
    (the prefill's logits those of the same chunking)."""
    long = list(range(200, 260))
    want_logits = Session(cpu_eng, 128, chunk=8).sync(long, keep_logits=True)
    want_a = _greedy(Session(cpu_eng, 128), PROMPTS[1], 40)[0]
    b = cpu_eng.start_batching(window_ms=200.0, prefill_chunk=8, trace=1000)
    started = threading.Event()
    a = Session(cpu_eng, 128)
    got_a: list[int] = []

    def decoder():
        a.sync(PROMPTS[1])
        with a.generating():
            for i in range(40):
                t = int(np.argmax(a.logits))
                got_a.append(t)
                a.eval(t)
                if i == 2:
                    started.set()
        return True

    def prefiller():
        started.wait(30)
        return Session(cpu_eng, 128, chunk=2048).sync(long, keep_logits=True)

    try:
        _, got_logits = _threads([decoder, prefiller])
    finally:
        cpu_eng.stop_batching()
    assert got_a == want_a
    assert np.array_equal(got_logits, want_logits)
    kinds = [(kind, ids) for kind, ids, _ in b.trace]
    chunks = [i for i, (k, ids) in enumerate(kinds) if k == "prefill" and id(a) not in ids]
    assert len(chunks) == 8         # 60 tokens in chunks of 8
    # a decode step of the generating session between every two chunks of the other's prefill
    between = [any(k == "decode" and id(a) in ids for k, ids in kinds[i + 1:j]) for i, j in zip(chunks, chunks[1:])]
    assert all(between), kinds


def test_errors_stay_with_their_session(cpu_eng, invariant):
    """Batching on: a bad token and a full context are refused in their own thread; a session
    whose pass fails inside a batch gets its error, and the others in that batch their own
    correct steps (the batch is run again step by step)."""
    alone = [_greedy(Session(cpu_eng, 128), p, 8) for p in PROMPTS[:3]]
    b = cpu_eng.start_batching(window_ms=5000.0)
    go = threading.Barrier(4)
    retried = b.stats["retried"]

    def good(i):
        s = Session(cpu_eng, 128)
        s.sync(PROMPTS[i])
        out, rows = [], []
        with s.generating():
            go.wait()
            for _ in range(8):
                t = int(np.argmax(s.logits))
                out.append(t)
                rows.append(s.eval(t).copy())
        return out, np.array(rows)

    def bad():
        s = Session(cpu_eng, 8)
        s.sync([1, 2, 3])
        errors = []
        with s.generating():
            go.wait()
            try:
                s.eval(10 ** 9)
            except ValueError as e:
                errors.append(str(e))
            s.state.layers = s.state.layers[:1]      # its next pass fails at layer 1, in a batch
            try:
                s.eval(4)
            except IndexError:
                errors.append("failed pass")
        s.state = cpu_eng.model.ops.new_state(cpu_eng.config, 8, 8)
        s.reset()
        s.sync([1, 2, 3, 4, 5, 6])
        s.eval(7)
        try:
            s.eval(8)
        except ContextFull as e:
            errors.append(str(e))
        return errors

    try:
        got = _threads([lambda i=i: good(i) for i in range(3)] + [bad])
    finally:
        cpu_eng.stop_batching()
    assert got[3][0].startswith("token id 1000000000 is outside the vocabulary")
    assert got[3][1] == "failed pass" and "context of 8 tokens is full" in got[3][2]
    assert b.stats["retried"] > retried
    for (ta, la), (tg, lg) in zip(alone, got[:3]):
        assert ta == tg and np.array_equal(la, lg)


def test_batching_off_by_default_and_one_session_runs_alone(cpu_eng):
    assert not cpu_eng.batching
    b = cpu_eng.start_batching(window_ms=1000.0, trace=10)
    try:
        s = Session(cpu_eng, 64)
        s.sync([1, 2, 3])
        with s.generating():
            s.eval(4)                # the only session: no window to wait, a batch of one
        s.eval(5)                    # not registered: runs at once too
    finally:
        cpu_eng.stop_batching()
    assert [(k, n) for k, _, n in b.trace] == [("prefill", 3), ("decode", 1), ("decode", 1)]
    with pytest.raises(ValueError, match="window_ms"):
        cpu_eng.start_batching(window_ms=-1)
    assert not cpu_eng.batching


def test_mlx_sessions_on_threads_batched(batch_model):
    """The batcher on mlx (MLX's CPU device here): four threads, one batch a step, the tokens of
    each session alone. The threads park (MLX work on a thread that ends can abort the exit)."""
    with _open(batch_model, "mlx") as eng:
        alone = [_greedy(Session(eng, 128), p, 6)[0] for p in PROMPTS]
        b = eng.start_batching(window_ms=5000.0)
        go = threading.Barrier(len(PROMPTS))

        def run(i):
            s = Session(eng, 128)
            s.sync(PROMPTS[i])
            with s.generating():
                go.wait()
                for _ in range(6):
                    s.eval(int(np.argmax(s.logits)))
            return s.tokens[len(PROMPTS[i]):]

        got = _threads([lambda i=i: run(i) for i in range(len(PROMPTS))], park=True)
        eng.stop_batching()
    assert got == alone
    assert b.stats["max_batch"] == 4


def test_bench_slots_runs_and_prints_both_ratios(batch_model, capsys):
    """scripts/bench_slots.py end to end on the small model (what it prints, not how fast)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("bench_slots", Path(__file__).parents[1] / "scripts" / "bench_slots.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["-m", str(batch_model), "--steps", "2", "--prompt", "8", "--ctx", "64", "--rounds", "1",
                     "--quiet-wait", "0", "--threads", "1", "--by-batch"]) == 0
    out = capsys.readouterr().out
    assert "aggregate/alone" in out and "alone/slowest stream" in out and "forward_batch B=4" in out
    assert "stream 1 tokens as alone: True" in out


class _Interrupt(BaseException):
    """Any BaseException out of a batched pass."""


def test_a_pass_that_raises_fails_its_steps_and_the_executor_goes_on(cpu_eng, invariant, monkeypatch):
    """A batched pass raises even a BaseException mid-pass: every step of that batch gets it in its
    caller's thread, the batcher's own executor thread lives on, and the steps asked again give
    the results they give alone (a step writes its KV rows by position)."""
    alone = [_greedy(Session(cpu_eng, 128), p, 5) for p in PROMPTS[:3]]
    real = cpu_eng.model.forward_batch
    fired = []

    def once(*args, **kw):
        if not fired:
            fired.append(threading.get_ident())
            real(*args, **kw)                   # (the pass has written every session's rows)
            raise _Interrupt()
        return real(*args, **kw)

    monkeypatch.setattr(cpu_eng.model, "forward_batch", once)
    b = cpu_eng.start_batching(window_ms=5000.0)
    go = threading.Barrier(3)

    def run(i):
        s = Session(cpu_eng, 128)
        s.sync(PROMPTS[i])
        out, rows = [], []
        with s.generating():
            go.wait()
            for _ in range(5):
                t = int(np.argmax(s.logits))
                try:
                    rows.append(s.eval(t).copy())
                except _Interrupt:
                    rows.append(s.eval(t).copy())    # asked again: the step runs again
                out.append(t)
        return out, np.array(rows), threading.get_ident()

    try:
        got = _threads([lambda i=i: run(i) for i in range(3)])
    finally:
        cpu_eng.stop_batching()
    # the pass ran on the batcher's thread, never a caller's (one OpenMP team: batcher.py)
    assert len(fired) == 1 and fired[0] not in [g[2] for g in got]
    for (ta, la), (tg, lg, _) in zip(alone, got):
        assert ta == tg and np.array_equal(la, lg)
    assert b.stats["max_batch"] == 3
