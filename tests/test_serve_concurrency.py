"""The shim under concurrent clients (ds4agent/serve, protocol.md §5.0: requests are parsed on the
client side and run one at a time, FIFO, by the single inference worker).

* 8 streaming clients at once, mixing the four APIs (plain text and forced tool calls), all
  complete, and each one's result (streamed text, tool calls, finish reason) equals running the
  same request alone, and equals the non-streaming answer;
* a client that disconnects mid-stream cancels its generation: the worker goes idle at once,
  far below the token cap, and the next request works; likewise a non-streaming client that
  hangs up while its answer is being generated;
* a queued request whose client went away is skipped (never run by the worker), streamed or not;
* SSE keep-alive comments (`: prefill`) go out while a streamed request waits in the queue or
  while its long prompt is prefilled;
* a server stopped with a request in flight cancels it, and the worker survives.

Generation is deterministic: thinking off, temperature 0 (greedy), distinct prompts. A live
ServerThread (uvicorn) with httpx clients on threads, one engine per module.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from ds4agent.serve import ServeConfig, ServerThread, Shim
from ds4agent.serve.events import Finish
from engine import Engine
from helpers_serve import NO_THINK, hold_slots, sse_event

KEEPALIVE_S = 0.2
TOOL = "get_weather"
FORCED_ARGS = {"city": "Paris"}
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def srv(agent_engine):
    # conftest's engine, in exact numerics: these tests judge scheduling, not the arithmetic
    shim = Shim(agent_engine, ServeConfig(ctx=4096, keepalive_s=KEEPALIVE_S,
                                    forced_tool_calls={TOOL: FORCED_ARGS}))
    with ServerThread(shim) as url:
        yield url, shim


def wait_idle(shim: Shim, timeout: float = 10.0) -> float:
    """Seconds until the worker has nothing running and nothing queued."""
    t0 = time.monotonic()
    while shim.worker.busy or shim.worker.queued():
        assert time.monotonic() - t0 < timeout, "the worker did not go idle"
        time.sleep(0.005)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------------
# The eight requests

CHAT_TOOLS = [{"type": "function", "function": {"name": TOOL, "description": "Weather forecast",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}}}}]
RESP_TOOLS = [{"type": "function", "name": TOOL, "description": "Weather forecast",
               "parameters": CHAT_TOOLS[0]["function"]["parameters"]}]
ANTH_TOOLS = [{"name": TOOL, "description": "Weather forecast",
               "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]

REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a haiku about rivers."}],
                              "temperature": 0, "max_tokens": 7, **NO_THINK}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "You check the weather."},
                                           {"role": "user", "content": "Weather in Paris?"}],
                              "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 80,
                              "stream_options": {"include_usage": True}, **NO_THINK}),
    ("/v1/completions", {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 6,
                         **NO_THINK}),
    ("/v1/completions", {"prompt": "def fibonacci(n):", "temperature": 0, "max_tokens": 8, **NO_THINK}),
    ("/v1/responses", {"input": "Count from one to five.", "temperature": 0, "max_output_tokens": 8,
                       "reasoning": {"effort": "none"}}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text",
                                                               "text": "Is it raining in Paris?"}]}],
                       "instructions": "Use tools.", "tools": RESP_TOOLS, "temperature": 0,
                       "max_output_tokens": 80, "reasoning": {"effort": "none"}}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6,
                      "temperature": 0, **NO_THINK}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Forecast for Paris"}]}],
                      "system": "Be brief.", "tools": ANTH_TOOLS, "max_tokens": 80, "temperature": 0,
                      **NO_THINK}),
]


# ------------------------------------------------------------------------------------------
# Clients: one request, its result in one shape for every API

def _frames(chunks):
    """SSE frames (text without the blank line) from byte chunks, as they arrive."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            yield frame.decode("utf-8")
    assert buf == b"", f"a partial SSE frame at the end: {buf[:200]!r}"


class Summary:
    """What a client got: visible text, reasoning, calls (name, arguments JSON), finish."""

    def __init__(self):
        self.text = ""
        self.reasoning = ""
        self.calls: dict[int, list] = {}         # index -> [id, name, arguments text]
        self.finish = None
        self.ids: list[str] = []                 # response ids and tool ids seen

    def key(self):
        calls = [(n, json.loads(a)) for _, (_, n, a) in sorted(self.calls.items())]
        return self.text, self.reasoning, calls, self.finish

    def __repr__(self):
        return repr(self.key())


