"""A cursor over JSON text that behaves like ds4's hand-written request parser.

Why not `json.loads`: tool schemas go into the prompt as the client's own bytes (key order,
whitespace, duplicate keys, `\\u00e9` escapes), so we need the span of a value, not its parsed
form. And which requests ds4 accepts is decided by its permissive parser, not by RFC 8259:

* whitespace is C `isspace` (space, \\t, \\n, \\v, \\f, \\r);
* strings may hold raw control characters; escapes are the JSON ones; a high surrogate followed
  by a `\\u` escape that is not a low surrogate keeps the high one and drops the second escape; a
  lone surrogate stays a lone code point (ds4 writes it as 3-byte UTF-8); a decoded string ends
  at its first NUL (ds4 keeps C strings);
* numbers are whatever C `strtod` reads (`+1`, `.5`, `1.`, `0x1p3`, `inf`, `nan`...);
* literals match by prefix (`nullx` reads `null`, then the `x` fails whatever comes next);
* skipping a value is strict (commas required, no trailing comma, nesting below 256), but the
  field-by-field loops ds4 writes for the fields it reads are loose: a comma between members is
  optional and a trailing comma is accepted. `obj()` and `arr()` are those loose loops.

Every failure raises `JSONBad`; the request parsers turn it into "invalid JSON request".
"""
from __future__ import annotations

import json
import re
from typing import Iterator

__all__ = ["JSONBad", "Cursor", "minify", "json_escape", "object_members"]

MAX_NESTING = 256            # ds4 JSON_MAX_NESTING: skipping deeper values fails
_WS = " \t\n\v\f\r"          # C isspace in the "C" locale

# C strtod: decimal with optional exponent (only taken when digits follow), hex float with
# optional binary exponent, inf/infinity, nan/nan(chars); optional sign; case-insensitive words.
_NUMBER = re.compile(
    r"[+-]?(?:"
    r"0[xX](?:[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?"
    r"|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?"
    r")"
)
_PLAIN = re.compile(r'[^"\\]*')
# one scalar as `skip` reads it (literals first, then strtod), and a run of them as ds4's loose
# loops read them: separators taken only between two scalars, so the loop sees the last one's.
# Plain decimals only, and only where strtod would end them too (the lookahead): anything else
# ends the run early, and the loop reads it the slow way, which is always exact.
# (Possessive: the loop never takes back what it read, and re runs them twice as fast.)
_SCALAR = r"(?:[+-]?+[0-9]++(?:\.[0-9]++)?+(?:[eE][+-]?+[0-9]++)?+(?![.eExX0-9])|true|false|null)"
_SCALAR_ONE = re.compile(_SCALAR)
_SCALAR_RUN = re.compile(_SCALAR + r"(?:[ \t\n\v\f\r]*+,?+[ \t\n\v\f\r]*+" + _SCALAR + ")*+")
# Skipping a container runs Python's C decoder first: JSON it accepts is JSON ds4's strict skip
# accepts (its numbers, literals, escapes and whitespace are subsets of strtod's and ds4's), up
# to nesting, checked below. What it refuses goes through the exact slow path. The slow path
# costs ~2-4 us a value, so a 10 MB body of ignored numbers took 20-40 s of CPU (issue 32 item 5).
_DECODER = json.JSONDecoder(strict=False)
_PAIRS = json.JSONDecoder(strict=False, object_pairs_hook=lambda pairs: [v for _, v in pairs])
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JSONBad(Exception):
    """The text is not something ds4's parser accepts at this point."""


