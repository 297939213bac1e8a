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
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers_serve import NO_THINK, ServeProc, free_port, serve_cmd, sse_event


# ------------------------------------------------------------------------------------------
# 1. Binding

def _run_serve(model: Path, tmp: Path, *args: str) -> tuple[int, str]:
    p = subprocess.run(serve_cmd(model, *args), capture_output=True, text=True, timeout=120, cwd=tmp,
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
    rc, err = _run_serve(agent_model, tmp_path, "--host", host, "--port", str(free_port()))
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: cannot serve on host {host}"), err
    assert words in err


def test_port_out_of_range_is_a_flag_error(agent_model, tmp_path):
    rc, err = _run_serve(agent_model, tmp_path, "--port", "70000")
    assert rc == 2 and err.strip() == "error: --port must be at most 65535", err


# ------------------------------------------------------------------------------------------
# 2. A stop signal during a streamed answer

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
    srv = ServeProc(agent_model, tmp_path)
    t0 = time.monotonic()
    try:
        client(srv.url, sigs, srv)
    finally:
        rc = srv.wait()
    log = srv.text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert time.monotonic() - t0 < (40 if sigs == 1 else 25), log[-3000:]


# ------------------------------------------------------------------------------------------
# In-process servers (ServerThread) for the rest

from ds4agent.serve import ServeConfig, ServerThread, Shim      # noqa: E402

TOOL = "get_weather"
ANTH_TOOLS = [{"name": TOOL, "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}]


def _server(engine, **kw) -> ServerThread:
    kw.setdefault("slots", 1)
    return ServerThread(Shim(engine, ServeConfig(ctx=4096, **kw)))


def _sse(r: httpx.Response) -> list[tuple[str | None, object]]:
    """(event name, data) of each frame of a streamed response; comments left out."""
    return [sse_event(frame) for frame in r.text.split("\n\n") if frame and not frame.startswith(":")]


# ------------------------------------------------------------------------------------------
# 3. A turn cut inside its thinking: the same fields streamed and not

THINKING_ASKS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Think hard: 17 * 23?"}],
                                      "max_tokens": 6, "seed": 7, "thinking": {"type": "enabled"}}),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": "Think hard: 17 * 23?"}],
                                   "max_tokens": 6, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    "responses": ("/v1/responses", {"input": "Think hard: 17 * 23?", "max_output_tokens": 6,
                                    "reasoning": {"effort": "high", "summary": "auto"}}),
}


def _whole_fields(api: str, b: dict) -> tuple[str, str, str]:
    """(content, reasoning, finish) of a non-streamed body."""
    if api == "chat":
        m = b["choices"][0]
        return m["message"]["content"], m["message"].get("reasoning_content", ""), m["finish_reason"]
    if api == "anthropic":
        text = "".join(c["text"] for c in b["content"] if c["type"] == "text")
        thinking = "".join(c["thinking"] for c in b["content"] if c["type"] == "thinking")
        return text, thinking, b["stop_reason"]
    text = "".join(p["text"] for o in b["output"] if o["type"] == "message" for p in o["content"])
    summary = "".join(p["text"] for o in b["output"] if o["type"] == "reasoning" for p in o["summary"])
    return text, summary, b["status"]


def _stream_fields(api: str, frames) -> tuple[str, str, str]:
    content = reasoning = finish = ""
    for name, d in frames:
        if api == "chat" and d != "[DONE]":
            for c in d["choices"]:
                content += c["delta"].get("content") or ""
                reasoning += c["delta"].get("reasoning_content") or ""
                finish = c["finish_reason"] or finish
        elif api == "anthropic" and name == "content_block_delta":
            content += d["delta"].get("text", "")
            reasoning += d["delta"].get("thinking", "")
        elif api == "anthropic" and name == "message_delta":
            finish = d["delta"]["stop_reason"]
        elif api == "responses" and name == "response.output_text.delta":
            content += d["delta"]
        elif api == "responses" and name == "response.reasoning_summary_text.delta":
            reasoning += d["delta"]
        elif api == "responses" and name in ("response.completed", "response.incomplete", "response.failed"):
            finish = d["response"]["status"]
    return content, reasoning, finish