def summarize_stream(path: str, events) -> Summary:
    s = Summary()
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert events[-1] == (None, "[DONE]"), events[-3:]
        for _, d in events[:-1]:
            s.ids.append(d["id"])
            if not d["choices"]:
                continue                                    # the usage chunk
            ch = d["choices"][0]
            if path == "/v1/completions":
                s.text += ch["text"]
            else:
                delta = ch["delta"]
                s.text += delta.get("content") or ""
                s.reasoning += delta.get("reasoning_content") or ""
                for tc in delta.get("tool_calls") or []:
                    c = s.calls.setdefault(tc["index"], [None, None, ""])
                    if "id" in tc:
                        c[0], c[1] = tc["id"], tc["function"]["name"]
                    c[2] += tc["function"].get("arguments") or ""
            if ch["finish_reason"]:
                assert s.finish is None
                s.finish = ch["finish_reason"]
        s.ids = sorted(set(s.ids))
        assert len(s.ids) == 1, s.ids
    elif path == "/v1/responses":
        seq = [d["sequence_number"] for _, d in events]
        assert seq == list(range(len(events)))
        for name, d in events:
            t = d["type"]
            if t == "response.created":
                s.ids.append(d["response"]["id"])
            elif t == "response.output_text.delta":
                s.text += d["delta"]
            elif t == "response.reasoning_summary_text.delta":
                s.reasoning += d["delta"]
            elif t == "response.output_item.done" and d["item"]["type"] == "function_call":
                it = d["item"]
                s.calls[d["output_index"]] = [it["call_id"], it["name"], it["arguments"]]
            elif t in ("response.completed", "response.incomplete", "response.failed"):
                assert (name, d) == events[-1]
                s.finish = d["response"]["status"]
                assert d["response"]["id"] == s.ids[0]
    else:
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
        kinds = {}
        for name, d in events:
            if name == "message_start":
                s.ids.append(d["message"]["id"])
            elif name == "content_block_start":
                b = d["content_block"]
                kinds[d["index"]] = b["type"]
                if b["type"] == "tool_use":
                    s.calls[d["index"]] = [b["id"], b["name"], ""]
            elif name == "content_block_delta":
                delta = d["delta"]
                if delta["type"] == "text_delta":
                    s.text += delta["text"]
                elif delta["type"] == "thinking_delta":
                    s.reasoning += delta["thinking"]
                elif delta["type"] == "input_json_delta":
                    s.calls[d["index"]][2] += delta["partial_json"]
            elif name == "message_delta":
                s.finish = d["delta"]["stop_reason"]
    s.ids += [c[0] for c in s.calls.values()]
    return s


def summarize_body(path: str, body: dict) -> Summary:
    s = Summary()
    if path == "/v1/chat/completions":
        ch = body["choices"][0]
        s.text = ch["message"]["content"]
        s.reasoning = ch["message"].get("reasoning_content") or ""
        for i, tc in enumerate(ch["message"].get("tool_calls") or []):
            s.calls[i] = [tc["id"], tc["function"]["name"], tc["function"]["arguments"]]
        s.finish = ch["finish_reason"]
    elif path == "/v1/completions":
        s.text, s.finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
    elif path == "/v1/responses":
        for i, it in enumerate(body["output"]):
            if it["type"] == "message":
                s.text += "".join(c["text"] for c in it["content"])
            elif it["type"] == "function_call":
                s.calls[i] = [it["call_id"], it["name"], it["arguments"]]
        s.finish = body["status"]
    else:
        for i, b in enumerate(body["content"]):
            if b["type"] == "text":
                s.text += b["text"]
            elif b["type"] == "tool_use":
                s.calls[i] = [b["id"], b["name"], json.dumps(b["input"])]
        s.finish = body["stop_reason"]
    return s


