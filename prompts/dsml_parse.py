"""Model output -> reasoning, content and DSML tool calls (protocol.md §3.1-3.5, §3.6, §7.1).

`parse_output(text, think_mode)` is ds4's `parse_generated_message_ex` followed by the worker's
finish-reason rules: the text is what the model sampled after the prompt (after `<think>` in
thinking mode, after `</think>` otherwise), markers inline as strings, EOS excluded.

Everything here follows ds4_server.c byte for byte where that is observable, including its
tolerance: the short (`<DSML｜…>`) and plain-XML (`<tool_calls>`) spellings, a parameter without
`string=` (a string), and the "loose nested" shape where a parameter without `string=` holds
further parameters (a JSON object). The parse of a block is all or nothing: one malformed tag and
the whole raw text comes back as content (finish "stop", error "invalid tool call"); a block that
was opened but never closed gives finish "error" ("unterminated tool call").

Small helpers used by the streaming parser (dsml_stream.py) and the tool memory (tool_ids.py)
live here too: the three syntaxes, marker search, attribute extraction and entity unescaping.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from .jsonspan import json_escape, minify  # ds4's json_escape / json_minify_raw_value

__all__ = [
    "DSML", "Syntax", "SYNTAX_FULL", "SYNTAX_SHORT", "SYNTAX_PLAIN", "SYNTAXES",
    "ParsedCall", "Parsed", "parse_output", "thinking_enabled",
    "unescape_entities", "dsml_attr", "json_escape", "find_any_tool_start", "find_any_tool_end",
    "find_next_dsml_tool_block",
]

DSML = "｜DSML｜"  # U+FF5C on both sides: one special token (id 128825)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# C isspace() in the "C" locale. Python's str.isspace() also accepts Unicode spaces and \x1c-\x1f,
# which ds4 treats as text.
WS = " \t\n\v\f\r"


class Syntax(NamedTuple):
    tool_calls_start: str
    tool_calls_end: str
    invoke_start: str
    invoke_end: str
    param_start: str
    param_end: str


def _syntax(ns: str) -> Syntax:
    return Syntax(f"<{ns}tool_calls>", f"</{ns}tool_calls>", f"<{ns}invoke", f"</{ns}invoke>",
                  f"<{ns}parameter", f"</{ns}parameter>")


SYNTAX_FULL = _syntax(DSML)            # what the model is taught and ds4 renders
SYNTAX_SHORT = _syntax("DSML｜")       # first bar dropped: recovered
SYNTAX_PLAIN = _syntax("")             # plain XML: recovered
SYNTAXES = (SYNTAX_FULL, SYNTAX_SHORT, SYNTAX_PLAIN)

# parse_generated_message_ex's block-start search: FIRST PATTERN THAT OCCURS wins, not the
# earliest position; the "\n\n" forms come first so the separator belongs to the block.
_PRIORITY_STARTS = (
    ("\n\n" + SYNTAX_FULL.tool_calls_start, SYNTAX_FULL),
    (SYNTAX_FULL.tool_calls_start, SYNTAX_FULL),
    ("\n\n" + SYNTAX_SHORT.tool_calls_start, SYNTAX_SHORT),
    (SYNTAX_SHORT.tool_calls_start, SYNTAX_SHORT),
    ("\n\n" + SYNTAX_PLAIN.tool_calls_start, SYNTAX_PLAIN),
    (SYNTAX_PLAIN.tool_calls_start, SYNTAX_PLAIN),
)


# --------------------------------------------------------------------------- data

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


# --------------------------------------------------------------------------- small helpers

def thinking_enabled(think_mode) -> bool:
    """`think_mode`: "none" | "high" | "max" (ds4's modes) or a bool."""
    if isinstance(think_mode, bool):
        return think_mode
    if think_mode in ("none", None):
        return False
    if think_mode in ("high", "max"):
        return True
    raise ValueError(f"think_mode must be 'none', 'high', 'max' or a bool, not {think_mode!r}")


_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'"}
_ENTITY_RE = re.compile("&(?:amp|lt|gt|quot|apos);")


def unescape_entities(s: str) -> str:
    """dsml_unescape_text (§3.3): the five named entities, left to right; any other `&` stays
    (so `&#60;` is NOT decoded: ds4 knows no numeric entities)."""
    return _ENTITY_RE.sub(lambda m: _ENTITIES[m.group(0)], s) if "&" in s else s


def dsml_attr(tag: str, name: str) -> str | None:
    """dsml_attr: first `name="` anywhere in the tag text, up to the next `"`, unescaped.
    Plain substring search, exactly like ds4 (`xname="…"` would match `name`)."""
    pat = name + '="'
    i = tag.find(pat)
    if i < 0:
        return None
    i += len(pat)
    j = tag.find('"', i)
    if j < 0:
        return None
    return unescape_entities(tag[i:j])


def _skip_ws(s: str, p: int) -> int:
    n = len(s)
    while p < n and s[p] in WS:
        p += 1
    return p


def _find_earliest(text: str, needles, start: int = 0) -> tuple[int, int]:
    """(position, index of needle) of the earliest occurrence; ties keep the first needle."""
    best, best_i = -1, -1
    for i, nd in enumerate(needles):
        p = text.find(nd, start)
        if p >= 0 and (best < 0 or p < best):
            best, best_i = p, i
    return best, best_i


_STARTS = tuple(s.tool_calls_start for s in SYNTAXES)
_ENDS = tuple(s.tool_calls_end for s in SYNTAXES)


def find_any_tool_start(text: str, start: int = 0) -> tuple[int, Syntax | None]:
    """find_any_tool_start: earliest of the three `tool_calls` openings (no separator)."""
    p, i = _find_earliest(text, _STARTS, start)
    return (p, SYNTAXES[i]) if p >= 0 else (-1, None)


def find_any_tool_end(text: str, start: int = 0) -> int:
    return _find_earliest(text, _ENDS, start)[0]


def find_next_dsml_tool_block(text: str, start: int = 0) -> tuple[int, int]:
    """ds4's find_next_dsml_tool_block (KV trailer writer, kvcache.md §2.4): the earliest start
    among the six forms ("\\n\\n" first on ties) whose own end tag follows it.
    Returns (start, end) of the block, or (-1, -1)."""
    best, best_end = -1, -1
    for opener, syn in _PRIORITY_STARTS:
        s = text.find(opener, start)
        if s < 0 or (best >= 0 and s >= best):
            continue
        e = text.find(syn.tool_calls_end, s)
        if e < 0:
            continue
        best, best_end = s, e + len(syn.tool_calls_end)
    return best, best_end


def _split_reasoning_content(s: str) -> tuple[str, str | None]:
    """split_reasoning_content: drop one leading `<think>`; reasoning = before the FIRST
    `</think>`, content = after it; without `</think>` the whole text (leading `<think>` kept)
    is content and reasoning is None."""
    body = s[len(THINK_OPEN):] if s.startswith(THINK_OPEN) else s
    k = body.find(THINK_CLOSE)
    if k < 0:
        return s, None
    return body[k + len(THINK_CLOSE):], body[:k]


# --------------------------------------------------------------------------- ds4's JSON scanner
# The DSML parser and the API re-serialization use ds4's hand-written permissive JSON reader.
# Porting it (rather than calling json.loads) keeps which prefix of a `string="false"` value
# counts as the value, and when a whole call's arguments degrade to `{}`, identical to ds4.

_JSON_MAX_NESTING = 256
# strtod() in the C locale: what json_number accepts (more than JSON: +1, .5, 0x1f, inf, nan).
_STRTOD = re.compile(
    r"[+-]?(?:0[xX](?:[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?"
    r"|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?)")
_SIMPLE_ESC = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


class _Fail(Exception):
    pass


def _json_string(s: str, p: int) -> tuple[str, int]:
    """json_string: skips leading space; raw control characters allowed; lone surrogates
    (which ds4 writes as 3-byte sequences) become U+FFFD so the result stays valid UTF-8."""
    p = _skip_ws(s, p)
    if p >= len(s) or s[p] != '"':
        raise _Fail
    p += 1
    out = []
    n = len(s)
    while True:
        q = p
        while q < n and s[q] != '"' and s[q] != "\\":
            q += 1
        out.append(s[p:q])
        if q >= n:
            raise _Fail
        if s[q] == '"':
            return "".join(out), q + 1
        # backslash
        c = s[q + 1] if q + 1 < n else ""
        if c in _SIMPLE_ESC and c:
            out.append(_SIMPLE_ESC[c])
            p = q + 2
            continue
        if c != "u" or not _HEX4.fullmatch(s, q + 2, q + 6):
            raise _Fail
        cp = int(s[q + 2:q + 6], 16)
        p = q + 6
        if 0xD800 <= cp <= 0xDBFF and s.startswith("\\u", p) and _HEX4.fullmatch(s, p + 2, p + 6):
            lo = int(s[p + 2:p + 6], 16)
            # ds4 consumes the second escape even when it is not a low surrogate (then lost).
            p += 6
            if 0xDC00 <= lo <= 0xDFFF:
                out.append(chr(0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)))
                continue
            out.append("\ufffd")
            continue
        out.append("\ufffd" if 0xD800 <= cp <= 0xDFFF else chr(cp))