@pytest.mark.parametrize("api", list(THINKING_ASKS))
def test_thinking_cut_by_the_token_limit_is_reasoning_streamed_or_not(agent_engine, api):
    """ds4's parse returns a turn cut before `</think>` as content, which its non-streamed bodies
    sent (the cut reasoning as the answer, hidden Responses reasoning included) while the stream
    sent it as reasoning. Both are now the stream's: reasoning, empty content, the length end."""
    path, body = THINKING_ASKS[api]
    length = {"chat": "length", "anthropic": "max_tokens", "responses": "incomplete"}[api]
    with _server(agent_engine) as url, httpx.Client(base_url=url, timeout=60) as c:
        whole = c.post(path, json=body)
        assert whole.status_code == 200, whole.text
        streamed = c.post(path, json=dict(body, stream=True))
        assert streamed.status_code == 200, streamed.text
    w = _whole_fields(api, whole.json())
    s = _stream_fields(api, _sse(streamed))
    for got in (w, s):
        assert got[0] == "" and got[2] == length and got[1], (api, w, s)   # reasoning, no content
    if api == "chat":                   # a seed: the same tokens both times
        assert s == w, (s, w)


# ------------------------------------------------------------------------------------------
# 4b. A live-only continuation that loses its state while queued: a real 409

def test_a_queued_stream_that_loses_its_live_state_gets_a_409_not_a_200(agent_engine):
    """An Anthropic tool result answering a call the client did not resend can only continue
    the live timeline. Queued behind another request on the one slot, it finds that timeline
    gone when it starts. Its headers now wait for that moment, so the refusal is an HTTP 409 in
    Anthropic's shape (it was a 200, keep-alives, then an error event)."""
    server = _server(agent_engine, keepalive_s=0.2, forced_tool_calls={TOOL: {"city": "Paris"}})
    first = {"model": "m", "max_tokens": 40, "tools": ANTH_TOOLS, **NO_THINK,
             "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    with server as url, httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/messages", json=first)
        assert r.status_code == 200 and r.json()["stop_reason"] == "tool_use", r.text
        call = next(b for b in r.json()["content"] if b["type"] == "tool_use")
        shim = server.shim
        real_prepare = shim.prepare
        began = []

        def prepare_then_hold(api, body, emit):
            job = real_prepare(api, body, emit)
            if job.rendered.requires_live_tool_state:
                # another conversation takes the one slot now, after this job was checked
                # against the live state and before it is queued
                other = real_prepare("openai_chat", json.dumps(
                    {"messages": [{"role": "user", "content": "Something else entirely."}],
                     "max_tokens": 12, "temperature": 0, **NO_THINK}).encode(), began.append)
                shim.worker.submit(other)
                t0 = time.monotonic()
                while not began:
                    assert time.monotonic() - t0 < 10
                    time.sleep(0.01)
            return job
        shim.prepare = prepare_then_hold
        try:
            t0 = time.monotonic()
            cont = dict(first, stream=True, messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                              "content": "sunny"}]}])
            r = c.post("/v1/messages", json=cont)
        finally:
            shim.prepare = real_prepare
    assert began, "the other request never ran"
    assert r.status_code == 409, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert err["type"] == "error" and "continuation state is not available" in err["error"]["message"]
    assert time.monotonic() - t0 > 0.2            # it waited past a keep-alive interval


# ------------------------------------------------------------------------------------------
# 4c. The context found full by the worker

@pytest.fixture
def overflowing(agent_engine, monkeypatch):
    """A server whose worker finds every prompt one context too long at its own check, as a
    text-prefix reuse whose tokens come out longer than the canonical ones does."""
    from ds4agent.serve import slot as S
    real = S.Slot._prefill

    def longer(self, job, target, **kw):
        return real(self, job, list(target) + [0] * self.session.ctx, **kw)
    monkeypatch.setattr(S.Slot, "_prefill", longer)
    return agent_engine


CONTEXT_ASKS = {
    "openai_chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    "openai_completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
}


def _check_context_error(api: str, d: dict):
    if api == "anthropic":
        assert d["type"] == "error" and d["error"]["type"] == "invalid_request_error", d
        err = d["error"]
    else:
        err = d["error"]
        assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error", d
        assert err["param"] == {"responses": "input", "openai_completions": "prompt"}.get(api, "messages")
    assert "configured context size is 4096 tokens" in err["message"], err
    assert err["n_ctx"] == 4096 and err["n_prompt_tokens"] > 4096, err