class Cursor:
    """Position in a JSON text. Methods that read a value skip leading whitespace first."""

    __slots__ = ("s", "i")

    def __init__(self, s: str, i: int = 0):
        self.s = s
        self.i = i

    # -- primitives -------------------------------------------------------------------------

    def ws(self) -> None:
        s, i, n = self.s, self.i, len(self.s)
        while i < n and s[i] in _WS:
            i += 1
        self.i = i

    def peek(self) -> str:
        """The current character, or "" at the end (ds4 sees the terminating NUL there)."""
        return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            raise JSONBad(f"expected {ch!r} at offset {self.i}")
        self.i += 1

    def lit(self, word: str) -> bool:
        """Consume `word` if the text continues with it (prefix match, like strncmp)."""
        if self.s.startswith(word, self.i):
            self.i += len(word)
            return True
        return False

    def string(self) -> str:
        """A JSON string, decoded; raises JSONBad if the next value is not a string."""
        self.ws()
        s = self.s
        if self.peek() != '"':
            raise JSONBad(f"expected a string at offset {self.i}")
        i = self.i + 1
        parts: list[str] = []
        n = len(s)
        while True:
            m = _PLAIN.match(s, i)
            if m.end() > i:
                parts.append(m.group())
                i = m.end()
            if i >= n:
                raise JSONBad("unterminated string")
            c = s[i]
            if c == '"':
                i += 1
                break
            # backslash
            if i + 1 >= n:
                raise JSONBad("unterminated escape")
            e = s[i + 1]
            if e in _SIMPLE_ESCAPES:
                parts.append(_SIMPLE_ESCAPES[e])
                i += 2
                continue
            if e != "u":
                raise JSONBad(f"bad escape \\{e}")
            if not _HEX4.match(s, i + 2):
                raise JSONBad("bad \\u escape")
            cp = int(s[i + 2:i + 6], 16)
            i += 6
            if 0xD800 <= cp <= 0xDBFF and s.startswith("\\u", i) and _HEX4.match(s, i + 2):
                lo = int(s[i + 2:i + 6], 16)
                i += 6                    # ds4 consumes the second escape even when unused
                if 0xDC00 <= lo <= 0xDFFF:
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
            parts.append(chr(cp))
        self.i = i
        out = "".join(parts)
        nul = out.find("\0")
        return out if nul < 0 else out[:nul]

    def number(self) -> float:
        self.ws()
        m = _NUMBER.match(self.s, self.i)
        if not m:
            raise JSONBad(f"expected a number at offset {self.i}")
        self.i = m.end()
        text = m.group()
        try:
            if "x" in text or "X" in text:
                sign = -1.0 if text.startswith("-") else 1.0
                body = text.lstrip("+-")
                if "p" not in body and "P" not in body:
                    body += "p0"
                return sign * float.fromhex(body)
            low = text.lower()
            if "nan" in low:
                return float("nan")
            return float(text)
        except (ValueError, OverflowError):
            return float("inf")

    def int_(self) -> int:
        """ds4 json_int: a number, negatives clamp to 0, above INT_MAX to INT_MAX, truncated."""
        v = self.number()
        if v != v or v < 0:
            return 0
        if v > 2147483647:
            return 2147483647
        return int(v)

    def bool_(self) -> bool:
        self.ws()
        if self.lit("true"):
            return True
        if self.lit("false"):
            return False
        raise JSONBad(f"expected a boolean at offset {self.i}")

    # -- whole values -----------------------------------------------------------------------

    def skip(self, depth: int = 0) -> None:
        """Skip one value, strictly (ds4 json_skip_value)."""
        self.ws()
        c = self.peek()
        if (c == "[" or c == "{") and self._fast_skip(depth):
            return
        if c == '"':
            self.string()
        elif c == "{":
            if depth >= MAX_NESTING:
                raise JSONBad("nesting too deep")
            self.i += 1
            self.ws()
            if self.peek() == "}":
                self.i += 1
                return
            while True:
                self.string()
                self.ws()
                self.expect(":")
                self.skip(depth + 1)
                self.ws()
                c = self.peek()
                if c == "}":
                    self.i += 1
                    return
                self.expect(",")
        elif c == "[":
            if depth >= MAX_NESTING:
                raise JSONBad("nesting too deep")
            self.i += 1
            self.ws()
            if self.peek() == "]":
                self.i += 1
                return
            while True:
                self.skip(depth + 1)
                self.ws()
                c = self.peek()
                if c == "]":
                    self.i += 1
                    return
                self.expect(",")
        elif self.lit("true") or self.lit("false") or self.lit("null"):
            return
        else:
            self.number()

    def _fast_skip(self, depth: int) -> bool:
        """Skip a container with the C decoder; False (nothing consumed) when it refuses it or
        it nests past MAX_NESTING, for the slow path to decide as ds4 does."""
        s, i = self.s, self.i
        try:
            v, end = _DECODER.raw_decode(s, i)
            if depth + s.count("[", i, end) + s.count("{", i, end) > MAX_NESTING:
                # brackets (some maybe inside strings) could nest too deep: measure, with every
                # duplicate key's value kept (a dict keeps only the last: objects become lists)
                if s.count("{", i, end):
                    v = _PAIRS.raw_decode(s, i)[0]
                if depth + _nesting(v, MAX_NESTING - depth) > MAX_NESTING:
                    return False
        except (ValueError, RecursionError):
            return False
        self.i = end
        return True

    def skip_scalars(self) -> list[str] | None:
        """Skip a run of scalars (numbers, literals) of a loose loop at once, up to the last one
        (the loop reads the separator after it): their texts; None when the next value is no
        plain scalar."""
        m = _SCALAR_RUN.match(self.s, self.i)
        if not m:
            return None
        self.i = m.end()
        return _SCALAR_ONE.findall(m.group())

    def raw(self) -> str:
        """The exact text of the next value, from its first non-whitespace character."""
        return self.s[self.raw_span()]

    def raw_span(self) -> slice:
        self.ws()
        start = self.i
        self.skip()
        return slice(start, self.i)

    # -- ds4's loose field loops ------------------------------------------------------------

    def obj(self) -> Iterator[str]:
        """Iterate an object's members, yielding each key with the cursor on its value.

        The caller must consume the value before asking for the next key. Commas between
        members are optional and a trailing comma is accepted (ds4's field loops)."""
        self.ws()
        self.expect("{")
        self.ws()
        while self.i < len(self.s) and self.s[self.i] != "}":
            key = self.string()
            self.ws()
            self.expect(":")
            yield key
            self.ws()
            if self.peek() == ",":
                self.i += 1
            self.ws()
        self.expect("}")

    def arr(self) -> Iterator[None]:
        """Iterate an array's elements, the cursor on each (whitespace skipped); same looseness."""
        self.ws()
        self.expect("[")
        self.ws()
        while self.i < len(self.s) and self.s[self.i] != "]":
            yield None
            self.ws()
            if self.peek() == ",":
                self.i += 1
            self.ws()
        self.expect("]")

    def content(self) -> str:
        """ds4 json_content: a string; null -> ""; an array -> its strings and the `text` member
        of its objects, concatenated; any other value -> "" (skipped)."""
        self.ws()
        c = self.peek()
        if c == '"':
            return self.string()
        if self.lit("null"):
            return ""
        if c != "[":
            self.skip()
            return ""
        parts: list[str] = []
        for _ in self.arr():
            c = self.peek()
            if c == '"':
                parts.append(self.string())
            elif c == "{":
                for key in self.obj():
                    if key == "text":
                        parts.append(self.string())
                    else:
                        self.skip()
            elif self.skip_scalars() is None:
                self.skip()
        return "".join(parts)


