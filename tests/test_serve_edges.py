"""The serve rough edges a new user hit (issue 23, part 3), each checked where the user met it:

* a busy port, or a host that is not this machine's, is one `error:` line and exit 1, with no
  "serving on" banner before it (the sockets are bound before anything is announced);
* a stop signal during a streamed answer ends it the way its API ends a failed answer (Chat: an
  error object and no finish_reason, Responses: `response.failed`, Anthropic: an `error` event):
  the official SDKs raise or report the answer as not completed; and the process logs no
  "Exception in ASGI application", on one signal or two;
* a non-streamed answer cut inside its thinking gives the same fields as the streamed one:
  the thinking as reasoning, empty content, finish "length";
* a streamed continuation that needs a live tool state it loses while queued gets a real 409,
  not a 200 and then an error event;
* a context overflow found by the worker (after a text-prefix reuse) is each API's
  context-length error;
* a lone UTF-16 surrogate nested in a tool call's JSON arguments is a 400, not a 500.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

NO_THINK = {"thinking": {"type": "disabled"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(model: Path, *args: str) -> list[str]:
    exe = Path(sys.executable).with_name("ds4-agent")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "ds4agent.cli"]
    return head + ["--serve", "--model", str(model), "--ctx", "4096", *args]


# ------------------------------------------------------------------------------------------
# 1. Binding

def _run_serve(model: Path, tmp: Path, *args: str) -> tuple[int, str]:
    p = subprocess.run(_serve_cmd(model, *args), capture_output=True, text=True, timeout=120, cwd=tmp,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return p.returncode, p.stderr


def test_a_busy_port_is_one_line_and_no_banner(agent_model, tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        rc, err = _run_serve(agent_model, tmp_path, "--port", str(port))
    assert rc == 1, err
    assert err.strip().splitlines() == [err.strip()], err        # one line
    assert err.startswith(f"error: port {port} is in use"), err
    assert "serving" not in err


@pytest.mark.parametrize("host, words", [("192.0.2.1", "not an address of this machine"),
                                         ("no-such-host.invalid", "does not resolve")])
def test_a_host_that_cannot_be_bound_is_one_line(agent_model, tmp_path, host, words):
    rc, err = _run_serve(agent_model, tmp_path, "--host", host, "--port", str(_free_port()))
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: cannot serve on host {host}"), err
    assert words in err


def test_port_out_of_range_is_a_flag_error(agent_model, tmp_path):
    rc, err = _run_serve(agent_model, tmp_path, "--port", "70000")
    assert rc == 2 and err.strip() == "error: --port must be at most 65535", err