def _json_skip_value(s: str, p: int, depth: int = 0) -> int:
    """json_skip_value_depth: end offset of the value at p (leading space skipped)."""
    p = _skip_ws(s, p)
    c = s[p] if p < len(s) else ""
    if c == '"':
        return _json_string(s, p)[1]
    if c == "{" or c == "[":
        if depth >= _JSON_MAX_NESTING:
            raise _Fail
        close = "}" if c == "{" else "]"
        p = _skip_ws(s, p + 1)
        if s.startswith(close, p):
            return p + 1
        while True:
            if c == "{":
                _, p = _json_string(s, p)
                p = _skip_ws(s, p)
                if not s.startswith(":", p):
                    raise _Fail
                p += 1
            p = _skip_ws(s, _json_skip_value(s, p, depth + 1))
            if s.startswith(close, p):
                return p + 1
            if not s.startswith(",", p):
                raise _Fail
            p += 1
    for lit in ("true", "false", "null"):
        if s.startswith(lit, p):
            return p + len(lit)
    m = _STRTOD.match(s, p)
    if not m:
        raise _Fail
    return m.end()


def _json_object_or_empty(internal: str) -> str:
    """append_json_object_or_empty (json_args_parse + re-emit): the API form of a call's
    arguments: `{"k":v,...}`, keys in order, duplicates kept, "{}" when unparseable."""
    s = internal
    try:
        p = _skip_ws(s, 0)
        if not s.startswith("{", p):
            raise _Fail
        p = _skip_ws(s, p + 1)
        members = []
        while p < len(s) and s[p] != "}":
            key, p = _json_string(s, p)
            p = _skip_ws(s, p)
            if not s.startswith(":", p):
                raise _Fail
            p = _skip_ws(s, p + 1)
            if s.startswith('"', p):
                val, p = _json_string(s, p)
                members.append(json_escape(key) + ":" + json_escape(val))
            else:
                end = _json_skip_value(s, p)
                members.append(json_escape(key) + ":" + minify(s[p:end]))
                p = end
            p = _skip_ws(s, p)
            if s.startswith(",", p):         # ds4: the comma is optional
                p += 1
            p = _skip_ws(s, p)
        if not s.startswith("}", p):
            raise _Fail
    except _Fail:
        return "{}"
    return "{" + ",".join(members) + "}"


