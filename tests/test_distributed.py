"""The model split by layers across ranks (issue 38): the plan, the partial KV state and the
snapshot's layer blocks in one process; then real ranks on loopback (mx.distributed's ring
backend, the environment mlx.launch sets, and one run through mlx.launch itself), each compared
token for token and byte for byte with one process."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, EngineOptions, Session
from engine.model import snapshot as snap
from engine.model.layer_split import PartialKVState, SplitError, auto_plan, parse_ranges, plan
from helpers_split import driver, finish, gen_lines, greedy, spawn, stop_then_greedy

pytest.importorskip("mlx.core", reason="the split runs over mx.distributed (mlx[cpu] on Linux)")

PROMPT = list(range(40, 51))          # 11 tokens: with chunk 4 the prefill crosses two chunk boundaries
IDS = ",".join(map(str, PROMPT))


# -- the plan ------------------------------------------------------------------------------------
def test_ranges_parse_and_must_tile_the_model():
    assert parse_ranges("auto") is None
    assert plan("0:2, 2:6", 6, 2) == [(0, 2), (2, 6)]
    for spec, n, msg in (("0:2,3:6", 2, "follow each other"), ("0:2,2:5", 2, "model has 6"),
                         ("0:6", 2, "1 range"), ("0:2,2:6", 3, "2 range")):
        with pytest.raises(SplitError, match=msg):
            plan(spec, 6, n)
    for bad in ("", "0-2", "3:3", "a:b", "0:2,"):
        with pytest.raises(SplitError):
            parse_ranges(bad)
    with pytest.raises(ValueError, match="range"):
        EngineOptions(layers="0:2;2:6")


def test_auto_plan_follows_free_memory():
    assert auto_plan(6, 2) == [(0, 3), (3, 6)]
    assert auto_plan(6, 3) == [(0, 2), (2, 4), (4, 6)]
    # a rank with three times the memory takes about three times the layers
    assert auto_plan(8, 2, free=[3 << 30, 1 << 30]) == [(0, 6), (6, 8)]
    # every rank gets a layer, however little memory it has
    assert auto_plan(4, 3, free=[100, 1, 1]) == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(SplitError, match="at least one"):
        auto_plan(2, 3)


def test_layers_alone_runs_one_process_and_two_ranges_alone_are_refused(tiny_q2):
    os.environ.pop("MLX_HOSTFILE", None)
    with Engine.open(tiny_q2, EngineOptions(backend="numpy", layers="auto")) as eng:
        assert getattr(eng.model, "split", None) is None
    with pytest.raises(SplitError, match="mlx.launch"):
        Engine.open(tiny_q2, EngineOptions(backend="numpy", layers="0:3,3:6"))


# -- the payload from parts ------------------------------------------------------------------------
def test_partial_states_load_and_pack_the_single_process_payload(small_engine):
    """A payload loaded by two partial states (as two ranks do) and packed again from their layer
    blocks is the same bytes; the loaded rows are the full state's."""
    c = small_engine.config
    sess = Session(small_engine, 256, chunk=8)
    sess.sync(PROMPT * 2)
    data = sess.snapshot()
    parts = [PartialKVState(c, 256, sess.rewind_cap, r) for r in ((0, 2), (2, c.n_layer))]
    for p in parts:
        tokens, logits = snap.load(c, p, data)
    T = len(tokens)
    R = min(snap.raw_window(c, 256), T)
    layers = [p.layers[il] for p in parts for il in range(*p.span)]
    again = snap.pack(c, 256, sess.chunk, tokens, logits, [ls.n_comp for ls in layers],
                      [ls.n_index for ls in layers], [snap.layer_block(ls, T, R) for ls in layers])
    assert again == data
    # a partial state iterates its own layers only (what truncate, reset and a backend's walk see)
    assert [ls for ls in parts[0].layers] == [parts[0].layers[0], parts[0].layers[1]]


