"""What every console command shares (issue 35 items 7, 8, 9, 11, 12): a reader that goes away
ends it quietly, a bad flag value is one line and exit 1, every flag has help text, an empty
prompt is refused, and the same mistake gets the same words everywhere."""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli_help import DefaultsHelpFormatter
from engine.console import PIPE_EXIT

BIN = Path(sys.executable).parent


def _parsers():
    from ds4agent import cli, download, ds4_cli, sessions_cli
    from engine import bench
    from engine.gguf import gguf_cli
    from sessions import kv_cli
    return {"ds4-agent": cli._parser(), "ds4-agent sessions": sessions_cli._parser(),
            "ds4-agent download": download._parser(), "ds4": ds4_cli._parser(),
            "ds4-gguf": gguf_cli._parser(), "ds4-kv": kv_cli._parser(), "ds4-bench": bench.build_parser()}


def _walk(name, parser):
    yield name, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, p in a.choices.items():
                yield from _walk(f"{name} {sub}", p)


def test_every_flag_and_argument_of_every_command_has_help_and_shows_its_default():
    missing, no_default = [], []
    for top, parser in _parsers().items():
        for name, p in _walk(top, parser):
            shows = issubclass(p.formatter_class, DefaultsHelpFormatter)
            for a in p._actions:
                if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                    continue
                label = f"{name} {'/'.join(a.option_strings) or a.dest}"
                if not (a.help or "").strip():
                    missing.append(label)
                elif (a.option_strings and a.nargs != 0 and a.default not in (None, False, argparse.SUPPRESS)
                      and not shows and "default" not in a.help):
                    no_default.append(label)
    assert not missing, f"no help text: {missing}"
    assert not no_default, f"a default that --help does not show: {no_default}"


def test_synth_vocab_help_names_the_size_synth_writes():
    from engine.gguf import gguf_cli
    from engine.gguf.synth import TINY_VOCAB_BASE, config_for
    vocab = next(a for a in next(p for n, p in _walk("g", gguf_cli._parser()) if n == "g synth")._actions
                 if a.dest == "vocab")
    cfg, _ = config_for("tiny")
    assert f"{cfg.n_vocab} ids" in vocab.help and str(TINY_VOCAB_BASE) in vocab.help


BAD_VALUES = [
    ("ds4agent.cli", ["--ctx", "abc"], "--ctx"),
    ("ds4agent.cli", ["--serve", "--port", "abc"], "--port"),
    ("ds4agent.cli", ["sessions", "list", "--bogus"], "--bogus"),
    ("ds4agent.cli", ["download"], "RECIPE"),
    ("ds4agent.ds4_cli", ["-m", "x.gguf", "--ctx", "abc"], "--ctx"),
    ("ds4agent.ds4_cli", ["-p", "hi"], "--model"),
    ("engine.gguf.gguf_cli", ["synth", "out.gguf", "--embd", "abc"], "--embd"),
    ("engine.gguf.gguf_cli", ["frobnicate"], "frobnicate"),
    ("sessions.kv_cli", [], "FILE"),
    ("engine.bench", ["-m", "x.gguf", "--ctx-start", "abc"], "--ctx-start"),
]


@pytest.mark.parametrize("module,argv,word", BAD_VALUES, ids=[" ".join(a) or m for m, a, _ in BAD_VALUES])
def test_a_bad_flag_value_is_one_line_and_exit_1(module, argv, word, capsys):
    main = __import__(module, fromlist=["main"]).main
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 1 and out == "", (rc, out)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and word in err, err
    assert "usage:" not in err


# -- empty input ------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["", "  \n\t"])
def test_agent_refuses_an_empty_task_before_anything_loads(task, capsys, monkeypatch, tmp_path):
    from ds4agent import cli
    monkeypatch.setattr(cli, "_check_model", lambda *a, **k: pytest.fail("the model was opened"))
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path))
    assert cli.main(["-m", "nonexistent.gguf", "-p", task]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "empty" in err


class _Stdin(io.StringIO):
    def __init__(self, text, tty=False):
        super().__init__(text)
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("argv,stdin,words", [
    (["-p", ""], None, "the prompt (-p) is empty"),
    (["-p", " \n "], None, "is empty"),
    ([], _Stdin("", tty=True), "no prompt: give -p TEXT"),
    ([], _Stdin("  \n"), "the prompt (stdin) is empty"),
])
def test_ds4_requires_a_prompt(small_model, argv, stdin, words, capsys):
    from ds4agent.ds4_cli import main
    assert main(["-m", str(small_model), "-n", "2", *argv], stdin=stdin) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and words in err, err


def test_ds4_reads_the_prompt_from_a_pipe_and_reports_honest_speeds(small_model, capsys):
    from ds4agent.ds4_cli import main, speed
    assert main(["-m", str(small_model), "-n", "1", "--temp", "0"], stdin=_Stdin("Once upon a time")) == 0
    err = capsys.readouterr().err
    # one token is sampled from the prefill's logits: no decode step to time, so no rate
    assert "generation: 1 token in" in err and "too short to measure a rate" in err, err
    assert speed(1, 1, 0.0003) == "1 token in 0.00 s (too short to measure a rate)"
    assert speed(0, 0, 0.0) == "0 tokens in 0.00 s"
    assert speed(3, 2, 0.5) == "3 tokens in 0.50 s (4.00 t/s)"


# -- same words everywhere --------------------------------------------------------------------
def test_bench_says_a_directory_is_a_directory(tmp_path, capsys):
    from engine.bench import main
    assert main(["-m", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path}: is a directory, not a GGUF file\n"


# -- readers that go away ---------------------------------------------------------------------
def _closed_early(argv, cwd, env) -> tuple[int, str]:
    """Run with stdout a real pipe whose reading end is closed before the command writes."""
    r, w = os.pipe()
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=w, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(w)
    os.close(r)
    _, err = p.communicate(timeout=120)
    return p.returncode, err.decode(errors="replace")


def test_every_command_ends_quietly_when_its_reader_goes_away(tiny_q2, tmp_path):
    env = dict(os.environ, DS4_AGENT_HOME=str(tmp_path / "home"), DS4_BACKEND="numpy")
    kv = tmp_path / "x.kv"
    kv.write_bytes(b"not a kv file")
    for argv in ([BIN / "ds4-agent", "sessions", "list", "--all"],
                 [BIN / "ds4-gguf", "inspect", tiny_q2, "--tensors"],
                 [BIN / "ds4-kv", kv],
                 [BIN / "ds4", "-m", tiny_q2, "-p", "hi", "-n", "2"]):
        rc, err = _closed_early([str(a) for a in argv], tmp_path, env)
        # ds4-kv's bad file still says so on stderr (its own line), but nothing about the pipe
        assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipe" not in err, (argv, err)
        assert rc == PIPE_EXIT, (argv, rc, err)


@pytest.mark.slow
def test_bench_ends_quietly_when_its_reader_goes_away(small_model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a model. " * 20)
    rc, err = _closed_early([str(BIN / "ds4-bench"), "-m", str(small_model), "--prompt-file", str(text),
                             "--ctx-start", "32", "--ctx-max", "32", "--gen-tokens", "2", "--backend", "numpy"],
                            tmp_path, dict(os.environ))
    assert "Traceback" not in err and "Broken pipe" not in err and rc == PIPE_EXIT, (rc, err)
