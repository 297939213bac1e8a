"""The shim's HTTP server runtime: uvicorn's h11 server with the limits a long-running server needs
against slow or idle clients, and a shutdown that always runs (docs/serve.md, "Limits, timeouts,
shutdown").

uvicorn has a keep-alive timeout (idle time between requests) but nothing for a client that opens a
connection and then sends its request line, headers or body slowly or not at all, and its
`limit_concurrency` only answers requests (in plain text): idle sockets are never closed, so enough
of them exhaust the file descriptors. `Protocol` adds per-connection deadlines and a connection cap
that closes the oldest idle connection first; `Server` logs an accept loop at the fd limit once, and
leaves the process's signal disposition alone on the way out (uvicorn re-raises SIGTERM after its
shutdown, which killed the process before the shim's own shutdown save).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import signal
import socket
import sys
import threading
import time

import os

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServeConfig
from .wire import error_body

log = logging.getLogger("ds4agent.serve")

# File descriptors kept free of client sockets: the model file, KV checkpoints being written or
# read, the trace file, logging, the event loop's own (epoll, self-pipe) and the listening socket.
FD_RESERVE = 64
# Connections over the cap while none is idle: answered 503 (they need their headers read first);
# past this many more, closed at once so the fds stay bounded whatever clients do.
OVERFLOW = 16
# listen() queue, and how many connections asyncio accepts in one go before any of them reaches
# the cap check (which runs a loop iteration later; a closed socket is released one after that):
# the cap leaves room for two such bursts
ACCEPT_BACKLOG = 64
LOG_EVERY_S = 60.0           # one line per condition (cap reached, fd limit) at most this often
# After the grace period the open answers are ended in their API's terms: this long for their last
# frames to go out, then their connections are closed (a stalled client must not hold the exit).
INTERRUPT_S = 2.0
_HANDLED = (signal.SIGINT, signal.SIGTERM)


def fd_soft_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(cfg: ServeConfig, soft_limit: int | None = None) -> int:
    """--max-connections, kept below the open-files limit with room for the process's own files."""
    soft = fd_soft_limit() if soft_limit is None else soft_limit
    room = soft - FD_RESERVE - OVERFLOW - 2 * ACCEPT_BACKLOG
    cap = min(cfg.max_connections, room)
    if cap < cfg.max_connections:
        log.warning("open files limit %d: at most %d connections (--max-connections %d)",
                    soft, max(1, cap), cfg.max_connections)
    return max(1, cap)


class _Once:
    """A log line that repeats at most every LOG_EVERY_S, saying how often it was held back."""

    def __init__(self):
        self.last = -LOG_EVERY_S
        self.held = 0

    def __call__(self, msg: str, *args):
        now = time.monotonic()
        if now - self.last < LOG_EVERY_S:
            self.held += 1
            return
        more = f" ({self.held} more since the last report)" if self.held else ""
        self.last, self.held = now, 0
        log.warning(msg + more, *args)


