"""The shim's request edge (docs/serve.md, "The request edge"): text that is not Unicode, foreign
Host names, cross-origin browser requests, the router's own 404/405, the body limit, the cheap
context bound before tokenizing, and memory given back after big bodies.

Every refusal must be a 4xx JSON error in the API's own shape, with no traceback or error record
in any log, and none may reach the worker (its request counter does not move).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ds4agent.serve import ServeConfig, ServerThread, Shim
from ds4agent.serve.app import create_app
from ds4agent.serve.config import MAX_BODY_BYTES
from ds4agent.serve.edge import exposure_warning, host_allowed, origin_allowed, text_problem
from engine import Engine
from prompts import ContextLengthError, RequestError

POSTS = {"/v1/chat/completions": "openai_chat", "/v1/completions": "openai_completions",
         "/v1/responses": "responses", "/v1/messages": "anthropic"}
U = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.bad: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if record.exc_info or record.levelno >= logging.ERROR or "Traceback" in msg:
            self.bad.append(f"{record.name}: {msg}")


@pytest.fixture(scope="module")
def srv(agent_model):
    shim = Shim(Engine.open(agent_model), ServeConfig(ctx=4096, max_tokens=1))
    records = _Records()
    server = ServerThread(shim)
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "ds4agent.serve", "asyncio")]
    for lg in loggers:
        lg.addHandler(records)
    try:
        with server as url:
            with httpx.Client(base_url=url, timeout=60) as c:
                yield SimpleNamespace(url=url, shim=shim, client=c, records=records)
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    assert not records.bad, records.bad[:5]


def ran(shim) -> int:
    return shim.worker.stats["requests"]


def assert_error(r: httpx.Response, path: str, status: int, word: str = "") -> str:
    """A JSON error body in the shape of the path's API; returns its message."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    obj = r.json()
    err = obj["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if POSTS.get(path) == "anthropic" or path.startswith("/v1/messages"):
        assert obj["type"] == "error"
    else:
        assert "type" not in obj
    assert word.lower() in err["message"].lower(), err["message"]
    return err["message"]


# ------------------------------------------------------------------------------------------
# Item 1: strings that are not Unicode never reach the engine

# "@@" marks the string field that gets the bad escape; every field a client can set that is a
# string: stop words, tool names and arguments, system and message text, model, tool_choice names.
_SITES = {
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "@@"}]},
        {"messages": [{"role": "system", "content": "@@"}, U]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "@@"}]}]},
        {"messages": [U], "stop": "@@"},
        {"messages": [U], "stop": ["x", "@@"]},
        {"messages": [U], "model": "@@"},
        {"messages": [U], "tools": [{"type": "function", "function": {"name": "@@"}}]},
        {"messages": [U], "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "@@"}}},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "@@", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}, U]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":"@@"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}, U]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "@@", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "@@", "content": "@@"}, U]},
        {"messages": [{"role": "assistant", "content": "a", "reasoning_content": "@@"}, U]},
        {"messages": [U], "metadata": {"user": "@@"}},          # even a field nobody reads
    ],
    "/v1/completions": [
        {"prompt": "@@"}, {"prompt": ["x", "@@"]}, {"prompt": "x", "stop": "@@"},
        {"prompt": "x", "stop": ["@@"]}, {"prompt": "x", "model": "@@"},
    ],
    "/v1/responses": [
        {"input": "@@"}, {"input": "x", "instructions": "@@"}, {"input": "x", "model": "@@"},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "@@"}]}]},
        {"input": [{"type": "function_call", "call_id": "c1", "name": "@@", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
        {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":"@@"}'},
                   {"type": "function_call_output", "call_id": "c1", "output": "@@"}]},
        {"input": "x", "tools": [{"type": "function", "name": "@@", "parameters": {"type": "object"}}]},
        {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "@@"}},
        {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "@@"}]},
                   {"role": "user", "content": "x"}]},
    ],
    "/v1/messages": [
        {"messages": [{"role": "user", "content": "@@"}]},
        {"messages": [U], "system": "@@"},
        {"messages": [U], "system": [{"type": "text", "text": "@@"}]},
        {"messages": [U], "stop_sequences": ["@@"]},
        {"messages": [U], "model": "@@"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "@@"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "@@", "input": {}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                         "input": {"a": "@@"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "@@"}]}]},
        {"messages": [U], "tools": [{"name": "@@", "input_schema": {"type": "object"}}]},
        {"messages": [U], "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "@@"}},
        {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "@@", "signature": ""}]}, U]},
    ],
}
CASES = [(path, i) for path, sites in _SITES.items() for i in range(len(sites))]
# a lone high half, a lone low half, a high half followed by an escape that is not a low half
# (ds4 keeps the high half and drops the other), a high half at the very end of a string
BAD_ESCAPES = ["\\ud800", "\\udfff", "\\ud83d\\u0041", "a\\ud83d"]


