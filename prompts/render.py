"""Messages + tools + thinking mode -> the prompt text ds4 renders (protocol.md §2, §4).

The text carries the special markers inline (BOS, `<｜User｜>`, `<think>`, ...); tokenizing it
splits on the seven markers of §1.1 and BPEs the rest (engine.runtime.tokenizer does that).

Entry points:
* `render_request(api, body, ctx)`: a raw client request -> `Rendered` (what ds4-server does
  between the HTTP body and the tokenizer), refusing what ds4 refuses with `RequestError`.
* `render_messages(messages, tools_raw, think_mode)`: the one chat renderer (§2.4).
* `render_completion(prompt, think_mode)`: /v1/completions' fixed template (§2.6).
* `render_live_tool_tail(...)`, `render_tool_results(...)`, `render_agent_tool_results(...)`,
  `assistant_prefix(...)`: pieces appended to a live transcript.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable, Sequence

from .dsml_render import render_tool_calls
from .errors import RequestError
from .messages import (
    THINK_MODES, Conversation, Message, escape_tool_result, from_anthropic, from_openai_chat,
    from_openai_completions, from_responses,
)

__all__ = [
    "BOS", "EOS", "USER", "ASSISTANT", "THINK_OPEN", "THINK_CLOSE", "DSML_MARKER", "MARKERS",
    "THINK_MAX_PREFIX", "THINK_MAX_MIN_CONTEXT", "COMPLETION_SYSTEM", "APIS",
    "Rendered", "render_request", "render_messages", "render_completion", "render_live_tool_tail",
    "render_tool_results", "render_agent_tool_results", "assistant_prefix", "tools_text",
    "think_mode_for_context", "uses_tool_context", "attach_replay", "message_dsml", "to_bytes",
]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML_MARKER = "｜DSML｜"
# The only strings the rendered-chat tokenizer treats as special, in ds4's matching order.
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML_MARKER)

THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
# DeepSeek recommends Think Max only with a context of at least 384K tokens; below it ds4
# quietly uses ordinary thinking.
THINK_MAX_MIN_CONTEXT = 393216

COMPLETION_SYSTEM = "You are a helpful assistant"     # no period, no newline (§2.6)

APIS = ("openai_chat", "openai_completions", "anthropic", "responses")

_TOOLS_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as raw text and set `string="true"`. '
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string "
    "characters with XML or HTML entity escapes. "
    "Only if a string value itself contains the exact closing parameter tag "
    "`</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format "
    'and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls. Use the exact parameter names from the schemas."
)


def tools_text(schemas: str) -> str:
    """The tools block of the system text (§2.5) around the newline-joined schema lines; ""
    without schemas. No newline after the last sentence."""
    return _TOOLS_HEAD + schemas + _TOOLS_TAIL if schemas else ""


def think_mode_for_context(mode: str, ctx: int | None) -> str:
    """The Think Max gate: "max" needs ctx >= 393,216, else it renders as "high"."""
    if mode not in THINK_MODES:
        raise ValueError(f"think mode must be one of {THINK_MODES}, not {mode!r}")
    if mode == "max" and max(ctx or 0, 0) < THINK_MAX_MIN_CONTEXT:
        return "high"
    return mode


def _schemas(tools_raw: str | Sequence[str] | None) -> str:
    if not tools_raw:
        return ""
    if isinstance(tools_raw, str):
        return tools_raw
    return "\n".join(t for t in tools_raw if t)


def uses_tool_context(messages: Sequence[Message], tools_raw: str | Sequence[str] | None) -> bool:
    """Tools rendered, or any assistant tool call or tool result in the history: then every
    assistant turn keeps its reasoning in thinking mode."""
    if _schemas(tools_raw):
        return True
    return any((m.role == "assistant" and m.tool_calls) or m.role in ("tool", "function")
               for m in messages)


def message_dsml(m: Message) -> str:
    """The DSML text of an assistant turn's calls: the exact sampled block when every call
    carries the same one (ds4's replay rule), else canonical DSML from the JSON arguments."""
    if not m.tool_calls:
        return ""
    blocks = {c.dsml for c in m.tool_calls}
    if len(blocks) == 1:
        (block,) = blocks
        if block:
            return block
    return render_tool_calls(m.tool_calls)


def assistant_prefix(think_mode: str) -> str:
    """What opens a generation: `<｜Assistant｜><think>` or `<｜Assistant｜></think>`."""
    return ASSISTANT + (THINK_OPEN if think_mode in ("high", "max") else THINK_CLOSE)


def _turns(msgs: Sequence[Message], start: int, think: bool,
           keep_reasoning: Callable[[int], bool], out: list[str]) -> None:
    """The §2.4 loop from msgs[start]: user turns, grouped tool results, assistant turns, and
    the final assistant prefix when a user-like message is still unanswered."""
    pending_assistant = pending_tool_result = False
    for i in range(start, len(msgs)):
        m = msgs[i]
        role = m.role
        if role in ("system", "developer"):
            continue
        if role == "user":
            out += (USER, m.content or "")
            pending_assistant, pending_tool_result = True, False
        elif role in ("tool", "function"):
            if not pending_tool_result:
                out.append(USER)
            out += ("<tool_result>", escape_tool_result(m.content), "</tool_result>")
            pending_assistant = pending_tool_result = True
        elif role == "assistant":
            if pending_assistant:
                out.append(ASSISTANT)
                if think and keep_reasoning(i):
                    out += (THINK_OPEN, m.reasoning or "", THINK_CLOSE)
                else:
                    out.append(THINK_CLOSE)
            out += (m.content or "", message_dsml(m), EOS)
            pending_assistant = pending_tool_result = False
        # any other role is skipped
    if pending_assistant:
        out.append(ASSISTANT + (THINK_OPEN if think else THINK_CLOSE))


def render_messages(conv_or_messages: Conversation | Sequence[Message],
                    tools_raw: str | Sequence[str] | None = None,
                    think_mode: str | None = None) -> str:
    """The chat prompt (§2.4). For a Conversation, tools default to its active tools (none when
    tool_choice is "none") and the mode to its requested one; apply the Think Max gate
    (think_mode_for_context) before calling. For a message list the mode defaults to "high"."""
    if isinstance(conv_or_messages, Conversation):
        msgs: Sequence[Message] = conv_or_messages.messages
        if tools_raw is None:
            tools_raw = conv_or_messages.tools_active
        if think_mode is None:
            think_mode = conv_or_messages.think_mode
    else:
        msgs = conv_or_messages
    think_mode = think_mode or "high"
    if think_mode not in THINK_MODES:
        raise ValueError(f"think mode must be one of {THINK_MODES}, not {think_mode!r}")
    think = think_mode in ("high", "max")
    schemas = _schemas(tools_raw)
    tool_context = uses_tool_context(msgs, schemas)

    # System text: the tools block first, then every system/developer message, hoisted from
    # wherever it stands, joined by a blank line.
    system = tools_text(schemas)
    for m in msgs:
        if m.role in ("system", "developer"):
            if system:
                system += "\n\n"
            system += m.content or ""
    last_user = max((i for i, m in enumerate(msgs) if m.role in ("user", "tool", "function")),
                    default=-1)

    out = [BOS]
    if think_mode == "max":
        out.append(THINK_MAX_PREFIX)
    out.append(system)
    # Old reasoning is kept only with tool context, or for answers after the last user turn.
    _turns(msgs, 0, think, lambda i: tool_context or i > last_user, out)
    return "".join(out)


def render_live_tool_tail(messages: Sequence[Message], start: int, think_mode: str) -> str:
    """What ds4 appends to a live KV that ends right after a sampled tool-call block: EOS, the
    messages from `start` (assistant turns always with their reasoning when thinking), and the
    next assistant prefix."""
    out = [EOS]
    _turns(messages, start, think_mode in ("high", "max"), lambda i: True, out)
    return "".join(out)


def render_completion(prompt: str, think_mode: str) -> str:
    """/v1/completions: the fixed system text, one user turn, the assistant prefix (§2.6).
    Apply the Think Max gate before calling."""
    if think_mode not in THINK_MODES:
        raise ValueError(f"think mode must be one of {THINK_MODES}, not {think_mode!r}")
    return (BOS + (THINK_MAX_PREFIX if think_mode == "max" else "") + COMPLETION_SYSTEM + USER
            + (prompt or "") + assistant_prefix(think_mode))


def render_tool_results(texts: Iterable[str]) -> str:
    """One user turn of tool results, as §2.4 renders consecutive tool messages."""
    return USER + "".join("<tool_result>" + escape_tool_result(t) + "</tool_result>" for t in texts)


def render_agent_tool_results(results: Sequence[tuple[str, str]], style: str = "official") -> str:
    """The agent's tool-result turn for the calls of one block, results as (tool name, text).

    "official" (default): `<｜User｜><tool_result>…</tool_result>…`, the DeepSeek V4 form that
    ds4-server renders, so an agent transcript equals render_messages of the same history.
    "ds4": ds4_agent.c's own form, `<｜User｜>Tool: Tool result 1 (NAME):\\n…` (agent.md §3.1,
    §3.4), kept for comparison with the C agent."""
    if style == "official":
        return render_tool_results(text for _, text in results)
    if style != "ds4":
        raise ValueError(f"unknown tool-result style {style!r}")
    parts = []
    for i, (name, text) in enumerate(results, 1):
        parts.append(f"Tool result {i} ({name or 'unknown'}):\n{text}")
        if text and not text.endswith("\n"):
            parts.append("\n")
    if not results:
        parts.append("Tool error: empty tool call block\n")
    return USER + "Tool: " + "".join(parts)


# ------------------------------------------------------------------------------------------
# Whole requests

@dataclass
class Rendered:
    """A rendered request. `text` has the markers inline; `think_mode` is the mode after the
    Think Max gate; `has_tools` is true when tool schemas were rendered (decoding then watches
    for DSML). `live_call_ids` / `live_tail` describe the tool-result tail that a live KV
    holding the previous sampled call could be extended with (Responses and Anthropic only);
    `requires_live_tool_state` says a tool result is answered by a call known only live."""
    text: str
    think_mode: str
    has_tools: bool
    api: str = "openai_chat"
    conversation: Conversation | None = None
    preserves_reasoning: bool = False
    live_call_ids: list[str] = field(default_factory=list)
    live_tail: str | None = None
    requires_live_tool_state: bool = False
    requires_live_reasoning: bool = False

    def encode(self) -> bytes:
        return to_bytes(self.text)


def to_bytes(text: str) -> bytes:
    """UTF-8 bytes of rendered text, undoing the surrogate escapes that carry a request's
    invalid UTF-8 bytes (and writing lone surrogates from `\\uD800` escapes as 3 bytes, as
    ds4 does)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        out = bytearray()
        for ch in text:
            o = ord(ch)
            if 0xDC80 <= o <= 0xDCFF:
                out.append(o - 0xDC00)
            else:
                out += ch.encode("utf-8", "surrogatepass")
        return bytes(out)


_PARSERS = {
    "openai_chat": from_openai_chat,
    "openai_completions": from_openai_completions,
    "anthropic": from_anthropic,
    "responses": from_responses,
}


def _has_prior_call(msgs: Sequence[Message], before: int, id: str) -> Message | None:
    for j in range(before - 1, -1, -1):
        m = msgs[j]
        if m.role == "assistant" and any(c.id == id for c in m.tool_calls):
            return m
    return None


def _validate_results(api: str, msgs: Sequence[Message], think_mode: str,
                      live_call_ids: Container[str]) -> tuple[bool, bool]:
    """Every tool-result id must answer a call replayed earlier in the request or a call the
    live session still holds (§6.4). Returns (requires_live_tool_state, requires_live_reasoning)."""
    needs_live = needs_reasoning = False
    for i, m in enumerate(msgs):
        if api == "responses":
            if m.role not in ("tool", "function"):
                continue
        elif not (m.role == "user" and m.result_ids()):
            continue
        for id in m.result_ids():
            live = id in live_call_ids
            prior = _has_prior_call(msgs, i, id)
            if not live and prior is None:
                if api == "responses":
                    raise RequestError(f"Responses continuation state is not available for call_id "
                                       f"{id}; retry by replaying the full input history")
                raise RequestError(f"Anthropic continuation state is not available for tool_use_id "
                                   f"{id}; retry by replaying the full messages history")
            if prior is None:
                needs_live = True
            elif api == "responses" and think_mode != "none" and not prior.reasoning:
                needs_reasoning = True
    return needs_live, needs_reasoning


def attach_replay(messages: Sequence[Message], replay: Any) -> None:
    """Exact DSML replay (§6.2): an assistant turn whose call ids ALL map to the SAME sampled
    block gets that block (set on each call); otherwise it stays canonical. `replay` is anything
    with `.get(id)` (a dict, prompts.tool_ids.ToolMemory) or a function id -> block or None."""
    lookup = replay.get if hasattr(replay, "get") else replay     # a dict, a ToolMemory, a function
    for m in messages:
        if not m.tool_calls or (len({c.dsml for c in m.tool_calls}) == 1 and m.tool_calls[0].dsml):
            continue
        blocks = [lookup(c.id) if c.id else None for c in m.tool_calls]
        if all(blocks) and len(set(blocks)) == 1:
            for c in m.tool_calls:
                c.dsml = blocks[0]


def _live_tail(api: str, msgs: Sequence[Message], think_mode: str) -> tuple[list[str], str | None]:
    """The trailing tool results a live continuation would append, and their call ids."""
    ids: list[str] = []

    def push(id: str | None) -> None:
        if id and id not in ids:
            ids.append(id)

    if api == "responses":
        start = len(msgs)
        while start > 0 and msgs[start - 1].role in ("tool", "function"):
            start -= 1
        if start == len(msgs):
            return [], None
        if start > 0:
            anchor = msgs[start - 1]
            if anchor.role != "assistant" or not anchor.tool_calls:
                return [], None
            for c in anchor.tool_calls:
                push(c.id)
        else:
            for m in msgs[start:]:
                for id in m.result_ids():
                    push(id)
    else:
        end = len(msgs)
        while end > 0 and msgs[end - 1].role in ("system", "developer"):
            end -= 1
        start = end
        while start > 0 and msgs[start - 1].role == "user" and msgs[start - 1].result_ids():
            start -= 1
        if start == end:
            return [], None
        for m in msgs[start:]:
            for id in m.result_ids():
                push(id)
    if not ids:
        return [], None
    return ids, render_live_tool_tail(msgs, start, think_mode)


def render_request(api: str, body: Any, ctx: int, *,
                   live_call_ids: Container[str] = (),
                   replay: Any = None) -> Rendered:
    """Parse a client request the way ds4-server does and render its prompt.

    api: "openai_chat", "openai_completions", "anthropic" or "responses"; body: the raw request
    (bytes or str; a dict works but loses the client's schema bytes); ctx: the context size
    (Think Max needs >= 393,216). live_call_ids: tool-call ids the live session holds for this
    API (tool results answering them need no replayed call); replay: tool id -> exact sampled
    DSML block (a dict, a ToolMemory or a function; see attach_replay). Raises RequestError with ds4's message for a request ds4 refuses."""
    parser = _PARSERS.get(api)
    if parser is None:
        raise ValueError(f"api must be one of {APIS}, not {api!r}")
    conv = parser(body)
    mode = think_mode_for_context(conv.think_mode, ctx)
    if api == "openai_completions":
        return Rendered(render_completion(conv.prompt or "", mode), mode, False, api, conv)
    needs_live = needs_reasoning = False
    if api in ("anthropic", "responses"):
        needs_live, needs_reasoning = _validate_results(api, conv.messages, mode, live_call_ids)
    if replay is not None:
        attach_replay(conv.messages, replay)
    tools = conv.tools_active
    ids, tail = ([], None)
    if api in ("anthropic", "responses"):
        ids, tail = _live_tail(api, conv.messages, mode)
    text = render_messages(conv.messages, tools, mode)
    return Rendered(text=text, think_mode=mode, has_tools=conv.has_tools, api=api,
                    conversation=conv, preserves_reasoning=uses_tool_context(conv.messages, tools),
                    live_call_ids=ids, live_tail=tail, requires_live_tool_state=needs_live,
                    requires_live_reasoning=needs_reasoning)