class Client:
    """One streaming request on its own connection; frames are timestamped as they arrive."""

    def __init__(self, url: str, path: str, body: dict):
        self.url, self.path, self.body = url, path, dict(body, stream=True)
        self.frames: list[tuple[float, str]] = []
        self.status = None
        self.error: BaseException | None = None
        self.t_sent = self.t_done = None

    def run(self, barrier: threading.Barrier | None = None):
        try:
            with httpx.Client(base_url=self.url, timeout=TIMEOUT) as c:
                if barrier is not None:
                    barrier.wait(TIMEOUT)
                self.t_sent = time.monotonic()
                with c.stream("POST", self.path, json=self.body) as r:
                    self.status = r.status_code
                    assert r.status_code == 200, r.read()
                    assert r.headers["content-type"].startswith("text/event-stream")
                    for f in _frames(r.iter_bytes()):
                        self.frames.append((time.monotonic(), f))
                self.t_done = time.monotonic()
        except BaseException as e:          # reported by the test thread
            self.error = e

    def events(self):
        return [sse_event(f) for _, f in self.frames if not f.startswith(":")]

    def comments(self):
        return [(t, f) for t, f in self.frames if f.startswith(":")]

    def summary(self) -> Summary:
        return summarize_stream(self.path, self.events())


def run_one(url, path, body) -> Summary:
    c = Client(url, path, body)
    c.run()
    if c.error:
        raise c.error
    return c.summary()


# ------------------------------------------------------------------------------------------
# Eight at once

def test_eight_concurrent_streams_equal_sequential(srv):
    url, shim = srv
    # one by one (streaming, then non-streaming)
    alone = [run_one(url, p, b) for p, b in REQUESTS]
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        bodies = [c.post(p, json=dict(b, stream=False)) for p, b in REQUESTS]
    assert all(r.status_code == 200 for r in bodies), [r.text for r in bodies]
    whole = [summarize_body(p, r.json()) for (p, _), r in zip(REQUESTS, bodies)]

    # all at once
    before = dict(shim.worker.stats)
    clients = [Client(url, p, b) for p, b in REQUESTS]
    barrier = threading.Barrier(len(clients))
    threads = [threading.Thread(target=c.run, args=(barrier,)) for c in clients]
    peak = [0]
    stop = threading.Event()

    def watch():                        # how many jobs waited in the queue at once
        while not stop.is_set():
            peak[0] = max(peak[0], shim.worker.queued())
            time.sleep(0.002)
    w = threading.Thread(target=watch)
    w.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    stop.set()
    w.join()
    assert not any(t.is_alive() for t in threads), "a concurrent stream did not finish"
    for c in clients:
        if c.error:
            raise c.error
    together = [c.summary() for c in clients]

    # they really overlapped: every request was sent before the first one finished, and
    # several waited in the queue at the same time
    assert max(c.t_sent for c in clients) < min(c.t_done for c in clients)
    assert peak[0] >= 3, peak
    assert shim.worker.stats["requests"] - before["requests"] == len(REQUESTS)

    for (path, _), a, b, nonstream in zip(REQUESTS, alone, together, whole):
        assert b.key() == a.key(), (path, a, b)
        assert nonstream.key() == a.key(), (path, a, nonstream)
    # the run did something: text everywhere, the forced calls where tools were offered
    for (path, body), a in zip(REQUESTS, alone):
        if "tools" in body:
            assert [n for _, n, _ in a.calls.values()] == [TOOL], (path, a)
            assert json.loads(next(iter(a.calls.values()))[2]) == FORCED_ARGS
            assert a.finish in ("tool_calls", "completed", "tool_use"), (path, a)
        else:
            assert a.text and not a.calls and a.finish in ("length", "incomplete", "max_tokens", "stop",
                                                            "end_turn", "completed"), (path, a)
    # every response and tool id is distinct across the concurrent streams
    ids = [i for s in together for i in s.ids]
    assert len(ids) == len(set(ids)), ids


# ------------------------------------------------------------------------------------------
# Disconnects

def _long_chat(n: int, text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": n,
            "stream": True, **NO_THINK}


def test_disconnect_mid_stream_cancels_generation(srv):
    url, shim = srv
    wait_idle(shim)
    cap = 2000
    before = shim.worker.stats["generated"]
    got = 0
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/chat/completions", json=_long_chat(cap, "Tell me a very long story.")) as r:
            assert r.status_code == 200
            for f in _frames(r.iter_bytes()):
                name, d = sse_event(f)
                if name != ":" and d != "[DONE]" and d["choices"][0]["delta"].get("content"):
                    got += 1
                    if got == 3:
                        break               # leaving the block closes the connection
        t_closed = time.monotonic()
    idle_after = wait_idle(shim, timeout=5.0)
    generated = shim.worker.stats["generated"] - before
    assert got == 3
    # stopped quickly and far below the cap (a token takes ~20 ms: 2,000 would be ~40 s)
    assert idle_after < 2.0, idle_after
    assert generated < 100, generated
    assert time.monotonic() - t_closed < 5.0
    # the server is fine afterwards, and a new request is answered in full
    s = run_one(url, "/v1/chat/completions", _long_chat(4, "Hello again."))
    assert s.finish == "length" and s.text


