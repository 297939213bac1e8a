"""The message model every client API is reduced to, and the request fields the APIs share.

Every chat API becomes a list of `Message` (role, content, reasoning, tool calls, tool result
ids) plus the raw tool schema lines, exactly as ds4-server does (protocol.md §5.3, §5.5, §5.7);
render.py renders that one form. The per-API parsers are in messages.py. Fields are read from the
raw request text with ds4's permissive rules (jsonspan.py) because both matter byte for byte:
which requests are refused, and the tool schemas, which go into the prompt as the client's own
JSON text.

Parsers accept the body as bytes (decoded as UTF-8; invalid bytes survive as surrogate escapes),
str, or an already-parsed dict (re-serialized; then the schema bytes are json.dumps's).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import INVALID_JSON, RequestError, field_problem
from .jsonspan import Cursor, JSONBad, json_escape

__all__ = [
    "ToolCall", "Message", "Conversation", "THINK_MODES", "body_text", "parse_tools",
    "walk_request", "ThinkingControls", "sampling_field",
]

THINK_MODES = ("none", "high", "max")

# parse_reasoning_effort_name: exact, case-sensitive.
_EFFORTS = {"max": "max", "xhigh": "high", "high": "high", "medium": "high", "low": "high",
            "minimal": "high", "none": "none"}


@dataclass
class ToolCall:
    """One call of an assistant turn. `arguments_json` is the call's JSON text as the client sent
    it (OpenAI: the decoded `arguments` string; Anthropic `input` / raw JSON: the raw bytes).
    `dsml` is the exact sampled DSML block of the turn, when known: then the turn is replayed
    with those bytes instead of canonical DSML (every call of the turn carries the same block)."""
    id: str | None
    name: str
    arguments_json: str
    dsml: str | None = None


@dataclass
class Message:
    """role: system, developer, user, assistant, tool or function (any other role is kept and
    not rendered). `tool_call_id` is the first id a tool result answers; `tool_call_ids` all of
    them (an Anthropic user message can carry several tool_result blocks)."""
    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    tool_call_ids: list[str] = field(default_factory=list)

    def add_tool_call_id(self, id: str | None) -> None:
        if not id:
            return
        if self.tool_call_id is None:
            self.tool_call_id = id
        if id not in self.tool_call_ids:
            self.tool_call_ids.append(id)

    def result_ids(self) -> list[str]:
        ids = [self.tool_call_id] if self.tool_call_id else []
        ids += [i for i in self.tool_call_ids if i and i not in ids]
        return ids


@dataclass
class Conversation:
    """A parsed request. `think_mode` is what the request asks for, before the Think Max
    context gate (render.think_mode_for_context). `tools_raw` holds one schema line per tool,
    the client's raw JSON text. `params` has the sampling fields the request set (temperature,
    top_p, min_p, top_k, seed, max_tokens, stream, include_usage, stop), parsed as ds4 does."""
    api: str
    messages: list[Message] = field(default_factory=list)
    tools_raw: list[str] = field(default_factory=list)
    tool_choice: str | None = None
    think_mode: str = "high"
    model: str | None = None
    reasoning_summary: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    prompt: str | None = None          # openai_completions only
    # Responses tools whose prompt name is not their wire name: prompt name -> {"name", "namespace"}
    # for a namespace's inner function, {"type": "tool_search"} for the hosted tool search.
    tool_wire: dict[str, dict] = field(default_factory=dict)

    @property
    def tools_active(self) -> list[str]:
        """The schema lines that are rendered: none when tool_choice is "none"."""
        return [] if self.tool_choice == "none" else self.tools_raw

    @property
    def has_tools(self) -> bool:
        return any(self.tools_active)


# ------------------------------------------------------------------------------------------
# Request text

def body_text(body: Any) -> str:
    """The request body as text. ds4 reads it as a C string, so it ends at the first NUL."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        text = bytes(body).decode("utf-8", errors="surrogateescape")
    elif isinstance(body, str):
        text = body
    elif isinstance(body, (dict, list)):
        text = json.dumps(body, ensure_ascii=False)
    else:
        raise TypeError(f"request body must be bytes, str or dict, not {type(body).__name__}")
    nul = text.find("\0")
    return text if nul < 0 else text[:nul]


