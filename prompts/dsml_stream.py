"""Streaming DSML: sampled text pieces in, display events out (protocol.md §3.6-3.8).

    st = DsmlStream("high")
    for tok in sampled:
        events = st.feed(tokenizer.token_bytes(tok))   # or the token's text
        temperature = 0 if st.in_dsml_syntax else t    # before sampling the next token
        if st.done: break                              # closing tool tag (or a stop sequence)
    events += st.finish()
    result = st.result                                 # == parse_output(st.text, ...)

Three things run on the same growing text, as in ds4's worker:

* the projection (ds4's OpenAI/Anthropic stream update): reasoning deltas up to `</think>`, text
  deltas that hold back whatever could still become a tool marker, and inside the block a
  translation of each parameter into OpenAI-style argument JSON fragments (§3.8). It is a view:
  it may fail on loose DSML and stop projecting, and it never retracts anything.
* the marker observer (§3.6): when a `tool_calls` end follows a start outside reasoning, decoding
  must stop (`done`); the block is parsed then and ToolCallEnd events carry the authoritative
  calls (`parse_output` rules, all or nothing).
* the structural/payload tracker (§3.7, `in_dsml_syntax`).

Everything works on UTF-8 bytes like ds4 (pieces may be `bytes`, split anywhere, or `str`).
`finish()` flushes held-back text, emits any parsed call the projection did not show, and a
StreamError when the block was malformed (recovered=True: the raw text becomes the content,
finish "stop") or never closed (recovered=False: finish "error").
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from .dsml_block import Parsed, ParsedCall, finalize
from .dsml_syntax import (SYNTAXES, THINK_CLOSE, THINK_OPEN, WS, Syntax, dsml_attr, thinking_enabled,
                          unescape_entities)
from .jsonspan import json_escape

__all__ = ["DsmlStream", "Event", "ReasoningDelta", "TextDelta", "ToolCallStart", "ToolArgsDelta",
           "ToolCallEnd", "StreamError"]


# --------------------------------------------------------------------------- events

@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    index: int
    text: str          # a fragment of the OpenAI `function.arguments` string


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ParsedCall   # authoritative (parse_output of the finished block)


@dataclass(frozen=True)
class StreamError:
    message: str       # "invalid tool call" | "unterminated tool call"
    recovered: bool    # True: the turn ends normally with the raw text as content


Event = Union[ReasoningDelta, TextDelta, ToolCallStart, ToolArgsDelta, ToolCallEnd, StreamError]


# --------------------------------------------------------------------------- byte helpers

_WSB = frozenset(WS.encode())
_B_SYNTAXES = tuple(Syntax(*(f.encode() for f in s)) for s in SYNTAXES)
_B_STARTS = tuple(s.tool_calls_start for s in _B_SYNTAXES)
_B_ENDS = tuple(s.tool_calls_end for s in _B_SYNTAXES)
_MAX_START = max(len(s) for s in _B_STARTS)          # dsml_max_tool_start_len (22)
_THINK_OPEN, _THINK_CLOSE = THINK_OPEN.encode(), THINK_CLOSE.encode()
_THINK_MARKER = re.compile(re.escape(_THINK_CLOSE) + b"|" + re.escape(_THINK_OPEN))
_ENTITIES = (b"&amp;", b"&lt;", b"&gt;", b"&quot;", b"&apos;")
_MARKER_HOLD = 80          # text mode: a '<' this close to the end may open a tool marker

# the projection's modes
_THINKING, _TEXT, _TOOL, _SUPPRESS = range(4)
# the projection's tool states
_BETWEEN_INVOKES, _BETWEEN_PARAMS, _PARAM_VALUE, _TOOL_DONE, _TOOL_FAIL = range(5)
# the tracker (§3.7)
OUTSIDE, STRUCTURAL, STRING_BODY, JSON_STRUCTURAL, JSON_STRING = (
    "outside", "structural", "string_body", "json_structural", "json_string")
_T_SEARCH, _T_STRUCTURAL, _T_STRING_BODY, _T_JSON, _T_DONE = range(5)


def _find_earliest(raw, needles, start: int, end: int) -> tuple[int, int]:
    best, best_i = -1, -1
    for i, nd in enumerate(needles):
        p = raw.find(nd, start, end)
        if p >= 0 and (best < 0 or p < best):
            best, best_i = p, i
    return best, best_i


def _full(raw, n: int, pos: int, lit: bytes) -> bool:
    """raw_full_lit over raw[:n]."""
    return raw.startswith(lit, pos, n)


def _partial(raw, n: int, pos: int, lit: bytes, min_len: int = 0) -> bool:
    """raw_partial_lit(_min): raw[pos:n] is a proper prefix of lit (at least min_len bytes)."""
    avail = n - pos
    return min_len <= avail < len(lit) and lit.startswith(raw[pos:n])


def _rtrim_ws(raw, start: int, limit: int) -> int:
    while limit > start and raw[limit - 1] in _WSB:
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


def _utf8_safe(raw, start: int, limit: int, final: bool) -> int:
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


def _entity_safe(raw, start: int, limit: int) -> int:
    """dsml_entity_stream_safe_len: stop before a trailing `&` that may still become an entity."""
    scan = limit - 6 if limit > start + 6 else start
    for i in range(limit, scan, -1):
        if raw[i - 1] != 0x26:   # '&'
            continue
        amp = i - 1
        tail = raw[amp:limit]
        for ent in _ENTITIES:
            if len(tail) < len(ent) and ent.startswith(tail):
                return amp
        break
    return limit


def _param_value_safe(raw, start: int, n: int, param_end: bytes, is_string: bool) -> int:
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
        limit = _entity_safe(raw, start, limit)
    return _utf8_safe(raw, start, limit, False)


def _dec(b) -> str:
    return bytes(b).decode("utf-8", errors="replace")


def _attr(raw, start: int, end: int, name: str) -> str | None:
    return dsml_attr(_dec(raw[start:end]), name)


def _escape_fragment(s: str) -> str:
    return json_escape(s)[1:-1]


# --------------------------------------------------------------------------- the stream

class DsmlStream:
    """Incremental projection of one generation. See the module docstring.

    think_mode: "none" | "high" | "max" or bool (thinking: the text starts inside reasoning).
    has_tools: the request offered tools. Without tools (as ds4) DSML is streamed as plain text,
    decoding does not stop at a block and `in_dsml_syntax` stays False; calls a block still
    parses to are emitted at finish().
    stop: stop sequences (held back while they may be forming; a hit ends the text before it).
    """

    def __init__(self, think_mode="high", *, has_tools: bool = True, stop=()):
        self.thinking = thinking_enabled(think_mode)
        self.has_tools = has_tools
        self._raw = bytearray()
        self._dec_cache: tuple[int, str] = (0, "")
        # stop sequences
        if isinstance(stop, (str, bytes)):
            stop = [stop]
        self._stops = [s.encode() if isinstance(s, str) else bytes(s) for s in stop if s]
        self._stop_hold = max((len(s) for s in self._stops), default=0) - 1
        self._stop_scan = 0
        self.stopped = False
        self.stop_hit: str | None = None      # the stop sequence that ended the text
        # projection
        self._mode = _THINKING if self.thinking else _TEXT
        self._emit = 0
        self._checked_think_prefix = False
        self._ts = _BETWEEN_INVOKES
        self._syn: Syntax | None = None
        self._tpos = 0
        self._tindex = 0
        self._args_open = False
        self._first_param = True
        self._param_is_string = False
        self._started: dict[int, str] = {}
        # marker observer (§3.6); the prompt ended with <think> (thinking) or </think>
        self._think_tail = bytearray(_THINK_OPEN if self.thinking else _THINK_CLOSE)
        self._think_inside = self.thinking
        self._waiting_think_close = self.thinking
        self._scan_from = 0
        self._tool_start_at = -1
        self.saw_tool_start = False
        self.saw_tool_end = False
        self._ended: dict[int, ParsedCall] = {}
        # tracker (§3.7)
        self._t_mode = _T_SEARCH
        self._t_state = OUTSIDE
        self._t_syn: Syntax | None = None
        self._t_pos = 0
        self._t_in_str = False
        self._t_esc = False
        self._finished = False
        self.result: Parsed | None = None

    # ------------------------------------------------------------------ public
    @property
    def text(self) -> str:
        """Everything fed so far (up to a stop sequence hit), decoded."""
        n = len(self._raw)
        if self._dec_cache[0] != n:
            self._dec_cache = (n, _dec(self._raw))
        return self._dec_cache[1]

    @property
    def done(self) -> bool:
        """Decoding should stop: the tool block closed (with tools) or a stop sequence hit."""
        return self.stopped or (self.has_tools and self.saw_tool_end)

    @property
    def dsml_state(self) -> str:
        """The §3.7 tracker state for the NEXT token: outside | structural | string_body |
        json_structural | json_string ("outside" when the request has no tools)."""
        return self._t_state if self.has_tools else OUTSIDE

    @property
    def in_dsml_syntax(self) -> bool:
        """True: the next token is DSML syntax (or JSON structure inside a string="false"
        value) and ds4 samples it greedily (temperature 0); False: payload or plain text."""
        return self.dsml_state in (STRUCTURAL, JSON_STRUCTURAL)

    def feed(self, piece: str | bytes) -> list[Event]:
        """One sampled piece (ideally one token's bytes, as ds4 updates per token)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.done or not piece:
            return []
        b = piece.encode("utf-8") if isinstance(piece, str) else bytes(piece)
        self._raw += b
        if self.has_tools:
            self._track()
        n = len(self._raw)
        # stop sequences: the earliest hit ends the text right before it
        hit = -1
        stream_len = n
        if self._stops:
            for s in self._stops:
                p = self._raw.find(s, self._stop_scan)
                if p >= 0 and (hit < 0 or p < hit):
                    hit = p
                    self.stop_hit = _dec(s)
            if hit >= 0:
                stream_len = hit
            elif self._stop_hold > 0:
                stream_len = max(n - self._stop_hold, 0)
                self._stop_scan = stream_len
        stream_len = _utf8_safe(self._raw, 0, stream_len, hit >= 0)
        out: list[Event] = []
        self._project(stream_len, False, out)
        was_end = self.saw_tool_end
        if self.has_tools:
            self._observe_piece(len(b))
        if hit >= 0:
            # ds4 checks the stop hit first: finish "stop", the text cut before the stop string
            del self._raw[hit:]
            self.stopped = True
        elif self.has_tools and self.saw_tool_end and not was_end:
            self._emit_calls(self._finalize("stop"), out)
        return out

    def finish(self, finish: str | None = None) -> list[Event]:
        """End of generation: flush, reconcile with the authoritative parse, report errors.
        `finish`: "length" when a token limit ended sampling, "error" on failure; by default
        "stop" (EOS, stop sequence) or "tool_calls" (closing tag seen)."""
        if self._finished:
            return []
        self._finished = True
        out: list[Event] = []
        self._project(len(self._raw), True, out)
        res = self._finalize(finish or "stop")
        self.result = res
        self._emit_calls(res, out)
        if res.error is not None:
            out.append(StreamError(res.error, recovered=res.finish_reason != "error"))
        return out

    # ------------------------------------------------------------------ final parse
    def _finalize(self, finish: str) -> Parsed:
        return finalize(self.text, self.thinking, finish, self.has_tools,
                        self.saw_tool_start, self.saw_tool_end)

    def _emit_calls(self, res: Parsed, out: list) -> None:
        for i, call in enumerate(res.tool_calls):
            if i in self._ended:
                continue
            if i not in self._started:
                # the projection never showed this call (loose DSML, no tools...): show it whole
                self._started[i] = call.name
                out.append(ToolCallStart(i, call.name))
                out.append(ToolArgsDelta(i, call.arguments_json))
            self._ended[i] = call
            out.append(ToolCallEnd(i, call))

    # ------------------------------------------------------------------ §3.6 marker observer
    def _observe_piece(self, size: int) -> None:
        """Observe the last `size` bytes as ds4 does per token, with its thinking_state fed
        byte by byte (an 8-byte tail): the piece is observed up to each `<think>`/`</think>`
        it completes, then the reasoning state flips. So a piece holding `</think>`, text and
        `<think>` is read as the tokens it stands for, and the outcome does not depend on how
        the text was cut."""
        raw, n = self._raw, len(self._raw)
        tail = self._think_tail
        buf = tail + raw[n - size:n]
        off = len(tail) - (n - size)          # buf index - raw index
        for m in _THINK_MARKER.finditer(buf):
            if m.end() > len(tail):           # completed by this piece
                self._observe(m.end() - off)
                self._think_inside = m.group() == _THINK_OPEN
        self._think_tail = bytearray(buf[-8:])
        self._observe(n)

    def _observe(self, n: int) -> None:
        """observe_tool_markers over raw[:n] (§3.6)."""
        raw = self._raw
        if self.thinking and self._think_inside:
            # DSML inside reasoning is never executable: skip past it
            self._waiting_think_close = True
            self._scan_from = n
            return
        if self._waiting_think_close:
            k = raw.rfind(_THINK_CLOSE, 0, n)
            self._scan_from = k + len(_THINK_CLOSE) if k >= 0 else n
            self._waiting_think_close = False
        scan = min(self._scan_from, n)
        start, _ = _find_earliest(raw, _B_STARTS, scan, n)
        if start >= 0 and not self.saw_tool_start:
            self.saw_tool_start = True
            self._tool_start_at = start
        if self.saw_tool_start:
            # Only an end AFTER the start counts (§3.6). ds4 searches from its 80-byte hold
            # point once a start was seen, so an orphan end just before the start would stop
            # decoding a token later; the spec's rule is the intended one.
            if _find_earliest(raw, _B_ENDS, max(scan, self._tool_start_at), n)[0] >= 0:
                self.saw_tool_end = True
        self._scan_from = max(self._scan_from, n - _MARKER_HOLD, 0)

    # ------------------------------------------------------------------ §3.7 tracker
    def _track(self) -> None:
        """dsml_decode_tracker_update, byte for byte (including its quirks: the whole text is
        searched, reasoning included; a lone trailing '<' in a payload is stepped over)."""
        raw, n = self._raw, len(self._raw)
        while True:
            if self._t_mode == _T_DONE:
                self._t_state = OUTSIDE
                return
            if self._t_mode == _T_SEARCH:
                p, i = _find_earliest(raw, _B_STARTS, self._t_pos, n)
                if p < 0:
                    self._t_pos = max(n - _MAX_START, 0)
                    self._t_state = OUTSIDE
                    return
                self._t_syn = _B_SYNTAXES[i]
                self._t_pos = p + len(_B_STARTS[i])
                self._t_mode = _T_STRUCTURAL
                self._t_state = STRUCTURAL
            syn = self._t_syn
            if self._t_mode == _T_STRING_BODY:
                lit = syn.param_end
                k = raw.find(lit, self._t_pos, n)
                if k >= 0:
                    self._t_pos = k + len(lit)
                    self._t_mode = _T_STRUCTURAL
                else:
                    for p in range(max(self._t_pos, n - len(lit) + 1), n):
                        if _partial(raw, n, p, lit, 2):
                            self._t_pos = p
                            self._t_state = STRUCTURAL
                            return
                    self._t_pos = n
                    self._t_state = STRING_BODY
                    return
            elif self._t_mode == _T_JSON:
                lit = syn.param_end
                pos, in_str, esc = self._t_pos, self._t_in_str, self._t_esc
                closed = partial = False
                while pos < n:
                    if not in_str:
                        if _full(raw, n, pos, lit):
                            pos += len(lit)
                            closed = True
                            break
                        if _partial(raw, n, pos, lit, 2):
                            partial = True
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
                self._t_pos, self._t_in_str, self._t_esc = pos, in_str, esc
                if partial:
                    self._t_state = STRUCTURAL
                    return
                if not closed:
                    self._t_state = JSON_STRING if in_str else JSON_STRUCTURAL
                    return
                self._t_mode = _T_STRUCTURAL
            # structural
            while True:
                pos = self._t_pos
                while pos < n and raw[pos] in _WSB:
                    pos += 1
                self._t_pos = pos
                self._t_state = STRUCTURAL
                if pos >= n:
                    return
                if _full(raw, n, pos, syn.tool_calls_end):
                    self._t_mode = _T_DONE
                    self._t_pos = pos + len(syn.tool_calls_end)
                    self._t_state = OUTSIDE
                    return
                if _full(raw, n, pos, syn.invoke_end):
                    self._t_pos = pos + len(syn.invoke_end)
                    continue
                if _full(raw, n, pos, syn.invoke_start):
                    gt = raw.find(b">", pos, n)
                    if gt < 0:
                        return
                    self._t_pos = gt + 1
                    continue
                if _full(raw, n, pos, syn.param_start):
                    gt = raw.find(b">", pos, n)
                    if gt < 0:
                        return
                    self._t_pos = gt + 1
                    if _attr(raw, pos, gt + 1, "string") == "true":
                        self._t_mode = _T_STRING_BODY
                        self._t_state = STRING_BODY
                    else:   # absent or anything but "true": JSON (unlike the parser)
                        self._t_mode = _T_JSON
                        self._t_in_str = self._t_esc = False
                        self._t_state = JSON_STRUCTURAL
                    break
                # a partial tag, or bytes that are no tag at all: structural either way (stuck)
                return
            # a parameter value just opened: scan what already follows it

    # ------------------------------------------------------------------ §3.8 projection
    def _project(self, n: int, final: bool, out: list) -> None:
        raw = self._raw
        if self._mode == _THINKING:
            if not self._checked_think_prefix:
                if n < len(_THINK_OPEN) and _THINK_OPEN.startswith(raw[:n]) and not final:
                    return
                if raw.startswith(_THINK_OPEN, 0, n) and n >= len(_THINK_OPEN):
                    self._emit = len(_THINK_OPEN)
                self._checked_think_prefix = True
            close = raw.find(_THINK_CLOSE, self._emit, n)
            if close >= 0:
                limit = close
            elif final:
                limit = n
            else:
                hold = len(_THINK_CLOSE) - 1
                limit = n - hold if n > hold else self._emit
                limit = _utf8_safe(raw, self._emit, limit, False)
            if limit > self._emit:
                out.append(ReasoningDelta(_dec(raw[self._emit:limit])))
                self._emit = limit
            if close >= 0:
                self._emit = close + len(_THINK_CLOSE)
                self._mode = _TEXT
            elif final:
                self._mode = _SUPPRESS   # ended inside reasoning: no text at all
                return
            else:
                return
        if self._mode == _TEXT:
            tool, ti = (_find_earliest(raw, _B_STARTS, self._emit, n) if self.has_tools
                        else (-1, -1))
            limit = self._text_safe_limit(n, tool, final)
            if limit > self._emit:
                out.append(TextDelta(_dec(raw[self._emit:limit])))
                self._emit = limit
            if tool >= 0:
                self._emit = tool
                self._syn = _B_SYNTAXES[ti]
                self._tpos = tool + len(self._syn.tool_calls_start)
                self._ts = _BETWEEN_INVOKES
                self._mode = _TOOL
            elif final:
                self._mode = _SUPPRESS
        if self._mode == _TOOL:
            self._project_tool(n, out)
            if self._ts in (_TOOL_DONE, _TOOL_FAIL):
                self._mode = _SUPPRESS

    def _text_safe_limit(self, n: int, tool: int, final: bool) -> int:
        """text_stream_safe_limit."""
        raw, start = self._raw, self._emit
        if n <= start:
            return n
        limit = n
        if self.has_tools:
            if tool >= 0:
                return _rtrim_ws(raw, start, tool)   # the separator before a block is syntax
            if not final:
                limit = _rtrim_ws(raw, start, limit)
                scan = n - _MARKER_HOLD if n - start > _MARKER_HOLD else start
                k = raw.rfind(b"<", scan, n)
                if k >= 0 and k < limit:
                    limit = k
                limit = _rtrim_ws(raw, start, limit)
        return _utf8_safe(raw, start, limit, final)

    def _args(self, text: str, out: list) -> None:
        if text:
            out.append(ToolArgsDelta(self._tindex, text))

    def _string_value(self, a: int, b: int, out: list) -> None:
        if b > a:
            self._args(_escape_fragment(unescape_entities(_dec(self._raw[a:b]))), out)

    def _project_tool(self, n: int, out: list) -> None:
        """openai_tool_stream_update / anthropic_tool_stream_update (identical machines)."""
        raw, syn = self._raw, self._syn
        while self._tpos < n and self._ts not in (_TOOL_DONE, _TOOL_FAIL):
            if self._ts == _BETWEEN_INVOKES:
                pos = self._tpos
                while pos < n and raw[pos] in _WSB:
                    pos += 1
                self._tpos = pos
                if pos >= n:
                    return
                if _full(raw, n, pos, syn.tool_calls_end):
                    self._tpos = pos + len(syn.tool_calls_end)
                    self._ts = _TOOL_DONE
                    return
                if _partial(raw, n, pos, syn.tool_calls_end) or _partial(raw, n, pos, syn.invoke_start):
                    return
                if _full(raw, n, pos, syn.invoke_start):
                    gt = raw.find(b">", pos, n)
                    if gt < 0:
                        return
                    name = _attr(raw, pos, gt + 1, "name")
                    if name is None:
                        self._ts = _TOOL_FAIL
                        return
                    self._started[self._tindex] = name
                    out.append(ToolCallStart(self._tindex, name))
                    self._args("{", out)
                    self._args_open = True
                    self._first_param = True
                    self._tpos = gt + 1
                    self._ts = _BETWEEN_PARAMS
                    continue
                self._ts = _TOOL_FAIL
                return
            if self._ts == _BETWEEN_PARAMS:
                pos = self._tpos
                while pos < n and raw[pos] in _WSB:
                    pos += 1
                self._tpos = pos
                if pos >= n:
                    return
                if _full(raw, n, pos, syn.invoke_end):
                    if self._args_open:
                        self._args("}", out)
                    self._args_open = False
                    self._tpos = pos + len(syn.invoke_end)
                    self._tindex += 1
                    self._ts = _BETWEEN_INVOKES
                    continue
                if _partial(raw, n, pos, syn.invoke_end) or _partial(raw, n, pos, syn.param_start):
                    return
                if _full(raw, n, pos, syn.param_start):
                    gt = raw.find(b">", pos, n)
                    if gt < 0:
                        return
                    name = _attr(raw, pos, gt + 1, "name")
                    is_string = _attr(raw, pos, gt + 1, "string")
                    if name is None or is_string is None:
                        self._ts = _TOOL_FAIL     # the projection needs both; the parser does not
                        return
                    string_value = is_string == "true"
                    frag = ("" if self._first_param else ",") + json_escape(name) + ":"
                    self._first_param = False
                    self._args(frag + ('"' if string_value else ""), out)
                    self._param_is_string = string_value
                    self._tpos = gt + 1
                    self._ts = _PARAM_VALUE
                    continue
                self._ts = _TOOL_FAIL
                return
            if self._ts == _PARAM_VALUE:
                end = raw.find(syn.param_end, self._tpos, n)
                if end >= 0:
                    if self._param_is_string:
                        self._string_value(self._tpos, end, out)
                        self._args('"', out)
                    elif end > self._tpos:
                        self._args(_dec(raw[self._tpos:end]), out)   # JSON forwarded raw
                    self._tpos = end + len(syn.param_end)
                    self._ts = _BETWEEN_PARAMS
                    continue
                limit = _param_value_safe(raw, self._tpos, n, syn.param_end, self._param_is_string)
                if limit > self._tpos:
                    if self._param_is_string:
                        self._string_value(self._tpos, limit, out)
                    else:
                        self._args(_dec(raw[self._tpos:limit]), out)
                    self._tpos = limit
                return