def test_disconnect_while_waiting_for_a_whole_body_cancels_generation(srv):
    """A non-streaming client that hangs up: the app notices (it polls every keepalive_s) and
    the worker stops."""
    url, shim = srv
    wait_idle(shim)
    before = shim.worker.stats["generated"]
    body = dict(_long_chat(2000, "Another very long story."), stream=False)
    s = _raw_post(url, "/v1/messages", dict(body, max_tokens=2000))
    try:
        t0 = time.monotonic()
        while not shim.worker.busy:
            assert time.monotonic() - t0 < 10, "the request never started"
            time.sleep(0.005)
        start = shim.worker.session.pos
        while shim.worker.session.pos < start + 20:     # prefilled, and some tokens generated
            assert time.monotonic() - t0 < 10, "the request never generated"
            time.sleep(0.005)
    finally:
        s.close()
    assert wait_idle(shim, timeout=5.0) < 2.0
    assert shim.worker.stats["generated"] - before < 150
    assert run_one(url, "/v1/completions", {"prompt": "ok", "max_tokens": 2, **NO_THINK}).finish == "length"


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A request sent on a bare socket (closed by the caller without reading the answer)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), len(data)) + data)
    return s


@pytest.mark.parametrize("stream", [False, True])
def test_queued_request_of_a_gone_client_is_skipped(srv, stream):
    url, shim = srv
    wait_idle(shim)
    others = threading.Event()            # with several slots, A takes the one left free
    assert hold_slots(shim, 60, len(shim.worker.slots) - 1, others).wait(10)
    before = dict(shim.worker.stats)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/chat/completions", json=_long_chat(2000, "An endless list, please.")) as r:
            assert r.status_code == 200
            frames = _frames(r.iter_bytes())
            while True:                                   # A is generating
                name, d = sse_event(next(frames))
                if name != ":" and d["choices"][0]["delta"].get("content"):
                    break
            # B queues behind A, then its client goes away
            body = {"messages": [{"role": "user", "content": "I will not wait."}], "max_tokens": 5,
                    "stream": stream, **NO_THINK}
            b = _raw_post(url, "/v1/chat/completions", body)
            t0 = time.monotonic()
            while shim.worker.queued() < 1:
                assert time.monotonic() - t0 < 5, "B was never queued"
                time.sleep(0.002)
            if stream:                                    # it got its headers and a keep-alive
                b.settimeout(5)
                head = b""
                while b": prefill" not in head:
                    chunk = b.recv(4096)
                    assert chunk, head
                    head += chunk
                assert head.startswith(b"HTTP/1.1 200")
            b.close()
            # give the app time to notice (it polls every keepalive_s), with A still running
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10 * KEEPALIVE_S:
                next(frames)
            assert shim.worker.queued() == 1 and shim.worker.busy    # B still waits, A still runs
            others.set()
        # A's client leaves too
    idle_after = wait_idle(shim, timeout=5.0)
    # only A ran; B was skipped, and A stopped soon after its client left, far below its 2,000
    # tokens (how many it made before depends on the machine: ~100 at 20 ms a token, 200+ at 10)
    assert shim.worker.stats["requests"] - before["requests"] == 1
    assert idle_after < 2.0, idle_after
    assert shim.worker.stats["generated"] - before["generated"] < 1000
    s = run_one(url, "/v1/messages", {"messages": [{"role": "user", "content": "still there?"}],
                                      "max_tokens": 3, "temperature": 0, **NO_THINK})
    assert s.finish == "max_tokens" and s.text


# ------------------------------------------------------------------------------------------
# Keep-alives

def _keepalive_checks(c: Client, wait_s: float):
    """At least one `: prefill` per keepalive_s of waiting arrived, spread over the wait and all
    before the first event; the stream itself is complete."""
    if c.error:
        raise c.error
    comments = c.comments()
    first_event_t = next(t for t, f in c.frames if not f.startswith(":"))
    assert all(f == ": prefill" for _, f in comments), comments
    before = [t for t, _ in comments if t < first_event_t]
    assert len(before) >= max(3, int(0.5 * wait_s / KEEPALIVE_S)), (len(before), wait_s)
    # they come as the wait goes on, not in one burst at the end
    assert before[0] - c.t_sent < 1.0
    assert first_event_t - before[0] >= 0.5 * wait_s
    gaps = [b - a for a, b in zip(before, before[1:])]
    assert max(gaps) < 1.0, gaps
    c.summary()