def walk_request(body: Any, fields: Callable[[Cursor, str], None]) -> None:
    """Walk the top-level object, handing every key to `fields`. Any JSON problem -> 400."""
    cur = Cursor(body_text(body))
    try:
        cur.ws()
        if cur.peek() != "{":
            raise JSONBad("request is not an object")
        # ds4 does not look past the closing brace of the request object.
        for key in cur.obj():
            start = cur.i
            try:
                fields(cur, key)
            except JSONBad as e:           # valid JSON of the wrong shape: name the field
                raise RequestError(field_problem(cur.s, start, key, e)) from None
    except JSONBad:
        raise RequestError(INVALID_JSON) from None


# ------------------------------------------------------------------------------------------
# Fields shared by several APIs

class ThinkingControls:
    """Thinking controls: `thinking`/`think` switch it, efforts pick high or max (§4.2)."""

    def __init__(self) -> None:
        self.enabled = True
        self.effort = "high"
        self.explicit = False      # a thinking control was present: model aliases are ignored

    def control(self, cur: Cursor) -> None:
        """`thinking`: bool, or an object whose `type` is enabled/disabled; null or any other
        value changes nothing (but still counts as explicit, as in ds4)."""
        self.explicit = True
        cur.ws()
        if cur.lit("null"):
            return
        c = cur.peek()
        if c in ("t", "f"):
            self.enabled = cur.bool_()
            return
        if c != "{":
            cur.skip()
            return
        for key in cur.obj():
            if key == "type":
                t = cur.string()
                if t == "enabled":
                    self.enabled = True
                elif t == "disabled":
                    self.enabled = False
            else:
                cur.skip()

    def think_bool(self, cur: Cursor) -> None:
        self.explicit = True
        self.enabled = cur.bool_()

    def effort_value(self, cur: Cursor) -> bool:
        """An effort string (or null: no change). Returns whether a value was given."""
        cur.ws()
        if cur.lit("null"):
            return False
        name = cur.string()
        if name not in _EFFORTS:
            raise JSONBad(f"unknown reasoning effort {name!r}")
        self.effort = _EFFORTS[name]
        return True

    def mode(self, model: str | None) -> str:
        enabled = self.enabled
        if not self.explicit and model == "deepseek-chat":
            enabled = False
        if not self.explicit and model == "deepseek-reasoner":
            enabled = True
        if not enabled or self.effort == "none":
            return "none"
        return "max" if self.effort == "max" else "high"


def _stop(cur: Cursor) -> list[str]:
    stops: list[str] = []
    cur.ws()
    if cur.peek() == '"':
        s = cur.string()
        return [s] if s else []
    if cur.peek() != "[":
        cur.skip()
        return stops
    for _ in cur.arr():
        if cur.peek() == '"':
            s = cur.string()
            if s:
                stops.append(s)
        else:
            cur.skip()
    return stops


def _stream_options(cur: Cursor, params: dict) -> None:
    cur.ws()
    if cur.peek() != "{":
        cur.skip()
        return
    for key in cur.obj():
        if key == "include_usage":
            params["include_usage"] = cur.bool_()
        else:
            cur.skip()


def _seed(cur: Cursor) -> int:
    v = cur.number()
    if not (v > 0):
        return 0
    return min(int(v), 2**64 - 1) if v != float("inf") else 2**64 - 1


def sampling_field(cur: Cursor, key: str, params: dict, allowed: tuple[str, ...]) -> bool:
    """Parse a sampling field if `key` is one this API reads; returns whether it was."""
    if key not in allowed:
        return False
    if key in ("temperature", "top_p", "min_p"):
        params[key] = cur.number()
    elif key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        params["max_tokens"] = cur.int_()
    elif key == "top_k":
        params["top_k"] = cur.int_()
    elif key == "seed":
        params["seed"] = _seed(cur)
    elif key == "stream":
        params["stream"] = cur.bool_()
    elif key == "stream_options":
        _stream_options(cur, params)
    elif key in ("stop", "stop_sequences"):
        params["stop"] = _stop(cur)
    return True


# ------------------------------------------------------------------------------------------
# Tools (shared by all three chat APIs)