# -- a posted pass that fails ------------------------------------------------------------------------
def test_a_failed_posted_chunk_is_told_at_the_next_round_only():
    """A worker whose posted prefill chunk fails sends nothing then (rank 0 may be sending: no
    message may travel towards it outside a round), drops the posted chunks behind it, and
    answers the next round with its one line; after that it serves again."""
    from engine.runtime import distributed as D
    from engine.runtime.split_worker import Worker, unpack_json

    class FakeLink:
        rank, size = 1, 2

        def __init__(self, inbox):
            self.inbox, self.sent = list(inbox), []

        def recv(self):
            if not self.inbox:
                raise ConnectionError("closed")
            op, sid = self.inbox.pop(0)
            h = np.zeros(D.HEADER, np.int64)
            h[0], h[1] = op, sid
            return h, [np.arange(2, dtype=np.int64), np.zeros(8, np.float32)]

        def send(self, op, sid=0, args=(), parts=()):
            self.sent.append((op, [np.array(p, copy=True) for p in parts]))

    class Done(BaseException):
        pass

    class W(Worker):
        def _exit(self, rc):
            raise Done

    # no engine is bound here, so the first posted pass fails
    link = FakeLink([(D.POST, 7), (D.POST, 7), (D.FWD, 7), (D.CLOSE, 0)])
    with pytest.raises(Done):
        W(link, "m.gguf", None, None).run()
    ops = [op for op, _ in link.sent]
    assert ops == [D.ERR, D.CLOSE], ops
    assert unpack_json(link.sent[0][1][0]).startswith("rank 1: ")


# -- real ranks ------------------------------------------------------------------------------------
# Each rank count is one launch running every check in turn (process start and imports cost more
# than a small run): greedy 64 after a prefill of three chunks (stopped once after two) on two
# 6-layer synthetic models and two backends, then a session saved and one resumed.
BACKENDS = ("numpy", "cpu")
N_GEN = 64


def _backends():
    from engine.backends import registry
    return [b for b in BACKENDS if b in registry.available_names()]


def _single_lines(model, backend, n=N_GEN, chunk=4):
    with Engine.open(model, EngineOptions(backend=backend, paging="none", threads=1)) as eng:
        return stop_then_greedy(Session(eng, 256, chunk=chunk), PROMPT, n)


def _single_session(model):
    with Engine.open(model, EngineOptions(backend="numpy", paging="none")) as eng:
        sess = Session(eng, 256, chunk=4)
        sess.sync(PROMPT)
        single = sess.snapshot()
        want = greedy(sess, 8)
        sess.rewind(5)
        return {"kv": single.hex(), "want": want, "rewound": greedy(sess, 4)}


