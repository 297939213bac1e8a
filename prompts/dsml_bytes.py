"""Byte-level helpers of the streaming DSML readers (dsml_stream.py, dsml_track.py): ds4
works on the UTF-8 bytes of the growing text, so partial characters, partial tags and partial
entities are decided on bytes, as in ds4_server.c (the C names are given per function).
"""
from __future__ import annotations

from .dsml_syntax import SYNTAXES, WS, Syntax, dsml_attr
from .jsonspan import json_escape

WSB = frozenset(WS.encode())
B_SYNTAXES = tuple(Syntax(*(f.encode() for f in s)) for s in SYNTAXES)
B_STARTS = tuple(s.tool_calls_start for s in B_SYNTAXES)
B_ENDS = tuple(s.tool_calls_end for s in B_SYNTAXES)
MAX_START = max(len(s) for s in B_STARTS)          # dsml_max_tool_start_len (22)
ENTITIES = (b"&amp;", b"&lt;", b"&gt;", b"&quot;", b"&apos;")


def find_earliest(raw, needles, start: int, end: int) -> tuple[int, int]:
    best, best_i = -1, -1
    for i, nd in enumerate(needles):
        p = raw.find(nd, start, end)
        if p >= 0 and (best < 0 or p < best):
            best, best_i = p, i
    return best, best_i


def full(raw, n: int, pos: int, lit: bytes) -> bool:
    """raw_full_lit over raw[:n]."""
    return raw.startswith(lit, pos, n)


def partial(raw, n: int, pos: int, lit: bytes, min_len: int = 0) -> bool:
    """raw_partial_lit(_min): raw[pos:n] is a proper prefix of lit (at least min_len bytes)."""
    avail = n - pos
    return min_len <= avail < len(lit) and lit.startswith(raw[pos:n])


def rtrim_ws(raw, start: int, limit: int) -> int:
    while limit > start and raw[limit - 1] in WSB:
        limit -= 1
    return limit


def _utf8_expected_len(c: int) -> int:
    if c < 0x80:
        return 1
    if 0xC2 <= c <= 0xDF:
        return 2
    if 0xE0 <= c <= 0xEF:
        return 3
    if 0xF0 <= c <= 0xF4:
        return 4
    return 1


def utf8_safe(raw, start: int, limit: int, final: bool) -> int:
    """utf8_stream_safe_len: hold back only a trailing incomplete character."""
    if final or limit <= start:
        return limit
    p, cont = limit, 0
    while p > start and cont < 4 and (raw[p - 1] & 0xC0) == 0x80:
        p -= 1
        cont += 1
    if p == limit:
        return limit - 1 if _utf8_expected_len(raw[limit - 1]) > 1 else limit
    if p == start and (raw[p] & 0xC0) == 0x80:
        return start
    lead = p - 1
    return lead if limit - lead < _utf8_expected_len(raw[lead]) else limit


def entity_safe(raw, start: int, limit: int) -> int:
    """dsml_entity_stream_safe_len: stop before a trailing `&` that may still become an entity."""
    scan = limit - 6 if limit > start + 6 else start
    for i in range(limit, scan, -1):
        if raw[i - 1] != 0x26:   # '&'
            continue
        amp = i - 1
        tail = raw[amp:limit]
        for ent in ENTITIES:
            if len(tail) < len(ent) and ent.startswith(tail):
                return amp
        break
    return limit


def param_value_safe(raw, start: int, n: int, param_end: bytes, is_string: bool) -> int:
    """tool_param_value_stream_safe_len."""
    limit = n
    scan = n - len(param_end) if n > start + len(param_end) else start
    for i in range(n, scan, -1):
        if raw[i - 1] != 0x3C:   # '<'
            continue
        if n - (i - 1) < len(param_end) and param_end.startswith(raw[i - 1:n]):
            limit = i - 1
        break
    if is_string:
        limit = entity_safe(raw, start, limit)
    return utf8_safe(raw, start, limit, False)


def dec(b) -> str:
    return bytes(b).decode("utf-8", errors="replace")


def attr(raw, start: int, end: int, name: str) -> str | None:
    return dsml_attr(dec(raw[start:end]), name)


def escape_fragment(s: str) -> str:
    return json_escape(s)[1:-1]
