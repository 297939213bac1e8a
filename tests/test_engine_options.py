"""One place for engine options: every command's parser gets the same engine flags from
engine/options.py, the values reach Engine.open unchanged, and a bad one is one `error:` line and
exit 1 in every command."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from ds4agent import cli as agent_cli
from ds4agent import ds4_cli
from engine import Engine, Session, bench
from engine.options import NUMERICS, PAGING, EngineOptions, add_engine_flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("--backend", "--numerics", "--paging", "--threads", "-t")      # -t as in ds4


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# every command that opens an Engine with the user's choices (`ds4-agent --serve` parses with the
# agent's parser and hands its namespace to serve_main)
PARSERS = {
    "ds4": ds4_cli._parser,
    "ds4-agent": agent_cli._parser,
    "ds4-bench": bench.build_parser,
    "scripts/bench_layer.py": lambda: _script("bench_layer").build_parser(),
}


def _engine_flags(parser: argparse.ArgumentParser) -> dict:
    return {opt: (a.dest, a.default, a.type, a.choices, a.metavar, a.help)
            for a in parser._actions for opt in a.option_strings if opt in FLAGS}


@pytest.mark.parametrize("command", PARSERS)
def test_every_command_has_the_same_engine_flags(command):
    ref = argparse.ArgumentParser()
    add_engine_flags(ref)
    want = _engine_flags(ref)
    assert sorted(want) == sorted(FLAGS) and all(v[-1] for v in want.values())   # each has help
    assert _engine_flags(PARSERS[command]()) == want


@pytest.mark.parametrize("command", PARSERS)
def test_options_round_trip_through_every_parser(command):
    p = PARSERS[command]()
    assert EngineOptions.from_args(p.parse_args(_required(command))) == EngineOptions()
    want = EngineOptions(backend="numpy", numerics="exact", paging="lowmem", threads=3)
    argv = _required(command) + ["--backend", "numpy", "--numerics", "exact", "--paging", "lowmem", "-t", "3"]
    got = EngineOptions.from_args(p.parse_args(argv))
    assert got == want and EngineOptions(**got.as_dict()) == got


def _required(command: str) -> list[str]:
    return ["-m", "x.gguf"] if command in ("ds4", "ds4-bench") else []


@pytest.mark.parametrize("field,value,words", [
    ("numerics", "fast", "numerics must be one of ds4, exact, not 'fast'"),
    ("paging", "bogus", "paging must be one of auto, resident, prefault, lowmem, none, not 'bogus'"),
    ("threads", 0, "threads must be a whole number from 1 to 1024, not 0"),
    ("threads", 5000, "threads must be a whole number from 1 to 1024, not 5000"),
    ("threads", True, "threads must be a whole number"),
    ("backend", "", "backend must be a backend's name"),
])
def test_bad_values_are_refused_at_construction(field, value, words):
    with pytest.raises(ValueError) as e:
        EngineOptions(**{field: value})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_defaults_and_known_sets():
    assert EngineOptions() == EngineOptions("auto", "ds4", "auto", None)
    assert set(NUMERICS) == {"ds4", "exact"} and "auto" in PAGING and "resident" in PAGING


def _one_line_exit_1(rc: int, err: str, words: str):
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err


BAD = [(["--backend", "nosuch"], "nosuch"),
       (["--paging", "bogus"], "paging must be one of"),
       (["--threads", "0"], "threads must be"),
       (["-t", "5000"], "threads must be"),            # the kernels' limit, before any start-up
       (["--numerics", "fast"], "numerics must be one of")]


@pytest.mark.parametrize("args,words", BAD)
def test_ds4_bad_engine_option_is_one_line(small_model, capsys, args, words):
    rc = ds4_cli.main(["-m", str(small_model), "-p", "hi", "-n", "1", *args])
    _one_line_exit_1(rc, capsys.readouterr().err, words)


def test_ds4_backend_mlx_without_mlx_is_one_line(small_model, capsys):
    if importlib.util.find_spec("mlx") is not None:
        pytest.skip("mlx is installed here: the mlx backend's own tests cover it")
    rc = ds4_cli.main(["-m", str(small_model), "-p", "hi", "-n", "1", "--backend", "mlx"])
    _one_line_exit_1(rc, capsys.readouterr().err, "mlx")


@pytest.mark.parametrize("args,words", BAD)
def test_agent_bad_engine_option_is_one_line(agent_model, tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    rc = agent_cli.main(["-m", str(agent_model), "-p", "hi", *args])
    _one_line_exit_1(rc, capsys.readouterr().err, words)


@pytest.mark.parametrize("args,words", BAD)
def test_serve_bad_engine_option_is_one_line(agent_model, tmp_path, monkeypatch, capsys, args, words):
    """--serve opens the engine itself (it does not go through the agent's UI); an unknown
    backend there was a traceback."""
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    rc = agent_cli.main(["-m", str(agent_model), "--serve", "--port", "0", *args])
    _one_line_exit_1(rc, capsys.readouterr().err, words)


@pytest.mark.parametrize("args,words", BAD)
def test_bench_bad_engine_option_is_one_line(small_model, tmp_path, capsys, args, words):
    text = tmp_path / "t.txt"
    text.write_text("parole " * 50)
    rc = bench.main(["-m", str(small_model), "--prompt-file", str(text), "--ctx-start", "8", "--ctx-max", "8",
                     "--gen-tokens", "1", *args])
    out, err = capsys.readouterr()
    assert out == ""
    _one_line_exit_1(rc, err, words)


@pytest.mark.parametrize("args,words", BAD)
def test_bench_layer_bad_engine_option_is_one_line(tmp_path, capsys, args, words):
    """Checked before the script writes its (multi-GB) file: the path given is never created."""
    path = tmp_path / "never.gguf"
    rc = _script("bench_layer").main(["--path", str(path), *args])
    _one_line_exit_1(rc, capsys.readouterr().err, words)
    assert not path.exists()


class _Opened(Exception):
    pass


def test_agent_passes_threads_and_paging_to_the_engine(agent_model, tmp_path, monkeypatch):
    """The agent has --threads and --paging (it had neither) and hands all four to Engine.open."""
    seen = []

    def fake_open(path, options=None, **kw):
        seen.append(options if options is not None else EngineOptions(**kw))
        raise _Opened

    def fake_headless(make_agent, task, resume=False, **options):   # quiet=, and what comes later
        with pytest.raises(_Opened):
            make_agent(lambda event: None)
        return 0

    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Engine, "open", staticmethod(fake_open))
    monkeypatch.setattr("ds4agent.headless.run_headless", fake_headless)
    rc = agent_cli.main(["-m", str(agent_model), "-p", "hi", "--backend", "numpy", "--numerics", "exact",
                         "--threads", "2", "--paging", "none"])
    assert rc == 0 and seen == [EngineOptions("numpy", "exact", "none", 2)]


def test_engine_open_takes_options_as_the_keywords(small_model):
    o = EngineOptions(backend="numpy", numerics="exact", paging="none")
    toks = list(range(3, 20))
    with Engine.open(small_model, options=o) as e:
        assert (e.backend, e.numerics, e.paging) == ("numpy", "exact", "none")
        got = Session(e, 64).sync(toks, keep_logits=True)
    with Engine.open(small_model, backend="numpy", numerics="exact", paging="none") as e:
        ref = Session(e, 64).sync(toks, keep_logits=True)
    assert (got == ref).all()
    with pytest.raises(TypeError, match="options"):
        Engine.open(small_model, options=o, numerics="ds4")
    with pytest.raises(ValueError, match="threads"):
        Engine.open(small_model, threads=0)


def test_check_resolves_auto_and_names_what_cannot_serve(monkeypatch):
    from engine.backends import registry
    from engine.errors import BackendError
    monkeypatch.setenv("DS4_BACKEND", "numpy")
    assert EngineOptions().check() == "numpy"
    with pytest.raises(BackendError, match="unknown backend 'nosuch'"):
        EngineOptions(backend="nosuch").check()
    if importlib.util.find_spec("mlx") is None:
        with pytest.raises(BackendError, match="mlx is not installed"):
            EngineOptions(backend="mlx").check()
    numpy = registry.get("numpy")
    registry.register(registry.Backend(name="exactonly", summary="test", available=lambda: None,
                                       make_ops=numpy.make_ops, numerics=("exact",)))
    try:
        assert EngineOptions(backend="exactonly", numerics="exact").check() == "exactonly"
        with pytest.raises(BackendError, match="'exactonly' does not support numerics 'ds4'"):
            EngineOptions(backend="exactonly").check()
    finally:
        registry.unregister("exactonly")


def test_agent_backend_mlx_without_mlx_is_one_line(agent_model, tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("mlx") is not None:
        pytest.skip("mlx is installed here: the mlx backend's own tests cover it")
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    rc = agent_cli.main(["-m", str(agent_model), "--backend", "mlx"])    # the TUI never starts
    _one_line_exit_1(rc, capsys.readouterr().err, "mlx is not installed")


def test_serve_main_reports_an_engine_that_cannot_open(agent_model, capsys):
    """serve_main opens the engine itself: a backend refused there (the agent's check passed, or
    an embedder called it directly) is one line and exit 1, not a traceback."""
    from ds4agent.serve.cli import serve_main
    a = agent_cli._parser().parse_args(["--serve", "--port", "0"])
    rc = serve_main(a, str(agent_model), 4096, EngineOptions(backend="nosuch"))
    _one_line_exit_1(rc, capsys.readouterr().err, "unknown backend 'nosuch'")
