"""OpenAI Responses (`/v1/responses`) bodies and SSE events (protocol.md §5.6).

Ids: resp_/rs_/msg_/fc_ + 24 lowercase hex; a call's call_id is the worker's tool id.

Where this differs from ds4, on purpose (each is what OpenAI's own API does):
* Every frame has an `event: <type>` line before `data:` (some clients key on it); the JSON
  still carries `type` and, right after it, `sequence_number` 0, 1, 2, ...
* `response.in_progress` follows `response.created`.
* An incomplete response says `"reason":"max_output_tokens"` (ds4: "max_tokens", which the
  SDK's type does not allow).
* The response object also carries `parallel_tool_calls`, `tool_choice` and `tools` (the SDK
  requires them; `tools` is [] since the request's tools are not echoed), and output_text
  delta/done events carry `"logprobs":[]` (likewise required).
* An item is closed when the next one opens (reasoning before text), not only at the end, so
  output items never overlap; reasoning arriving after text opens a new reasoning item.
* A streamed error (prefill failure after the headers) is an `error` event with the API's
  `type`/`code`/`message` members and ds4's `error` object as well: the SDKs raise on the
  latter, clients that switch on `type` see the former.
* A stop signal that cuts a streamed answer ends it with `response.failed` (the open item closed
  as incomplete); a turn cut inside its thinking has no message item in the body either (ds4's
  body returns the thinking as output text, hidden reasoning included).
* Reasoning item status: "completed" iff `</think>` was sampled, in the body as in the stream.
"""
from __future__ import annotations

import json

from .events import CallOut, Finish, Usage
from .wire_common import Wire, context_error_body, dumps, new_id, raw_object, sse

__all__ = ["ResponsesWire", "usage_responses", "new_id"]


def usage_responses(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": u.write_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


_STATUS = {"length": "incomplete", "error": "failed"}
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
             "failed": "response.failed"}


def _item_status(fin: Finish) -> str:
    return "incomplete" if fin.finish in ("length", "error") else "completed"


def _reasoning_item(rid: str, text: str, status: str) -> dict:
    return {"id": rid, "type": "reasoning", "status": status,
            "summary": [{"type": "summary_text", "text": text}]}


