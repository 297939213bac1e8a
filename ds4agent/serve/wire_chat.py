"""OpenAI Chat Completions (`/v1/chat/completions`) and legacy Completions (`/v1/completions`)
bodies and SSE chunks (protocol.md §5.4). SSE frames are `data:` lines only, as ds4 sends them.

Where this differs from ds4, on purpose:
* A call whose header was not projected live is sent whole at the end even when other calls
  were (ds4 sends the whole-call chunk only when none was projected, so such a call was lost).
* A turn cut inside its thinking is `reasoning_content` with empty content in the body too, as
  the stream shows it (ds4's body returns it as content).
* A stop signal that cuts a streamed answer ends it with an error object and no finish chunk or
  `[DONE]` (the SDK raises; a finish_reason would say the answer ended).
* Legacy completions return the raw generation (§2.6: reasoning and `</think>` included, no
  split). The worker may still report it as Reasoning then Text; the reasoning then goes out as
  text and `</think>` is put back where the two meet, so the stream equals the raw bytes.
"""
from __future__ import annotations

from .events import CallOut, Finish, ToolArgs, ToolStart, Usage
from .wire_common import Wire, dumps, sse

__all__ = ["ChatWire", "CompletionsWire", "usage_openai"]


def usage_openai(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens,
                                      "cache_write_tokens": u.write_tokens}}


def _whole_call(c: CallOut) -> dict:
    return {"id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": c.arguments_json}}


class ChatWire(Wire):
    api = "openai_chat"

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.seq}"

    def _chunk(self, delta: dict, finish: str | None = None) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    def _on_begin(self, usage):
        return [self._chunk({"role": "assistant"})]

    def _on_reasoning(self, text):
        return [self._chunk({"reasoning_content": text})]

    def _on_text(self, text):
        return [self._chunk({"content": text})]

    def _on_tool_start(self, ev: ToolStart):
        return [self._chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                             "function": {"name": ev.name, "arguments": ""}}]})]

    def _on_tool_args(self, ev: ToolArgs):
        return [self._chunk({"tool_calls": [{"index": ev.index,
                                             "function": {"arguments": ev.text}}]})]

    def _on_finish(self, fin: Finish):
        out = []
        late = self.pending_calls(fin)
        if late:
            out.append(self._chunk({"tool_calls": [{"index": c.index, **_whole_call(c)}
                                                   for c in late]}))
        # finish_reason on the last choice chunk is what tells opencode the step ended.
        out.append(self._chunk({}, fin.finish))
        if self.params.get("include_usage"):
            out.append(sse({"id": self.id, "object": "chat.completion.chunk",
                            "created": self.created, "model": self.model, "choices": [],
                            "usage": usage_openai(fin.usage)}))
        out.append("data: [DONE]\n\n")
        return out

    def body(self, fin: Finish) -> str:
        content, reasoning = self.shown(fin)
        msg: dict = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if fin.calls:
            msg["tool_calls"] = [_whole_call(c) for c in fin.calls]
        return dumps({"id": self.id, "object": "chat.completion", "created": self.created,
                      "model": self.model,
                      "choices": [{"index": 0, "message": msg, "finish_reason": fin.finish}],
                      "usage": usage_openai(fin.usage)}) + "\n"


class CompletionsWire(Wire):
    api = "openai_completions"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.in_reasoning = False

    @property
    def id(self) -> str:
        return f"cmpl-{self.seq}"

    def _chunk(self, text: str, finish: str | None = None) -> str:
        return sse({"id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.model,
                    "choices": [{"text": text, "index": 0, "finish_reason": finish}]})

    def _on_reasoning(self, text):
        self.in_reasoning = True
        self.text_sent.append(text)        # raw output: reasoning is part of the text
        return [self._chunk(text)]

    def _on_text(self, text):
        if self.in_reasoning:
            self.in_reasoning = False
            self.text_sent.append("</think>")
            text = "</think>" + text
        return [self._chunk(text)]

    def tail(self, fin: Finish) -> str:
        # Nothing is split here, so whatever extends the raw text sent so far is new.
        sent = "".join(self.text_sent)
        return fin.content[len(sent):] if fin.content.startswith(sent) else ""

    def _on_finish(self, fin: Finish):
        out = [self._chunk("", fin.finish)]
        if self.params.get("include_usage"):
            out.append(sse({"id": self.id, "object": "text_completion", "created": self.created,
                            "model": self.model, "choices": [],
                            "usage": usage_openai(fin.usage)}))
        out.append("data: [DONE]\n\n")
        return out

    def body(self, fin: Finish) -> str:
        return dumps({"id": self.id, "object": "text_completion", "created": self.created,
                      "model": self.model,
                      "choices": [{"text": fin.content, "index": 0, "finish_reason": fin.finish}],
                      "usage": usage_openai(fin.usage)}) + "\n"
