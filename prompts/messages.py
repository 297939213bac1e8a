"""One message model for the three client APIs and the agent, and ds4's request parsers.

Every chat API is reduced to a list of `Message` (role, content, reasoning, tool calls, tool
result ids) plus the raw tool schema lines, exactly as ds4-server does (protocol.md §5.3, §5.5,
§5.7), and then rendered by one function (render.py). The parsers read the raw request text
with ds4's permissive rules (jsonspan.py) because both matter byte for byte: which requests are
refused, and the tool schemas, which go into the prompt as the client's own JSON text.

Parsers accept the body as bytes (decoded as UTF-8; invalid bytes survive as surrogate escapes),
str, or an already-parsed dict (re-serialized; then the schema bytes are json.dumps's).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import INVALID_JSON, RequestError
from .jsonspan import Cursor, JSONBad, json_escape

__all__ = [
    "ToolCall", "Message", "Conversation", "THINK_MODES",
    "from_openai_chat", "from_openai_completions", "from_anthropic", "from_responses",
    "parse_tools", "body_text", "escape_tool_result",
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


def _top(body: Any, fields: Callable[[Cursor, str], None]) -> None:
    """Walk the top-level object, handing every key to `fields`. Any JSON problem -> 400."""
    cur = Cursor(body_text(body))
    try:
        cur.ws()
        if cur.peek() != "{":
            raise JSONBad("request is not an object")
        # ds4 does not look past the closing brace of the request object.
        for key in cur.obj():
            fields(cur, key)
    except JSONBad:
        raise RequestError(INVALID_JSON) from None


# ------------------------------------------------------------------------------------------
# Fields shared by several APIs

class _Thinking:
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


def _sampling(cur: Cursor, key: str, params: dict, allowed: tuple[str, ...]) -> bool:
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


# ------------------------------------------------------------------------------------------
# OpenAI chat completions (§5.3)

def _openai_function_call(cur: Cursor, call: dict) -> None:
    cur.ws()
    if cur.peek() != "{":
        raise JSONBad("function is not an object")
    for key in cur.obj():
        if key == "name":
            call["name"] = cur.string()
        elif key == "arguments":
            cur.ws()
            call["arguments"] = cur.string() if cur.peek() == '"' else cur.raw()
        else:
            cur.skip()


def _openai_tool_calls(cur: Cursor) -> list[ToolCall]:
    cur.ws()
    if cur.lit("null"):
        return []
    if cur.peek() != "[":
        raise JSONBad("tool_calls is not an array")
    calls: list[ToolCall] = []
    for _ in cur.arr():
        if cur.peek() != "{":
            raise JSONBad("tool call is not an object")
        call: dict[str, Any] = {}
        for key in cur.obj():
            if key == "id":
                call["id"] = cur.string()
            elif key == "function":
                _openai_function_call(cur, call)
            else:
                cur.skip()
        # ds4 drops a call that lacks a name or arguments
        if "name" in call and "arguments" in call:
            calls.append(ToolCall(call.get("id"), call["name"], call["arguments"]))
    return calls


def _openai_messages(cur: Cursor) -> list[Message]:
    cur.ws()
    if cur.peek() != "[":
        raise JSONBad("messages is not an array")
    msgs: list[Message] = []
    for _ in cur.arr():
        if cur.peek() != "{":
            raise JSONBad("message is not an object")
        m = Message(role="user")
        for key in cur.obj():
            if key == "role":
                m.role = cur.string()
            elif key == "content":
                m.content = cur.content()
            elif key == "reasoning_content":
                m.reasoning = cur.content()
            elif key == "tool_call_id":
                m.add_tool_call_id(cur.string())
            elif key == "tool_calls":
                m.tool_calls = _openai_tool_calls(cur)
            elif key == "name":
                # ds4 ignores it; kept for callers, never rendered
                cur.ws()
                if cur.peek() == '"':
                    m.name = cur.string()
                else:
                    cur.skip()
            else:
                cur.skip()
        msgs.append(m)
    return msgs


_CHAT_SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "min_p",
                  "top_k", "seed", "stream", "stream_options", "stop")


def from_openai_chat(body: Any) -> Conversation:
    """POST /v1/chat/completions body -> Conversation."""
    conv = Conversation(api="openai_chat")
    think = _Thinking()
    got_messages = False

    def field_(cur: Cursor, key: str) -> None:
        nonlocal got_messages
        if key == "messages":
            conv.messages = _openai_messages(cur)
            got_messages = True
        elif key == "tools":
            conv.tools_raw = parse_tools(cur)
        elif key == "tool_choice":
            cur.ws()
            if cur.peek() == '"':
                conv.tool_choice = cur.string()
            else:
                cur.skip()          # objects are accepted and ignored
        elif key == "model":
            conv.model = cur.string()
        elif key == "thinking":
            think.control(cur)
        elif key == "think":
            think.think_bool(cur)
        elif key == "reasoning_effort":
            think.effort_value(cur)
        elif not _sampling(cur, key, conv.params, _CHAT_SAMPLING):
            cur.skip()

    _top(body, field_)
    if not got_messages:
        raise RequestError("missing messages")
    conv.think_mode = think.mode(conv.model)
    return conv


# ------------------------------------------------------------------------------------------
# OpenAI legacy completions (§5.4)

def _prompt(cur: Cursor) -> str:
    cur.ws()
    if cur.peek() == '"':
        return cur.string()
    if cur.peek() != "[":
        cur.skip()
        return ""
    cur.i += 1
    cur.ws()
    if cur.peek() == '"':
        out = cur.string()
    else:
        out = ""
        if cur.peek() not in ("", "]"):
            cur.skip()
    # only the first element counts; the rest must be comma-separated values
    while cur.peek() not in ("", "]"):
        cur.ws()
        if cur.peek() == ",":
            cur.i += 1
            cur.skip()
        else:
            break
    cur.expect("]")
    return out


def from_openai_completions(body: Any) -> Conversation:
    """POST /v1/completions body -> Conversation with `prompt` set and no messages."""
    conv = Conversation(api="openai_completions")
    think = _Thinking()

    def field_(cur: Cursor, key: str) -> None:
        if key == "prompt":
            conv.prompt = _prompt(cur)
        elif key == "model":
            conv.model = cur.string()
        elif key == "thinking":
            think.control(cur)
        elif key == "think":
            think.think_bool(cur)
        elif key == "reasoning_effort":
            think.effort_value(cur)
        elif not _sampling(cur, key, conv.params, ("max_tokens", "temperature", "top_p", "min_p",
                                                   "top_k", "seed", "stream", "stream_options",
                                                   "stop")):
            cur.skip()

    _top(body, field_)
    if conv.prompt is None:
        raise RequestError("missing prompt")
    conv.think_mode = think.mode(conv.model)
    return conv


# ------------------------------------------------------------------------------------------
# Anthropic messages (§5.7)

def escape_tool_result(text: str | None) -> str:
    """The only escape inside <tool_result>: its own closing tag gets `&lt;` for its `<`."""
    return (text or "").replace("</tool_result>", "&lt;/tool_result>")


def _anthropic_block(cur: Cursor, m: Message) -> None:
    f: dict[str, Any] = {}
    for key in cur.obj():
        if key == "type":
            f["type"] = cur.string()
        elif key in ("text", "thinking"):
            f[key] = cur.content()
        elif key in ("id", "tool_use_id"):
            f["id"] = cur.string()
        elif key == "name":
            f["name"] = cur.string()
        elif key == "input":
            f["input"] = cur.raw()
        elif key == "content":
            f["content"] = cur.content()
        else:
            cur.skip()
    # Classified by the block's own type: the message's role may come after its content.
    kind = f.get("type")
    if kind == "tool_use":
        m.tool_calls.append(ToolCall(f.get("id"), f.get("name", ""), f.get("input", "{}")))
    elif kind == "tool_result":
        m.add_tool_call_id(f.get("id"))
        m.content = (m.content or "") + "<tool_result>" + escape_tool_result(f.get("content")) \
            + "</tool_result>"
    else:
        # text, thinking, and any other block that happens to carry text/thinking
        if f.get("text"):
            m.content = (m.content or "") + f["text"]
        if f.get("thinking"):
            m.reasoning = (m.reasoning or "") + f["thinking"]


def _anthropic_content(cur: Cursor, m: Message) -> None:
    cur.ws()
    c = cur.peek()
    if c == '"':
        m.content = cur.string()
        return
    if cur.lit("null"):
        m.content = ""
        return
    if c != "[":
        cur.skip()
        return
    for _ in cur.arr():
        c = cur.peek()
        if c == '"':
            m.content = (m.content or "") + cur.string()
        elif c == "{":
            _anthropic_block(cur, m)
        else:
            cur.skip()
    if m.content is None:
        m.content = ""


def _anthropic_messages(cur: Cursor) -> list[Message]:
    cur.ws()
    if cur.peek() != "[":
        raise JSONBad("messages is not an array")
    msgs: list[Message] = []
    for _ in cur.arr():
        if cur.peek() != "{":
            raise JSONBad("message is not an object")
        m = Message(role=None, content=None)  # type: ignore[arg-type]
        for key in cur.obj():
            if key == "role":
                m.role = cur.string()
            elif key == "content":
                m.content = None          # a second content member starts over (calls stay)
                _anthropic_content(cur, m)
            else:
                cur.skip()
        if m.role is None:
            m.role = "user"
        if m.content is None:
            m.content = ""
        msgs.append(m)
    return msgs


def _anthropic_system_part(parts: list[str], text: str) -> None:
    if not text or text.startswith("x-anthropic-"):
        return
    if parts and not parts[-1].endswith("\n"):
        parts.append("\n")
    parts.append(text)


def _anthropic_system(cur: Cursor) -> str:
    cur.ws()
    parts: list[str] = []
    c = cur.peek()
    if c == '"':
        _anthropic_system_part(parts, cur.string())
        return "".join(parts)
    if cur.lit("null"):
        return ""
    if c != "[":
        cur.skip()
        return ""
    for _ in cur.arr():
        c = cur.peek()
        if c == '"':
            _anthropic_system_part(parts, cur.string())
        elif c == "{":
            for key in cur.obj():
                if key == "text":
                    _anthropic_system_part(parts, cur.string())
                else:
                    cur.skip()
        else:
            cur.skip()
    return "".join(parts)


def from_anthropic(body: Any) -> Conversation:
    """POST /v1/messages body -> Conversation. The top-level `system` becomes a system message
    placed AFTER the messages (rendering hoists every system message in order)."""
    conv = Conversation(api="anthropic")
    think = _Thinking()
    got_messages = False
    system: str | None = None

    def field_(cur: Cursor, key: str) -> None:
        nonlocal got_messages, system
        if key == "messages":
            conv.messages = _anthropic_messages(cur)
            got_messages = True
        elif key == "system":
            system = _anthropic_system(cur)
        elif key == "tools":
            conv.tools_raw = parse_tools(cur)
        elif key == "tool_choice":
            cur.ws()
            if cur.peek() == "{":
                for ckey in cur.obj():
                    if ckey == "type":
                        conv.tool_choice = cur.string()
                    else:
                        cur.skip()
            else:
                cur.skip()          # only {"type":"none"} matters
        elif key == "model":
            conv.model = cur.string()
        elif key == "thinking":
            think.control(cur)
        elif key == "output_config":
            cur.ws()
            if cur.lit("null"):
                return
            if cur.peek() != "{":
                cur.skip()
                return
            for ckey in cur.obj():
                if ckey == "effort":
                    think.effort_value(cur)
                else:
                    cur.skip()
        elif key == "reasoning_effort":
            think.effort_value(cur)
        elif not _sampling(cur, key, conv.params, ("max_tokens", "temperature", "top_p", "top_k",
                                                   "stream", "stop_sequences")):
            cur.skip()

    _top(body, field_)
    if not got_messages:
        raise RequestError("missing messages")
    if system:
        conv.messages.append(Message(role="system", content=system))
    conv.think_mode = think.mode(conv.model)
    return conv


# ------------------------------------------------------------------------------------------
# OpenAI Responses (§5.5)

_TEXT_BLOCKS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _responses_content(cur: Cursor) -> str:
    """Strict: a string, null, or an array of strings and typed text blocks; anything else
    (images, files, unknown block types, numbers) is refused."""
    cur.ws()
    c = cur.peek()
    if c == '"':
        return cur.string()
    if cur.lit("null"):
        return ""
    if c != "[":
        raise JSONBad("content is not a string or an array")
    parts: list[str] = []
    for _ in cur.arr():
        c = cur.peek()
        if c == '"':
            parts.append(cur.string())
        elif c == "{":
            kind = text = None
            for key in cur.obj():
                if key == "type":
                    kind = cur.string()
                elif key == "text":
                    cur.ws()
                    text = "" if cur.lit("null") else cur.string()
                else:
                    cur.skip()
            if kind not in _TEXT_BLOCKS or text is None:
                raise JSONBad(f"unsupported content block {kind!r}")
            parts.append(text)
        else:
            raise JSONBad("content element is not a string or a block")
    return "".join(parts)


def _string_or_raw(cur: Cursor) -> str:
    cur.ws()
    return cur.string() if cur.peek() == '"' else cur.raw()


_REASONING_CONSUMERS = ("function_call", "custom_tool_call", "local_shell_call", "web_search_call",
                        "tool_search_call", "image_generation_call")
_HOSTED_CALLS = {"local_shell_call": "local_shell", "web_search_call": "web_search_call",
                 "tool_search_call": "tool_search", "image_generation_call": "image_generation_call"}
_HOSTED_OUTPUTS = ("local_shell_call_output", "web_search_call_output", "tool_search_output",
                   "tool_search_call_output", "image_generation_call_output")


def _responses_input(cur: Cursor, loaded_tools: list[str], wire: dict | None = None) -> list[Message]:
    cur.ws()
    if cur.peek() != "[":
        raise JSONBad("input is not a string or an array")
    msgs: list[Message] = []
    pending: list[str] = []          # reasoning waiting for the next assistant item

    def take_pending() -> str:
        text = "\n".join(pending)
        pending.clear()
        return text

    def add_call(call: ToolCall) -> None:
        # A Responses turn splits text and calls into items: merge calls into the assistant
        # message just before, so the calls do not render as a bare second assistant record.
        last = msgs[-1] if msgs else None
        if last is not None and last.role == "assistant":
            if pending and not last.reasoning:
                last.reasoning = take_pending()
            last.tool_calls.append(call)
        else:
            m = Message(role="assistant", content="")
            if pending:
                m.reasoning = take_pending()
            m.tool_calls.append(call)
            msgs.append(m)

    for _ in cur.arr():
        if cur.peek() != "{":
            raise JSONBad("input item is not an object")
        f: dict[str, Any] = {}
        for key in cur.obj():
            if key in ("type", "role", "name", "namespace", "call_id", "id", "status"):
                f[key] = cur.string()
            elif key in ("content", "summary"):
                f[key] = _responses_content(cur)
            elif key in ("arguments", "input", "result"):
                f[key] = _string_or_raw(cur)
            elif key == "output":
                cur.ws()
                f[key] = _responses_content(cur) if cur.peek() == "[" else _string_or_raw(cur)
            elif key in ("action", "tools"):
                f[key] = cur.raw()
            else:
                cur.skip()
        kind = f.get("type", "message")
        if f.get("status") and f["status"] != "completed":
            raise JSONBad("item status is not completed")
        consumes = (kind == "message" and f.get("role") == "assistant") or kind in _REASONING_CONSUMERS
        bookkeeping = kind in ("compaction", "context_compaction")
        if not consumes and not bookkeeping and pending:
            msgs.append(Message(role="assistant", content="", reasoning=take_pending()))
        call_id = f.get("call_id", f.get("id"))
        if kind == "message":
            m = Message(role=f.get("role", "user"), content=f.get("content", ""))
            if m.role == "assistant" and pending:
                m.reasoning = take_pending()
            msgs.append(m)
        elif kind in ("function_call", "custom_tool_call"):
            args = f.get("arguments", f.get("input", "{}"))
            name = f.get("name", "")
            if kind == "function_call" and f.get("namespace") and f.get("name"):
                name = f["namespace"] + f["name"]
            add_call(ToolCall(call_id if call_id is not None else "", name, args))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            m = Message(role="tool", content=f.get("output", ""))
            m.add_tool_call_id(call_id)
            msgs.append(m)
        elif kind == "reasoning":
            for part in (f.get("summary"), f.get("content")):
                if part:
                    pending.append(part)
        elif kind in _HOSTED_CALLS:
            args = f.get("action", f.get("arguments", f.get("input", "{}")))
            add_call(ToolCall(call_id if call_id is not None else "", _HOSTED_CALLS[kind], args))
        elif kind in _HOSTED_OUTPUTS:
            if kind == "tool_search_output" and "tools" in f:
                loaded_tools.extend(parse_tools(Cursor(f["tools"]), wire))
            body = f.get("output", f.get("result", f.get("tools", "")))
            m = Message(role="tool", content=body)
            m.add_tool_call_id(call_id)
            msgs.append(m)
        elif not bookkeeping:
            raise JSONBad(f"unknown input item type {kind!r}")
    if pending:
        msgs.append(Message(role="assistant", content="", reasoning=take_pending()))
    return msgs


def from_responses(body: Any) -> Conversation:
    """POST /v1/responses body -> Conversation. `instructions` becomes the first system message;
    tools listed by tool_search_output items are appended to the request's tools."""
    conv = Conversation(api="responses")
    think = _Thinking()
    got_input = False
    instructions: str | None = None
    loaded_tools: list[str] = []

    def field_(cur: Cursor, key: str) -> None:
        nonlocal got_input, instructions
        if key == "input":
            cur.ws()
            # (a repeated `input` replaces the messages; ds4 keeps tools loaded by the first)
            if cur.peek() == '"':
                conv.messages = [Message(role="user", content=cur.string())]
            else:
                conv.messages = _responses_input(cur, loaded_tools, conv.tool_wire)
            got_input = True
        elif key == "instructions":
            cur.ws()
            instructions = "" if cur.lit("null") else cur.string()
        elif key == "tools":
            conv.tools_raw = parse_tools(cur, conv.tool_wire)
        elif key == "tool_choice":
            cur.ws()
            if cur.peek() == '"':
                choice = cur.string()
                if choice not in ("none", "auto"):
                    raise RequestError(f"tool_choice={choice} not supported")
                conv.tool_choice = choice
            elif cur.peek() == "{":
                raise RequestError("forced tool_choice not supported")
            else:
                cur.skip()
        elif key == "model":
            conv.model = cur.string()
        elif key == "reasoning":
            cur.ws()
            if cur.lit("null"):
                return
            if cur.peek() != "{":
                cur.skip()
                return
            for rkey in cur.obj():
                if rkey == "effort":
                    # only a non-null effort is an explicit thinking control
                    if think.effort_value(cur):
                        think.explicit = True
                        if think.effort == "none":
                            think.enabled = False
                elif rkey == "summary":
                    cur.ws()
                    if cur.lit("null"):
                        pass
                    elif cur.peek() == '"':
                        if cur.string() in ("auto", "concise", "detailed"):
                            conv.reasoning_summary = True
                    else:
                        cur.skip()
                else:
                    cur.skip()
        elif key in ("previous_response_id", "conversation"):
            cur.ws()
            if not cur.lit("null"):
                raise RequestError(f"{key} is not supported; replay full input instead")
        elif not _sampling(cur, key, conv.params, ("max_output_tokens", "max_tokens",
                                                   "temperature", "top_p", "stream")):
            cur.skip()

    _top(body, field_)
    if not got_input:
        raise RequestError("missing input")
    if instructions:
        conv.messages.insert(0, Message(role="system", content=instructions))
    conv.tools_raw = conv.tools_raw + loaded_tools
    conv.think_mode = think.mode(conv.model)
    return conv
