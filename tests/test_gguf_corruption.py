"""Hundreds of corrupted variants of a tiny model through all three loaders: never a traceback, never a hang.

scripts/gguf_corrupt.py builds each variant (truncations and flips in every section, out-of-range
values of every metadata key the engine reads, tensor directory and tokenizer corruptions). Each goes
through `ds4-gguf inspect`, `ds4` (a one-token generation) and `ds4-agent -p` (which opens the model
the way the agent does, then stops: its system prompt does not fit the context given), in-process,
each run under a time limit. A run may succeed (a flipped bit in a weight is still a model) or fail
with exit status 1 and one `error:` line; anything else is a failure of the loaders.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from ds4agent.cli import main as agent_main
from ds4agent.ds4_cli import main as ds4_main
from engine import ModelFileError
from engine.gguf.gguf_cli import main as gguf_main
from engine.runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 20      # per run; a healthy one takes well under a second


def _load_generator():
    spec = importlib.util.spec_from_file_location("gguf_corrupt", ROOT / "scripts" / "gguf_corrupt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gguf_corrupt"] = mod      # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


gguf_corrupt = _load_generator()


class _Hang(Exception):
    pass


def _on_alarm(*_):
    raise _Hang()


def run_cli(entry, argv, limit=LIMIT_S):
    """(exit status or 'hang'/'traceback', stderr) of one CLI main() run in this process."""
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                rc = entry(argv)
            except SystemExit as e:
                rc = e.code
            except _Hang:
                rc = "hang"
            except BaseException:
                rc = "traceback"
                err.write(traceback.format_exc())
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return rc, err.getvalue()


def clean(name: str, rc, err: str) -> bool:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if "Traceback" in err:
        return False
    if rc == 0:
        return True
    if rc != 1:
        return False
    if len(lines) != 1:
        return False
    # the agent checks the file before it starts (`error:`); what only loading the weights finds
    # (a hash table's values), or its system prompt not fitting --ctx 64, its engine thread reports
    return lines[0].startswith("error: ") or (name == "ds4-agent" and lines[0].startswith("[error] could not start: "))


@pytest.fixture(scope="module")
def all_variants(small_model):
    return gguf_corrupt.variants(small_model, seed=0)


def test_generator_is_deterministic_and_covers_every_section(small_model, all_variants):
    labels = [label for label, _ in all_variants]
    assert len(labels) >= 159 and len(set(labels)) == len(labels)
    for words in ("(header)", "(metadata)", "(tensor infos)", "(data)", "truncated at byte", "sinkhorn_iterations",
                  "rope.freq_base = 0", "merges: every pair flipped", "re-typed", "bos_token_id"):
        assert any(words in lab for lab in labels), words
    again = dict(gguf_corrupt.variants(small_model, seed=0))
    src = small_model.read_bytes()
    for label, build in all_variants[::17]:
        data = build()
        assert data != src, label
        assert hashlib.sha256(data).digest() == hashlib.sha256(again[label]()).digest(), label
    other = dict(gguf_corrupt.variants(small_model, seed=1))
    assert any(lab not in other for lab in labels if "flipped" in lab)


def test_every_variant_loads_or_fails_with_one_line(small_model, all_variants, tmp_path, monkeypatch):
    loaded = _run_all(all_variants, tmp_path, monkeypatch)
    assert 0 < loaded < len(all_variants) // 4   # flips in weights load; most corruptions do not


@pytest.mark.slow
def test_more_seeds_of_flips_and_truncations(small_model, tmp_path, monkeypatch):
    """The byte-level variants (other flip positions) for four more seeds."""
    more = [(f"seed {seed}: {label}", build) for seed in range(1, 5)
            for label, build in gguf_corrupt.variants(small_model, seed=seed) if "flipped" in label]
    _run_all(more, tmp_path, monkeypatch)


def _run_all(variants, tmp_path, monkeypatch) -> int:
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    path = tmp_path / "variant.gguf"
    p = str(path)
    cli = [("ds4-gguf inspect", gguf_main, ["inspect", p]),
           ("ds4", ds4_main, ["-m", p, "-p", "hi", "-n", "1", "--nothink", "--ctx", "64", "--seed", "1"]),
           ("ds4-agent", agent_main, ["-m", p, "-p", "hi", "--ctx", "64"])]
    bad, loaded, seconds = [], 0, {name: 0.0 for name, _, _ in cli}
    for label, build in variants:
        path.write_bytes(build())
        for name, entry, argv in cli:
            t0 = time.perf_counter()
            rc, err = run_cli(entry, argv)
            seconds[name] += time.perf_counter() - t0
            loaded += name == "ds4" and rc == 0
            if not clean(name, rc, err):
                bad.append(f"{label} | {name}: {rc} {err.strip()[-300:]}")
    print(f"\n{len(variants)} variants, {loaded} load and generate; seconds per CLI: "
          + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    assert not bad, "\n".join(bad)
    assert list(project.iterdir()) == []          # nothing written where the user ran it
    return loaded


@pytest.mark.parametrize("label", ["deepseek4.hyper_connection.sinkhorn_iterations = 2^31-1",
                                   "merges: pair without a space"])
def test_subprocess_ds4_exits_1_without_traceback(label, all_variants, tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(dict(all_variants)[label]())
    p = subprocess.run([sys.executable, "-m", "ds4agent.ds4_cli", "-m", str(path), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ")


def test_tokenizer_build_failure_is_a_value_error_not_the_librarys_exception():
    toks = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "a", "b", "ab"]
    assert Tokenizer(toks, ["a b"]).encode("ab") == [4]
    for merges, words in ((["b a"], "BPE tables do not load"), (["ab"], "not two tokens"),
                          (["a zz"], "BPE tables do not load")):
        with pytest.raises(ValueError, match=words):
            Tokenizer(toks, merges)
    with pytest.raises(ModelFileError, match=r"^m\.gguf: tokenizer metadata: .*BPE tables"):
        Tokenizer.from_metadata({"tokens": toks, "merges": ["b a"], "path": "m.gguf"})