def _reject_constant(name):
    raise ValueError(name)


def _arguments_from_internal(internal: str) -> tuple[dict, str]:
    compact = _json_object_or_empty(internal)
    try:
        args = json.loads(compact, strict=False, parse_constant=_reject_constant)
    except ValueError:
        # ds4 would forward strtod-only numbers (+1, .5, 0x1f, inf) as invalid JSON; a call
        # whose arguments are not JSON is reported like any other unparseable one.
        return {}, "{}"
    if not isinstance(args, dict):
        return {}, "{}"
    return args, compact


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
        raise _Fail
    gt = text.find(">", p)
    if gt < 0:
        raise _Fail
    tag = text[p:gt + 1]
    name = dsml_attr(tag, "name")
    is_string = dsml_attr(tag, "string")
    if name is None:
        raise _Fail
    vend = text.find(syn.param_end, gt + 1)
    if vend < 0:
        raise _Fail
    raw = text[gt + 1:vend]
    typ = is_string if is_string is not None else "true"
    members.append(_args_member(name, unescape_entities(raw) if typ == "true" else raw, typ))
    return vend + len(syn.param_end)


def _parse_block(text: str, p: int, syn: Syntax) -> tuple[list[tuple[str, str]], int]:
    """Walk the block from just after its opening tag. Returns ([(name, internal_args)], end)."""
    calls = []
    while True:
        p = _skip_ws(text, p)
        if text.startswith(syn.tool_calls_end, p):
            return calls, p + len(syn.tool_calls_end)
        if not text.startswith(syn.invoke_start, p):
            raise _Fail
        gt = text.find(">", p)
        if gt < 0:
            raise _Fail
        name = dsml_attr(text[p:gt + 1], "name")
        if name is None:
            raise _Fail
        p = gt + 1
        members: list[str] = []
        while True:
            p = _skip_ws(text, p)
            if text.startswith(syn.invoke_end, p):
                p += len(syn.invoke_end)
                break
            if not text.startswith(syn.param_start, p):
                raise _Fail
            gt = text.find(">", p)
            if gt < 0:
                raise _Fail
            tag = text[p:gt + 1]
            pname = dsml_attr(tag, "name")
            is_string = dsml_attr(tag, "string")
            if pname is None:
                raise _Fail
            vstart = gt + 1
            if is_string is None and text.startswith(syn.param_start, _skip_ws(text, vstart)):
                # Loose nested recovery: consecutive leaf parameters become a JSON object.
                inner: list[str] = []
                q = vstart
                while True:
                    q = _skip_ws(text, q)
                    if not text.startswith(syn.param_start, q):
                        break
                    q = _leaf_param(text, q, syn, inner)
                members.append(_args_member(pname, "{" + ", ".join(inner) + "}", "false"))
                p = _skip_ws(text, q)
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
    for opener, s in _PRIORITY_STARTS:
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
    except _Fail:
        return False, None, None, [], None
    dsml = text[start:end]
    calls = []
    for name, internal in raw_calls:
        args, compact = _arguments_from_internal(internal)
        calls.append(ParsedCall(name=name, arguments=args, arguments_json=compact, dsml=dsml))
    content, reasoning = _split_reasoning_content(text[:content_len])
    return True, content, reasoning, calls, dsml