@pytest.mark.parametrize("api", list(CONTEXT_ASKS))
def test_context_full_in_the_worker_is_the_apis_context_error(overflowing, api):
    path, body = CONTEXT_ASKS[api]
    with _server(overflowing) as url, httpx.Client(base_url=url, timeout=60) as c:
        for stream in (False, True):
            r = c.post(path, json=dict(body, stream=stream, **NO_THINK))
            assert r.status_code == 400, r.text
            _check_context_error(api, r.json())


def test_context_full_after_the_headers_is_the_context_error_event(overflowing):
    """Queued past the keep-alive interval, the stream's headers are out: the same error as an
    event, which the openai SDK raises with its code."""
    import openai
    server = _server(overflowing, keepalive_s=0.2)
    with server as url:
        shim = server.shim
        hold = threading.Event()
        began = threading.Event()

        def emit(ev):
            began.set()
            hold.wait(10)
        # a job that passes (Failure is emitted at once) would not hold: hold the slot in emit
        job = shim.prepare("openai_chat", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 1, **NO_THINK}).encode(), emit)
        shim.worker.submit(job)
        assert began.wait(10)
        threading.Timer(0.8, hold.set).start()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError) as e:
            for _ in client.chat.completions.create(model="m", stream=True, max_tokens=2,
                                                    messages=[{"role": "user", "content": "hi"}]):
                pass
    assert e.value.code == "context_length_exceeded", e.value.body
    _check_context_error("openai_chat", {"error": e.value.body})


# ------------------------------------------------------------------------------------------
# 4d. Text that is not Unicode, nested where the body check cannot see it

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "f", "arguments": '{"x": "\\ud800"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}),
    ("/v1/responses", {"input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": "a\\udc80b"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
])
def test_a_lone_surrogate_in_tool_arguments_is_a_400(agent_engine, path, body):
    """The body check sees `\\\\ud800` (an escaped backslash: plain text at the JSON level); the
    arguments string is JSON itself and decodes to a lone surrogate. It was a 500."""
    with _server(agent_engine) as url, httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(path, json=dict(body, max_tokens=1, **NO_THINK))
        assert r.status_code == 400, r.text
        assert "surrogate" in r.json()["error"]["message"]
        # a whole pair in the same place is a character, and passes
        ok = json.loads(json.dumps(body).replace("\\\\ud800", "\\\\ud83d\\\\ude00")
                        .replace("\\\\udc80", "\\\\ud83d\\\\ude00"))
        assert c.post(path, json=dict(ok, max_tokens=1, **NO_THINK)).status_code == 200


def test_a_non_ascii_api_key_can_match(agent_engine):
    """Headers arrive as bytes; a key compared with their latin-1 reading never matched a
    non-ASCII --api-key sent as UTF-8."""
    with _server(agent_engine, api_key="clé-ключ") as url, httpx.Client(base_url=url, timeout=60) as c:
        key = "clé-ключ".encode()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **NO_THINK}
        assert c.post("/v1/chat/completions", json=body, headers={"x-api-key": key}).status_code == 200
        assert c.post("/v1/chat/completions", json=body,
                      headers={"authorization": b"Bearer " + key}).status_code == 200
        assert c.post("/v1/chat/completions", json=body, headers={"x-api-key": "cle"}).status_code == 401


@pytest.mark.parametrize("path, body, kind", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}]}, None),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me a long story."}]}, "overloaded_error"),
])
def test_a_stop_cuts_a_non_streamed_answer_with_a_503(agent_engine, path, body, kind):
    """Two stop signals (as Ctrl-C twice) while a non-streamed answer is generated: a 503 in the
    API's shape at once, not a body that looks finished, and the job stops."""
    server = _server(agent_engine)
    got = {}
    with server as url:
        def post():
            got["r"] = httpx.post(url + path, timeout=60, json=dict(body, max_tokens=LONG, **NO_THINK))
        t = threading.Thread(target=post)
        t.start()
        t0 = time.monotonic()
        while not server.shim.worker.busy:
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
        time.sleep(0.3)
        server.server.handle_exit(signal.SIGINT, None)
        server.server.handle_exit(signal.SIGINT, None)
        t.join(30)
        assert server.shim.worker.stats["generated"] < LONG
    r = got["r"]
    assert r.status_code == 503, r.text
    d = r.json()
    assert "shutting down" in (d["error"]["message"])
    if kind:
        assert d["error"]["type"] == kind
