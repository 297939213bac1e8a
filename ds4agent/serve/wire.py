"""The wire format layer: the worker's events (events.py) -> each API's JSON bodies and SSE frames.

One `Wire` per request, made by `make_wire`. It is pure: no I/O, no clock, no randomness
beyond the ids it mints. The app sends what `frames(ev)` returns for each event of a streaming
request, `body(fin)` for a non-streaming one, and `error_frames(msg)` for a failure after the
SSE headers went out. Shapes follow protocol.md §5.1-§5.8; where this layer deliberately
differs from ds4 the subclass module says so in its docstring.

JSON is written by our own small encoder (`dumps`): compact, non-ASCII kept raw (ds4 writes
UTF-8 raw), member order as built, lone surrogates replaced by U+FFFD (request bytes that were
not UTF-8 reach us as surrogate escapes and would make `.encode("utf-8")` fail), and `Raw`
values embedded verbatim, so a tool call's `arguments_json` reaches the client byte for byte
even where it is an object rather than a string (a parse/dump round trip would turn `1e5`
into `100000.0`).
"""
from __future__ import annotations

import json
from typing import Any

from .events import Begin, Event, Failure, Finish, Prefill, Reasoning, Text, ToolArgs, ToolEnd, \
    ToolStart, Usage

__all__ = ["Wire", "make_wire", "error_body", "context_error_body", "dumps", "clean", "sse",
           "Raw", "raw_object", "KEEPALIVE", "APIS"]

APIS = ("openai_chat", "openai_completions", "responses", "anthropic")

# What ds4 sends every >= 5 s while a streamed request is still prefilling (§5.0).
KEEPALIVE = ": prefill\n\n"


# ------------------------------------------------------------------------------------------
# JSON

class Raw(str):
    """JSON text that `dumps` embeds as is (it must already be valid, single-line JSON)."""
    __slots__ = ()


def clean(s: str) -> str:
    """`s` with lone surrogates replaced by U+FFFD (a surrogate pair stored as two code points
    is joined), so the result always encodes as UTF-8."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


# The C encoder json.dumps uses with ensure_ascii=False: escapes `"`, `\` and controls only.
_quote = json.encoder.encode_basestring


def _enc(v: Any, out: list) -> None:
    if isinstance(v, str):
        out.append(clean(v) if isinstance(v, Raw) else _quote(clean(v)))
    elif v is None:
        out.append("null")
    elif v is True:
        out.append("true")
    elif v is False:
        out.append("false")
    elif isinstance(v, int):
        out.append(int.__repr__(v))
    elif isinstance(v, float):
        out.append(json.dumps(v))
    elif isinstance(v, dict):
        out.append("{")
        first = True
        for k, x in v.items():
            if not first:
                out.append(",")
            first = False
            out.append(_quote(clean(str(k))))
            out.append(":")
            _enc(x, out)
        out.append("}")
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, x in enumerate(v):
            if i:
                out.append(",")
            _enc(x, out)
        out.append("]")
    else:
        raise TypeError(f"cannot encode {type(v).__name__} as JSON")


def dumps(v: Any) -> str:
    """Compact JSON text of `v` (see the module docstring); always valid UTF-8."""
    out: list = []
    _enc(v, out)
    return "".join(out)


def raw_object(text: str) -> Any:
    """A tool call's arguments text as a value to embed where the API wants an object (Anthropic
    `input`, Responses tool_search `arguments`): the text itself when it is a one-line JSON
    object, else a compact re-dump, else {} (never a corrupt body, whatever the worker sent)."""
    try:
        v = json.loads(text)
    except (ValueError, TypeError):
        return {}
    if not isinstance(v, dict):
        return {}
    # A raw line break would end the SSE `data:` line early; inside a JSON string it cannot occur.
    return dumps(v) if "\n" in text or "\r" in text else Raw(text)


def sse(payload: Any, event: str | None = None) -> str:
    """One SSE frame. `payload` is a JSON-able value or already-encoded text."""
    data = payload if isinstance(payload, str) else dumps(payload)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


# ------------------------------------------------------------------------------------------
# Errors (§5.1)

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def error_type(api: str, status: int) -> str:
    """The error `type` word for an HTTP status, in the API's own vocabulary."""
    if api == "anthropic":
        return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(api: str, message: str, status: int = 400, kind: str | None = None) -> str:
    """An error response body. OpenAI APIs: `{"error":{"message":M,"type":T}}`; Anthropic its own
    `{"type":"error","error":{"type":T,"message":M}}` (ds4 uses the OpenAI shape everywhere, but
    the Anthropic SDKs read theirs). `kind` overrides the type derived from `status`."""
    t = kind or error_type(api, status)
    if api == "anthropic":
        return dumps({"type": "error", "error": {"type": t, "message": message}}) + "\n"
    return dumps({"error": {"message": message, "type": t}}) + "\n"


def context_error_body(api: str, n_prompt: int, n_ctx: int) -> str:
    """The 400 for a prompt that does not fit the context (§5.1), in the API's shape."""
    msg = f"Prompt has {n_prompt} tokens, but the configured context size is {n_ctx} tokens"
    if api == "anthropic":
        return dumps({"type": "error", "error": {"type": "invalid_request_error", "message": msg,
                                                 "n_prompt_tokens": n_prompt, "n_ctx": n_ctx}}) + "\n"
    param = {"responses": "input", "openai_completions": "prompt"}.get(api, "messages")
    return dumps({"error": {"message": msg, "type": "invalid_request_error", "param": param,
                            "code": "context_length_exceeded", "n_prompt_tokens": n_prompt,
                            "n_ctx": n_ctx}}) + "\n"