def observe_tool_markers(text: str, thinking: bool) -> tuple[bool, bool]:
    """(saw_start, saw_end) as ds4's generation loop sees them on a finished text (§3.6): in
    thinking mode only after the last `</think>` (nothing while reasoning is open); an end
    marker counts only after the earliest start marker."""
    scan = 0
    if thinking:
        k = text.rfind(THINK_CLOSE)
        if k < 0:
            return False, False
        scan = k + len(THINK_CLOSE)
    s, _ = find_any_tool_start(text, scan)
    if s < 0:
        return False, False
    return True, find_any_tool_end(text, s) >= 0


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


def parse_output(text: str, think_mode, *, finish: str = "stop", has_tools: bool = True) -> Parsed:
    """Parse a finished generation (protocol.md §3.5 + the worker's finish rules).

    text: what the model sampled (EOS excluded). think_mode: "none" | "high" | "max" or bool.
    finish: why sampling ended ("stop" for EOS or the closing tool tag, "length" for a token
    limit, "error"). has_tools: whether the request offered tools (ds4 still parses a block
    without tools, but a malformed one is then not flagged).

    finish_reason: "tool_calls" when calls parsed (or a closed, empty block); "error" with
    error "unterminated tool call" when a tool block opened and never closed; otherwise finish
    ("stop"), with error "invalid tool call" when a closed block did not parse (then content is
    the ENTIRE raw text, reasoning None, no calls).
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    thinking = thinking_enabled(think_mode)
    saw_start, saw_end = observe_tool_markers(text, thinking)
    return finalize(text, thinking, finish, has_tools, saw_start, saw_end)
