"""ds4-eval (issue 40): the answer extractors on fixed strings (as ds4 tests its own), the Wilson
interval, the items file, a run on a tiny model with its trace, resume, and Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ds4agent import eval_items as ev
from ds4agent.eval_cli import default_items, main as eval_main

MC = {"id": "q", "question": "?", "choices": ["a", "b", "c", "d"], "answer": "B"}


@pytest.mark.parametrize("text,want", [
    ("Answer: B", "B"),
    ("The answer is (c).", "C"),
    ("<think>A looks right... Answer: A</think>\nAfter checking, Answer: D", "D"),   # reasoning not graded
    ("I would say B. Final answer: **C**", "C"),             # "answer" first, then the last letter
    ("Between A and B, B is correct.", "B"),                  # no "answer": the last standalone letter
    ("Answer: E", None),                                       # E is not a choice of four; no other letter
    ("Absolutely sure: Bob", None),                            # letters inside words do not count
    ("", None),
])
def test_find_letter(text, want):
    assert ev.find_letter(text, 4) == want


@pytest.mark.parametrize("text,want", [
    ("Answer: 042", 42.0),
    ("so 3 + 4 = 7, and the answer is 1,234.", 1234.0),
    ("We get -3.5 in the end", -3.5),
    ("the ratio is 7/2", 3.5),
    ("<think>maybe 12</think> The result is 13", 13.0),
    ("first 5 then 9", 9.0),                                   # no "answer": the last number
    ("answer: none, but earlier 4", 4.0),                      # nothing after "answer" in range... then last
    ("no digits here", None),
])
def test_find_number(text, want):
    assert ev.find_number(text) == want


def test_grade():
    assert ev.grade(MC, "Answer: b") == ("B", True)
    assert ev.grade(MC, "Answer: A") == ("A", False)
    assert ev.grade({"id": "n", "question": "?", "answer": 56}, "Answer: 56") == ("56", True)
    assert ev.grade({"id": "n", "question": "?", "answer": 3.14, "tolerance": 0.01}, "Answer: 3.141") == ("3.141", True)
    assert ev.grade({"id": "n", "question": "?", "answer": 2}, "nothing") == (None, False)


def test_wilson():
    lo, hi = ev.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert ev.wilson(0, 10)[0] == 0.0 and ev.wilson(0, 10)[1] > 0.2     # not zero-width at 0/n
    assert ev.wilson(10, 10)[1] == pytest.approx(1.0) and ev.wilson(10, 10)[0] < 0.8
    assert ev.wilson(0, 0) == (0.0, 1.0)


def test_items_file_checks(tmp_path):
    items = ev.load_items(default_items())
    assert len(items) >= 20 and any(i.get("choices") for i in items) and any(not i.get("choices") for i in items)
    for bad, words in [('{"id": "a", "question": "?"}', "no 'answer'"),
                       ('{"id": "a", "question": "?", "choices": ["x", "y"], "answer": "C"}', "one of AB"),
                       ('{"id": "a", "question": "?", "answer": "seven"}', "a number"),
                       ('{"id": "a", "question": "?", "answer": 1}\n{"id": "a", "question": "?", "answer": 2}', "twice"),
                       ("{not json", ":1:")]:
        f = tmp_path / "bad.jsonl"
        f.write_text(bad)
        with pytest.raises(ev.ItemError, match=words.replace("(", r"\(")):
            ev.load_items(f)


def _items(tmp_path, n):
    f = tmp_path / "items.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in
                           [dict(MC, id=f"mc{i}") if i % 2 else {"id": f"n{i}", "question": "1+1?", "answer": 2}
                            for i in range(n)]))
    return f


def test_run_trace_and_resume(small_model, tmp_path, capsys):
    items, trace = _items(tmp_path, 2), tmp_path / "trace.jsonl"
    args = ["-m", str(small_model), "--items", str(items), "-n", "5", "--reply-budget", "2", "--trace", str(trace)]
    assert eval_main(args + ["--limit", "1"]) == 0
    out = capsys.readouterr()
    assert "[1/1] n0: FAIL" in out.out and "accuracy = 0/1" in out.out and "Wilson interval" in out.out
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert lines[0]["settings"]["think"] == "high" and len(lines) == 2
    rec = lines[1]
    assert rec["gen_tokens"] <= 5 and rec["forced_close"] and "</think>" in rec["output"]
    assert rec["prompt"].startswith("1+1?") and rec["expected"] == 2
    # the same trace again without --resume, or with other settings: refused in one line
    assert eval_main(args) == 1 and "--resume" in capsys.readouterr().err
    assert eval_main(args + ["--resume", "--nothink"]) == 1 and "think" in capsys.readouterr().err
    assert eval_main(args + ["--resume"]) == 0
    out = capsys.readouterr()
    assert "1 item(s) done, 1 to go" in out.err and "[2/2] mc1" in out.out and "/2 = " in out.out
    assert len(trace.read_text().splitlines()) == 3


@pytest.mark.slow      # a subprocess that opens the model and answers an item first: ~20 s on a loaded 2-core VM
def test_ctrl_c_keeps_the_items_done(small_model, tmp_path):
    items, trace = _items(tmp_path, 40), tmp_path / "trace.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "ds4agent.eval_cli", "-m", str(small_model), "--items", str(items),
                          "-n", "3", "--nothink", "--trace", str(trace)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seen = ""
    while "[1/40]" not in seen:
        line = p.stdout.readline()
        if not line:
            break
        seen += line
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "--resume continues" in err and "interrupted" in out
    done = len(trace.read_text().splitlines()) - 1
    assert 1 <= done < 40


def test_think_max_needs_its_context(tmp_path, capsys):
    """ds4's gate: without --ctx >= 393216, --think-max falls back to --think (said on stderr)."""
    items = _items(tmp_path, 1)
    rc = eval_main(["-m", str(tmp_path / "none.gguf"), "--items", str(items), "--think-max",
                    "--trace", str(tmp_path / "t.jsonl")])
    err = capsys.readouterr().err
    assert "--think-max needs --ctx" in err and rc == 1 and err.strip().splitlines()[-1].startswith("error:")


def test_help(capsys):
    with pytest.raises(SystemExit):
        eval_main(["--help"])
    out = capsys.readouterr().out
    assert "--resume" in out and "--nothink" in out and "--trace" in out
