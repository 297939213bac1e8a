"""`ds4`: generation streams, dumps, thinking modes and clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ds4agent.ds4_cli import main, render_user_turn


def run(capsys, *args):
    rc = main(list(map(str, args)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generates_n_tokens_and_reports_speed(small_model, capsys):
    rc, out, err = run(capsys, "-m", small_model, "-p", "hello", "-n", 16, "--seed", 1, "--dump-tokens")
    assert rc == 0
    gen = [l for l in out.splitlines() if l.startswith("gen[")]
    assert len(gen) == 16 or gen[-1].split()[1] == "1"          # 16 tokens unless EOS came first
    assert "prefill:" in err and "generation:" in err and "t/s" in err
    prompt = [l for l in out.splitlines() if l.startswith("prompt[")]
    assert prompt[1].endswith('"<｜User｜>"') and prompt[-1].endswith('"<think>"')


def test_greedy_is_reproducible_and_nothink_closes_thinking(small_model, capsys):
    a = run(capsys, "-m", small_model, "-p", "Once upon", "-n", 8, "--temp", 0, "--nothink", "--dump-tokens")
    b = run(capsys, "-m", small_model, "-p", "Once upon", "-n", 8, "--temp", 0, "--nothink", "--dump-tokens")
    assert a[0] == 0 and a[1] == b[1]
    assert [l for l in a[1].splitlines() if l.startswith("prompt[")][-1].endswith('"</think>"')


def test_dump_logprobs_and_logits_agree(small_model, tmp_path, capsys):
    lp, lg = tmp_path / "lp.json", tmp_path / "lg.npy"
    rc, out, err = run(capsys, "-m", small_model, "-p", "x", "-n", 5, "--seed", 3,
                       "--dump-logprobs", lp, "--logprobs-top-k", 4, "--dump-logits", lg)
    assert rc == 0, err
    d = json.loads(lp.read_text())
    logits = np.load(lg)
    assert logits.shape == (len(d["steps"]), 512) and d["top_k"] == 4
    for i, st in enumerate(d["steps"]):
        top = st["top_logprobs"]
        assert len(top) == 4 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        x = logits[i].astype(np.float64)
        ls = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert top[0]["id"] == int(np.argmax(x)) and top[0]["logprob"] == pytest.approx(ls.max(), abs=1e-6)
        assert st["logprob"] == pytest.approx(ls[st["token"]["id"]], abs=1e-6)
        assert bytes(st["token"]["bytes"]).decode("utf-8", "replace") == st["token"]["text"]


def test_think_max_needs_a_large_context():
    assert "Reasoning Effort" in render_user_turn("q", "max")
    assert render_user_turn("q", "none").endswith("<｜Assistant｜></think>")


@pytest.mark.parametrize("args,words", [
    (["-m", "/nonexistent.gguf", "-p", "hi"], "no such file"),
    (["--prompt-file", "/nonexistent.txt"], "cannot read the prompt"),
    (["-p", "hi", "--ctx", "20", "-n", "50"], "does not fit --ctx 20"),
    (["-p", "hi", "--backend", "cuda"], "unknown backend 'cuda'"),
])
def test_errors_are_one_line_exit_1(small_model, capsys, args, words):
    if "-m" not in args:
        args = ["-m", str(small_model)] + args
    rc, out, err = run(capsys, *args)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and words in err, err


def test_console_script_streams(small_model):
    p = subprocess.run([sys.executable, "-m", "ds4agent.ds4_cli", "-m", str(small_model), "-p", "hello", "-n", "4",
                        "--temp", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() and "generation:" in p.stderr
