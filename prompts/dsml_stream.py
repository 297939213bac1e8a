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
from .dsml_bytes import (B_ENDS, B_STARTS, B_SYNTAXES, WSB, attr, dec, escape_fragment, find_earliest,
                         full, param_value_safe, partial, rtrim_ws, utf8_safe)
from .dsml_syntax import THINK_CLOSE, THINK_OPEN, Syntax, thinking_enabled, unescape_entities
from .dsml_track import (JSON_STRING, JSON_STRUCTURAL, OUTSIDE, STRING_BODY, STRUCTURAL,  # noqa: F401
                          DsmlTracker)            # (the states are re-exported: `dsml_state` returns them)
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


# --------------------------------------------------------------------------- constants

_THINK_OPEN, _THINK_CLOSE = THINK_OPEN.encode(), THINK_CLOSE.encode()
_THINK_MARKER = re.compile(re.escape(_THINK_CLOSE) + b"|" + re.escape(_THINK_OPEN))
_MARKER_HOLD = 80          # text mode: a '<' this close to the end may open a tool marker

# the projection's modes
_THINKING, _TEXT, _TOOL, _SUPPRESS = range(4)
# the projection's tool states
_BETWEEN_INVOKES, _BETWEEN_PARAMS, _PARAM_VALUE, _TOOL_DONE, _TOOL_FAIL = range(5)


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
        self._tracker = DsmlTracker()
        self._finished = False
        self.result: Parsed | None = None

    # ------------------------------------------------------------------ public
    @property
    def text(self) -> str:
        """Everything fed so far (up to a stop sequence hit), decoded."""
        n = len(self._raw)
        if self._dec_cache[0] != n:
            self._dec_cache = (n, dec(self._raw))
        return self._dec_cache[1]

    @property
    def done(self) -> bool:
        """Decoding should stop: the tool block closed (with tools) or a stop sequence hit."""
        return self.stopped or (self.has_tools and self.saw_tool_end)

    @property
    def dsml_state(self) -> str:
        """The §3.7 tracker state for the NEXT token: outside | structural | string_body |
        json_structural | json_string ("outside" when the request has no tools)."""
        return self._tracker.state if self.has_tools else OUTSIDE

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
            self._tracker.update(self._raw)
        n = len(self._raw)
        # stop sequences: the earliest hit ends the text right before it
        hit = -1
        stream_len = n
        if self._stops:
            for s in self._stops:
                p = self._raw.find(s, self._stop_scan)
                if p >= 0 and (hit < 0 or p < hit):
                    hit = p
                    self.stop_hit = dec(s)
            if hit >= 0:
                stream_len = hit
            elif self._stop_hold > 0:
                stream_len = max(n - self._stop_hold, 0)
                self._stop_scan = stream_len
        stream_len = utf8_safe(self._raw, 0, stream_len, hit >= 0)
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
        start, _ = find_earliest(raw, B_STARTS, scan, n)
        if start >= 0 and not self.saw_tool_start:
            self.saw_tool_start = True
            self._tool_start_at = start
        if self.saw_tool_start:
            # Only an end AFTER the start counts (§3.6). ds4 searches from its 80-byte hold
            # point once a start was seen, so an orphan end just before the start would stop
            # decoding a token later; the spec's rule is the intended one.
            if find_earliest(raw, B_ENDS, max(scan, self._tool_start_at), n)[0] >= 0:
                self.saw_tool_end = True
        self._scan_from = max(self._scan_from, n - _MARKER_HOLD, 0)

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
                limit = utf8_safe(raw, self._emit, limit, False)
            if limit > self._emit:
                out.append(ReasoningDelta(dec(raw[self._emit:limit])))
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
            tool, ti = (find_earliest(raw, B_STARTS, self._emit, n) if self.has_tools
                        else (-1, -1))
            limit = self._text_safe_limit(n, tool, final)
            if limit > self._emit:
                out.append(TextDelta(dec(raw[self._emit:limit])))
                self._emit = limit
            if tool >= 0:
                self._emit = tool
                self._syn = B_SYNTAXES[ti]
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
                return rtrim_ws(raw, start, tool)   # the separator before a block is syntax
            if not final:
                limit = rtrim_ws(raw, start, limit)
                scan = n - _MARKER_HOLD if n - start > _MARKER_HOLD else start
                k = raw.rfind(b"<", scan, n)
                if k >= 0 and k < limit:
                    limit = k
                limit = rtrim_ws(raw, start, limit)
        return utf8_safe(raw, start, limit, final)

    def _args(self, text: str, out: list) -> None:
        if text:
            out.append(ToolArgsDelta(self._tindex, text))

    def _string_value(self, a: int, b: int, out: list) -> None:
        if b > a:
            self._args(escape_fragment(unescape_entities(dec(self._raw[a:b]))), out)

    def _project_tool(self, n: int, out: list) -> None:
        """openai_tool_stream_update / anthropic_tool_stream_update (identical machines)."""
        step = {_BETWEEN_INVOKES: self._between_invokes, _BETWEEN_PARAMS: self._between_params,
                _PARAM_VALUE: self._param_value}
        while self._tpos < n and self._ts not in (_TOOL_DONE, _TOOL_FAIL):
            if not step[self._ts](n, out):
                return

    def _skip_ws(self, n: int) -> int:
        pos = self._tpos
        while pos < n and self._raw[pos] in WSB:
            pos += 1
        self._tpos = pos
        return pos

    def _between_invokes(self, n: int, out: list) -> bool:
        """Between invokes. True: the machine moved on; False: it waits (or is done/failed)."""
        raw, syn = self._raw, self._syn
        pos = self._skip_ws(n)
        if pos >= n:
            return False
        if full(raw, n, pos, syn.tool_calls_end):
            self._tpos = pos + len(syn.tool_calls_end)
            self._ts = _TOOL_DONE
            return False
        if partial(raw, n, pos, syn.tool_calls_end) or partial(raw, n, pos, syn.invoke_start):
            return False
        if not full(raw, n, pos, syn.invoke_start):
            self._ts = _TOOL_FAIL
            return False
        gt = raw.find(b">", pos, n)
        if gt < 0:
            return False
        name = attr(raw, pos, gt + 1, "name")
        if name is None:
            self._ts = _TOOL_FAIL
            return False
        self._started[self._tindex] = name
        out.append(ToolCallStart(self._tindex, name))
        self._args("{", out)
        self._args_open = True
        self._first_param = True
        self._tpos = gt + 1
        self._ts = _BETWEEN_PARAMS
        return True

    def _between_params(self, n: int, out: list) -> bool:
        raw, syn = self._raw, self._syn
        pos = self._skip_ws(n)
        if pos >= n:
            return False
        if full(raw, n, pos, syn.invoke_end):
            if self._args_open:
                self._args("}", out)
            self._args_open = False
            self._tpos = pos + len(syn.invoke_end)
            self._tindex += 1
            self._ts = _BETWEEN_INVOKES
            return True
        if partial(raw, n, pos, syn.invoke_end) or partial(raw, n, pos, syn.param_start):
            return False
        if not full(raw, n, pos, syn.param_start):
            self._ts = _TOOL_FAIL
            return False
        gt = raw.find(b">", pos, n)
        if gt < 0:
            return False
        name = attr(raw, pos, gt + 1, "name")
        is_string = attr(raw, pos, gt + 1, "string")
        if name is None or is_string is None:
            self._ts = _TOOL_FAIL     # the projection needs both; the parser does not
            return False
        string_value = is_string == "true"
        frag = ("" if self._first_param else ",") + json_escape(name) + ":"
        self._first_param = False
        self._args(frag + ('"' if string_value else ""), out)
        self._param_is_string = string_value
        self._tpos = gt + 1
        self._ts = _PARAM_VALUE
        return True

    def _param_value(self, n: int, out: list) -> bool:
        raw, syn = self._raw, self._syn
        end = raw.find(syn.param_end, self._tpos, n)
        if end >= 0:
            if self._param_is_string:
                self._string_value(self._tpos, end, out)
                self._args('"', out)
            elif end > self._tpos:
                self._args(dec(raw[self._tpos:end]), out)   # JSON forwarded raw
            self._tpos = end + len(syn.param_end)
            self._ts = _BETWEEN_PARAMS
            return True
        limit = param_value_safe(raw, self._tpos, n, syn.param_end, self._param_is_string)
        if limit > self._tpos:
            if self._param_is_string:
                self._string_value(self._tpos, limit, out)
            else:
                self._args(dec(raw[self._tpos:limit]), out)
            self._tpos = limit
        return False