# ------------------------------------------------------------------------------------------
# The per-request state machine

class Wire:
    """Turns one request's events into frames. Subclasses implement the `_on_*` hooks; this
    class dispatches, keeps what every API needs to know (was the stream opened, which text
    and reasoning went out, which calls were projected live) and ignores anything after the
    end (Finish or Failure)."""

    api = ""

    def __init__(self, conv, *, model: str, seq: int, created: int, stream: bool):
        self.conv = conv
        self.model = model
        self.seq = seq
        self.created = created
        self.stream = stream
        self.params: dict = getattr(conv, "params", None) or {}
        self.begun = False
        self.ended = False
        self.saw_reasoning = False
        self.text_sent: list[str] = []      # visible text deltas, in order
        self.live_calls: set[int] = set()   # call indexes whose header went out at ToolStart

    # -- public ---------------------------------------------------------------------------------
    def frames(self, ev: Event) -> list[str]:
        """The SSE frames for one event ([] for those that show nothing, e.g. Prefill). A
        Failure becomes `error_frames`; nothing is produced after the stream ended."""
        if self.ended or isinstance(ev, Prefill):
            return []
        if isinstance(ev, Failure):
            self.ended = True
            return self.error_frames(ev.message)
        out: list[str] = []
        if not self.begun:
            # Begin always comes first; opening here anyway keeps a stream well formed if a
            # worker ever skips it.
            self.begun = True
            usage = ev.usage if isinstance(ev, (Begin, Finish)) else Usage(0)
            out += self._on_begin(Usage(usage.prompt_tokens, usage.cached_tokens, 0))
        if isinstance(ev, Reasoning):
            self.saw_reasoning = True
            if ev.text:
                out += self._on_reasoning(ev.text)
        elif isinstance(ev, Text):
            if ev.text:
                out += self._on_text(ev.text)
                self.text_sent.append(ev.text)
        elif isinstance(ev, ToolStart):
            self.live_calls.add(ev.index)
            out += self._on_tool_start(ev)
        elif isinstance(ev, ToolArgs):
            if ev.index in self.live_calls and ev.text:
                out += self._on_tool_args(ev)
        elif isinstance(ev, ToolEnd):
            if ev.call.index in self.live_calls:
                out += self._on_tool_end(ev)
        elif isinstance(ev, Finish):
            tail = self.tail(ev)
            if tail:
                out += self._on_text(tail)
                self.text_sent.append(tail)
            self.ended = True
            out += self._on_finish(ev)
        return out

    def body(self, fin: Finish) -> str:
        """The whole non-streaming response body."""
        raise NotImplementedError

    def error_frames(self, message: str) -> list[str]:
        """An error after the SSE headers were sent (§5.1)."""
        return [sse({"error": {"message": message, "type": "server_error"}}, "error")]

    def status_of(self, fin: Finish) -> int:
        # Decoding errors are reported in-band (finish "error") with HTTP 200 (§5.1).
        return 200

    # -- shared helpers -------------------------------------------------------------------------
    def tail(self, fin: Finish) -> str:
        """Final text the stream has not shown yet: after a malformed DSML block the final parse
        returns the raw text, which extends what was streamed. Nothing when the generation ended
        inside thinking: ds4's parse then returns the reasoning as content, but the stream
        showed it as reasoning and shows no text (§3.8)."""
        if self.saw_reasoning and not fin.reasoning_closed:
            return ""
        sent = "".join(self.text_sent)
        content = fin.content
        if not content.startswith(sent) and self.saw_reasoning and "</think>" in content:
            # a failed parse in thinking mode returns the whole raw text, reasoning included;
            # the stream showed only what follows `</think>` as text
            content = content.split("</think>", 1)[1]
        return content[len(sent):] if content.startswith(sent) else ""

    def pending_calls(self, fin: Finish) -> list:
        """Final calls whose header never went out live: they are sent whole at the end."""
        return [c for c in fin.calls if c.index not in self.live_calls]

    # -- hooks ----------------------------------------------------------------------------------
    def _on_begin(self, usage: Usage) -> list[str]:
        return []

    def _on_reasoning(self, text: str) -> list[str]:
        return []

    def _on_text(self, text: str) -> list[str]:
        return []

    def _on_tool_start(self, ev: ToolStart) -> list[str]:
        return []

    def _on_tool_args(self, ev: ToolArgs) -> list[str]:
        return []

    def _on_tool_end(self, ev: ToolEnd) -> list[str]:
        return []

    def _on_finish(self, fin: Finish) -> list[str]:
        return []


def make_wire(api: str, conv, *, model: str, seq: int, created: int, stream: bool) -> Wire:
    """The Wire for one request. api: openai_chat | openai_completions | responses | anthropic;
    seq: the per-process request counter (chatcmpl-<seq>, cmpl-<seq>); created: unix seconds."""
    if api == "openai_chat":
        from .wire_chat import ChatWire as cls
    elif api == "openai_completions":
        from .wire_chat import CompletionsWire as cls
    elif api == "responses":
        from .wire_responses import ResponsesWire as cls
    elif api == "anthropic":
        from .wire_anthropic import AnthropicWire as cls
    else:
        raise ValueError(f"unknown api {api!r}")
    return cls(conv, model=model, seq=seq, created=created, stream=stream)
