"""The one generation loop (ds4agent/generation.py) the agent and the shim share, against a fake
session that plays a script of tokens and logs every call: greedy inside DSML syntax, forced
tokens, stop strings, EOS, the cap, a full context, cancellation, and the order of the callbacks."""
from __future__ import annotations

import pytest

import prompts
from ds4agent.generation import GREEDY, generate
from engine import ContextFull, SamplingParams
from prompts import DsmlStream

EOS = 0
SAMPLING = SamplingParams(temperature=0.8, seed=3)


class Vocab:
    """Token ids for text pieces, made up as the test names them (0 is EOS)."""

    def __init__(self):
        self.pieces = ["<EOS>"]

    def ids(self, *pieces: str) -> list[int]:
        out = []
        for p in pieces:
            if p not in self.pieces:
                self.pieces.append(p)
            out.append(self.pieces.index(p))
        return out

    def token_bytes(self, t: int) -> bytes:
        return self.pieces[t].encode()


class FakeRng:
    draws = 0


class FakeSession:
    """Plays `script` from sample(); logs (what, detail) for every call; eval raises ContextFull
    past `ctx` tokens."""

    def __init__(self, script, log, stream=None, ctx=None):
        self.script, self.log, self.stream, self.ctx = list(script), log, stream, ctx
        self.evaluated: list[int] = []
        self.sampled: list[tuple[float, bool]] = []   # (temperature used, stream in DSML syntax)

    def sample(self, params, rng):
        rng.draws += 1
        syn = self.stream.in_dsml_syntax if self.stream is not None else False
        self.sampled.append((params.temperature, syn))
        self.log.append(("sample", params.temperature))
        return self.script.pop(0)

    def eval(self, t):
        if self.ctx is not None and len(self.evaluated) >= self.ctx:
            raise ContextFull("the context is full")
        self.evaluated.append(t)
        self.log.append(("eval", t))


def run(script, *, stream=None, limit=100, ctx=None, **kw):
    v, log = kw.pop("vocab"), []
    stream = stream or DsmlStream("none", has_tools=False)
    s = FakeSession(script, log, stream, ctx)
    rng = FakeRng()
    res = generate(s, stream, sampling=SAMPLING, rng=rng, limit=limit, eos_id=EOS,
                   token_bytes=v.token_bytes, **kw)
    return res, s, stream, rng, log


def test_dsml_syntax_is_sampled_greedily_and_payload_with_the_callers_sampling():
    v = Vocab()
    block = prompts.render_tool_calls([prompts.ToolCall(None, "get_weather", '{"city":"Paris"}')])
    pieces = ["Sure", "."] + [block[i:i + 3] for i in range(0, len(block), 3)]
    script = v.ids(*pieces, "after", "more")
    res, s, stream, rng, _ = run(script, stream=DsmlStream("none", has_tools=True), vocab=v)
    assert all(t == (0.0 if syn else 0.8) for t, syn in s.sampled), s.sampled
    assert any(syn for _, syn in s.sampled) and s.sampled[0] == (0.8, False)
    # the payload "Paris" is sampled with the caller's parameters
    i = next(k for k, p in enumerate(pieces) if "Par" in p or "ari" in p)
    assert s.sampled[i][0] == 0.8
    # decoding stops at the closing tag: the tokens after it are never drawn
    assert (res.finish, res.n_tokens, rng.draws) == ("stop", len(pieces), len(pieces))
    assert stream.result.finish_reason == "tool_calls"
    assert [c.name for c in stream.result.tool_calls] == ["get_weather"]


def test_forced_tokens_are_evaluated_without_drawing_and_end_as_eos():
    v = Vocab()
    forced = v.ids("Hel", "lo")
    res, s, stream, rng, _ = run(v.ids("never"), forced=forced, vocab=v)
    assert (res.finish, res.n_tokens, rng.draws, s.evaluated) == ("stop", 2, 0, forced)
    assert stream.text == "Hello" and stream.result.finish_reason == "stop"
    assert forced == v.ids("Hel", "lo")          # the caller's list is left as it was
    # an EOS inside a forced text ends it there
    res, s, stream, _, _ = run([], forced=v.ids("a") + [EOS] + v.ids("b"), vocab=v)
    assert (res.finish, s.evaluated, stream.text) == ("stop", v.ids("a"), "a")


