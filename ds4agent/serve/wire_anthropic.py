"""Anthropic Messages (`/v1/messages`) bodies and SSE events (protocol.md §5.8). Frames are
`event: NAME\\ndata: JSON\\n\\n`, as Anthropic's API sends them; no `ping` events.

Where this differs from ds4, on purpose:
* The message id is `msg_` + 24 lowercase hex (ds4 reuses `chatcmpl-<n>`); Anthropic's ids
  and SDK examples all start with `msg_`. The thinking block's signature is that id, as in ds4.
* A stop string that ended the generation gives `stop_reason:"stop_sequence"` and names the
  string in `stop_sequence` (ds4 always says end_turn / null).
* A stream that produced no block at all still gets an empty text block: Claude Code retries
  the whole request without streaming when no `content_block_start` arrives.
* A turn cut inside its thinking is a thinking block (and an empty text block) in the body too,
  as in the stream (ds4's body returns it as text).
* A stop signal that cuts a streamed answer ends it with an `overloaded_error` event.
* A streamed error uses Anthropic's `{"type":"error","error":{...}}` shape (as ds4 does there).
"""
from __future__ import annotations

from .events import CallOut, Finish, ToolArgs, ToolEnd, ToolStart, Usage
from .wire_common import Wire, dumps, new_id, raw_object, sse

__all__ = ["AnthropicWire", "usage_anthropic", "stop_reason"]


def usage_anthropic(u: Usage, output_tokens: int | None = None) -> dict:
    # ds4's formula: everything not read from the cache counts as written to it, so
    # input_tokens is 0 in practice.
    r, w = u.cached_tokens, u.write_tokens
    return {"input_tokens": max(0, u.prompt_tokens - r - w),
            "output_tokens": u.completion_tokens if output_tokens is None else output_tokens,
            "cache_read_input_tokens": r, "cache_creation_input_tokens": w}


def stop_reason(fin: Finish) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A decoding error reads as end_turn (§5.1)."""
    if fin.finish == "tool_calls":
        return "tool_use", None
    if fin.finish == "length":
        return "max_tokens", None
    if fin.finish == "stop" and fin.stop_sequence:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


class AnthropicWire(Wire):
    api = "anthropic"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.id = new_id("msg_")
        self.blocks = 0                 # index of the next content block
        self.open: tuple[str, int] | None = None    # (kind, index) of the open block
        self.call_blocks: dict[int, int] = {}       # call index -> its block index
        self.kinds: set[str] = set()    # kinds of blocks sent

    def _ev(self, name: str, **fields) -> str:
        return sse({"type": name, **fields}, name)

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self._stop()
        k = self.blocks
        self.blocks += 1
        self.open = (kind, k)
        self.kinds.add(kind)
        return out + [self._ev("content_block_start", index=k, content_block=block)]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        kind, k = self.open
        self.open = None
        out = []
        if kind == "thinking":
            out.append(self._ev("content_block_delta", index=k,
                                delta={"type": "signature_delta", "signature": self.id}))
        out.append(self._ev("content_block_stop", index=k))
        return out

    def _delta(self, kind: str, block: dict, delta: dict) -> list[str]:
        out = [] if self.open and self.open[0] == kind else self._start(kind, block)
        return out + [self._ev("content_block_delta", index=self.open[1], delta=delta)]

    def _message(self, content: list, sr: str | None, seq: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": sr, "stop_sequence": seq, "usage": usage}

    # -- streaming ------------------------------------------------------------------------------
    def _on_begin(self, usage):
        # Pi reads message.usage.input_tokens from this event and fails without it.
        return [self._ev("message_start", message=self._message([], None, None,
                                                                 usage_anthropic(usage, 0)))]

    def _on_reasoning(self, text):
        return self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                           {"type": "thinking_delta", "thinking": text})

    def _on_text(self, text):
        return self._delta("text", {"type": "text", "text": ""},
                           {"type": "text_delta", "text": text})

    def _tool_start(self, c_id: str, name: str, index: int) -> list[str]:
        out = self._start("tool_use", {"type": "tool_use", "id": c_id, "name": name, "input": {}})
        self.call_blocks[index] = self.open[1]
        return out

    def _on_tool_start(self, ev: ToolStart):
        return self._tool_start(ev.id, ev.name, ev.index)

    def _on_tool_args(self, ev: ToolArgs):
        k = self.call_blocks.get(ev.index)
        if self.open != ("tool_use", k):
            return []       # its block was already closed: nothing can be added to it
        return [self._ev("content_block_delta", index=k,
                         delta={"type": "input_json_delta", "partial_json": ev.text})]

    def _on_tool_end(self, ev: ToolEnd):
        if self.open == ("tool_use", self.call_blocks.get(ev.call.index)):
            return self._stop()
        return []

    def _on_finish(self, fin: Finish):
        out = []
        for c in self.pending_calls(fin):
            out += self._tool_start(c.id, c.name, c.index)
            out.append(self._ev("content_block_delta", index=self.open[1],
                                delta={"type": "input_json_delta",
                                       "partial_json": c.arguments_json}))
        out += self._stop()
        if not (self.kinds & {"text", "tool_use"}):
            out += self._start("text", {"type": "text", "text": ""}) + self._stop()
        sr, seq = stop_reason(fin)
        out.append(self._ev("message_delta", delta={"stop_reason": sr, "stop_sequence": seq},
                            usage={"output_tokens": fin.usage.completion_tokens}))
        out.append(self._ev("message_stop"))
        return out

    def error_frames(self, message: str) -> list[str]:
        return [self._ev("error", error={"type": "api_error", "message": message})]

    def interrupted_frames(self, message: str) -> list[str]:
        # what Anthropic sends when it cannot finish an answer it started; the SDKs raise on an
        # `error` event, and clients retry an overloaded_error
        return [self._ev("error", error={"type": "overloaded_error", "message": message})]

    # -- whole body -----------------------------------------------------------------------------
    def body(self, fin: Finish) -> str:
        text, reasoning = self.shown(fin)
        content: list = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": self.id})
        if text:
            content.append({"type": "text", "text": text})
        for c in fin.calls:
            content.append(_tool_use(c))
        if not text and not fin.calls:
            content.append({"type": "text", "text": ""})
        sr, seq = stop_reason(fin)
        return dumps(self._message(content, sr, seq, usage_anthropic(fin.usage))) + "\n"


def _tool_use(c: CallOut) -> dict:
    return {"type": "tool_use", "id": c.id, "name": c.name,
            "input": raw_object(c.arguments_json)}
