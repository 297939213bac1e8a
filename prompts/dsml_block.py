"""The authoritative parse of a finished generation (protocol.md §3.5, §3.6): ds4's
`parse_generated_message_ex` followed by the worker's finish-reason rules.

It follows ds4_server.c byte for byte where that is observable, including its tolerance: the
short (`<DSML｜…>`) and plain-XML (`<tool_calls>`) spellings, a parameter without `string=` (a
string), and the "loose nested" shape where a parameter without `string=` holds further
parameters (a JSON object). The parse of a block is all or nothing: one malformed tag and the
whole raw text comes back as content (finish "stop", error "invalid tool call"); a block that
was opened but never closed gives finish "error" ("unterminated tool call").

`finalize` needs what the generation loop's marker observer saw (§3.6); the stream
(dsml_stream.py) is that observer, and `parse_output` runs it (dsml_parse.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .dsml_json import ScanFail, arguments_from_internal
from .dsml_syntax import PRIORITY_STARTS, THINK_CLOSE, THINK_OPEN, WS, Syntax, dsml_attr, skip_ws, \
    unescape_entities
from .jsonspan import json_escape, minify

__all__ = ["ParsedCall", "Parsed", "finalize"]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict                    # json.loads(arguments_json); duplicate keys: last wins
    arguments_json: str                # compact JSON, members in DSML order (§7.1), "{}" if unparseable
    dsml: str                          # the exact sampled block (shared by every call of the turn)


@dataclass(frozen=True)
class Parsed:
    reasoning: str | None
    content: str
    tool_calls: list[ParsedCall] = field(default_factory=list)
    finish_reason: str = "stop"        # "stop" | "tool_calls" | "error" (| "length" when passed in)
    error: str | None = None           # "invalid tool call" | "unterminated tool call"
    dsml: str | None = None            # the block's exact bytes when a block parsed (even with 0 calls)


def _split_reasoning_content(s: str) -> tuple[str, str | None]:
    """split_reasoning_content: drop one leading `<think>`; reasoning = before the FIRST
    `</think>`, content = after it; without `</think>` the whole text (leading `<think>` kept)
    is content and reasoning is None."""
    body = s[len(THINK_OPEN):] if s.startswith(THINK_OPEN) else s
    k = body.find(THINK_CLOSE)
    if k < 0:
        return s, None
    return body[k + len(THINK_CLOSE):], body[:k]


# --------------------------------------------------------------------------- the block parser

def _args_member(name: str, value: str, is_string: str) -> str:
    """tool_call_json_args_add: one member of ds4's internal arguments text."""
    if is_string == "true":
        return json_escape(name) + ": " + json_escape(value)
    mini = minify(value)
    return json_escape(name) + ": " + (mini if mini else "null")


def _leaf_param(text: str, p: int, syn: Syntax, members: list[str]) -> int:
    """dsml_parse_leaf_param_json: one flat parameter inside a loose nested object."""
    if not text.startswith(syn.param_start, p):
        raise ScanFail
    gt = text.find(">", p)
    if gt < 0:
        raise ScanFail
    tag = text[p:gt + 1]
    name = dsml_attr(tag, "name")
    is_string = dsml_attr(tag, "string")
    if name is None:
        raise ScanFail
    vend = text.find(syn.param_end, gt + 1)
    if vend < 0:
        raise ScanFail
    raw = text[gt + 1:vend]
    typ = is_string if is_string is not None else "true"
    members.append(_args_member(name, unescape_entities(raw) if typ == "true" else raw, typ))
    return vend + len(syn.param_end)


