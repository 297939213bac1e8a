"""`ds4-agent doctor` (issue 40): its vector comparison against vectors made from the model itself
(one corrupted, which must fail), its run on a synthetic model, --help and Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine import Session
from ds4agent.cli import main as agent_main
from ds4agent.doctor import main as doctor_main
from ds4agent.ds4_cli import render_user_turn

PROMPTS = {"fact": "Who was Ada Lovelace?", "code": "def add(a, b):", "bad_token": "Say hi.",
           "bad_logprob": "Count to three."}


def _vector(engine, prompt: str, steps: int) -> dict:
    """One case in the official vectors' format, from the model's own greedy continuation."""
    tok = engine.tokenizer
    ids = tok.encode(render_user_turn(prompt, "none"))
    sess = Session(engine, 64)
    sess.sync(ids)
    out = []
    for i in range(steps):
        top = sess.top_logprobs(20)
        tj = lambda t: {"text": tok.token_bytes(t).decode("utf-8", "replace"), "bytes": list(tok.token_bytes(t))}  # noqa: E731
        out.append({"step": i, "token": tj(top[0][0]), "logprob": top[0][1],
                    "top_logprobs": [{"token": tj(t), "logprob": lp} for t, lp in top[:5]]
                    + [{"token": tj(t), "logprob": -9999.0} for t, _ in top[5:]]})
        sess.eval(top[0][0])
    return {"schema": "ds4-official-logprobs-v1", "prompt": prompt, "usage": {"prompt_tokens": len(ids)},
            "steps": out}


@pytest.fixture(scope="module")
def vectors(small_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("vectors")
    (root / "prompts").mkdir()
    (root / "official").mkdir()
    manifest = []
    for cid, prompt in PROMPTS.items():
        v = _vector(small_engine, prompt, 3)
        if cid == "bad_token":       # the API "chose" another token at step 1
            v["steps"][1]["token"]["bytes"] = list(b"\xff\xfe")
        if cid == "bad_logprob":     # an official logprob 5 nats from the local one
            v["steps"][0]["top_logprobs"][1]["logprob"] -= 5.0
        (root / "prompts" / f"{cid}.txt").write_text(prompt)
        (root / "official" / f"{cid}.official.json").write_text(json.dumps(v))
        manifest.append({"id": cid, "prompt_file": f"prompts/{cid}.txt",
                         "official_file": f"official/{cid}.official.json", "steps": 3})
    (root / "manifest.json").write_text(json.dumps({"prompts": manifest}))
    return root


def _rows(out: str) -> dict:
    return {line[6:36].strip(): (line[:5].strip(), line[37:]) for line in out.splitlines() if line[:4] in
            ("PASS", "FAIL", "SKIP", "INFO")}


def test_vectors_from_the_model_pass_and_corrupted_ones_fail(small_model, vectors, capsys):
    rc = doctor_main(["--model", str(small_model), "--vectors", str(vectors), "--bench-tokens", "8"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["vector fact"][0] == "PASS" and rows["vector code"][0] == "PASS", out
    assert rows["vector bad_token"][0] == "FAIL" and "step 1" in rows["vector bad_token"][1]
    assert rows["vector bad_logprob"][0] == "FAIL" and "logprob" in rows["vector bad_logprob"][1]
    assert rc == 1 and "2 failed" in out


def test_synthetic_model_skips_the_official_vectors_and_runs_the_rest(small_model, capsys):
    t0 = time.time()
    rc = agent_main(["doctor", "--model", str(small_model), "--bench-tokens", "16"])
    out = capsys.readouterr().out
    assert time.time() - t0 < 60
    rows = _rows(out)
    assert rows["official vectors"][0] == "SKIP" and "real weights" in rows["official vectors"][1]
    assert rows["open"][0] == "PASS" and rows["memory"][0] in ("PASS", "INFO")
    assert "prefill" in rows["speed"][1] and "backend" in rows["speed"][1]
    assert rc == 0 and out.splitlines()[-1].startswith("doctor: ")


def test_help_and_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        doctor_main(["--help"])
    assert "--vectors" in capsys.readouterr().out
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    assert doctor_main(["--model", str(bad)]) == 1
    assert "FAIL  open" in capsys.readouterr().out


def test_ctrl_c_prints_the_rows_so_far(small_model):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "ds4agent.cli", "doctor", "--model", str(small_model),
                          "--bench-tokens", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    seen = ""
    while True:
        line = p.stdout.readline()
        seen += line
        if "official vectors" in line or not line:
            break
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in (seen + out)


def test_prompts_only_checks_the_rendered_token_count(small_engine, vectors, tmp_path):
    """A synthetic model with the real vocabulary still checks rendering + tokenizer against the
    API's prompt_tokens: a count that differs fails."""
    import shutil

    from ds4agent.doctor import Table
    from ds4agent.vectors import run_vectors
    folder = tmp_path / "v"
    shutil.copytree(vectors, folder)
    f = folder / "official" / "code.official.json"
    v = json.loads(f.read_text())
    v["usage"]["prompt_tokens"] += 1
    f.write_text(json.dumps(v))
    import io
    out = io.StringIO()
    run_vectors(small_engine, folder, 64, Table(out), prompts_only=True)
    rows = _rows(out.getvalue())
    assert rows["vector fact"][0] == "SKIP" and "renders to the API's" in rows["vector fact"][1]
    assert rows["vector bad_token"][0] == "SKIP"          # its prompt is right; only generation would fail
    assert rows["vector code"][0] == "FAIL" and "tokens here" in rows["vector code"][1]


def test_hash_of_a_file_that_is_not_published(small_model, capsys):
    """--hash reads the whole file; a name the Hub does not publish gets the digest and no verdict."""
    import hashlib
    rc = doctor_main(["--model", str(small_model), "--hash", "--bench-tokens", "0"])
    rows = _rows(capsys.readouterr().out)
    want = hashlib.sha256(small_model.read_bytes()).hexdigest()
    assert rows["sha256"] == ("INFO", f"{want} (not a published file name: nothing to compare with)")
    assert rows["speed"][0] == "SKIP" and rc == 0
