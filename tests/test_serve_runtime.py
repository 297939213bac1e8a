"""The shim's server runtime (ds4agent/serve/server.py, worker.py's queue bound, cli.py's shutdown):

* a client that sends its request line and headers slowly, or nothing at all, is closed once the
  header timeout passes; a body that stalls or trickles likewise (with a 408), and normal
  requests still pass meanwhile; a client that reads nothing of its answer is dropped too;
* open connections are capped: past the cap the oldest idle ones are closed, so a new client is
  still answered; in a subprocess with a lowered RLIMIT_NOFILE, hundreds of idle connections
  leave a normal request answered and the log short, and so does a limit lowered below the
  open connections (the accept loop's `Too many open files` is logged once, not per attempt);
* the queue of requests waiting for the worker is bounded: past it a 503 in the API's JSON shape
  with Retry-After, streamed or not;
* SIGTERM and SIGINT both stop the server, run the shutdown save and exit 0.
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import threading
import time

import httpx
import pytest

from ds4agent.serve import ServeConfig, ServerThread, Shim
from ds4agent.serve import worker as W
from helpers_serve import NO_THINK, ServeProc, hold_slots

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **NO_THINK}


def serve(engine, **kw) -> ServerThread:
    return ServerThread(Shim(engine, ServeConfig(ctx=4096, **kw)))


def hostport(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[1].split(":")
    return host, int(port)


def closed_after(s: socket.socket, limit: float, trickle: bytes = b"") -> tuple[float, bytes]:
    """Seconds until the server closes `s` (reading what it sent), sending one byte of `trickle`
    every 0.1 s meanwhile. Fails past `limit`."""
    t0 = time.monotonic()
    got = b""
    s.settimeout(0.1)
    i = 0
    while time.monotonic() - t0 < limit:
        if i < len(trickle):
            try:
                s.sendall(trickle[i:i + 1])
            except OSError:            # closed under us: what it sent is still readable
                pass
            i += 1
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0, got
        if not chunk:
            return time.monotonic() - t0, got
        got += chunk
    pytest.fail(f"the server kept the connection open past {limit} s (sent {got!r})")


def watch_all(*socks: tuple[socket.socket, bytes], limit: float = 5) -> list[tuple[float, bytes]]:
    """closed_after for several sockets at once (each on a thread, all clocks starting now)."""
    out: list = [None] * len(socks)

    def one(i, s, trickle):
        try:
            out[i] = closed_after(s, limit, trickle)
        except BaseException as e:       # pytest.fail raises outside Exception
            out[i] = e
    threads = [threading.Thread(target=one, args=(i, s, t)) for i, (s, t) in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit + 5)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


# ------------------------------------------------------------------------------------------
# Slow clients

def test_slow_or_silent_headers_are_closed(agent_engine):
    with serve(agent_engine, header_timeout_s=0.6) as url:
        addr = hostport(url)
        silent = socket.create_connection(addr)
        partial = socket.create_connection(addr)
        partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        trickler = socket.create_connection(addr)
        # a header line that never ends, one byte every 0.1 s: each byte must not restart the clock
        trickle = b"X-Slow: " + b"a" * 200
        (t_silent, got_silent), (t_partial, got_partial), (t_trickle, got_trickle) = watch_all(
            (silent, b""), (partial, b""), (trickler, trickle))
        assert t_silent < 1.5 and got_silent == b""
        for t, got in ((t_partial, got_partial), (t_trickle, got_trickle)):
            assert t < 1.5, t
            assert got.startswith(b"HTTP/1.1 408 "), got
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        # normal requests still pass, and a slow second request on a kept-alive connection is
        # timed like the first
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        s = socket.create_connection(addr)
        body = json.dumps(CHAT).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        s.settimeout(30)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        t, got = closed_after(s, 5, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + b"X: " + b"b" * 100)
        assert t < 1.5 and b"408" in got.split(b"\r\n", 1)[0], got


def test_slow_body_is_closed_with_408(agent_engine):
    with serve(agent_engine, body_timeout_s=0.6, body_min_rate=10 ** 9) as url:
        addr = hostport(url)
        stalled = socket.create_connection(addr)
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"messages\"")
        trickler = socket.create_connection(addr)
        trickler.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n")
        (t1, got1), (t2, got2) = watch_all((stalled, b""), (trickler, b" " * 200))
        for t, got in ((t1, got1), (t2, got2)):
            assert t < 1.5, t
            assert got.startswith(b"HTTP/1.1 408 "), got
        assert json.loads(got2.split(b"\r\n\r\n", 1)[1])["type"] == "error"      # Anthropic's shape
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_long_body_that_keeps_up_the_rate_is_read(agent_engine):
    """The body deadline grows with what arrived: a body slower than the base timeout but
    faster than the minimum rate is read whole."""
    with serve(agent_engine, body_timeout_s=0.5, body_min_rate=200) as url:
        s = socket.create_connection(hostport(url))
        body = json.dumps(dict(CHAT, messages=[{"role": "user", "content": "x" * 250}])).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        for i in range(0, len(body), 40):          # ~400 bytes a second, for about 0.8 s
            s.sendall(body[i:i + 40])
            time.sleep(0.1)
        s.settimeout(30)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        assert got.startswith(b"HTTP/1.1 200 "), got[:200]


def test_a_client_that_reads_nothing_is_dropped_after_the_write_timeout(agent_engine):
    """The transport's buffer full (asyncio pauses writing) for write_timeout_s: closed. Filling a
    loopback socket's buffers takes megabytes, so the pause is signalled directly."""
    server = serve(agent_engine, write_timeout_s=0.3)
    with server as url:
        s = socket.create_connection(hostport(url))
        t0 = time.monotonic()
        while not server.server.server_state.connections:
            assert time.monotonic() - t0 < 5
            time.sleep(0.01)
        (proto,) = server.server.server_state.connections
        loop = proto.loop
        loop.call_soon_threadsafe(proto.pause_writing)
        t, _ = closed_after(s, 5)
        assert 0.2 < t < 1.5, t
        # a pause that ends in time leaves the connection open
        s2 = socket.create_connection(hostport(url))
        time.sleep(0.2)
        (proto2,) = [c for c in server.server.server_state.connections if c is not proto]
        loop.call_soon_threadsafe(proto2.pause_writing)
        time.sleep(0.1)
        loop.call_soon_threadsafe(proto2.resume_writing)
        time.sleep(0.5)
        s2.setblocking(False)
        with pytest.raises(BlockingIOError):
            s2.recv(1)                       # still open: no EOF
        s2.close()