def _shared(tmp_path_factory, name, make):
    """`make()`'s value (JSON), made once for every pytest-xdist worker of this run: one worker
    computes it under a lock, the others read its file (one process's runs are a third of these
    tests' time)."""
    import fcntl
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent              # (the run's folder, above each worker's own)
    path = root / f"ds4-split-{name}"
    with open(root / "ds4-split.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            value = make()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(value))
            tmp.rename(path)
    return json.loads(path.read_text())


def _run_suite(tmp, n_ranks, models, backends, *, sessions=True, cache=False, **env):
    """One launch of n_ranks: rank 0's stdout lines by tag, and the workers' logs."""
    runs = [dict(tag=f"{b}-{name}", kind="tokens", model=str(m), backend=b, chunk=4, n=N_GEN)
            for b in backends for name, m in models.items()]
    if cache:           # --expert-cache 0 on every rank: each holds only the working set of experts
        runs.append(dict(tag="numpy-tiny-cache", kind="tokens", model=str(models["tiny"]), backend="numpy",
                         chunk=4, n=N_GEN, expert_cache=0))
    if sessions:
        small = str(models["small"])
        cut = ",".join(f"{a}:{b}" for a, b in auto_plan(6, n_ranks, free=[1] * (n_ranks - 1) + [2]))
        runs += [dict(tag="save", kind="save", model=small, backend="numpy", layers=cut, chunk=4,
                      out=str(tmp / "split.kv")),
                 dict(tag="resume", kind="resume", model=small, backend="numpy", src=str(tmp / "single.kv"), n=8)]
    spec = tmp / "suite.json"
    spec.write_text(json.dumps({"ids": IDS, "runs": runs}))
    log = tmp / "split-log"
    procs = spawn(tmp, [driver("suite", spec)] * n_ranks, DS4_KERNEL_THREADS=1, DS4_SPLIT_LOG=log, **env)
    res = finish(procs, timeout=600)
    assert [r[0] for r in res] == [0] * n_ranks, res[0][2][-2000:]
    assert all(not o and not e for _, o, e in res[1:]), "a worker printed something"
    by = {}
    for ln in res[0][1].splitlines():
        tag, _, rest = ln.partition(" ")
        by.setdefault(tag, []).append(rest)
    logs = {r: (tmp / f"split-log.rank{r}").read_text().splitlines() for r in range(1, n_ranks)}
    return by, logs


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_split_runs_match_one_process(n_ranks, tiny_q2, small_model, tmp_path, tmp_path_factory):
    """One launch of 2 or 3 ranks (process start and imports cost more than a small run), each
    check against one process:
    - numpy and cpu, two 6-layer synthetic models: greedy 64 after a prefill of three chunks,
      and the logits of a prefill stopped after its second chunk; on 2 ranks also with
      --expert-cache at its smallest (each rank caches only its layers' experts);
    - the prefill is pipelined: its first two chunks go on without an answer (rank 0 starts the
      next chunk at once), only the last comes back; every worker ran them in order;
    - a split run's session payload is the single process's, byte for byte (a split other than
      auto's); a single process's payload resumes split to the same tokens, as does a fork of
      it, and a rewind on every rank."""
    from engine.runtime import distributed as D
    models = {"tiny": tiny_q2, "small": small_model}
    one = _shared(tmp_path_factory, "session.json", lambda: _single_session(small_model))
    single, want, rewound = bytes.fromhex(one["kv"]), one["want"], one["rewound"]
    (tmp_path / "single.kv").write_bytes(single)
    by, logs = _run_suite(tmp_path, n_ranks, models, _backends(), cache=n_ranks == 2)
    for b in _backends():
        for name, m in models.items():
            ref = _shared(tmp_path_factory, f"{b}-{name}.json", lambda: _single_lines(m, b))
            assert by[f"{b}-{name}"][1:] == ref, (b, name)
            assert by[f"{b}-{name}"][0] == "prefill posted 2 rounds 1"
    if n_ranks == 2:            # --layers with --expert-cache (its smallest size): the same tokens
        assert by["numpy-tiny-cache"][1] == "cache True"
        assert by["numpy-tiny-cache"][2:] == _shared(tmp_path_factory, "numpy-tiny.json",
                                                     lambda: _single_lines(tiny_q2, "numpy"))
    for r, lines in logs.items():
        ops = [int(ln.split()[1]) for ln in lines]
        # a tokens run: NEW, the prefill (POST, POST, FWD), RESET, the stopped one (POST, POST, TAIL), the rest
        i = ops.index(D.NEW)
        assert ops[i + 1:i + 9] == [D.POST, D.POST, D.FWD, D.RESET, D.POST, D.POST, D.TAIL, D.FWD], (r, ops[:20])
    assert (tmp_path / "split.kv").read_bytes() == single
    lines = by["resume"]
    assert [ln for ln in lines if ln.startswith("gen[")] == want
    assert [ln[5:] for ln in lines if ln.startswith("fork ")] == want
    assert [ln[8:] for ln in lines if ln.startswith("rewound ")] == rewound


@pytest.mark.slow
@pytest.mark.parametrize("n_ranks", [2, 3])
def test_mlx_backend_split_gives_one_process_tokens(tiny_q2, tmp_path, n_ranks):
    from engine.backends import registry
    if "mlx" not in registry.available_names():
        pytest.skip("backend mlx is not built here")
    by, _ = _run_suite(tmp_path, n_ranks, {"tiny": tiny_q2}, ["mlx"], sessions=False)
    assert by["mlx-tiny"] == ["prefill posted 2 rounds 1"] + _single_lines(tiny_q2, "mlx")


@pytest.mark.parametrize("sig,says", [(signal.SIGKILL, "rank 1 is gone"), (signal.SIGSTOP, "rank 1 did not answer within")])
def test_a_killed_or_stopped_worker_ends_rank_0_with_one_line(tiny_q2, tmp_path, sig, says):
    """Killed: the link drops at once; stopped (a hung machine): the hop timeout, here 3 s."""
    saved = tmp_path / "saved.kv"
    procs = spawn(tmp_path, [driver("hang", tiny_q2, "auto", "numpy", IDS, saved)] * 2,
                  DS4_HOP_TIMEOUT=3, DS4_HOP_TOKEN_TIMEOUT=0.5)
    try:
        t_end = time.monotonic() + 60
        line = procs[0].stdout.readline()
        assert line.strip() == "ready", procs[0].stderr.read()[-2000:] if procs[0].poll() is not None else line
        before = saved.read_bytes()
        time.sleep(0.3)
        procs[1].send_signal(sig)
        t0 = time.monotonic()
        rc0, _, err = finish(procs[:1], timeout=max(1, t_end - time.monotonic()))[0]
        assert rc0 == 1 and time.monotonic() - t0 < 20
    finally:
        procs[1].kill()
        procs[1].wait()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], err[-2000:]
    assert saved.read_bytes() == before
    with Engine.open(tiny_q2, EngineOptions(backend="numpy", paging="none")) as eng:
        Session(eng, 256).restore(before)          # the file saved before the fault loads


