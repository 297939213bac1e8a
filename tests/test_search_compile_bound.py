"""search's compile is bounded (issue 32 item 1): `regex.compile` lays out every fixed repeat
count, so `((((a{100}){100}){100}){100})` took 14 GB before the search's time limit started.

The hostile compile runs in a child under an address-space cap, so that on code without the bound
the test fails (MemoryError or a wrong answer) instead of taking the machine's memory.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import regex

import tools
from tools import ToolContext, call, rxlimit

REPO = Path(tools.__file__).resolve().parents[1]
NESTED = "((((a{100}){100}){100}){100})"


@pytest.fixture
def proj(tmp_path) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "a.txt").write_text("date 2024-01-31 here\n" + "a" * 120 + "\n")
    return root


def test_nested_repeat_of_the_issue_is_refused_in_bounded_memory(proj):
    code = f"""
        import resource, time
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from tools import ToolContext, call
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.monotonic()
        for p in ({NESTED!r}, "a{{100000000}}", "(?x) a{{1 0 0 0 0 0 0}}", "(?:a+){{1000000}}"):
            res = call("search", {{"pattern": p}}, ToolContext(root={str(proj)!r}))
            print(res.ok, res.text.replace("\\n", " "))
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(round(time.monotonic() - t, 2), grew // 1024)
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    *answers, last = r.stdout.strip().split("\n")
    assert len(answers) == 4
    for a in answers:   # one clear line each: refused, not an internal error
        assert a.startswith("False ") and "too large to compile" in a, a
    took, grew_mb = last.split()
    assert float(took) < 5 and int(grew_mb) < 100


def test_ordinary_patterns_still_compile_and_match(proj):
    ctx = ToolContext(root=proj)
    for p in (r"\d{4}-\d{2}-\d{2}", r"(?x) \d{4} - \d{2}", "a{100}", "(?:a{0,1000}){1000}",
              "a{2,}", "x{3", r"[{]{2}|date"):
        res = call("search", {"pattern": p}, ctx)
        assert res.ok, (p, res.text)
    assert "1:date 2024-01-31 here" in call("search", {"pattern": r"\d{4}-\d{2}"}, ctx).text
    assert "2:" in call("search", {"pattern": "a{100}"}, ctx).text
    # a syntax error is still reported as one
    bad = call("search", {"pattern": "(a{3}"}, ctx)
    assert not bad.ok and "invalid regular expression" in bad.text


def test_expanded_size_follows_minimum_counts():
    def size(p):
        return rxlimit.expanded_size(rxlimit._parse(p, regex.VERSION0), limit=10**12)
    assert size("a{1000}") > 1000 and size("(?:a{1000}){1000}") > 10**6
    assert size("(?:a{0,1000}){0,1000}") < 10 and size("a*b?c+") < 10
    assert size("(?:a{1000,}){3}") > 3000          # an open upper end costs its minimum
    assert size("(?:ab|cd{50}){10}") > 500          # branches add up
    with pytest.raises(regex.error):
        rxlimit.check("(a{2}", regex.VERSION0)


def test_fallback_compiles_in_a_capped_child(monkeypatch):
    # without the package's parser the pattern is compiled in a child under a memory cap
    monkeypatch.setattr(rxlimit, "_core", None)
    monkeypatch.setattr(rxlimit, "CHILD_MEMORY", 256 << 20)
    rxlimit.check(r"\d{4}", regex.VERSION0)
    with pytest.raises(rxlimit.TooLarge):
        rxlimit.check("a{10000000}", regex.VERSION0)