def _parse_block(text: str, p: int, syn: Syntax) -> tuple[list[tuple[str, str]], int]:
    """Walk the block from just after its opening tag. Returns ([(name, internal_args)], end)."""
    calls = []
    while True:
        p = skip_ws(text, p)
        if text.startswith(syn.tool_calls_end, p):
            return calls, p + len(syn.tool_calls_end)
        if not text.startswith(syn.invoke_start, p):
            raise ScanFail
        gt = text.find(">", p)
        if gt < 0:
            raise ScanFail
        name = dsml_attr(text[p:gt + 1], "name")
        if name is None:
            raise ScanFail
        p = gt + 1
        members: list[str] = []
        while True:
            p = skip_ws(text, p)
            if text.startswith(syn.invoke_end, p):
                p += len(syn.invoke_end)
                break
            if not text.startswith(syn.param_start, p):
                raise ScanFail
            gt = text.find(">", p)
            if gt < 0:
                raise ScanFail
            tag = text[p:gt + 1]
            pname = dsml_attr(tag, "name")
            is_string = dsml_attr(tag, "string")
            if pname is None:
                raise ScanFail
            vstart = gt + 1
            if is_string is None and text.startswith(syn.param_start, skip_ws(text, vstart)):
                # Loose nested recovery: consecutive leaf parameters become a JSON object.
                inner: list[str] = []
                q = vstart
                while True:
                    q = skip_ws(text, q)
                    if not text.startswith(syn.param_start, q):
                        break
                    q = _leaf_param(text, q, syn, inner)
                members.append(_args_member(pname, "{" + ", ".join(inner) + "}", "false"))
                p = skip_ws(text, q)
                if text.startswith(syn.param_end, p):
                    p += len(syn.param_end)
                continue
            p = _leaf_param(text, p, syn, members)
        calls.append((name, "{" + ", ".join(members) + "}"))


def _parse_generated(text: str, thinking: bool):
    """parse_generated_message_ex. Returns (ok, content, reasoning, calls, raw_dsml)."""
    search_from = 0
    if thinking:
        k = text.rfind(THINK_CLOSE)
        if k < 0:    # reasoning never closed: nothing is executable
            content, reasoning = _split_reasoning_content(text)
            return True, content, reasoning, [], None
        search_from = k + len(THINK_CLOSE)
    start, syn = -1, None
    for opener, s in PRIORITY_STARTS:
        start = text.find(opener, search_from)
        if start >= 0:
            syn = s
            break
    if start < 0:
        content, reasoning = _split_reasoning_content(text)
        return True, content, reasoning, [], None
    content_len = start
    while content_len > 0 and text[content_len - 1] in WS:
        content_len -= 1
    p = text.find(syn.tool_calls_start, start) + len(syn.tool_calls_start)
    try:
        raw_calls, end = _parse_block(text, p, syn)
    except ScanFail:
        return False, None, None, [], None
    dsml = text[start:end]
    calls = []
    for name, internal in raw_calls:
        args, compact = arguments_from_internal(internal)
        calls.append(ParsedCall(name=name, arguments=args, arguments_json=compact, dsml=dsml))
    content, reasoning = _split_reasoning_content(text[:content_len])
    return True, content, reasoning, calls, dsml


def finalize(text: str, thinking: bool, finish: str, has_tools: bool,
             saw_start: bool, saw_end: bool) -> Parsed:
    """The worker's end of a chat generation: unterminated-block check, parse, recovery."""
    error = None
    if has_tools and saw_end and finish == "stop":
        finish = "tool_calls"        # decoding stops at the closing tag (the EOS is never sampled)
    if has_tools and saw_start and not saw_end and finish != "error":
        finish, error = "error", "unterminated tool call"
    ok, content, reasoning, calls, dsml = _parse_generated(text, thinking)
    if not ok:
        if has_tools and saw_start and finish != "error":
            finish = "length" if finish == "length" else "stop"
            error = "invalid tool call"
        return Parsed(reasoning=None, content=text, tool_calls=[], finish_reason=finish, error=error)
    if calls:
        finish, error = "tool_calls", None
    return Parsed(reasoning=reasoning, content=content, tool_calls=calls, finish_reason=finish,
                  error=error, dsml=dsml)