def test_keepalive_while_queued_behind_another(srv):
    url, shim = srv
    wait_idle(shim)
    hold = 1.5
    began = hold_slots(shim, hold)
    assert began.wait(10)
    b = Client(url, "/v1/messages", {"messages": [{"role": "user", "content": "And the mountains?"}],
                                     "max_tokens": 3, "temperature": 0, **NO_THINK})
    b.run()
    if b.error:
        raise b.error
    first = next(t for t, f in b.frames if not f.startswith(":"))
    waited = first - b.t_sent                   # B waited for the held worker
    assert waited > 0.8 * hold, waited
    _keepalive_checks(b, waited)
    assert b.summary().finish == "max_tokens"


def test_keepalive_during_long_prefill(srv, monkeypatch):
    url, shim = srv
    wait_idle(shim)
    sess = shim.worker.session
    # small chunks, each held 100 ms: the prefill lasts >= 1.4 s and reports progress all along,
    # whatever the machine's speed (half the tokens and twice the hold of the first version: the
    # same length of prefill, half its compute)
    monkeypatch.setattr(sess, "chunk", 64)
    real_forward = sess._forward

    def slow_forward(part, all_logits, **kw):      # (kw: split runs' `post`, cb82b99)
        if len(part) > 1:
            time.sleep(0.1)
        return real_forward(part, all_logits, **kw)

    monkeypatch.setattr(sess, "_forward", slow_forward)
    words = " ".join(f"w{i}" for i in range(450))       # ~900 tokens: ~14 chunks of 64
    c = Client(url, "/v1/completions", {"prompt": words, "max_tokens": 2, "temperature": 0, **NO_THINK})
    c.run()
    if c.error:
        raise c.error
    prefill = next(t for t, f in c.frames if not f.startswith(":")) - c.t_sent
    assert prefill > 1.0, prefill
    _keepalive_checks(c, prefill)
    assert c.summary().finish == "length"


# ------------------------------------------------------------------------------------------
# Shutdown

@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_shutdown_with_a_request_in_flight_keeps_the_worker_alive(agent_model):
    """uvicorn cancels a handler still waiting when the shutdown's grace period ends, then
    closes its event loop. The job must be cancelled with it, and the worker must survive
    emitting into the closed loop (it used to die there, and a queue left behind was lost)."""
    engine = Engine.open(agent_model)            # its own engine: the module's server stays idle
    shim = Shim(engine, ServeConfig(ctx=4096))
    server = ServerThread(shim)
    url = server.__enter__()
    server.server.config.timeout_graceful_shutdown = 0.3
    got = {}

    def client():
        try:
            got["r"] = httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT,
                                  json={"messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000,
                                        "temperature": 0, **NO_THINK}).status_code
        except httpx.HTTPError as e:
            got["r"] = e
    t = threading.Thread(target=client)
    t.start()
    try:
        t0 = time.monotonic()
        while not shim.worker.busy:
            assert time.monotonic() - t0 < 10
            time.sleep(0.005)
        time.sleep(0.2)                           # generating now
        server.server.should_exit = True
        server.thread.join(10)
        assert not server.thread.is_alive()
        wait_idle(shim, timeout=3.0)              # the job was cancelled, not run to its 3,000 tokens
        assert shim.worker.stats["generated"] < 1000
        # the worker still runs what is handed to it after the server is gone
        seen = []
        job = shim.prepare("openai_chat", json.dumps({"messages": [{"role": "user", "content": "after"}],
                                                      "max_tokens": 2, **NO_THINK}).encode(), seen.append)
        shim.worker.submit(job)
        t0 = time.monotonic()
        while not any(isinstance(e, Finish) for e in seen):
            assert time.monotonic() - t0 < 5, f"the inference thread stopped working: {seen}"
            time.sleep(0.01)
        assert shim.worker._thread.is_alive()
    finally:
        t.join(TIMEOUT)
        server.sock.close()
        shim.stop()
    assert not shim.worker._thread.is_alive()     # stop() drained and ended it normally