def test_a_stop_string_ends_decoding():
    v = Vocab()
    stream = DsmlStream("none", has_tools=False, stop=["lo"])
    res, s, stream, rng, _ = run(v.ids("hel", "lo w", "orld"), stream=stream, vocab=v)
    assert (res.finish, res.n_tokens, rng.draws) == ("stop", 2, 2)
    assert (stream.stop_hit, stream.result.content) == ("lo", "hel")


def test_eos_is_not_evaluated():
    v = Vocab()
    res, s, stream, _, _ = run(v.ids("a") + [EOS] + v.ids("b"), vocab=v)
    assert (res.finish, res.n_tokens, s.evaluated) == ("stop", 1, v.ids("a"))
    assert stream.result.finish_reason == "stop"


@pytest.mark.parametrize("limit", [0, -3, 2])
def test_the_cap_ends_with_length(limit):
    v = Vocab()
    res, s, stream, rng, _ = run(v.ids("a", "b", "c"), limit=limit, vocab=v)
    n = max(0, limit)
    assert (res.finish, res.n_tokens, rng.draws, len(s.evaluated)) == ("length", n, n, n)
    assert stream.result.finish_reason == "length"     # the stream is told why it ended


def test_a_cap_inside_a_tool_block_reads_as_cut():
    v = Vocab()
    script = v.ids("<｜DSML｜tool_calls>\n", "<｜DSML｜invoke name=\"x\">", "more", "more")
    res, _, stream, _, _ = run(script, stream=DsmlStream("none", has_tools=True), limit=2, vocab=v)
    assert res.finish == "length"
    assert (stream.result.finish_reason, stream.result.error) == ("error", "unterminated tool call")


def test_a_full_context_ends_with_length():
    v = Vocab()
    res, s, stream, rng, _ = run(v.ids("a", "b", "c", "d"), ctx=2, vocab=v)
    assert (res.finish, res.n_tokens, s.evaluated) == ("length", 2, v.ids("a", "b"))
    assert stream.result.finish_reason == "length" and stream.text == "ab"


def test_should_stop_is_asked_before_each_token():
    v = Vocab()
    seen = []

    def stop():
        return len(seen) == 2

    res, s, stream, rng, _ = run(v.ids("a", "b", "c"), should_stop=stop,
                                 on_events=lambda evs: seen.append(evs), vocab=v)
    assert (res.finish, res.cancelled, res.n_tokens, rng.draws) == ("cancelled", True, 2, 2)
    assert stream.result.finish_reason == "length"    # cut, not finished


def test_callbacks_come_in_order():
    """Per token: should_stop, before_token, sample, eval, the fed token's events; then the
    stream's finish events once."""
    v = Vocab()
    log = []
    script = v.ids("Hi", " there") + [EOS]
    stream = DsmlStream("none", has_tools=False)
    s = FakeSession(script, log, stream)

    def on_events(evs):
        log.append(("events", "".join(e.text for e in evs if isinstance(e, prompts.TextDelta))))

    res = generate(s, stream, sampling=SAMPLING, rng=FakeRng(), limit=10, eos_id=EOS,
                   token_bytes=v.token_bytes, should_stop=lambda: log.append(("stop?",)) or False,
                   before_token=lambda: log.append(("before",)), on_events=on_events)
    a, b = v.ids("Hi", " there")
    assert log == [("stop?",), ("before",), ("sample", 0.8), ("eval", a), ("events", "Hi"),
                   ("stop?",), ("before",), ("sample", 0.8), ("eval", b), ("events", " there"),
                   ("stop?",), ("before",), ("sample", 0.8), ("events", "")]
    assert (res.finish, res.n_tokens) == ("stop", 2) and res.elapsed >= 0


def test_greedy_sampling_stays_greedy():
    """The agent's compaction passes GREEDY: no token is sampled with temperature."""
    v = Vocab()
    log = []
    stream = DsmlStream("none", has_tools=False)
    s = FakeSession(v.ids("x", "y"), log, stream)
    generate(s, stream, sampling=GREEDY, rng=FakeRng(), limit=2, eos_id=EOS, token_bytes=v.token_bytes)
    assert [t for t, _ in s.sampled] == [0.0, 0.0]
