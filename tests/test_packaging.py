"""Files the packages read at run time are installed with them: every tracked file inside a
package folder that is not Python (nor the C sources, which the extension build ships) is named
by pyproject's package-data. A wheel once left out prompts/system/agent.txt and the agent could
not start from it."""
from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ds4agent", "engine", "prompts", "sessions", "tools", "metal_kernels", "cuda_kernels")


def test_run_time_data_files_are_package_data():
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", *PACKAGES], capture_output=True,
                               text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    data = [f for f in files if not f.endswith(".py") and "/csrc/" not in f]
    assert data, "no data files found: the check would prove nothing"
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for f in data:
        pkg, rel = f.split("/", 1)
        assert any(fnmatch.fnmatch(rel, g) for g in globs.get(pkg, [])), f"{f} is not package data"