def _body(path: str, i: int, stream: bool, escape: str) -> bytes:
    body = dict(_SITES[path][i], stream=stream)
    if path == "/v1/messages":
        body.setdefault("max_tokens", 1)
    return json.dumps(body).replace("@@", escape).encode()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,i", CASES)
def test_lone_surrogates_in_any_string_are_refused(srv, path, i, stream):
    before = ran(srv.shim)
    for escape in BAD_ESCAPES:
        r = srv.client.post(path, content=_body(path, i, stream, escape))
        assert_error(r, path, 400, "surrogate")
    assert ran(srv.shim) == before          # nothing reached the worker
    assert not srv.records.bad, srv.records.bad[:3]


@pytest.mark.parametrize("path", list(POSTS))
def test_invalid_utf8_bytes_are_refused(srv, path):
    """The issue's case: raw ED A0 80 (a surrogate written as UTF-8) in a streamed stop string."""
    key = "stop_sequences" if path == "/v1/messages" else "stop"
    base = json.loads(_body(path, 0, True, "x"))
    base[key] = ["@@"]
    raw = json.dumps(base).encode()
    before = ran(srv.shim)
    for bad in (b"\xed\xa0\x80", b"\xff", b"caf\xe9", b"\xf0\x9f\x98"):
        r = srv.client.post(path, content=raw.replace(b"@@", bad))
        assert_error(r, path, 400, "not valid UTF-8")
    assert ran(srv.shim) == before
    assert not srv.records.bad, srv.records.bad[:3]


@pytest.mark.parametrize("path", list(POSTS))
def test_whole_characters_are_still_taken(srv, path):
    """A surrogate pair escape, an escaped backslash before `ud800` (plain text), raw UTF-8."""
    for text in ("\\ud83d\\ude00 ok", "\\\\ud800 is text", "caf\u00e9 \U0001F600"):
        r = srv.client.post(path, content=_body(path, 0, False, text).decode().encode("utf-8"))
        assert r.status_code == 200, r.text[:300]


def test_text_problem_finds_exactly_the_lone_halves():
    ok = [b'{"a":"\\ud83d\\ude00"}', b'{"a":"\\\\ud800"}', b'{"a":"\\\\\\\\ud800"}', b'{"a":"\\u00e9"}',
          "\u00e9\U0001F600".encode(), b'{"a":"\\uD83D\\uDE00"}', b""]
    for body in ok:
        assert text_problem(body) is None, body
    bad = {b'{"a":"\\ud800"}': 6, b'{"a":"\\\\\\ud800"}': 8, b'{"a":"\\ude00\\ud83d"}': 6,
           b'{"a":"\\ud83d\\\\\\ude00"}': 6, b'{"a":"\\ud83d\\ud83d\\ude00"}': 6, b'{"a":"x\\ud83d"}': 7,
           b'{"\\udbff":1}': 2}
    for body, at in bad.items():
        msg = text_problem(body)
        assert msg and "surrogate" in msg and f"offset {at}" in msg, (body, msg)
    assert "offset 8" in text_problem(b'{"a":"\xc3\xa9\xed\xa0\x80"}')


# ------------------------------------------------------------------------------------------
# Item 11: Host and Origin

def test_host_names_accepted_and_refused():
    for h in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "localhost.:80", "[::1]:8000", "[::1]",
              "127.5.6.7", "127.1", "[::ffff:127.0.0.1]:9", None):
        assert host_allowed(h, "127.0.0.1"), h
    for h in ("rebind.evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]:80",
              "localhost.evil", "x", "", "127.1 evil", "127.0.0.1:80:80", "[::1", "[::1]x", "::1", "0.0.0.0:8000"):
        assert not host_allowed(h, "127.0.0.1"), h
    assert host_allowed("192.168.1.5:8000", "192.168.1.5") and not host_allowed("evil:80", "192.168.1.5")
    assert host_allowed("MyBox.lan:8000", "mybox.lan") and host_allowed("localhost", "mybox.lan")
    assert host_allowed("[fe80::1]:80", "fe80:0::1")
    for bind in ("0.0.0.0", "::"):
        assert host_allowed("rebind.evil.example", bind)