def _nesting(v: list, stop: int) -> int:
    """How deep lists nest in v (1: a flat list; objects are lists of their values here),
    level by level; past `stop` levels it stops counting."""
    depth, level = 0, [v]
    while level and depth <= stop:
        depth += 1
        level = [y for x in level for y in x if type(y) is list]
    return depth


def minify(raw: str) -> str:
    """ds4 json_minify_raw_value: drop whitespace outside strings, keep strings byte for byte.
    Text that is not one valid value comes back unchanged."""
    cur = Cursor(raw)
    try:
        span = cur.raw_span()
    except JSONBad:
        return raw
    out: list[str] = []
    in_string = escape = False
    for c in raw[span]:
        if in_string:
            out.append(c)
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
            out.append(c)
        elif c not in _WS:
            out.append(c)
    return "".join(out)


def json_escape(s: str) -> str:
    """ds4 json_escape: a quoted JSON string; only `"`, `\\` and control characters escaped
    (\\n \\r \\t by name, the rest as lowercase \\u00xx); everything else raw."""
    out = ['"']
    for c in s:
        if c == '"' or c == "\\":
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif c < " ":
            out.append("\\u%04x" % ord(c))
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


def object_members(text: str | None) -> list[tuple[str, str, bool]] | None:
    """ds4 json_args_parse: the members of a JSON object in the order sent, duplicates kept, as
    (key, value, is_string): a string member decoded, any other value minified JSON text.
    None when `text` does not start with an object ds4 can read (text after it is ignored)."""
    cur = Cursor(text or "")
    try:
        cur.ws()
        if cur.peek() != "{":
            return None
        cur.i += 1
        cur.ws()
        members: list[tuple[str, str, bool]] = []
        while cur.i < len(cur.s) and cur.s[cur.i] != "}":
            key = cur.string()
            cur.ws()
            cur.expect(":")
            cur.ws()
            if cur.peek() == '"':
                members.append((key, cur.string(), True))
            else:
                members.append((key, minify(cur.raw()), False))
            cur.ws()
            if cur.peek() == ",":
                cur.i += 1
            cur.ws()
        if cur.peek() != "}":
            return None
        return members
    except JSONBad:
        return None
