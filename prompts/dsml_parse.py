"""Model output -> reasoning, content and DSML tool calls (protocol.md §3.1-3.6, §7.1).

`parse_output(text, think_mode)` is the stream (dsml_stream.py) fed the whole text and
finished: one reading of DSML serves the live generation loops and the finished text alike, so
what a turn means cannot depend on whether it was streamed. The text is what the model sampled
after the prompt (after `<think>` in thinking mode, after `</think>` otherwise), markers inline
as strings, EOS excluded.

The pieces live in their own modules and are re-exported here under their historical names:
the vocabulary (dsml_syntax.py), ds4's JSON reader (dsml_json.py) and the authoritative block
parse with the finish rules (dsml_block.py).
"""
from __future__ import annotations

from .dsml_block import Parsed, ParsedCall
from .dsml_stream import DsmlStream
from .dsml_syntax import (DSML, SYNTAX_FULL, SYNTAX_PLAIN, SYNTAX_SHORT, SYNTAXES, Syntax, dsml_attr,
                          find_any_tool_end, find_any_tool_start, find_next_dsml_tool_block,
                          thinking_enabled, unescape_entities)
from .jsonspan import json_escape

__all__ = [
    "DSML", "Syntax", "SYNTAX_FULL", "SYNTAX_SHORT", "SYNTAX_PLAIN", "SYNTAXES",
    "ParsedCall", "Parsed", "parse_output", "thinking_enabled",
    "unescape_entities", "dsml_attr", "json_escape", "find_any_tool_start", "find_any_tool_end",
    "find_next_dsml_tool_block",
]


def parse_output(text: str | bytes, think_mode, *, finish: str = "stop",
                 has_tools: bool = True) -> Parsed:
    """Parse a finished generation (protocol.md §3.5 + the worker's finish rules, §3.6).

    text: what the model sampled (EOS excluded). think_mode: "none" | "high" | "max" or bool.
    finish: why sampling ended ("stop" for EOS or the closing tool tag, "length" for a token
    limit, "error"). has_tools: whether the request offered tools (ds4 still parses a block
    without tools, but a malformed one is then not flagged).

    finish_reason: "tool_calls" when calls parsed (or a closed, empty block); "error" with
    error "unterminated tool call" when a tool block opened outside reasoning and never
    closed; otherwise finish ("stop"), with error "invalid tool call" when a closed block did
    not parse (then content is the ENTIRE raw text, reasoning None, no calls).

    A text that goes on after the closing tool tag is parsed whole here (the live stream stops
    taking text at that tag; the parse ignores what follows a block that parsed).
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    st = DsmlStream(think_mode, has_tools=has_tools)
    st.feed(text)
    st.finish(finish)
    return st.result