def test_origins():
    assert origin_allowed(None, None, "127.0.0.1:8000", False)
    assert origin_allowed("http://127.0.0.1:8000", "same-origin", "127.0.0.1:8000", False)
    assert origin_allowed("http://localhost", None, "localhost:80", False)
    for o in ("http://evil.example", "null", "http://127.0.0.1:3000", "file://", "http://127.0.0.1:8000/x"):
        assert not origin_allowed(o, None, "127.0.0.1:8000", False), o
    assert not origin_allowed(None, "cross-site", "127.0.0.1:8000", False)
    assert origin_allowed("http://evil.example", "cross-site", "127.0.0.1:8000", True)


def test_foreign_host_is_refused_before_parsing(srv):
    before = ran(srv.shim)
    for path in list(POSTS) + ["/v1/models", "/nowhere"]:
        for host in ("rebind.evil.example", "rebind.evil.example:" + srv.url.rsplit(":", 1)[1]):
            r = srv.client.post(path, content=b"{not json", headers={"host": host})
            assert_error(r, path, 403, "host")
    r = srv.client.get("/v1/models", headers={"host": "localhost"})
    assert r.status_code == 200
    assert ran(srv.shim) == before


def test_cross_origin_posts_are_refused_without_cors(srv):
    body = json.dumps({"messages": [U]}).encode()
    before = ran(srv.shim)
    for headers in ({"origin": "http://evil.example", "content-type": "text/plain"},
                    {"origin": "null"}, {"sec-fetch-site": "cross-site"},
                    {"origin": "http://127.0.0.1:1", "content-type": "text/plain"}):
        for path in POSTS:
            r = srv.client.post(path, content=body, headers=headers)
            assert_error(r, path, 403, "cross-origin")
    r = srv.client.options("/v1/chat/completions", headers={"origin": "http://evil.example",
                                                            "access-control-request-method": "POST"})
    assert_error(r, "/v1/chat/completions", 403)
    assert "access-control-allow-origin" not in r.headers
    assert ran(srv.shim) == before
    # the server's own origin, and no origin at all (SDKs, agent CLIs), are served
    own = srv.url
    assert srv.client.post("/v1/chat/completions", content=body, headers={"origin": own}).status_code == 200
    assert srv.client.post("/v1/chat/completions", content=body).status_code == 200


