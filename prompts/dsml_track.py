"""The structural/payload tracker of a generation (protocol.md §3.7): before each token, is the
model writing DSML syntax (sampled greedily) or a payload (sampled with the request's
parameters)? ds4's `dsml_decode_tracker_update`, byte for byte, including its quirks: the whole
text is searched, reasoning included; a parameter without `string="true"` is JSON (the parser
reads it as a string); a lone trailing '<' in a payload is stepped over; after the first block
closes nothing more is tracked.
"""
from __future__ import annotations

from .dsml_bytes import B_STARTS, B_SYNTAXES, MAX_START, WSB, attr, find_earliest, full, partial

__all__ = ["DsmlTracker", "OUTSIDE", "STRUCTURAL", "STRING_BODY", "JSON_STRUCTURAL", "JSON_STRING"]

OUTSIDE, STRUCTURAL, STRING_BODY, JSON_STRUCTURAL, JSON_STRING = (
    "outside", "structural", "string_body", "json_structural", "json_string")
_SEARCH, _STRUCTURAL, _STRING_BODY, _JSON, _DONE = range(5)


class DsmlTracker:
    """Feed it the whole text so far (`update(raw)`); `state` is the class of the next token."""

    def __init__(self):
        self.state = OUTSIDE
        self._mode = _SEARCH
        self._syn = None
        self._pos = 0
        self._in_str = False
        self._esc = False

    def update(self, raw) -> str:
        n = len(raw)
        while self._step(raw, n):
            pass
        return self.state

    def _step(self, raw, n: int) -> bool:
        """Run until a parameter value opens (True: go on with it) or more text is needed."""
        if self._mode == _DONE:
            self.state = OUTSIDE
            return False
        if self._mode == _SEARCH and not self._search(raw, n):
            return False
        if self._mode == _STRING_BODY and not self._string_body(raw, n):
            return False
        if self._mode == _JSON and not self._json(raw, n):
            return False
        return self._structural(raw, n)

    def _search(self, raw, n: int) -> bool:
        p, i = find_earliest(raw, B_STARTS, self._pos, n)
        if p < 0:
            self._pos = max(n - MAX_START, 0)
            self.state = OUTSIDE
            return False
        self._syn = B_SYNTAXES[i]
        self._pos = p + len(B_STARTS[i])
        self._mode = _STRUCTURAL
        self.state = STRUCTURAL
        return True

    def _string_body(self, raw, n: int) -> bool:
        lit = self._syn.param_end
        k = raw.find(lit, self._pos, n)
        if k >= 0:
            self._pos = k + len(lit)
            self._mode = _STRUCTURAL
            return True
        for p in range(max(self._pos, n - len(lit) + 1), n):
            if partial(raw, n, p, lit, 2):
                self._pos = p
                self.state = STRUCTURAL
                return False
        self._pos = n
        self.state = STRING_BODY
        return False

    def _json(self, raw, n: int) -> bool:
        lit = self._syn.param_end
        pos, in_str, esc = self._pos, self._in_str, self._esc
        closed = cut = False
        while pos < n:
            if not in_str:
                if full(raw, n, pos, lit):
                    pos += len(lit)
                    closed = True
                    break
                if partial(raw, n, pos, lit, 2):
                    cut = True
                    break
            c = raw[pos]
            pos += 1
            if in_str:
                if esc:
                    esc = False
                elif c == 0x5C:     # backslash
                    esc = True
                elif c == 0x22:     # quote
                    in_str = False
            elif c == 0x22:
                in_str = True
        self._pos, self._in_str, self._esc = pos, in_str, esc
        if cut:
            self.state = STRUCTURAL
            return False
        if not closed:
            self.state = JSON_STRING if in_str else JSON_STRUCTURAL
            return False
        self._mode = _STRUCTURAL
        return True

    def _structural(self, raw, n: int) -> bool:
        syn = self._syn
        while True:
            pos = self._pos
            while pos < n and raw[pos] in WSB:
                pos += 1
            self._pos = pos
            self.state = STRUCTURAL
            if pos >= n:
                return False
            if full(raw, n, pos, syn.tool_calls_end):
                self._mode = _DONE
                self._pos = pos + len(syn.tool_calls_end)
                self.state = OUTSIDE
                return False
            if full(raw, n, pos, syn.invoke_end):
                self._pos = pos + len(syn.invoke_end)
                continue
            if full(raw, n, pos, syn.invoke_start) or full(raw, n, pos, syn.param_start):
                gt = raw.find(b">", pos, n)
                if gt < 0:
                    return False
                self._pos = gt + 1
                if full(raw, n, pos, syn.invoke_start):
                    continue
                if attr(raw, pos, gt + 1, "string") == "true":
                    self._mode, self.state = _STRING_BODY, STRING_BODY
                else:   # absent or anything but "true": JSON (unlike the parser)
                    self._mode, self.state = _JSON, JSON_STRUCTURAL
                    self._in_str = self._esc = False
                return True     # a value just opened: scan what already follows it
            # a partial tag, or bytes that are no tag at all: structural either way (stuck)
            return False
