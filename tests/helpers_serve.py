"""Helpers shared by the HTTP shim's tests (test_serve_*.py): a running shim with SDK clients and its
trace records, one SSE frame read as (event, data), a worker whose slots are held busy, and
`ds4-agent --serve` in a subprocess."""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

NO_THINK = {"thinking": {"type": "disabled"}}


class Server:
    """A running shim: its url, SDK clients, and what the worker recorded per request (the shim's
    `trace` file). With `one_record_each`, last() also checks that a request wrote exactly one."""

    def __init__(self, shim, url: str, one_record_each: bool = True):
        # the SDKs are imported here: the modules that use this class skip without them
        import anthropic
        import openai
        self.shim, self.url = shim, url
        self.worker = shim.worker
        self.oc = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        self.ac = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
        self.one_record_each = one_record_each
        self._seen = 0

    def evaluated(self) -> int:
        """Tokens the sessions have run through the model so far (prefill chunks and single steps)."""
        # every slot's session (with --slots N a request may run on any of them)
        return sum(s.session.stats["prefill_tokens"] + s.session.stats["decode_tokens"]
                   for s in self.worker.slots)

    def records(self) -> list[dict]:
        path = self.shim.cfg.trace
        try:
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []

    def last(self) -> dict:
        """The trace record of the request just answered (a stream's record is written when its
        generator ends, which may be a moment after the SDK saw the last event)."""
        deadline = time.monotonic() + 10
        while True:
            recs = self.records()
            if len(recs) > self._seen:
                if self.one_record_each:
                    assert len(recs) == self._seen + 1, "one trace record per request"
                self._seen = len(recs)
                return recs[-1]
            assert time.monotonic() < deadline, "no trace record for the request"
            time.sleep(0.02)


def sse_event(frame: str):
    """(name, data) of one SSE frame, data parsed from JSON ("[DONE]" kept); (":", frame) for a comment."""
    if frame.startswith(":"):
        return ":", frame
    name, data = None, None
    for line in frame.split("\n"):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
    return name, (data if data == "[DONE]" else json.loads(data))


def hold_slots(shim, seconds: float, slots: int | None = None, release: threading.Event | None = None,
               request: dict | None = None) -> threading.Event:
    """Occupy `slots` inference slots (default: every one, so the next request queues) for
    `seconds` of wall time, or until `release` is set, whatever the machine's speed: tiny chat jobs
    (`request`'s fields, default one token without thinking) whose first event blocks. Returns an
    event set once every hold began."""
    began = threading.Event()
    n = len(shim.worker.slots) if slots is None else slots
    held = []
    lock = threading.Lock()
    release = release or threading.Event()
    request = {"max_tokens": 1, **NO_THINK} if request is None else request

    def hold():
        state = {"held": False}

        def emit(ev):
            if not state["held"]:
                state["held"] = True
                with lock:
                    held.append(1)
                    if len(held) == n:
                        began.set()
                release.wait(seconds)
        return emit

    for i in range(n):
        body = dict(request, messages=[{"role": "user", "content": f"hold {i}"}])
        shim.worker.submit(shim.prepare("openai_chat", json.dumps(body).encode(), hold()))
    if n == 0:
        began.set()
    return began


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(model: Path, *args: str) -> list[str]:
    """`ds4-agent --serve` on `model` with a 4096 context: the installed script, else the module."""
    exe = Path(sys.executable).with_name("ds4-agent")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "ds4agent.cli"]
    return head + ["--serve", "--model", str(model), "--ctx", "4096", *args]


class ServeProc:
    """`ds4-agent --serve` in a subprocess on a free port, its stderr in a file; with `nofile`, under
    that RLIMIT_NOFILE. Returns once the port accepts connections."""

    def __init__(self, model: Path, tmp: Path, *args: str, nofile: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"

        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        self.p = subprocess.Popen(serve_cmd(model, "--port", str(self.port), *args), cwd=tmp,
                                  stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"),
                                  preexec_fn=limit if nofile else None, env=dict(os.environ, PYTHONUNBUFFERED="1"))
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

    # before signal(): the default is read from the module `signal`, not this class's method
    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        self.p.send_signal(sig)
        return self.wait(timeout, f" on {sig!r}")

    def signal(self, n: int):
        """n SIGINTs, 0.3 s apart (a second Ctrl+C)."""
        for i in range(n):
            if i:
                time.sleep(0.3)
            self.p.send_signal(signal.SIGINT)

    def wait(self, timeout: float = 60, what: str = "") -> int:
        """The exit status; a server still running after `timeout` is killed and fails the test."""
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"the server did not exit{what}:\n{self.text()[-3000:]}")
