"""GitPython under tools.gitsafe's protection (tools/gitpy.py).

On its own GitPython runs git with the repository's configuration in force and with the process's
environment; the first tests show both, so the wrapper has something to prevent. Then: every call
made through the wrapper gets gitsafe's environment and command line, a call GitPython cannot make
exactly (a GIT_* variable it cannot unset) goes through gitsafe's subprocess instead, and its time
limit stops git's whole process group. The hostile configurations of tests/test_tools_git_safety.py
run through the git tool and the start-up summary, which use this wrapper."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

git = pytest.importorskip("git", reason="GitPython is a dependency (pyproject); not installed here")

from ds4agent.environment import git_summary
from test_tools_git_safety import make_repo
from tools import gitpy, gitsafe


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A repository whose config names a program for status (fsmonitor) and for diffs (textconv)."""
    r = make_repo(tmp_path)
    r.config("core.fsmonitor", r.mark("fsmonitor"))
    r.config("diff.x.textconv", r.mark("textconv"))
    for k in [k for k in os.environ if k.startswith("GIT_")]:
        monkeypatch.delenv(k)
    for k, v in r.env.items():
        if k.startswith("GIT_"):
            monkeypatch.setenv(k, v)
    r.clear()
    return r


def test_plain_gitpython_runs_the_repositorys_programs(hostile):
    """Why the wrapper exists: GitPython's Repo and Git run what the repository's config names."""
    repo = git.Repo(hostile.root)
    repo.git.status()
    repo.git.diff("HEAD~1")
    assert {"fsmonitor", "textconv"} <= hostile.found()


def test_gitpython_cannot_unset_a_variable(hostile, monkeypatch):
    """Why a stray GIT_* variable sends the call around GitPython: execute() starts from os.environ
    and its env= only adds, and an empty value is not "unset" to git."""
    monkeypatch.setenv("GIT_DIR", str(hostile.tmp / "elsewhere"))
    out = git.cmd.Git(str(hostile.root)).execute(["printenv", "GIT_DIR"], env={"PATH": os.environ["PATH"]})
    assert out == str(hostile.tmp / "elsewhere")
    r = subprocess.run(["git", "status"], cwd=hostile.root, env={**hostile.env, "GIT_DIR": ""},
                       capture_output=True, text=True)
    assert r.returncode != 0 and "not a git repository" in r.stderr


def test_reads_through_the_wrapper_run_nothing(hostile):
    before = gitpy.calls[0]
    g = gitpy.safe_git(hostile.root)
    for args in (["status", "--short"], ["diff-files", "-p"], ["diff", "HEAD~1"], ["log", "-p", "-2"],
                 ["show", "HEAD"]):
        code, out, err = g.text(*args)
        assert code == 0, (args, err)
    assert "+changed" in g.text("diff", "HEAD~1")[1]       # the diff itself, not textconv's output
    assert git_summary(hostile.root).startswith("branch main, ")
    assert gitpy.calls[0] - before >= 6, "the calls did not go through GitPython"
    assert hostile.found() == set()


def test_every_execute_gets_gitsafes_environment_and_command(hostile):
    """Whoever calls the instance's execute (GitPython's own helpers too) gets the overrides."""
    g = gitpy.safe_git(hostile.root)
    out = g.git.execute(["git", "config", "core.fsmonitor"])
    assert out == "false"                                   # gitsafe's override, not the marker
    assert g.git.status("--short") is not None              # GitPython's generated call
    assert hostile.found() == set()
    for bad in ("git status", ["sh", "-c", "true"], ["printenv"]):
        with pytest.raises(gitsafe.GitError):
            g.git.execute(bad)
    with pytest.raises(gitsafe.GitError):
        g.git.execute(["git", "status"], shell=True)


def test_a_stray_variable_goes_through_the_exact_environment(hostile, monkeypatch):
    g = gitpy.safe_git(hostile.root)
    monkeypatch.setenv("GIT_EXTERNAL_DIFF", hostile.mark("envdiff"))
    monkeypatch.setenv("GIT_DIR", str(hostile.tmp / "elsewhere"))
    before = gitpy.calls[0]
    code, out, _ = g.text("diff", "HEAD~1")
    assert code == 0 and "+changed" in out
    assert gitpy.calls[0] == before                         # not through GitPython
    with pytest.raises(gitsafe.GitError, match="GIT_DIR, GIT_EXTERNAL_DIFF"):
        g.git.execute(["git", "status"])
    assert hostile.found() == set()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads a process's state in /proc")
def test_the_time_limit_stops_gits_whole_group(hostile, tmp_path):
    g = gitpy.safe_git(hostile.root)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    pidfile = tmp_path / "child.pid"
    (fake / "git").write_text(f"#!/bin/sh\nsleep 30 &\necho $! > '{pidfile}'\nwait\n")
    (fake / "git").chmod(0o755)
    g.env["PATH"] = f"{fake}{os.pathsep}{g.env['PATH']}"
    g.safe.timeout = 1
    t0 = time.monotonic()
    with pytest.raises(gitsafe.GitTimeout, match="longer than 1 s"):
        g.run("status")
    assert time.monotonic() - t0 < 10
    child = Path(f"/proc/{int(pidfile.read_text())}/stat")
    deadline = time.monotonic() + 5
    while child.exists() and child.read_text().split(") ")[1][:1] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.exists() or child.read_text().split(") ")[1][:1] == "Z", "git's child outlived it"


def test_importing_gitpython_in_a_hostile_repository_runs_nothing(hostile):
    """GitPython's import runs `git version`: in the repository's folder, with its environment."""
    r = subprocess.run([sys.executable, "-c", "import git"], cwd=hostile.root, env=hostile.env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert hostile.found() == set()


def test_only_the_wrapper_imports_gitpython():
    """The rest of the project reaches GitPython through tools/gitpy.py (git.Repo is never used)."""
    root = Path(__file__).resolve().parent.parent
    users = []
    for pkg in ("engine", "ds4agent", "sessions", "prompts", "tools"):
        for f in (root / pkg).rglob("*.py"):
            text = f.read_text(encoding="utf-8")
            if any(line.strip().startswith(("import git", "from git ", "from git.")) for line in text.splitlines()):
                users.append(f.relative_to(root).as_posix())
    assert users == ["tools/gitpy.py"]


def test_checkpoints_read_through_the_wrapper_and_run_nothing(hostile, tmp_path):
    """The checkpoints' reads (rev-parse, ls-files, for-each-ref, diff-tree) go through GitPython,
    their private index and identity in its environment; the writes stay on gitsafe's subprocess."""
    from tools.checkpoints import CheckpointRepo
    before = gitpy.calls[0]
    cp = CheckpointRepo(hostile.root, tmp_path / "shadow")
    tree = cp.snapshot("b1")
    cp.commit("b1", "1", tree, {"n": 1})
    (hostile.root / "a.txt").write_text("later\n")
    now = cp.snapshot("b1")
    assert list(cp.refs("b1")) == ["1"]
    assert ("M", "a.txt") in [(s[:1], p) for s, p in cp.changes(tree, now)]
    assert "+later" in cp.diff_text(tree, now)
    assert gitpy.calls[0] - before >= 5
    assert hostile.found() == set()
