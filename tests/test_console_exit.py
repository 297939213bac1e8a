"""How the console commands end: Ctrl+C and SIGTERM on the MLX backend (a clean 130, never
`terminate called without an active exception`), and readers that go away (a quiet exit 141)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ds4-agent -p on the MLX backend, with an agent whose turn decodes until it is interrupted: the real
# command line, headless runner, worker thread, engine and session; only the agent is replaced (the
# real one first prefills the ~4k-token system prompt: minutes on MLX's CPU build)
FAKE_AGENT_RUN = textwrap.dedent("""
    import os, sys, threading, time
    import ds4agent.agent as agent_mod
    from ds4agent import events as E
    from ds4agent.cli import main

    class MlxBusyAgent:
        def __init__(self, engine, project, config=None, store=None, emit=None, mcp=None):
            self.engine, self.emit, self.store, self.cfg = engine, emit, None, config
            self.modified = False
            self._stop = threading.Event()
        def start(self):
            pass
        def interrupt(self):
            self._stop.set()
        def answer_approval(self, a):
            pass
        def submit(self, text):
            # real decode steps of the engine on the worker thread, as a turn makes them
            from engine import Rng, SamplingParams, Session
            sess = Session(self.engine, 256)
            sess.sync([1, 2, 3])
            self.emit(E.TextDelta("working"))
            params, rng = SamplingParams(temperature=1.0), Rng(1)
            stopped_at = None
            # SLOW_STOP: the turn goes on for 3 s after the interrupt, as a long prefill chunk does
            slow = 3.0 if os.environ.get("SLOW_STOP") else 0.0
            while stopped_at is None or time.monotonic() - stopped_at < slow:
                if stopped_at is None and self._stop.is_set():
                    stopped_at = time.monotonic()
                if sess.pos >= 250:
                    sess.rewind(3)
                sess.eval(sess.sample(params, rng))
            self.emit(E.TurnFinished(finish_reason="stop", interrupted=True))
        def command(self, line):
            return ""
        def save_on_exit(self):
            pass

    agent_mod.Agent = MlxBusyAgent
    sys.exit(main(sys.argv[1:]))
""")


def _interrupt_mid_run(argv, sig, cwd, env, twice=False, timeout=120):
    env = dict(env, SLOW_STOP="1") if twice else env
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = p.stdout.read(1)           # the turn has started: its first answer text
        assert first, p.stderr.read().decode(errors="replace")[-2000:]
        time.sleep(0.3)
        p.send_signal(sig)
        if twice:
            time.sleep(0.05)
            p.send_signal(sig)
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err.decode(errors="replace")


# twice: a second signal leaves at once, while the engine thread is still inside MLX (the fake turn
# stops 3 s after its interrupt); ~6 s each, so two of the four run by default
@pytest.mark.parametrize("sig,twice", [(signal.SIGINT, False), (signal.SIGTERM, True),
                                       pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow),
                                       pytest.param(signal.SIGINT, True, marks=pytest.mark.slow)],
                         ids=["sigint", "sigterm-twice", "sigterm", "sigint-twice"])
def test_mlx_headless_run_interrupted_mid_turn_exits_130_without_abort(tmp_path, tiny_q2, sig, twice):
    pytest.importorskip("mlx.core", reason="the MLX backend is not installed (the test extra has mlx[cpu])")
    env = dict(os.environ, DS4_AGENT_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    (tmp_path / "proj").mkdir()
    rc, err = _interrupt_mid_run([sys.executable, "-c", FAKE_AGENT_RUN, "--backend", "mlx", "-m", str(tiny_q2),
                                  "--ctx", "8192", "-p", "hi"], sig, tmp_path / "proj", env, twice=twice)
    assert "terminate called" not in err, err[-2000:]
    assert rc == 130, (rc, err[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_mlx_real_agent_interrupted_mid_generation_exits_130(tmp_path, agent_model, sig):
    """The real agent end to end (its first run prefills the system prompt on MLX: minutes)."""
    pytest.importorskip("mlx.core", reason="the MLX backend is not installed (the test extra has mlx[cpu])")
    env = dict(os.environ, DS4_AGENT_HOME=str(tmp_path / "home"))
    (tmp_path / "proj").mkdir()
    exe = Path(sys.executable).parent / "ds4-agent"
    rc, err = _interrupt_mid_run([str(exe), "--backend", "mlx", "-m", str(agent_model), "--ctx", "8192",
                                  "--nothink", "-p", "write a long story"], sig, tmp_path / "proj", env,
                                 timeout=900)
    assert "terminate called" not in err, err[-2000:]
    assert rc == 130, (rc, err[-2000:])
