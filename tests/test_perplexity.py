"""`ds4 --perplexity` and `--kl-base` (issue 40): the windows it scores, its PPL against a direct
computation from Session.logits, KL between backends and numerics, and Ctrl-C keeping the result."""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from engine import Session
from engine import quality as q
from engine.runtime.sampling import logprob_of
from ds4agent.ds4_cli import main as ds4_main

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away into the woods again."


def run(capsys, *args):
    rc = ds4_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_windows():
    assert q.plan_windows(10, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    # second half: only full enough chunks score, each token with >= ctx/2 tokens before it
    assert q.plan_windows(10, 4, second_half=True) == [(0, 4, 2), (4, 8, 6)]
    # stride: each window scores only what no earlier one scored
    assert q.plan_windows(10, 4, stride=2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    scored = [j for s, e, f in q.plan_windows(50, 8, stride=3) for j in range(f, e)]
    assert scored == list(range(1, 50))
    for bad in [dict(n=1, ctx=4), dict(n=10, ctx=1), dict(n=10, ctx=4, stride=4),
                dict(n=10, ctx=4, stride=1, second_half=True), dict(n=3, ctx=8, second_half=True)]:
        with pytest.raises(ValueError):
            q.plan_windows(**bad)


def test_ppl_and_its_error():
    nll = np.array([1.0, 2.0, 3.0])
    p, err = q.ppl(nll)
    assert p == pytest.approx(math.exp(2.0))
    assert err == pytest.approx(math.exp(2.0) * 1.0 / math.sqrt(3))


def _direct_ppl(engine, tokens, ctx) -> float:
    """Token by token: the logprob each Session.logits gives the next token, chunk by chunk."""
    nll = []
    for s in range(0, len(tokens) - 1, ctx):
        chunk = tokens[s:s + ctx]
        sess = Session(engine, ctx + 1)
        sess.sync(chunk[:1])
        for j in range(1, len(chunk)):
            nll.append(-logprob_of(sess.logits, chunk[j]))
            if j + 1 < len(chunk):
                sess.eval(chunk[j])
    return math.exp(sum(nll) / len(nll)), len(nll)


def test_perplexity_equals_a_direct_computation(small_model, small_engine, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    tokens = small_engine.tokenizer.encode(TEXT)
    assert len(tokens) > 12
    want, n = _direct_ppl(small_engine, tokens, 12)
    rc, out, err = run(capsys, "-m", small_model, "--perplexity", f, "--ctx", 12, "--chunk", 5)
    assert rc == 0, err
    got = float(re.search(r"PPL = ([\d.]+) \+/- ([\d.]+)", out).group(1))
    assert got == pytest.approx(want, rel=1e-4)
    assert f"scored={n}" in out and "window 2/" in err


def _kl(out: str) -> tuple[float, float]:
    m = re.search(r"mean KL = (\S+)", out)
    t = re.search(r"top-1 agreement = ([\d.]+) %", out)
    return float(m.group(1)), float(t.group(1))


def test_kl_base_between_backends_and_numerics(small_model, tmp_path, capsys):
    """numpy and cpu agree (exact numerics: the C kernels follow the reference's float32 math);
    ds4's rounding steps move the distribution a little, never not at all."""
    f, base = tmp_path / "t.txt", tmp_path / "base.npz"
    f.write_text(TEXT)
    common = ["-m", small_model, "--perplexity", f, "--ctx", 16, "--kl-base", base]
    rc, out, err = run(capsys, *common, "--backend", "numpy", "--numerics", "exact")
    assert rc == 0 and "saved" in out and base.exists(), err
    rc, out, err = run(capsys, *common, "--backend", "cpu", "--numerics", "exact")
    assert rc == 0, err
    kl, top1 = _kl(out)
    assert kl < 1e-6 and top1 == 100.0, out
    rc, out, err = run(capsys, *common, "--backend", "numpy", "--numerics", "ds4")
    assert rc == 0, err
    kl, _ = _kl(out)
    assert 1e-5 < kl < 0.05, out
    assert out.count("worst: pos") == 5
    # another --ctx cannot be compared with this base: one line, no traceback
    rc, out, err = run(capsys, "-m", small_model, "--perplexity", f, "--ctx", 12, "--kl-base", base)
    assert rc == 1 and err.startswith("error:") and "--ctx" in err and len(err.splitlines()) == 1


def test_bad_input_is_one_line(small_model, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    for args in (["-p", "hi"], ["--kl-base", junk], ["--ppl-stride", 16], ["--ppl-stride", 4, "--ppl-second-half"]):
        rc, out, err = run(capsys, "-m", small_model, "--perplexity", f, "--ctx", 16, *args)
        assert rc == 1 and err.startswith("error:") and len(err.splitlines()) == 1, (args, err)
    rc, out, err = run(capsys, "-m", small_model, "--perplexity", tmp_path / "none.txt")
    assert rc == 1 and "cannot read" in err


def test_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        ds4_main(["--help"])
    out = capsys.readouterr().out
    assert "--perplexity" in out and "--kl-base" in out and "--ppl-stride" in out


def test_ctrl_c_keeps_what_was_scored(small_model, tmp_path):
    """SIGINT mid-run: the PPL of the tokens scored so far, the partial base saved, no traceback."""
    f, base = tmp_path / "long.txt", tmp_path / "base.npz"
    f.write_text(TEXT * 12)          # ~640 tokens: 80 windows of 8, each with its progress line
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "ds4agent.ds4_cli", "-m", str(small_model), "--perplexity", str(f),
                          "--ctx", "8", "--kl-base", str(base)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    deadline = time.time() + 60
    seen = ""
    while time.time() < deadline:
        line = p.stderr.readline()
        seen += line
        if "window 2/" in line or not line:
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    err = seen + err
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert "PPL = " in out and "interrupted" in out
    meta, arrays = q.load_base(base)
    assert 14 <= len(arrays["pos"]) < meta["tokens"] - 1
