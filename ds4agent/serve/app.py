"""The HTTP side of the shim: Starlette routes on uvicorn (protocol.md §5).

Each POST is parsed, rendered and tokenized on the thread pool (`Shim.prepare`), queued to the one
inference worker, and answered from the worker's events: as one JSON body, or as SSE in the API's
own event shapes. A streaming response waits for the worker's first event so a refusal decided
there (409: the live tool state is gone) still gets a real HTTP status; once headers are out,
`: prefill` comments keep the connection alive while the prompt is prefilled. A client that
disconnects cancels its job (queued: skipped; running: stopped between chunks or tokens).
Malformed input is always a 4xx in the API's error shape; nothing a client sends reaches a 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import hmac
import logging
import threading
import time
import weakref

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prompts import ContextLengthError, RequestError

from . import events as E
from .config import MAX_BODY_BYTES
from .edge import EdgeGuard, api_for_path, exposure_warning
from .shim import Shim
from .wire import context_error_body, error_body, make_wire
from .worker import QueueFull

log = logging.getLogger("ds4agent.serve")

_API_OF = {"/v1/chat/completions": "openai_chat", "/v1/completions": "openai_completions",
           "/v1/responses": "responses", "/v1/messages": "anthropic"}
_CORS = {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
         "Access-Control-Allow-Headers": "*"}
# a body parsed once into any of these problems is the client's fault (4xx), whatever the cause
_CLIENT_ERRORS = (RequestError, ClientDisconnect)
# After a body this large is done with, freed heap is handed back to the system: glibc keeps it
# in its arenas otherwise (a 10 MB prompt's tokenization peaks near 2 GB and stayed resident).
TRIM_AFTER_BYTES = 1 << 20
PREPARE_THREADS = 40


def create_app(shim: Shim) -> Starlette:
    warning = exposure_warning(shim.cfg)
    if warning:
        log.warning("%s", warning)
    h = _Handlers(shim)
    routes = [Route("/v1/models", h.models, methods=["GET"]),
              Route("/v1/models/{model:path}", h.models, methods=["GET"])]
    for path in _API_OF:
        routes.append(Route(path, h.completion, methods=["POST"]))
    for path in list(_API_OF) + ["/v1/models", "/v1/models/{model:path}"]:
        routes.append(Route(path, h.options, methods=["OPTIONS"]))
    routes.append(Route("/{rest:path}", h.unknown,
                        methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    app = Starlette(routes=routes, middleware=[Middleware(EdgeGuard, cfg=shim.cfg, cors_headers=_CORS)],
                    exception_handlers={Exception: _internal_error, HTTPException: h.http_error})
    app.state.shim = shim
    app.state.interrupt = h.interrupt          # the server calls it when a stop's grace period ends
    app.state.stopping = h.stopping            # ... and this one as the stop begins
    return app


class _Handlers:
    """The routes' handlers over one shim: a completion's steps (read and prepare, queue, answer
    whole or as SSE) are methods of their own."""

    def __init__(self, shim: Shim):
        self.shim = shim
        self.cfg = shim.cfg
        # event queue -> job of each open request; weak, so a stream whose body never started
        # (its client left first: no `done`) does not keep its job and prompt
        self.open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # loop-agnostic (an app may serve from more than one loop in tests): a flag, the futures
        # of the requests waiting on a preparation, and a thread limit per loop
        self._stopped = False
        self._stop_waiters: set[asyncio.Future] = set()
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def stopping(self) -> None:
        """The server begins to stop (runs on the event loop): a request still being read or
        tokenized is answered 503 now rather than queued to a server on its way out, and its
        thread is left to finish alone (issue 32 item 6: SIGTERM under a 40 s tokenization gave
        two ASGI tracebacks, no answer, and an exit after 27.9 s)."""
        self._stopped = True
        for f in list(self._stop_waiters):
            if not f.done():
                f.set_result(None)

    def interrupt(self) -> None:
        """The server is stopping and its grace period is over (or a second signal skipped it):
        every open request ends now in its API's terms, streamed or not (an interrupted Failure
        put behind the events already queued), and its job is cancelled. Runs on the event loop."""
        for q, job in list(self.open.items()):
            job.cancel.set()
            q.put_nowait(INTERRUPTED)

    def headers(self) -> dict:
        return dict(_CORS) if self.cfg.cors else {}

    def json_response(self, body: str, status: int = 200) -> Response:
        return Response(body.encode("utf-8", "replace"), status_code=status,
                        media_type="application/json", headers=self.headers())

    def fail(self, api: str | None, status: int, message: str, extra: dict | None = None) -> Response:
        r = self.json_response(error_body(api or "openai_chat", message, status), status)
        r.headers.update(extra or {})
        return r

    def failure(self, api: str, ev: E.Failure) -> Response:
        """A Failure before any byte of the answer went out, as an HTTP error in the API's shape."""
        if ev.context_full:
            return self.json_response(context_error_body(api, ev.n_prompt or 0, ev.n_ctx), 400)
        return self.fail(api, ev.status, ev.message)

    def authorized(self, request: Request) -> bool:
        if not self.cfg.api_key:
            return True
        # headers arrive as bytes (Starlette decodes them as latin-1): compared as the key's UTF-8
        # bytes, so a non-ASCII key can match at all; in constant time
        want = self.cfg.api_key.encode("utf-8")
        auth = request.headers.get("authorization", "").encode("latin-1")
        key = request.headers.get("x-api-key", "").encode("latin-1")
        return hmac.compare_digest(auth, b"Bearer " + want) | hmac.compare_digest(key, want)

    async def models(self, request: Request) -> Response:
        import json
        if not self.authorized(request):
            return self.fail(api_for_path(request.url.path), 401, "invalid API key")
        data = self.shim.models()
        mid = request.path_params.get("model")
        if mid is None:
            return self.json_response(json.dumps({"object": "list", "data": data}) + "\n")
        for m in data:
            if m["id"] == mid:
                return self.json_response(json.dumps(m) + "\n")
        return self.fail(api_for_path(request.url.path), 404, f"unknown model {mid}")

    async def completion(self, request: Request) -> Response:
        api = _API_OF[request.url.path]
        if not self.authorized(request):
            return self.fail(api, 401, "invalid API key")
        t0 = time.time()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        job = None

        def emit(ev):          # called on the worker thread
            try:
                loop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:   # the event loop is closed (server stopped): nobody will read
                if job is not None:
                    job.cancel.set()   # (raising here would kill the inference thread)

        job = await self._prepare(api, request, emit)
        if isinstance(job, Response):
            return job
        conv = job.rendered.conversation
        stream = bool(conv.params.get("stream"))
        wire = make_wire(api, conv, model=self.shim.model_for(conv), seq=self.shim.next_seq(), created=int(t0),
                         stream=stream)
        done = functools.partial(self._done, job.trace, t0, q)
        self.open[q] = job
        try:
            self.shim.worker.submit(job)
        except QueueFull as e:          # past --max-queue: an answer now, not a wait with no byte sent
            done(503)
            return _busy(self.fail(api, 503, str(e)), e)
        # A continuation that only the live tool state can serve is refused (409) when its job
        # starts and finds that state gone, which a job queued ahead of it may well cause: its
        # headers wait for the job to start, so the refusal is a real status, not an error event
        # after a 200 (no keep-alive comments meanwhile: the wait is the queue's, not a prefill's).
        wait_s = None if job.rendered.requires_live_tool_state else self.cfg.keepalive_s
        try:
            first = await _next_event(q, request, job, wait_s)
        except _Gone:
            done(499)
            return Response(status_code=499)
        if isinstance(first, E.Failure):
            done(first.status, first)
            return self.failure(api, first)
        if not stream:
            return await self._whole(api, request, job, q, first, wire, done)
        h = self.headers()
        h["Cache-Control"] = "no-cache"
        h["X-Accel-Buffering"] = "no"
        return StreamingResponse(self._sse(job, q, first, wire, done), media_type="text/event-stream", headers=h)

    async def _prepare(self, api: str, request: Request, emit):
        """The request read, parsed, rendered and tokenized (on the thread pool): its job, or the
        error Response that refuses it."""
        size = 0
        try:
            self.shim.worker.check_room()
            body = await _read_body(request)
            size = len(body)
            loop = asyncio.get_running_loop()
            limit = self._limits.get(loop)
            if limit is None:
                limit = self._limits[loop] = asyncio.Semaphore(PREPARE_THREADS)
            async with limit:
                if self._stopped:
                    return self.fail(api, 503, "server shutting down", {"Retry-After": "1"})
                work = _in_daemon_thread(self.shim.prepare, api, body, emit)
                stop = loop.create_future()
                self._stop_waiters.add(stop)
                try:
                    await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self._stop_waiters.discard(stop)
                    if not work.done():        # stopping, or this request was cancelled
                        work.add_done_callback(_retrieved)
                if not work.done():
                    return self.fail(api, 503, "server shutting down", {"Retry-After": "1"})
            return work.result()
        except ContextLengthError as e:
            return self.json_response(e.body(api), e.status)
        except _BodyTooLarge:
            size = MAX_BODY_BYTES          # what was read of it is freed: trim below
            return self.fail(api, 413, f"request body exceeds {MAX_BODY_BYTES} bytes", {"Connection": "close"})
        except RequestError as e:
            return self.fail(api, e.status, e.message)
        except ClientDisconnect:
            return self.fail(api, 400, "bad HTTP request")
        except QueueFull as e:          # full before the body was even read
            return _busy(self.fail(api, 503, str(e)), e)
        finally:
            body = None
            if size >= TRIM_AFTER_BYTES:
                await anyio.to_thread.run_sync(_trim_heap)

    def _done(self, record: dict, t0: float, q: asyncio.Queue, status: int, ev=None) -> None:
        """The request is over: no longer open, its trace record completed and written."""
        self.open.pop(q, None)
        record.update(status=status, secs=round(time.time() - t0, 3))
        if isinstance(ev, E.Finish):
            record.update(finish=ev.finish, calls=[c.name for c in ev.calls])
        elif isinstance(ev, E.Failure):
            record.update(error=ev.message)
        self.shim.trace(record)

    async def _whole(self, api: str, request: Request, job, q: asyncio.Queue, first, wire, done) -> Response:
        """A non-streaming answer: every event until the last, then one JSON body."""
        ev = first
        checked = time.monotonic()
        try:
            while not isinstance(ev, (E.Finish, E.Failure)):
                ev = await _next_event(q, request, job)
                # events come every token while generating, so _next_event's own check (on a
                # quiet queue) never runs then: look for a client that hung up on the clock too
                if time.monotonic() - checked >= min(self.cfg.keepalive_s, 1.0):
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        job.cancel.set()
                        raise _Gone()
        except _Gone:
            done(499)
            return Response(status_code=499)
        if isinstance(ev, E.Failure):
            done(ev.status, ev)
            return self.failure(api, ev)
        done(200, ev)
        return self.json_response(wire.body(ev))

    async def _sse(self, job, q: asyncio.Queue, first, wire, done):
        """The streaming answer's bytes: the API's frames per event, `: prefill` keep-alives."""
        ev = first
        last_ev = None
        sent = 0.0
        keepalive_s = self.cfg.keepalive_s
        try:
            while True:
                if ev is None or (isinstance(ev, E.Prefill) and time.monotonic() - sent >= keepalive_s):
                    sent = time.monotonic()
                    yield b": prefill\n\n"
                elif isinstance(ev, E.Failure):
                    for f in wire.frames(ev):        # the API's error, context or cut-answer end
                        yield f.encode("utf-8", "replace")
                    last_ev = ev
                    return
                else:
                    for f in wire.frames(ev):
                        yield f.encode("utf-8", "replace")
                    if isinstance(ev, E.Finish):
                        last_ev = ev
                        return
                try:
                    ev = await asyncio.wait_for(q.get(), keepalive_s)
                except asyncio.TimeoutError:
                    ev = None
        finally:
            # normal end, or the client went away (the response task is cancelled)
            if last_ev is None:
                job.cancel.set()
            done(200 if isinstance(last_ev, E.Finish) else 499 if last_ev is None else last_ev.status,
                 last_ev)

    async def options(self, request: Request) -> Response:
        return Response(status_code=204, headers=self.headers())

    def refuse_path(self, request: Request) -> Response:
        """404 for a path nobody serves, 405 (with Allow) for a method its route does not take;
        JSON in the path's API shape (never Starlette's plain text)."""
        path, api = request.url.path, api_for_path(request.url.path)
        allow = _allowed_methods(path)
        if allow is None:
            return self.fail(api, 404, f"unknown endpoint {path}")
        return self.fail(api, 405, f"method {request.method} not allowed on {path} (use {allow})",
                         {"Allow": allow})

    async def unknown(self, request: Request) -> Response:
        if request.method == "OPTIONS":
            return await self.options(request)
        return self.refuse_path(request)

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        # the router's own refusals: a method that no route of the path takes
        if exc.status_code in (404, 405):
            return self.refuse_path(request)
        return self.fail(api_for_path(request.url.path), exc.status_code, exc.detail or "bad request",
                         dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s %s: %r", request.method, request.url.path, exc)
    api = _API_OF.get(request.url.path, "openai_chat")
    shim = request.app.state.shim
    h = dict(_CORS) if shim.cfg.cors else {}
    return Response(error_body(api, "internal error", 500).encode(), status_code=500,
                    media_type="application/json", headers=h)


def _allowed_methods(path: str) -> str | None:
    if path in _API_OF:
        return "POST"
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return "GET, HEAD"
    return None


def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """fn(*args) on a thread of its own, as a future of this loop. A daemon thread: a stop
    does not wait for a tokenization it no longer needs (anyio's pool threads are joined at
    exit, so one busy thread held the exit for as long as it ran)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value):
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def run():
        try:
            ok, value = True, fn(*args)
        except BaseException as e:         # handed to the awaiting request, whatever it is
            ok, value = False, e
        with contextlib.suppress(RuntimeError):     # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, name="ds4-prepare", daemon=True).start()
    return fut


def _retrieved(fut: asyncio.Future) -> None:
    """An abandoned request's outcome: read, so that asyncio does not log it as never read."""
    if not fut.cancelled():
        fut.exception()


def _trim_heap() -> None:
    """Give freed heap back to the system. A refused request's exception passed through anyio's
    thread hand-off, whose frames hold it in reference cycles: its parse tree and prompt text
    are only freed by the cycle collector, so that runs first. Then glibc's malloc_trim, which
    hands back the free pages of every arena (nothing to do elsewhere)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _busy(response: Response, e: QueueFull) -> Response:
    response.headers["Retry-After"] = str(e.retry_after)
    return response


# What an open request gets when the server stops under it (Handlers.interrupt): before any byte
# a 503; in a stream, its API's end of an answer that did not complete.
INTERRUPTED = E.Failure("server shutting down: the answer was cut off", 503, interrupted=True)


class _BodyTooLarge(Exception):
    pass


class _Gone(Exception):
    pass


async def _read_body(request: Request) -> bytes:
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > MAX_BODY_BYTES:
        raise _BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


async def _next_event(q: asyncio.Queue, request: Request, job, wait_s: float | None = None):
    """The worker's next event, or None once `wait_s` passed without one (None: wait as long as
    it takes; a streaming request uses the deadline so a refusal can still be an HTTP status,
    else headers go out and keep-alives start). A client that disconnected meanwhile cancels the
    job, and so does the handler's own cancellation (uvicorn cancels it when a shutdown's grace
    period ends)."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    try:
        while True:
            step = 1.0
            if deadline is not None:
                step = deadline - time.monotonic()
                if step <= 0:
                    return None
            try:
                return await asyncio.wait_for(q.get(), min(step, 1.0))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    raise _Gone() from None
    except asyncio.CancelledError:
        job.cancel.set()
        raise