def _json_answer(status: int, reason: str, path: bytes, message: str,
                 retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, in the API's error shape (the API is
    guessed from the path: the request may not have been parsed)."""
    api = "anthropic" if b"/messages" in path else "openai_chat"
    body = error_body(api, message, status).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _over_cap_app(scope, receive, send):
    """The app a connection over the cap gets: 503 with Retry-After, then the connection closes."""
    api = "anthropic" if "/messages" in scope.get("path", "") else "openai_chat"
    body = error_body(api, "too many open connections; retry shortly", 503).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines: the request line and headers must be complete within
    `header_timeout_s` of their first byte (or of the connection's opening), the body within
    `body_timeout_s` plus one second per `body_min_rate` bytes received, and a client that reads
    nothing of its answer for `write_timeout_s` is dropped. The subclass made by `protocol_for`
    carries the settings and the connection cap."""

    cfg: ServeConfig
    cap: int
    noted: _Once

    def connection_made(self, transport):
        super().connection_made(transport)
        self._idle_since = time.monotonic()
        self._header_timer = self._body_timer = self._write_timer = None
        self._body_start = 0.0
        self._body_got = 0
        self._arm_header_timer()
        if len(self.connections) > self.cap and self._open_count() > self.cap:
            self._make_room()

    def connection_lost(self, exc):
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes):
        was_idle = self._waiting_for_headers()
        in_body = self.conn.their_state is h11.SEND_BODY
        super().data_received(data)
        if self.transport.is_closing():
            return
        if in_body:
            self._body_got += len(data)
        if was_idle and self._header_timer is None and self._waiting_for_headers():
            self._arm_header_timer()          # the first byte of a kept-alive connection's next request
        self._track_state()

    def handle_events(self):
        super().handle_events()
        self._track_state()

    def on_response_complete(self):
        super().on_response_complete()
        self._idle_since = time.monotonic()
        self._track_state()

    def pause_writing(self):
        super().pause_writing()
        if self._write_timer is None and self.cfg.write_timeout_s > 0:
            self._write_timer = self.loop.call_later(self.cfg.write_timeout_s, self._drop_reader)

    def resume_writing(self):
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # -- state -------------------------------------------------------------------------------------
    def _waiting_for_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _open_count(self) -> int:
        """Connections not already closing (one closed stays listed until its socket is gone)."""
        return sum(1 for c in self.connections if c.transport is not None and not c.transport.is_closing())

    def _idle(self) -> bool:
        """Nothing in progress: waiting for a request that has not started arriving (a connection
        with partial headers counts too: it is the slow client the cap makes room against)."""
        return not self.transport.is_closing() and self._waiting_for_headers()

    def _track_state(self):
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is not h11.IDLE and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if state is h11.SEND_BODY and self._body_timer is None:
            self._body_start = time.monotonic()
            self._body_got = 0
            self._body_timer = self.loop.call_later(self.cfg.body_timeout_s, self._body_deadline)
        elif state is not h11.SEND_BODY and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self):
        for name in ("_header_timer", "_body_timer", "_write_timer"):
            t = getattr(self, name, None)
            if t is not None:
                t.cancel()
                setattr(self, name, None)

    # -- deadlines -----------------------------------------------------------------------------------
    def _arm_header_timer(self):
        if self.cfg.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self.cfg.header_timeout_s, self._header_deadline)

    def _header_deadline(self):
        self._header_timer = None
        if self.transport.is_closing() or not self._waiting_for_headers():
            return
        partial = self.conn.trailing_data[0]
        if partial:       # a request began: say why it ends (a silent connection just closes)
            self.transport.write(_json_answer(408, "Request Timeout", partial.split(b"\r\n", 1)[0],
                                              f"request headers not received within {self.cfg.header_timeout_s:g} s"))
        self._close()

    def _body_deadline(self):
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        allowed = self.cfg.body_timeout_s + self._body_got / max(1, self.cfg.body_min_rate)
        left = self._body_start + allowed - time.monotonic()
        if left > 0.001:                      # keeping up the minimum rate: more time
            self._body_timer = self.loop.call_later(left, self._body_deadline)
            return
        if self.cycle is not None and not self.cycle.response_started:
            path = self.scope.get("raw_path", b"") if self.scope else b""
            self.transport.write(_json_answer(408, "Request Timeout", path,
                                              f"request body not received within {allowed:.0f} s"))
        self._close()

    def _drop_reader(self):
        self._write_timer = None
        if self.flow.write_paused and not self.transport.is_closing():
            self._close()

    def _close(self):
        self._cancel_timers()
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    # -- the cap -------------------------------------------------------------------------------------
    def _make_room(self):
        """Over the cap: close the connection idle the longest; with none idle, this one is answered
        503 (or, far over, closed at once)."""
        idle = [c for c in self.connections if c is not self and isinstance(c, Protocol) and c._idle()]
        if idle:
            oldest = min(idle, key=lambda c: c._idle_since)
            self.noted("connection cap %d reached: closing the longest idle connections", self.cap)
            oldest._close()
            return
        self.noted("connection cap %d reached with every connection busy: answering 503", self.cap)
        if self._open_count() > self.cap + OVERFLOW:
            self._close()
        else:
            self.app = _over_cap_app