def test_cors_flag_lets_browsers_in(srv):
    srv.shim.cfg.cors = True
    try:
        r = srv.client.post("/v1/chat/completions", json={"messages": [U]},
                            headers={"origin": "http://app.example", "content-type": "text/plain"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = srv.client.options("/v1/messages", headers={"origin": "http://app.example"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
        r = srv.client.get("/v1/models", headers={"host": "evil.example"})
        assert_error(r, "/v1/models", 403)                       # the Host check stays
        assert r.headers["access-control-allow-origin"] == "*"
    finally:
        srv.shim.cfg.cors = False


def test_exposure_warning(caplog):
    assert exposure_warning(ServeConfig(host="127.0.0.1")) is None
    assert exposure_warning(ServeConfig(host="localhost")) is None
    assert exposure_warning(ServeConfig(host="::1")) is None
    assert exposure_warning(ServeConfig(host="0.0.0.0", api_key="k")) is None
    for host in ("0.0.0.0", "::", "192.168.1.5"):
        assert "--api-key" in exposure_warning(ServeConfig(host=host)), host
    assert "DNS rebinding" in exposure_warning(ServeConfig(host="0.0.0.0"))      # any Host accepted
    assert "DNS rebinding" not in exposure_warning(ServeConfig(host="192.168.1.5"))
    with caplog.at_level(logging.WARNING, logger="ds4agent.serve"):
        create_app(SimpleNamespace(cfg=ServeConfig(host="0.0.0.0")))
    assert any("without --api-key" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# ------------------------------------------------------------------------------------------
# Item 6: the router's own answers

@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "TRACE", "FOO", "HEAD", "POST", "OPTIONS"])
def test_router_answers_are_json_in_the_api_shape(srv, method):
    paths = list(POSTS) + ["/v1/models", "/v1/models/nope", "/nowhere", "/v1/messages/count_tokens",
                           "/v1/chat/completions/", "/v1"]
    for path in paths:
        r = srv.client.request(method, path)
        api_path = path in POSTS and method == "POST"
        if method == "OPTIONS" or (path == "/v1/models" and method in ("GET", "HEAD")) or api_path:
            continue             # served: 204, the list, or a 400 for the empty body
        assert r.status_code in (404, 405), (method, path, r.status_code)
        assert r.headers["content-type"].startswith("application/json"), (method, path, r.headers)
        if r.status_code == 405:
            assert r.headers["allow"] in ("POST", "GET, HEAD")
        if method != "HEAD":
            assert_error(r, path, r.status_code)
    assert srv.client.request("TRACE", "/v1/messages").json()["error"]["type"] == "invalid_request_error"
    assert srv.client.get("/v1/messages/count_tokens").json()["type"] == "error"


# ------------------------------------------------------------------------------------------
# Item 2: the body limit, the cheap bound, memory

def test_body_limit_is_for_text():
    # a 1M-token context of text is ~4 MB of UTF-8; JSON escaping at most doubles most text
    assert 8 << 20 <= MAX_BODY_BYTES <= 32 << 20


def test_declared_oversize_body_is_refused_before_reading(srv):
    host, port = srv.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{\"messages\":" % (MAX_BODY_BYTES + 1))
        got = b""
        t0 = time.monotonic()
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        assert time.monotonic() - t0 < 5
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower(), head
    assert json.loads(body)["error"]["type"] == "request_too_large"


def test_streamed_oversize_body_is_refused(srv):
    def chunks():
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)
    try:
        r = srv.client.post("/v1/chat/completions", content=chunks())
    except httpx.TransportError:
        return                   # the server may close before the client has sent it all
    assert_error(r, "/v1/chat/completions", 413, "exceeds")


def test_long_prompt_is_refused_without_tokenizing(srv, monkeypatch):
    tok = srv.shim.engine.tokenizer
    per = tok.max_token_chars
    assert per is not None
    calls = []
    monkeypatch.setattr(tok, "encode_upto", lambda *a: calls.append(a) or pytest.fail("tokenized"))
    text = "x" * (4095 * per + 1)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                       ("/v1/completions", {"prompt": text}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": text}], "max_tokens": 1})):
        r = srv.client.post(path, json=body)
        msg = assert_error(r, path, 400, "Prompt has at least")
        assert "context size is 4096 tokens" in msg
        n = r.json()["error"]["n_prompt_tokens"]
        assert n >= 4096 and n * per >= len(text)
    assert not calls


def test_long_prompt_stops_tokenizing_at_the_context(agent_model):
    """Under the cheap bound but over the context: the tokenizer stops once the context is
    full (the count is then a lower bound); a prompt that fits is counted whole."""
    shim = Shim(Engine.open(agent_model), ServeConfig(ctx=32768))
    text = "a b c d e f g\n" * 60000          # 840k characters: under 32767 * 70, ~480k tokens
    assert len(text) < 32767 * shim.engine.tokenizer.max_token_chars
    with pytest.raises(ContextLengthError) as e:
        shim.prepare("openai_completions", json.dumps({"prompt": text}).encode(), lambda ev: None)
    assert e.value.message.startswith("Prompt has at least ")
    assert 32768 <= e.value.n_prompt_tokens < len(shim.engine.tokenizer.encode(text)) // 2
    job = shim.prepare("openai_completions", json.dumps({"prompt": text[:40_000]}).encode(), lambda ev: None)
    assert job.tokens == shim.engine.tokenizer.encode(job.rendered.text)


def test_token_bound_is_provable(agent_model):
    """n characters never make fewer than n / max_token_chars tokens, on the texts that come
    closest: the vocabulary's longest strings back to back, markers, whitespace runs."""
    tok = Engine.open(agent_model).tokenizer
    per = tok.max_token_chars
    longest = sorted(tok.tokens, key=lambda s: len(s.encode()), reverse=True)[:50]
    texts = ["".join(tok.decode([tok.id_of[s]]) if "\uff5c" not in s else s for s in longest) * 20,
             "<\uff5cUser\uff5c>" * 500, " " * 5000, "\n" * 3000 + "x", "\u00e9\U0001F600" * 900]
    for text in texts:
        ids = tok.encode(text)
        assert len(ids) * per >= len(text), (len(ids), per, len(text))


def test_encode_upto_is_a_prefix_of_encode(agent_model):
    tok = Engine.open(agent_model).tokenizer
    text = "".join(f"line {i} with some words\n  indented {i}\n" for i in range(8000))    # ~340k chars
    full = tok.encode(text)
    ids, complete = tok.encode_upto(text, 5000)
    assert not complete and len(ids) >= 5000 and ids == full[:len(ids)] and len(ids) < len(full)
    assert tok.encode_upto(text, len(full) + 1) == (full, True)
    assert tok.encode_upto("short", 1) == (tok.encode("short"), True)


# -- memory after big bodies: a real server process, RSS read from /proc

def _rss_kb(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(key)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _big_bodies(n: int, size: int = 10_000_000) -> list[tuple[str, bytes]]:
    """n bodies of ~10 MB, of the shapes clients send: one huge message, many messages, a big
    tool result, a legacy prompt, Anthropic blocks."""
    words = "lorem ipsum dolor sit amet, consectetur\n"
    text = (words * (size // len(words) + 1))[:size]
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": text[:2000]}
            for i in range(size // 2100)]
    shapes = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/v1/chat/completions", {"messages": many + [U]}),
        ("/v1/completions", {"prompt": text, "stream": True}),
        ("/v1/messages", {"max_tokens": 5, "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"p": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": text}]}]}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}),
    ]
    return [(p, json.dumps(b).encode()) for p, b in (shapes[i % len(shapes)] for i in range(n))]


def _burst(agent_model, tmp_path, n: int) -> tuple[int, int, int]:
    port = _free_port()
    env = dict(os.environ, HOME=str(tmp_path), DS4_BACKEND="numpy")
    exe = Path(sys.executable).with_name("ds4-agent")
    proc = subprocess.Popen([str(exe), "--serve", "-m", str(agent_model), "--ctx", "32768", "--port", str(port)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            t0 = time.monotonic()
            while True:
                try:
                    if c.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() - t0 < 60, "server did not start"
                time.sleep(0.2)
            r = c.post("/v1/chat/completions", json={"messages": [U], "max_tokens": 1})
            assert r.status_code == 200
            start = _rss_kb(proc.pid)
            for path, body in _big_bodies(n):
                r = c.post(path, content=body)
                assert_error(r, path, 400, "Prompt has")
            time.sleep(0.5)
            return start, _rss_kb(proc.pid), _rss_kb(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert b"Traceback" not in out, out.decode(errors="replace")[-2000:]


def test_memory_returns_after_big_bodies(agent_model, tmp_path):
    start, end, peak = _burst(agent_model, tmp_path, 3)
    assert end - start < 200 * 1024, (start, end, peak)


@pytest.mark.slow
def test_memory_returns_after_twenty_big_bodies(agent_model, tmp_path):
    start, end, peak = _burst(agent_model, tmp_path, 20)
    assert end - start < 200 * 1024, (start, end, peak)


def test_recorded_clients_pass_the_edge():
    """The requests Claude Code, Codex, opencode and Pi really sent (shared/clients) pass every
    edge check unchanged: loopback Host, no Origin, text that is Unicode."""
    from conftest import SHARED
    files = sorted((SHARED / "clients").glob("*.json"))
    if not files:
        pytest.skip("shared/clients is absent (the shared/ folder beside the checkout holds it)")
    for f in files:
        rec = json.loads(f.read_text())
        h = {k.lower(): v for k, v in rec["headers"].items()}
        assert host_allowed(h.get("host"), "127.0.0.1"), f.name
        assert origin_allowed(h.get("origin"), h.get("sec-fetch-site"), h.get("host"), False), f.name
        body = rec.get("body")
        if body is not None:
            raw = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
            assert text_problem(raw.encode("utf-8")) is None, f.name


def test_prepare_refuses_lone_surrogates_in_str_and_dict_bodies(agent_model):
    """Embedders may hand the shim a str or dict body: lone surrogates there are refused too
    (a stop word of one crashed the worker's stream parser)."""
    shim = Shim(Engine.open(agent_model), ServeConfig(ctx=4096))
    for body in ({"messages": [U], "stop": ["\ud800"]}, '{"messages":[{"role":"user","content":"a\udc80"}]}',
                 '{"prompt":"x","stop":"\\ud800"}'):
        api = "openai_completions" if "prompt" in str(body) else "openai_chat"
        with pytest.raises(RequestError) as e:
            shim.prepare(api, body, lambda ev: None)
        assert "surrogate" in e.value.message or "UTF-8" in e.value.message
    assert shim.prepare("openai_chat", {"messages": [U], "stop": ["\U0001F600"]}, lambda ev: None).stop == ["\U0001F600"]