def _message_item(mid: str, text: str, status: str) -> dict:
    return {"id": mid, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


class _Open:
    """The output item being streamed: reasoning or message."""
    __slots__ = ("kind", "id", "index", "parts")

    def __init__(self, kind: str, iid: str, index: int):
        self.kind, self.id, self.index, self.parts = kind, iid, index, []


class ResponsesWire(Wire):
    api = "responses"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.resp_id = new_id("resp_")
        self.n = 0                      # sequence_number of the next event
        self.output: list[dict] = []    # final items, in output_index order
        self.open: _Open | None = None

    # -- pieces ---------------------------------------------------------------------------------
    def _ev(self, type_: str, **fields) -> str:
        data = {"type": type_, "sequence_number": self.n, **fields}
        self.n += 1
        return sse(data, type_)

    def _response(self, status: str, output: list, usage: Usage | None) -> dict:
        r = {"id": self.resp_id, "object": "response", "created_at": self.created,
             "status": status, "model": self.model}
        if status == "failed":
            r["error"] = {"code": "server_error", "message": "generation failed"}
        elif status == "incomplete":
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        r["output"] = output
        r["parallel_tool_calls"] = True
        r["tool_choice"] = "none" if getattr(self.conv, "tool_choice", None) == "none" else "auto"
        r["tools"] = []
        if usage is not None:
            r["usage"] = usage_responses(usage)
        return r

    def _call_item(self, c: CallOut, status: str, fid: str | None = None) -> dict:
        """The output item of one call, split back into the client's own names (§5.5)."""
        wire = (getattr(self.conv, "tool_wire", None) or {}).get(c.name) or {}
        fid = fid or new_id("fc_")
        if wire.get("type") == "tool_search":
            return {"id": fid, "type": "tool_search_call", "status": status, "call_id": c.id,
                    "execution": "client", "arguments": raw_object(c.arguments_json)}
        item = {"id": fid, "type": "function_call", "status": status,
                "name": wire.get("name", c.name)}
        if "namespace" in wire:
            item["namespace"] = wire["namespace"]
        item["call_id"] = c.id
        item["arguments"] = c.arguments_json
        return item

    # -- streaming ------------------------------------------------------------------------------
    def _on_begin(self, usage):
        r = self._response("in_progress", [], None)
        return [self._ev("response.created", response=r),
                self._ev("response.in_progress", response=r)]

    def _close(self, status: str) -> list[str]:
        o, self.open = self.open, None
        if o is None:
            return []
        text = "".join(o.parts)
        if o.kind == "reasoning":
            item = _reasoning_item(o.id, text, status)
            part = {"type": "summary_text", "text": text}
            out = [self._ev("response.reasoning_summary_text.done", item_id=o.id,
                            output_index=o.index, summary_index=0, text=text),
                   self._ev("response.reasoning_summary_part.done", item_id=o.id,
                            output_index=o.index, summary_index=0, part=part)]
        else:
            item = _message_item(o.id, text, status)
            part = {"type": "output_text", "text": text, "annotations": []}
            out = [self._ev("response.output_text.done", item_id=o.id, output_index=o.index,
                            content_index=0, text=text, logprobs=[]),
                   self._ev("response.content_part.done", item_id=o.id, output_index=o.index,
                            content_index=0, part=part)]
        self.output.append(item)
        # Codex takes the final text from this event.
        out.append(self._ev("response.output_item.done", output_index=o.index, item=item))
        return out

    def _opened(self, kind: str) -> tuple[_Open, list[str]]:
        """The open item of `kind`, opening it (and closing another kind) if needed."""
        if self.open is not None and self.open.kind == kind:
            return self.open, []
        # the previous item was superseded by a later one, so it ran to its end
        out = self._close("completed")
        o = self.open = _Open(kind, new_id("rs_" if kind == "reasoning" else "msg_"),
                              len(self.output))
        if kind == "reasoning":
            out += [self._ev("response.output_item.added", output_index=o.index,
                             item={"id": o.id, "type": "reasoning", "status": "in_progress",
                                   "summary": []}),
                    self._ev("response.reasoning_summary_part.added", item_id=o.id,
                             output_index=o.index, summary_index=0,
                             part={"type": "summary_text", "text": ""})]
        else:
            out += [self._ev("response.output_item.added", output_index=o.index,
                             item={"id": o.id, "type": "message", "status": "in_progress",
                                   "role": "assistant", "content": []}),
                    self._ev("response.content_part.added", item_id=o.id, output_index=o.index,
                             content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})]
        return o, out

    def _on_reasoning(self, text):
        # Reasoning is output only when the request opted in with reasoning.summary.
        if not getattr(self.conv, "reasoning_summary", False):
            return []
        o, out = self._opened("reasoning")
        o.parts.append(text)
        out.append(self._ev("response.reasoning_summary_text.delta", item_id=o.id,
                            output_index=o.index, summary_index=0, delta=text))
        return out

    def _on_text(self, text):
        o, out = self._opened("message")
        o.parts.append(text)
        out.append(self._ev("response.output_text.delta", item_id=o.id, output_index=o.index,
                            content_index=0, delta=text, logprobs=[]))
        return out

    def _on_finish(self, fin: Finish):
        status = _item_status(fin)
        if self.open is not None and self.open.kind == "reasoning":
            out = self._close("completed" if fin.reasoning_closed else "incomplete")
        else:
            out = self._close(status)
        # Calls go out only now, after the model stopped (§5.6 step 4).
        for c in fin.calls:
            index = len(self.output)
            item = self._call_item(c, status)
            if item["type"] == "tool_search_call":
                out.append(self._ev("response.output_item.added", output_index=index,
                                    item={**item, "status": "in_progress"}))
            else:
                out.append(self._ev("response.output_item.added", output_index=index,
                                    item={**item, "status": "in_progress", "arguments": ""}))
                out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=c.arguments_json))
                done = {"item_id": item["id"], "output_index": index, "name": item["name"]}
                if "namespace" in item:
                    done["namespace"] = item["namespace"]
                done["arguments"] = c.arguments_json
                out.append(self._ev("response.function_call_arguments.done", **done))
            self.output.append(item)
            out.append(self._ev("response.output_item.done", output_index=index, item=item))
        st = _STATUS.get(fin.finish, "completed")
        out.append(self._ev(_TERMINAL[st], response=self._response(st, self.output, fin.usage)))
        return out

    def error_frames(self, message: str, code: str = "server_error", error: dict | None = None,
                     param: str | None = None) -> list[str]:
        data = {"type": "error", "sequence_number": self.n, "code": code,
                "message": message, "param": param,
                "error": error or {"message": message, "type": "server_error"}}
        self.n += 1
        return [sse(data, "error")]

    def context_frames(self, n_prompt: int, n_ctx: int) -> list[str]:
        err = json.loads(context_error_body(self.api, n_prompt, n_ctx))["error"]
        return self.error_frames(err["message"], err["code"], err, "input")

    def interrupted_frames(self, message: str) -> list[str]:
        """A cut answer is a failed response (`response.incomplete` is only for the token limit
        and the content filter): the open item closes incomplete, then `response.failed` with
        the error. The SDK's stream helper has no completed response then, and Codex reports
        the failure."""
        out = []
        if not self.begun:
            self.begun = True
            out += self._on_begin(Usage(0))
        out += self._close("incomplete")
        r = self._response("failed", self.output, None)
        r["error"] = {"code": "server_error", "message": message}
        out.append(self._ev("response.failed", response=r))
        return out

    # -- whole body -----------------------------------------------------------------------------
    def body(self, fin: Finish) -> str:
        status = _item_status(fin)
        text, reasoning = self.shown(fin)
        output = []
        if getattr(self.conv, "reasoning_summary", False) and reasoning:
            output.append(_reasoning_item(new_id("rs_"), reasoning,
                                          "completed" if fin.reasoning_closed else "incomplete"))
        if text:
            output.append(_message_item(new_id("msg_"), text, status))
        output += [self._call_item(c, status) for c in fin.calls]
        # ds4 sends this body without a trailing newline (§5.6)
        return dumps(self._response(_STATUS.get(fin.finish, "completed"), output, fin.usage))
