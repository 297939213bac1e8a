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


# ------------------------------------------------------------------------------------------
# 2. A stop signal during a streamed answer

class _Proc:
    """`ds4-agent --serve` in a subprocess on a free port, its stderr in a file."""

    def __init__(self, model: Path, tmp: Path, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        self.p = subprocess.Popen(_serve_cmd(model, "--port", str(self.port), *args), cwd=tmp,
                                  stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"),
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        t0 = time.monotonic()
        while True:
            assert self.p.poll() is None, self.text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() - t0 < 60, "the server never listened"
                time.sleep(0.1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, n: int):
        for i in range(n):
            if i:
                time.sleep(0.3)
            self.p.send_signal(signal.SIGINT)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"the server did not exit:\n{self.text()[-3000:]}")


LONG = 3000          # tokens the answer may take: far more than the test waits for


def _chat(url, sigs, srv):
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    seen = []
    with pytest.raises(openai.APIError) as e:
        for i, chunk in enumerate(client.chat.completions.create(
                model="deepseek-chat", stream=True, max_tokens=LONG, temperature=0,
                messages=[{"role": "user", "content": "Tell me a long story."}])):
            seen += [c.finish_reason for c in chunk.choices]
            if i == 3:
                srv.signal(sigs)
    assert "shutting down" in str(e.value.message)
    assert seen and not any(seen), seen          # no finish_reason: the answer did not end


def _responses(url, sigs, srv):
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    types = []
    last = None
    for i, ev in enumerate(client.responses.create(model="deepseek-chat", stream=True, input="Tell me a story.",
                                                   max_output_tokens=LONG, reasoning={"effort": "none"})):
        types.append(ev.type)
        last = ev
        if ev.type == "response.output_text.delta" and types.count(ev.type) == 3:
            srv.signal(sigs)
    assert last.type == "response.failed", types
    assert last.response.status == "failed" and "shutting down" in last.response.error.message
    assert "response.completed" not in types and "response.incomplete" not in types
    # the open message item closed as incomplete before it
    assert last.response.output and last.response.output[-1].status == "incomplete"


def _anthropic(url, sigs, srv):
    import anthropic
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    stops = []
    with pytest.raises(anthropic.APIStatusError) as e:
        for i, ev in enumerate(client.messages.create(
                model="deepseek-v4-flash", stream=True, max_tokens=LONG, **NO_THINK,
                messages=[{"role": "user", "content": "Tell me a long story."}])):
            if ev.type == "message_delta":
                stops.append(ev.delta.stop_reason)
            if i == 4:
                srv.signal(sigs)
    assert e.value.body["error"]["type"] == "overloaded_error", e.value.body
    assert not stops                             # no stop_reason: the answer did not end


@pytest.mark.parametrize("client, sigs", [(_chat, 1), (_chat, 2), (_responses, 2), (_anthropic, 2)],
                         ids=["chat-one-signal", "chat-two", "responses-two", "anthropic-two"])
def test_a_stop_signal_ends_a_stream_as_a_failed_answer(agent_model, tmp_path, client, sigs):
    """One signal: the grace period (10 s) passes with the answer still running, then it is
    ended; two: at once. Either way the SDK sees an answer that did not complete, the process
    exits 0, and its log has no traceback."""
    srv = _Proc(agent_model, tmp_path)
    t0 = time.monotonic()
    try:
        client(srv.url, sigs, srv)
    finally:
        rc = srv.wait()
    log = srv.text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert time.monotonic() - t0 < (40 if sigs == 1 else 25), log[-3000:]
