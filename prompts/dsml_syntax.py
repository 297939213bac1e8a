"""The DSML vocabulary shared by every reader of model output (protocol.md §3.1, §3.3, §3.6):
the three spellings of the tool markers, the reasoning markers, ds4's whitespace, attribute
extraction, entity unescaping and the marker searches.

The readers built on it: the block parser (dsml_block.py, §3.5), the stream (dsml_stream.py:
projection §3.8, marker observer §3.6, tracker §3.7), `parse_output` (dsml_parse.py, the stream
run to the end) and the KV trailer writer's block search (`find_next_dsml_tool_block`).
"""
from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "DSML", "THINK_OPEN", "THINK_CLOSE", "WS", "Syntax", "SYNTAX_FULL", "SYNTAX_SHORT",
    "SYNTAX_PLAIN", "SYNTAXES", "PRIORITY_STARTS", "thinking_enabled", "unescape_entities",
    "dsml_attr", "skip_ws", "find_any_tool_start", "find_any_tool_end", "find_next_dsml_tool_block",
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
PRIORITY_STARTS = (
    ("\n\n" + SYNTAX_FULL.tool_calls_start, SYNTAX_FULL),
    (SYNTAX_FULL.tool_calls_start, SYNTAX_FULL),
    ("\n\n" + SYNTAX_SHORT.tool_calls_start, SYNTAX_SHORT),
    (SYNTAX_SHORT.tool_calls_start, SYNTAX_SHORT),
    ("\n\n" + SYNTAX_PLAIN.tool_calls_start, SYNTAX_PLAIN),
    (SYNTAX_PLAIN.tool_calls_start, SYNTAX_PLAIN),
)



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



def skip_ws(s: str, p: int) -> int:
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
    for opener, syn in PRIORITY_STARTS:
        s = text.find(opener, start)
        if s < 0 or (best >= 0 and s >= best):
            continue
        e = text.find(syn.tool_calls_end, s)
        if e < 0:
            continue
        best, best_end = s, e + len(syn.tool_calls_end)
    return best, best_end
