"""ds4's request parsers, one per client API: OpenAI chat completions (§5.3), legacy completions
(§5.4), Anthropic messages (§5.7) and OpenAI Responses (§5.5). Each reads the raw request text
with ds4's permissive rules and returns the one message model of conversation.py (re-exported
here, so `prompts.messages` names the whole request side).
"""
from __future__ import annotations

from typing import Any

from .conversation import (THINK_MODES, Conversation, Message, ThinkingControls, ToolCall, body_text, parse_tools,
                           sampling_field, walk_request)
from .errors import RequestError
from .jsonspan import Cursor, JSONBad

__all__ = [
    "ToolCall", "Message", "Conversation", "THINK_MODES",
    "from_openai_chat", "from_openai_completions", "from_anthropic", "from_responses",
    "parse_tools", "body_text", "escape_tool_result",
]

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
    think = ThinkingControls()
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
        elif not sampling_field(cur, key, conv.params, _CHAT_SAMPLING):
            cur.skip()

    walk_request(body, field_)
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
    think = ThinkingControls()

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
        elif not sampling_field(cur, key, conv.params, ("max_tokens", "temperature", "top_p", "min_p",
                                                   "top_k", "seed", "stream", "stream_options",
                                                   "stop")):
            cur.skip()

    walk_request(body, field_)
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
    think = ThinkingControls()
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
        elif not sampling_field(cur, key, conv.params, ("max_tokens", "temperature", "top_p", "top_k",
                                                   "stream", "stop_sequences")):
            cur.skip()

    walk_request(body, field_)
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


def _responses_item(cur: Cursor) -> dict[str, Any]:
    """The fields of one input item that _responses_input reads (the rest is skipped)."""
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
    return f


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
        f = _responses_item(cur)
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
    think = ThinkingControls()
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
        elif not sampling_field(cur, key, conv.params, ("max_output_tokens", "max_tokens",
                                                   "temperature", "top_p", "stream")):
            cur.skip()

    walk_request(body, field_)
    if not got_input:
        raise RequestError("missing input")
    if instructions:
        conv.messages.insert(0, Message(role="system", content=instructions))
    conv.tools_raw = conv.tools_raw + loaded_tools
    conv.think_mode = think.mode(conv.model)
    return conv
