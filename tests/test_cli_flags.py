"""--help and --version on every command (issue 24 item 5): each flag the issue named has a
description, defaults are shown, and every console script in pyproject.toml prints the version."""
from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

from engine.cli_help import package_version

SCRIPTS = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_command_prints_the_package_version(name, capsys):
    module, func = SCRIPTS[name].split(":")
    with pytest.raises(SystemExit) as e:
        getattr(importlib.import_module(module), func)(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"{name} {package_version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", package_version())


def _helps(parser) -> dict[str, str]:
    return {o: a.help or "" for a in parser._actions for o in a.option_strings}


def _text(parser) -> str:
    return " ".join(parser.format_help().split())     # argparse wraps lines: one line of words


def test_agent_help_describes_every_flag_and_shows_defaults():
    from ds4agent.cli import _parser
    p = _parser()
    helps, text = _helps(p), _text(p)
    for flag in ("--think", "--nothink", "--think-max", "--numerics", "--backend", "--seed", "--quiet",
                 "--max-tokens", "--kv-disk-space-mb", "--kv-cache-min-tokens", "--kv-cache-cold-max-tokens",
                 "--kv-cache-continued-interval-tokens", "--kv-cache-boundary-trim-tokens",
                 "--kv-cache-boundary-align-tokens", "--kv-cache-reject-different-quant", "--port", "--version"):
        assert len(helps[flag]) >= 8, flag
    assert "--port PORT TCP port (default: 8000)" in text
    assert "loaded (default: 512)" in text                           # --kv-cache-min-tokens
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "ds4-agent download" in text


def test_ds4_help_describes_sampling_and_thinking():
    from ds4agent.ds4_cli import _parser
    p = _parser()
    helps = _helps(p)
    for flag in ("--think", "--nothink", "--think-max", "--seed", "--temp", "--top-k", "--min-p", "--version"):
        assert len(helps[flag]) >= 8, flag
    assert "tokens to generate (default: 256)" in _text(p)
