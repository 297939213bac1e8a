"""The request parser's fast paths (issue 32 item 5): containers skipped by the C decoder and
runs of scalars read at once decide exactly as the slow cursor, ds4's rules, does; and a 10 MB
body of ignored numbers costs well under a second, not 20-40 s of CPU."""
from __future__ import annotations

import random
import time

import pytest

from prompts import jsonspan, render_request
from prompts.jsonspan import Cursor, JSONBad

ATOMS = ["1", "-2", "+3", ".5", "1.", "1.5", "1e5", "1e", "1e+", "0x1p3", "01", "inf", "NaN",
         "-Infinity", "nan(x)", "true", "false", "null", "nullx", "tru", '"a"', '"\\u00e9"',
         '"\\ud800"', '"\\x"', '"a\nb"', "[]", "{}", '{"a":1,"a":[2]}', "[1 2]", "[1,]", "[,1]",
         '{"a" 1}', '{1:2}', "1.5.5", "1-2", "1e5.", "x"]
SEPS = [",", " , ", "", " ", ",,", "\v,\f", "\t"]


def _value(rng: random.Random, depth: int) -> str:
    if depth > 3 or rng.random() < 0.4:
        return rng.choice(ATOMS)
    items = [_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if rng.random() < 0.5:
        return "[" + "".join(x + rng.choice(SEPS) for x in items[:-1]) + (items[-1] if items else "") + "]"
    keys = ['"k"', '"j"', "k", '"\\n"']
    return "{" + ",".join(rng.choice(keys) + rng.choice([":", " : ", ""]) + x for x in items) + "}"


def _outcome(fn, text: str):
    cur = Cursor(text)
    try:
        out = fn(cur)
    except JSONBad:
        return "bad"
    return cur.i, out


@pytest.fixture
def slow(monkeypatch):
    def slow_mode():
        monkeypatch.setattr(Cursor, "_fast_skip", lambda self, depth: False)
        monkeypatch.setattr(Cursor, "skip_scalars", lambda self: None)
    return slow_mode


def test_fast_paths_decide_as_the_slow_cursor(slow):
    rng = random.Random(32)
    texts = [_value(rng, 0) for _ in range(3000)]
    texts += ["[" * n + "]" * n for n in (255, 256, 257)] + ['{"a":' * 256 + "1" + "}" * 256]
    texts += ['{"a":' + "[" * 255 + "]" * 255 + ',"a":1}', '{"a":' + "[" * 256 + "]" * 256 + ',"a":1}']
    loops = {"skip": lambda c: c.skip(), "content": lambda c: c.content(),
             "tools": lambda c: jsonspan_tools(c)}
    fast = {k: [_outcome(f, t) for t in texts] for k, f in loops.items()}
    slow()
    for k, f in loops.items():
        assert fast[k] == [_outcome(f, t) for t in texts], k


def jsonspan_tools(cur):
    from prompts.conversation import parse_tools
    return parse_tools(cur)


def test_nesting_past_the_limit_is_still_refused():
    for text in ("[" * 257 + "]" * 257, '{"a":' * 257 + "1" + "}" * 257,
                 '{"x":' + "[" * 300 + "]" * 300 + ',"x":1}'):     # deep, then a duplicate key
        with pytest.raises(JSONBad, match="nesting"):
            Cursor(text).skip()
    Cursor("[" * 256 + "]" * 256).skip()


def test_ignored_values_cost_no_python_step_each(monkeypatch):
    """Deterministic: the slow cursor reads each ignored number in Python (its `number`); the
    fast paths read runs and containers in C."""
    calls = {"n": 0}
    number = Cursor.number

    def counted(self):
        calls["n"] += 1
        return number(self)
    monkeypatch.setattr(Cursor, "number", counted)
    n = 100_000
    head = b'{"messages":[{"role":"user","content":"hi"}],'
    for body in (head + b'"junk":[' + b"1," * n + b"1]}",
                 head + b'"junk":[' + b"[1.5, -2e3, null]," * n + b"1]}",
                 head + b'"tools":[' + b"1," * n + b"1]}",
                 b'{"messages":[{"role":"user","content":[' + b"1," * n + b'"hi"]}]}'):
        calls["n"] = 0
        r = render_request("openai_chat", body, 65536)
        assert "hi" in r.text and calls["n"] < 10, calls


@pytest.mark.slow
def test_ten_mb_of_ignored_numbers_is_parsed_fast():
    n = 10_000_000
    head = b'{"messages":[{"role":"user","content":"hi"}],'
    for body in (head + b'"junk":[' + b"1," * (n // 2) + b"1]}",
                 head + b'"junk":[' + b"1.5," * (n // 4) + b"1]}",
                 b'{"messages":[{"role":"user","content":[' + b"1," * (n // 2) + b'"hi"]}]}'):
        t = time.process_time()
        r = render_request("openai_chat", body, 65536)
        assert "hi" in r.text
        assert time.process_time() - t < 4      # was 8-38 s (a loaded 2-core machine: slack)