def test_a_different_model_file_on_a_worker_is_refused(tiny_q2, small_model, tmp_path):
    procs = spawn(tmp_path, [driver("tokens", tiny_q2, "auto", "numpy", IDS, 2, 4),
                             driver("tokens", small_model, "auto", "numpy", IDS, 2, 4)])
    (rc0, out0, err0), _ = finish(procs, timeout=60)
    assert rc0 != 0 and "rank 1 has a different model file" in err0, err0[-2000:]
    assert "gen[" not in out0


def test_mlx_launch_runs_ds4_with_layers_like_one_process(tiny_q2, tmp_path):
    """The issue's own command line, through the real launcher."""
    launch = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    if launch is None:
        pytest.skip("mlx.launch is not installed beside this Python")
    ds4 = str(Path(sys.executable).parent / "ds4")
    args = ["-m", str(tiny_q2), "--backend", "numpy", "-p", "hi", "-n", "16", "--temp", "0", "--dump-tokens",
            "--ctx", "256", "--chunk", "4"]
    env = dict(os.environ, DS4_PAGING="none")
    env.pop("MLX_HOSTFILE", None)
    env.pop("MLX_RANK", None)
    one = subprocess.run([ds4, *args], capture_output=True, text=True, env=env, timeout=120)
    # (--verbose: the launcher says "completed" for each rank that exits 0; its own status is 0
    # whatever the ranks return, mlx 0.32)
    two = subprocess.run([launch, "--verbose", "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--starting-port",
                          str(spawn_port()), "--", ds4, *args, "--layers", "auto"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    said = two.stdout + two.stderr
    assert all(f"Node with rank {r} completed" in said for r in (0, 1)), said[-2000:]
    assert gen_lines(two.stdout) == gen_lines(one.stdout) and len(gen_lines(one.stdout)) == 16


def spawn_port() -> int:
    from helpers_split import free_ports
    return free_ports(1)[0]