# ------------------------------------------------------------------------------------------
# Connection cap

def test_connection_cap_closes_the_oldest_idle(agent_engine):
    with serve(agent_engine, max_connections=20) as url:
        addr = hostport(url)
        idle = [socket.create_connection(addr) for _ in range(40)]
        time.sleep(0.3)
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
        still = 0
        for s in idle:
            s.setblocking(False)
            try:
                s.recv(1)                    # b"" (or a reset): the server closed it
            except BlockingIOError:
                still += 1                   # open: nothing to read, no EOF
            except OSError:
                pass
            s.close()
        assert still <= 20, still
        assert still >= 10, still            # the newest ones were kept, not all dropped


def test_connections_over_the_cap_with_none_idle_get_a_json_503(agent_engine):
    """Every connection busy with a request: the next one is answered 503 in the API's shape."""
    with serve(agent_engine, max_connections=3, body_timeout_s=30) as url:
        addr = hostport(url)
        busy = []
        for _ in range(3):                       # each sits in its body: not idle
            s = socket.create_connection(addr)
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{")
            busy.append(s)
        time.sleep(0.3)
        r = httpx.post(url + "/v1/messages", json=CHAT, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["type"] == "error" and r.headers["retry-after"].isdigit()
        for s in busy:
            s.close()


# ------------------------------------------------------------------------------------------
# The queue bound

def test_queue_bound_counts_only_live_jobs(agent_engine):
    shim = Shim(agent_engine, ServeConfig(ctx=4096, max_queue=2))     # not started: jobs stay queued
    jobs = [shim.prepare("openai_chat", json.dumps(CHAT).encode(), lambda ev: None) for _ in range(4)]
    shim.worker.submit(jobs[0])
    shim.worker.submit(jobs[1])
    with pytest.raises(W.QueueFull) as e:
        shim.worker.submit(jobs[2])
    assert e.value.retry_after >= 1 and "2" in str(e.value)
    jobs[0].cancel.set()                     # a client that left does not hold a place
    shim.worker.submit(jobs[3])
    assert shim.worker.waiting() == 2


@pytest.mark.parametrize("stream", [False, True])
def test_requests_past_the_queue_bound_get_503_with_retry_after(agent_engine, stream):
    server = serve(agent_engine, max_queue=2)
    with server as url:
        shim = server.shim
        began = hold_slots(shim, 2.5, request=CHAT)
        assert began.wait(10)
        results = []

        def post():
            results.append(httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code)
        waiting = [threading.Thread(target=post) for _ in range(2)]
        for t in waiting:
            t.start()
        t0 = time.monotonic()
        while shim.worker.waiting() < 2:
            assert time.monotonic() - t0 < 10, "the two requests never queued"
            time.sleep(0.01)
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", CHAT)):
            t1 = time.monotonic()
            r = httpx.post(url + path, json=dict(body, stream=stream), timeout=60)
            assert time.monotonic() - t1 < 1.0                    # answered at once, not queued
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert 1 <= int(r.headers["retry-after"]) <= 60
            err = r.json()["error"]
            assert "queue" in err["message"]
        # a full queue refuses before the body is read or tokenized: a body that would be a 400
        # (not JSON) is a 503 too, and the shim never sees it
        prepared = shim.worker.stats["requests"]
        calls = []
        real_prepare = shim.prepare
        shim.prepare = lambda *a: calls.append(a) or real_prepare(*a)
        try:
            r = httpx.post(url + "/v1/chat/completions", content=b"not json", timeout=60)
        finally:
            shim.prepare = real_prepare
        assert r.status_code == 503 and "retry-after" in r.headers and not calls, r.text
        assert shim.worker.stats["requests"] == prepared
        for t in waiting:
            t.join(60)
        assert results == [200, 200]
        # room again once the queue drained
        assert httpx.post(url + "/v1/chat/completions", json=dict(CHAT, stream=stream),
                          timeout=60).status_code == 200


# ------------------------------------------------------------------------------------------
# Subprocess servers: fd limit, signals

Proc = ServeProc          # test_mlx_user.py imports it from here


def _post_or_503(url: str) -> int:
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    if r.status_code == 503:
        assert r.json()["error"]["message"]
    return r.status_code


def test_idle_connections_under_a_low_fd_limit(agent_model, tmp_path):
    srv = ServeProc(agent_model, tmp_path, nofile=256)
    idle = []
    try:
        for _ in range(400):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(0.5)
        t0 = time.monotonic()
        assert _post_or_503(srv.url) == 200
        assert time.monotonic() - t0 < 30
    finally:
        for s in idle:
            s.close()
        rc = srv.stop()
    log = srv.text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "Too many open files" not in log, log[-3000:]     # the cap kept it below the limit
    assert len(log.splitlines()) < 40, log[-3000:]


def test_accept_at_the_fd_limit_logs_once(agent_model, tmp_path):
    """The limit lowered under a running server (prlimit) below what its cap allows: accept()
    fails with EMFILE. One warning, not one traceback per attempt; once connections close
    (header timeout), it serves again."""
    srv = ServeProc(agent_model, tmp_path, "--header-timeout", "2")
    held = []
    try:
        fds = len(os.listdir(f"/proc/{srv.p.pid}/fd"))
        soft, hard = resource.prlimit(srv.p.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(srv.p.pid, resource.RLIMIT_NOFILE, (fds + 20, hard))
        for _ in range(60):            # 20 get in, the rest wait in the listen backlog
            held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(1.5)
        for s in held:
            s.close()
        held = []
        time.sleep(4)                  # the backlog's connections were accepted and timed out
        assert _post_or_503(srv.url) == 200
    finally:
        for s in held:
            s.close()
        rc = srv.stop()
    log = srv.text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert log.count("Too many open files") == 1, log[-3000:]
    assert len(log.splitlines()) < 40, log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_session_and_exits_0(agent_model, tmp_path, sig):
    kv = tmp_path / "kv"
    srv = ServeProc(agent_model, tmp_path, "--kv-disk-dir", str(kv), "--kv-cache-min-tokens", "4",
               "--kv-cache-cold-max-tokens", "0", "--kv-cache-continued-interval-tokens", "0")
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, (r.text, srv.text()[-3000:])
    assert not list(kv.glob("*.kv"))             # no save before the shutdown one
    rc = srv.stop(sig)
    log = srv.text()
    assert rc == 0, log[-3000:]
    assert re.search(r"kv cache: stored tokens=\d+ reason=shutdown", log), log[-3000:]
    assert len(list(kv.glob("*.kv"))) == 1
    assert "Traceback" not in log, log[-3000:]