def _scan_object(raw: str, wanted: dict[str, str]) -> dict[str, Any] | None:
    """Read selected members of one object (a tool, already validated as JSON). `wanted` maps
    a key to "string" (keep the decoded string) or "raw" (keep the raw text), optionally as
    "raw:NAME" to store under NAME (ds4 reads `parameters` and `input_schema` into one slot).
    Later members win. None when a wanted member has the wrong type: ds4 then gives up on the
    special form and keeps the tool as a plain one."""
    cur = Cursor(raw)
    out: dict[str, Any] = {}
    try:
        cur.ws()
        if cur.peek() != "{":
            return None
        for key in cur.obj():
            how = wanted.get(key)
            if how is None:
                cur.skip()
                continue
            how, _, name = how.partition(":")
            out[name or key] = cur.string() if how == "string" else cur.raw()
    except JSONBad:
        return None
    return out


def _openai_function(raw: str) -> str | None:
    """`{"type":"function","function":X}` -> raw X (the first `function` member)."""
    cur = Cursor(raw)
    try:
        cur.ws()
        if cur.peek() != "{":
            return None
        for key in cur.obj():
            if key == "function":
                return cur.raw()
            cur.skip()
    except JSONBad:
        return None
    return None


_DEFAULT_PARAMETERS = '{"type":"object","properties":{}}'


def _namespace_tools(raw: str, wire: dict | None = None) -> list[str] | None:
    """Responses `{"type":"namespace","name":NS,"tools":[...]}` -> one schema line per inner
    function tool, named NS+name. None when it is not such a namespace or yields no line.
    `wire` collects prompt name -> {"name", "namespace"} so output items can split it again."""
    top = _scan_object(raw, {"type": "string", "name": "string", "tools": "raw"})
    if not top or top.get("type") != "namespace" or "name" not in top or "tools" not in top:
        return None
    ns = top["name"]
    lines: list[str] = []
    cur = Cursor(top["tools"])
    try:
        cur.ws()
        if cur.peek() != "[":
            return None
        for _ in cur.arr():
            inner = _scan_object(cur.raw(), {"type": "string", "name": "string",
                                             "description": "string", "parameters": "raw",
                                             "input_schema": "raw:parameters"})
            if inner is None:
                continue
            params = inner.get("parameters")
            if inner.get("type", "function") != "function" or not inner.get("name"):
                continue
            if wire is not None:
                wire[ns + inner["name"]] = {"name": inner["name"], "namespace": ns}
            lines.append('{"name":' + json_escape(ns + inner["name"])
                         + ',"description":' + json_escape(inner.get("description", ""))
                         + ',"parameters":' + (params if params is not None else _DEFAULT_PARAMETERS)
                         + "}")
    except JSONBad:
        pass       # ds4 keeps the lines it already made
    return lines or None


def _tool_search(raw: str) -> str | None:
    """Responses `{"type":"tool_search",...}` -> a tool_search function schema line."""
    top = _scan_object(raw, {"type": "string", "description": "string", "parameters": "raw"})
    if not top or top.get("type") != "tool_search":
        return None
    return ('{"name":"tool_search","description":'
            + json_escape(top.get("description", "Search available tools."))
            + ',"parameters":' + top.get("parameters", _DEFAULT_PARAMETERS) + "}")


def parse_tools(cur: Cursor, wire: dict | None = None) -> list[str]:
    """A `tools` value -> schema lines: an OpenAI tool gives the raw text of its `function`,
    a Responses namespace its inner functions, a tool_search its schema, anything else its own
    raw text. null -> no tools; anything but an array -> JSONBad. `wire` (optional) collects the
    Responses names that differ on the wire (Conversation.tool_wire)."""
    cur.ws()
    if cur.lit("null"):
        return []
    if cur.peek() != "[":
        raise JSONBad("tools is not an array")
    lines: list[str] = []
    for _ in cur.arr():
        run = cur.skip_scalars()
        if run is not None:           # numbers and literals: their text, read at once
            lines.extend(run)
            continue
        raw = cur.raw()
        fn = _openai_function(raw)
        if fn is not None:
            lines.append(fn)
            continue
        ns = _namespace_tools(raw, wire)
        if ns is not None:
            lines.extend(ns)
            continue
        special = _tool_search(raw)
        if special is not None and wire is not None:
            wire["tool_search"] = {"type": "tool_search"}
        lines.append(special if special is not None else raw)
    return [line for line in lines if line]