def protocol_for(cfg: ServeConfig, cap: int) -> type[Protocol]:
    return type("DS4Protocol", (Protocol,), {"cfg": cfg, "cap": cap, "noted": _Once()})


# How long accept() rests after running out of files (asyncio retries after 1 s: see _Listener)
ACCEPT_REST_S = 0.5
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _Listener(socket.socket):
    """A listening socket whose accept() rests after running out of files (issue 32 item 11).

    asyncio's accept loop (3.11-3.12) handles EMFILE by removing its reader and scheduling a
    retry in a second, but then goes on through the rest of its backlog-long loop: every further
    attempt fails too and schedules one more retry, and each retry adds back a reader that fires
    at once. With connections waiting, that made 240k-520k attempts a minute (36 % of a core)
    while the log said "retrying every second". Here the attempts after the first failure, until
    asyncio's own retry, end the loop as an empty backlog would: one attempt a second."""

    _rest_until = 0.0

    def accept(self):
        if time.monotonic() < self._rest_until:
            raise BlockingIOError(errno.EAGAIN, "resting after running out of files")
        try:
            return super().accept()
        except OSError as e:
            if e.errno in _OUT_OF:
                self._rest_until = time.monotonic() + ACCEPT_REST_S
            raise


class BindError(Exception):
    """The address cannot be served; the message is the one line the user sees."""


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to every address `host` names (as asyncio's create_server binds them:
    `localhost` is ::1 and 127.0.0.1), not yet listening: the model opens meanwhile, and a client
    gets a refusal rather than a hang until `listen`. Raises BindError."""
    if not 0 <= port <= 65535:
        raise BindError(f"--port {port} is not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"cannot serve on host {host}: the name does not resolve ({e.strerror})") from None
    socks: list[socket.socket] = []
    seen = set()
    try:
        for family, _type, _proto, _name, addr in infos:
            if (family, addr[:2]) in seen or family not in (socket.AF_INET, socket.AF_INET6):
                continue
            seen.add((family, addr[:2]))
            # proto given: asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets (else every
            # keep-alive request stalls ~40 ms on Nagle + delayed ACK)
            s = _Listener(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restart within TIME_WAIT
            if family == socket.AF_INET6:      # `::` beside 0.0.0.0 (asyncio does the same)
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
    except OSError as e:
        for s in socks:
            s.close()
        raise BindError(_bind_problem(host, port, e)) from None
    return socks


def listen(socks: list[socket.socket]) -> None:
    """Start listening (a second server that bound the same port meanwhile fails here: with
    SO_REUSEADDR, Linux refuses only a bind next to a socket already listening)."""
    try:
        for s in socks:
            s.listen(ACCEPT_BACKLOG)
    except OSError as e:
        host, port = socks[0].getsockname()[:2]
        for s in socks:
            s.close()
        raise BindError(_bind_problem(host, port, e)) from None


def _bind_problem(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} is in use (another server on {host or 'this machine'}; choose another --port)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"cannot serve on host {host}: it is not an address of this machine"
    if e.errno == errno.EACCES:
        return f"port {port} needs privileges to serve on (choose --port 1024 or above)"
    return f"cannot serve on {host}:{port}: {e.strerror or e}"


class Server(uvicorn.Server):
    """uvicorn.Server that records SIGINT/SIGTERM as a request to stop (a second one skips the
    wait for open requests) and does not re-raise them once stopped: the caller's shutdown (the
    disk-cache save) must still run, and the process exit 0. `interrupt`: called on the event
    loop when the grace period is over, to end the open answers (the app's Handlers.interrupt)."""

    def __init__(self, config: uvicorn.Config, interrupt=None, stopping=None):
        super().__init__(config)
        self.signals: list[int] = []
        self._accept_noted = _Once()
        self.interrupt = interrupt
        self.stopping = stopping      # called on the loop as the stop begins (the app's Handlers.stopping)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame):
        self.signals.append(sig)
        # said at once (issue 35 item 10): the wait for open requests can last the grace period.
        # os.write: a signal handler may run while the main thread is inside a print to stderr
        what = "Ctrl-C" if sig == signal.SIGINT else "the signal"
        if self.should_exit:
            self.force_exit = True
            _say("ds4-agent: stopping now: ending the open requests")
        else:
            grace = self.config.timeout_graceful_shutdown
            _say(f"ds4-agent: stopping: draining the open requests (up to {grace:g} s); "
                 f"{what} again stops now")
        self.should_exit = True

    async def startup(self, sockets=None):
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets=None):
        """uvicorn's shutdown, but what is still running when the grace period ends (or at once
        after a second signal) is ended by the app in its API's terms, and only a connection
        that will not take its last frames is closed; no task is cancelled, so nothing is logged
        as an exception."""
        if self.stopping is not None:
            self.stopping()                # requests not yet queued are refused from now on
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()          # idle keep-alive connections close; busy ones after their answer
        await asyncio.sleep(0.1)
        await self._tasks_done(self.config.timeout_graceful_shutdown, forced_ends=True)
        if self.server_state.tasks and self.interrupt is not None:
            log.info("stopping: ending %d open request(s)", len(self.server_state.tasks))
            self.interrupt()
            await self._tasks_done(INTERRUPT_S)
        if self.server_state.tasks:
            # a client that does not read its last frames: its connection goes (the app sees a
            # disconnect and returns; a send to a closed connection is dropped)
            for connection in list(self.server_state.connections):
                connection.transport.close()
            await self._tasks_done(INTERRUPT_S)
        for t in list(self.server_state.tasks):      # the last resort, not expected
            t.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _tasks_done(self, seconds: float, forced_ends: bool = False) -> None:
        """Wait until no request task runs, at most `seconds` (with `forced_ends`, a second stop
        signal ends the wait too)."""
        end = time.monotonic() + seconds
        while self.server_state.tasks and time.monotonic() < end:
            if forced_ends and self.force_exit:
                return
            await asyncio.sleep(0.05)

    def _loop_error(self, loop, context):
        exc = context.get("exception")
        if context.get("message", "").startswith("socket.accept() out of system resource"):
            # asyncio pauses accepting for a second, but logs a traceback for every attempt (as
            # many as the backlog, each wake-up): one line says it all
            self._accept_noted("cannot accept connections: %s (open files limit %d); retrying every "
                               "second", exc, fd_soft_limit())
            return
        loop.default_exception_handler(context)


def make_server(app, cfg: ServeConfig, *, graceful_s: float = 10) -> Server:
    cap = connection_cap(cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, http=protocol_for(cfg, cap), loop="asyncio",
                            lifespan="off", log_level="warning", backlog=ACCEPT_BACKLOG,
                            timeout_keep_alive=cfg.idle_timeout_s, timeout_graceful_shutdown=graceful_s)
    state = getattr(app, "state", None)
    return Server(config, interrupt=getattr(state, "interrupt", None),
                  stopping=getattr(state, "stopping", None))


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "replace"))


@contextlib.contextmanager
def quiet_signals(note: str):
    """While the shutdown save runs: a further SIGINT/SIGTERM is noted, not fatal (the save is a
    temp file renamed in place, but a killed process loses it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(sig, frame):
        print(note, flush=True, file=sys.stderr)
    old = {sig: signal.signal(sig, handler) for sig in _HANDLED}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
