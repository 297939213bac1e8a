"""ds4's hand-written permissive JSON reader, as the DSML parser and the API re-serialization
use it (protocol.md §7.1). Porting it (rather than calling json.loads) keeps which prefix of a
`string="false"` value counts as the value, and when a whole call's arguments degrade to `{}`,
identical to ds4.
"""
from __future__ import annotations

import json
import re

from .dsml_syntax import skip_ws
from .jsonspan import json_escape, minify  # ds4's json_escape / json_minify_raw_value

__all__ = ["ScanFail", "json_scan_string", "json_skip_value", "arguments_from_internal"]

_JSON_MAX_NESTING = 256
# strtod() in the C locale: what json_number accepts (more than JSON: +1, .5, 0x1f, inf, nan).
_STRTOD = re.compile(
    r"[+-]?(?:0[xX](?:[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?"
    r"|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?)")
_SIMPLE_ESC = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


class ScanFail(Exception):
    """The text is not what ds4's reader accepts."""


def json_scan_string(s: str, p: int) -> tuple[str, int]:
    """json_string: skips leading space; raw control characters allowed; lone surrogates
    (which ds4 writes as 3-byte sequences) become U+FFFD so the result stays valid UTF-8."""
    p = skip_ws(s, p)
    if p >= len(s) or s[p] != '"':
        raise ScanFail
    p += 1
    out = []
    n = len(s)
    while True:
        q = p
        while q < n and s[q] != '"' and s[q] != "\\":
            q += 1
        out.append(s[p:q])
        if q >= n:
            raise ScanFail
        if s[q] == '"':
            return "".join(out), q + 1
        # backslash
        c = s[q + 1] if q + 1 < n else ""
        if c in _SIMPLE_ESC and c:
            out.append(_SIMPLE_ESC[c])
            p = q + 2
            continue
        if c != "u" or not _HEX4.fullmatch(s, q + 2, q + 6):
            raise ScanFail
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


def json_skip_value(s: str, p: int, depth: int = 0) -> int:
    """json_skip_value_depth: end offset of the value at p (leading space skipped)."""
    p = skip_ws(s, p)
    c = s[p] if p < len(s) else ""
    if c == '"':
        return json_scan_string(s, p)[1]
    if c == "{" or c == "[":
        if depth >= _JSON_MAX_NESTING:
            raise ScanFail
        close = "}" if c == "{" else "]"
        p = skip_ws(s, p + 1)
        if s.startswith(close, p):
            return p + 1
        while True:
            if c == "{":
                _, p = json_scan_string(s, p)
                p = skip_ws(s, p)
                if not s.startswith(":", p):
                    raise ScanFail
                p += 1
            p = skip_ws(s, json_skip_value(s, p, depth + 1))
            if s.startswith(close, p):
                return p + 1
            if not s.startswith(",", p):
                raise ScanFail
            p += 1
    for lit in ("true", "false", "null"):
        if s.startswith(lit, p):
            return p + len(lit)
    m = _STRTOD.match(s, p)
    if not m:
        raise ScanFail
    return m.end()


def _json_object_or_empty(internal: str) -> str:
    """append_json_object_or_empty (json_args_parse + re-emit): the API form of a call's
    arguments: `{"k":v,...}`, keys in order, duplicates kept, "{}" when unparseable."""
    s = internal
    try:
        p = skip_ws(s, 0)
        if not s.startswith("{", p):
            raise ScanFail
        p = skip_ws(s, p + 1)
        members = []
        while p < len(s) and s[p] != "}":
            key, p = json_scan_string(s, p)
            p = skip_ws(s, p)
            if not s.startswith(":", p):
                raise ScanFail
            p = skip_ws(s, p + 1)
            if s.startswith('"', p):
                val, p = json_scan_string(s, p)
                members.append(json_escape(key) + ":" + json_escape(val))
            else:
                end = json_skip_value(s, p)
                members.append(json_escape(key) + ":" + minify(s[p:end]))
                p = end
            p = skip_ws(s, p)
            if s.startswith(",", p):         # ds4: the comma is optional
                p += 1
            p = skip_ws(s, p)
        if not s.startswith("}", p):
            raise ScanFail
    except ScanFail:
        return "{}"
    return "{" + ",".join(members) + "}"


def _reject_constant(name):
    raise ValueError(name)


def arguments_from_internal(internal: str) -> tuple[dict, str]:
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
