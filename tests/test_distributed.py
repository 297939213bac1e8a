"""The model split by layers across ranks (issue 38): the plan, the partial KV state and the
snapshot's layer blocks in one process; then real ranks on loopback (mx.distributed's ring
backend, the environment mlx.launch sets, and one run through mlx.launch itself), each compared
token for token and byte for byte with one process."""
from __future__ import annotations

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
from helpers_split import driver, finish, gen_lines, greedy, spawn

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


# -- real ranks ------------------------------------------------------------------------------------
def _single_tokens(model, n, chunk=4, backend="numpy"):
    with Engine.open(model, EngineOptions(backend=backend, paging="none", threads=1)) as eng:
        sess = Session(eng, 256, chunk=chunk)
        sess.sync(PROMPT)
        return greedy(sess, n)


def _split_tokens(tmp, model, n_ranks, backend, n=64):
    # one compute thread a rank, waiting passively: ranks that take turns on 2 cores must not
    # spin OpenMP threads at each other (the cpu backend ran 10x slower so)
    procs = spawn(tmp, [driver("tokens", model, "auto", backend, IDS, n, 4)] * n_ranks,
                  DS4_KERNEL_THREADS=1, OMP_WAIT_POLICY="PASSIVE")
    res = finish(procs)
    assert [r[0] for r in res] == [0] * n_ranks, res[0][2][-2000:]
    assert all(not o and not e for _, o, e in res[1:]), "a worker printed something"
    return gen_lines(res[0][1])


def test_two_ranks_numpy_give_one_process_tokens(tiny_q2, tmp_path):
    """Greedy, 64 tokens after a prefill crossing chunk boundaries, 6 layers split 3+3."""
    assert _split_tokens(tmp_path, tiny_q2, 2, "numpy") == _single_tokens(tiny_q2, 64)


@pytest.mark.slow
@pytest.mark.parametrize("n_ranks,backend", [(3, "numpy"), (2, "cpu"), (3, "cpu"), (2, "mlx")])
def test_more_ranks_and_the_cpu_backend_give_one_process_tokens(tiny_q2, tmp_path, n_ranks, backend):
    from engine.backends import registry
    if backend not in registry.available_names():
        pytest.skip(f"backend {backend} is not built here")
    assert _split_tokens(tmp_path, tiny_q2, n_ranks, backend) == _single_tokens(tiny_q2, 64, backend=backend)


def test_sessions_move_both_ways_between_split_and_single(small_model, tmp_path):
    """A 2-rank run's payload is the single process's, byte for byte; a single process's payload
    resumes in a 2-rank run to the same tokens, as does a fork of it, and a rewind on every rank."""
    with Engine.open(small_model, EngineOptions(backend="numpy", paging="none")) as eng:
        sess = Session(eng, 256, chunk=4)
        sess.sync(PROMPT)
        single = sess.snapshot()
        want = greedy(sess, 8)
        sess.rewind(5)
        rewound = ["rewound " + ln for ln in greedy(sess, 4)]
    out = tmp_path / "split.kv"
    res = finish(spawn(tmp_path, [driver("save", small_model, "0:2,2:6", "numpy", IDS, 4, out)] * 2))
    assert [r[0] for r in res] == [0, 0], res[0][2][-2000:]
    assert out.read_bytes() == single
    src = tmp_path / "single.kv"
    src.write_bytes(single)
    res = finish(spawn(tmp_path, [driver("resume", small_model, "0:3,3:6", "numpy", src, 8)] * 2))
    assert [r[0] for r in res] == [0, 0], res[0][2][-2000:]
    lines = res[0][1].splitlines()
    assert gen_lines(res[0][1]) == want
    assert [ln[5:] for ln in lines if ln.startswith("fork ")] == want
    assert [ln for ln in lines if ln.startswith("rewound ")] == rewound


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
    two = subprocess.run([launch, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--starting-port",
                          str(spawn_port()), "--", ds4, *args, "--layers", "auto"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert gen_lines(two.stdout) == gen_lines(one.stdout) and len(gen_lines(one.stdout)) == 16


def spawn_port() -> int:
    from helpers_split import free_ports
    return free_ports(1)[0]
