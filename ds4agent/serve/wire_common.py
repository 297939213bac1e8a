"""What every API's wire module shares: the JSON encoder (`dumps`, `Raw`, `clean`), SSE
framing, id minting and the `Wire` base class that dispatches the worker's events to the
subclass hooks. The subclasses (wire_chat.py, wire_responses.py, wire_anthropic.py) import
this module and nothing of each other; wire.py picks one per request (`make_wire`).

JSON is written by our own small encoder (`dumps`): compact, non-ASCII kept raw (ds4 writes
UTF-8 raw), member order as built, lone surrogates replaced by U+FFFD (request bytes that were
not UTF-8 reach us as surrogate escapes and would make `.encode("utf-8")` fail), and `Raw`
values embedded verbatim, so a tool call's `arguments_json` reaches the client byte for byte
even where it is an object rather than a string (a parse/dump round trip would turn `1e5`
into `100000.0`).
"""
from __future__ import annotations

import json
import secrets
from typing import Any

from .events import Begin, Event, Failure, Finish, Prefill, Reasoning, Text, ToolArgs, ToolEnd, \
    ToolStart, Usage

__all__ = ["Wire", "dumps", "clean", "sse", "Raw", "raw_object", "new_id", "context_error_body"]


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


def new_id(prefix: str) -> str:
    """prefix + 24 lowercase hex (resp_, rs_, msg_, fc_ ids)."""
    return prefix + secrets.token_hex(12)


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
            return self.failure_frames(ev)
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

    def failure_frames(self, f: Failure) -> list[str]:
        """How a failed request's stream ends: a cut answer (the server stopping) as the API ends
        an answer that did not complete, a prompt past the context as the API's context-length
        error, anything else as `error_frames`."""
        if f.interrupted:
            return self.interrupted_frames(f.message)
        if f.context_full:
            return self.context_frames(f.n_prompt or 0, f.n_ctx)
        return self.error_frames(f.message)

    def interrupted_frames(self, message: str) -> list[str]:
        """The answer was cut (the server is stopping). Chat and Completions: an error object and
        no finish chunk or `[DONE]`: the SDK raises on it, and a client that reads chunks never
        sees the finish_reason of an answer that ended."""
        return self.error_frames(message)

    def context_frames(self, n_prompt: int, n_ctx: int) -> list[str]:
        """The prompt did not fit the context, found after the SSE headers went out (a queued
        request whose text-prefix reuse came out longer): the 400 body as an error event."""
        return [sse(Raw(context_error_body(self.api, n_prompt, n_ctx).rstrip("\n")), "error")]

    def shown(self, fin: Finish) -> tuple[str, str | None]:
        """(content, reasoning) of a whole body, as the stream shows them: a turn cut inside its
        thinking (`</think>` never sampled) is all reasoning and no content (§3.8). ds4's parse
        returns such a turn as content, and ds4's non-streamed bodies send it so; the stream
        showed it as reasoning, and a client must get the same answer either way.
        (reasoning_closed is False only for a thinking turn without `</think>`.)"""
        if not fin.reasoning_closed:
            return "", (fin.reasoning or "") + fin.content
        return fin.content, fin.reasoning

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
