"""Canonical DSML text of JSON tool calls (protocol.md §3.2, §3.4).

Used for an assistant turn whose exact sampled block is unknown. The layout:

    \\n\\n<｜DSML｜tool_calls>\\n
    <｜DSML｜invoke name="NAME">\\n
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>\\n   (per member)
    </｜DSML｜invoke>\\n                                                          (per call)
    </｜DSML｜tool_calls>

Members come in the order the client sent them, duplicates included (schema property order is
not used, as in ds4). A string member is written decoded and raw; anything else as minified
JSON. Arguments that are not a JSON object become one `arguments` string parameter.
"""
from __future__ import annotations

from typing import Iterable

from .jsonspan import object_members

__all__ = [
    "DSML", "TOOL_CALLS_OPEN", "TOOL_CALLS_CLOSE", "PARAMETER_CLOSE",
    "render_tool_calls", "render_arguments", "escape_attr", "escape_string_value",
    "escape_json_value",
]

DSML = "｜DSML｜"
TOOL_CALLS_OPEN = "<｜DSML｜tool_calls>"
TOOL_CALLS_CLOSE = "</｜DSML｜tool_calls>"
INVOKE_OPEN = "<｜DSML｜invoke"
INVOKE_CLOSE = "</｜DSML｜invoke>"
PARAMETER_OPEN = "<｜DSML｜parameter"
PARAMETER_CLOSE = "</｜DSML｜parameter>"


def escape_attr(s: str | None) -> str:
    """Tool and parameter names inside `name="..."`: & < > " as entities."""
    return ((s or "").replace("&", "&amp;").replace("<", "&lt;")
            .replace(">", "&gt;").replace('"', "&quot;"))


def escape_string_value(s: str | None) -> str:
    """A string="true" value: raw, except the closing parameter tag gets `&lt;` for its `<`."""
    return (s or "").replace(PARAMETER_CLOSE, "&lt;" + PARAMETER_CLOSE[1:])


def escape_json_value(s: str | None) -> str:
    """A string="false" value: raw JSON, except the closing parameter tag gets `\\u003c`."""
    return (s or "").replace(PARAMETER_CLOSE, "\\u003c" + PARAMETER_CLOSE[1:])


def _parameter(name: str, value: str, is_string: bool) -> str:
    return (f'{PARAMETER_OPEN} name="{escape_attr(name)}" string="{"true" if is_string else "false"}">'
            + (escape_string_value(value) if is_string else escape_json_value(value))
            + PARAMETER_CLOSE + "\n")


def render_arguments(arguments_json: str | None) -> str:
    """The parameter lines of one invoke, from the call's JSON arguments text."""
    members = object_members(arguments_json)
    if members is None:
        return _parameter("arguments", arguments_json or "", True)
    return "".join(_parameter(k, v, s) for k, v, s in members)


def _name_args(call) -> tuple[str, str | None]:
    if isinstance(call, tuple):
        return call[0], call[1]
    return call.name, call.arguments_json


def render_tool_calls(calls: Iterable) -> str:
    """Canonical DSML block for `calls` (ToolCall objects or (name, arguments_json) pairs);
    "" when there are none. Starts with "\\n\\n", ends with the closing tool_calls tag."""
    calls = list(calls)
    if not calls:
        return ""
    out = ["\n\n", TOOL_CALLS_OPEN, "\n"]
    for call in calls:
        name, args = _name_args(call)
        out.append(f'{INVOKE_OPEN} name="{escape_attr(name)}">\n')
        out.append(render_arguments(args))
        out.append(INVOKE_CLOSE + "\n")
    out.append(TOOL_CALLS_CLOSE)
    return "".join(out)
