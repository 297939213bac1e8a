"""Nothing outside the project, the sessions folder, --kv-disk-dir and the download folder is ever
created, written or deleted (issue 32, acceptance): a symlink to an outside canary folder (or to a
file in it) is planted at every path the agent writes, each writer is run, and the canary must be
exactly as it was.

The paths: the checkpoints' private index folder (`.git/ds4-agent`, where it used to be) and the
folders git writes a checkpoint into; the download's `.part`, its destination and config.toml;
a bash job's log; an MCP server's stderr log and mcp.log; mcp-trust.json and its temp file; the
KV and session files (the caches) and the TUI history, written by temp + rename. Folders the user
chose (the agent home, --dir, the sessions folder itself) may be symlinks: those are the user's,
not planted by a repository or a model."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import tools
from ds4agent import download as D
from ds4agent import mcp_config
from helpers_git import BRANCH, make_repo
from test_download import hub, loopback_only    # noqa: F401 - the stand-in Hub and the loopback guard
from test_mcp_hardening import _manager
from tools.checkpoints import CheckpointError, CheckpointRepo

VICTIM = b'keep = "me"\n'


@pytest.fixture
def canary(tmp_path):
    c = tmp_path / "canary"
    c.mkdir()
    (c / "victim").write_bytes(VICTIM)
    for i in range(6):
        (c / f"index-{i:012x}").write_bytes(b"an index of someone else's")
    return c


def state(c: Path) -> dict:
    return {str(p.relative_to(c)): (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
            for p in sorted(c.rglob("*"))}


def test_checkpoints(tmp_path, canary):
    root = make_repo(tmp_path / "repo", {"a.txt": "one\n"})
    (root / ".git" / "ds4-agent").symlink_to(canary)
    before = state(canary)
    cp = CheckpointRepo(root, tmp_path / "agent" / "checkpoints")
    t1 = cp.snapshot(BRANCH)
    cp.commit(BRANCH, "1", t1, {"n": 1})
    (root / "b.txt").write_text("made by the agent\n")
    t2 = cp.snapshot(BRANCH)
    cp.restore(BRANCH, t1, t2)
    (root / ".git" / "refs" / "ds4-agent" / "fedcba987654").symlink_to(canary)   # another branch's refs
    with pytest.raises(CheckpointError):
        cp.snapshot(BRANCH)
    assert state(canary) == before


def test_download(hub, tmp_path, canary):   # noqa: F811 - the fixture imported above
    home, models = tmp_path / "home", tmp_path / "models"
    home.mkdir()
    models.mkdir()
    name = D.RECIPES["q2"].file
    before = state(canary)
    (models / (name + ".part")).symlink_to(canary / "victim")
    with pytest.raises(D.DownloadError):
        D.download("q2", models, home / "config.toml", out=open(os.devnull, "w"))
    (models / (name + ".part")).unlink()
    (models / name).symlink_to(canary / "victim")
    with pytest.raises(D.DownloadError):
        D.download("q2", models, home / "config.toml", out=open(os.devnull, "w"))
    (models / name).unlink()
    (home / "config.toml").symlink_to(canary / "victim")      # replaced by the rename, not written
    D.download("q2", models, home / "config.toml", out=open(os.devnull, "w"))
    assert state(canary) == before
    assert not (home / "config.toml").is_symlink() and str(models / name) in (home / "config.toml").read_text()


def test_bash_job_log(tmp_path, canary):
    proj, scratch = tmp_path / "proj", tmp_path / "scratch"
    proj.mkdir()
    (scratch / "bash").mkdir(parents=True)
    (scratch / "bash" / "job-1.log").symlink_to(canary / "victim")
    before = state(canary)
    ctx = tools.ToolContext(root=proj, scratch=scratch)
    try:
        res = tools.call("bash", {"command": "echo written by the job"}, ctx)
    finally:
        tools.close(ctx)
    assert "written by the job" in res.text
    assert state(canary) == before


def test_mcp_logs_and_trust(tmp_path, canary, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "mcp-raw.log").symlink_to(canary / "victim")
    (logs / "mcp.log").symlink_to(canary / "index-000000000000")
    before = state(canary)
    m = _manager(tmp_path, "junk", monkeypatch)       # stderr, and junk the SDK logs to mcp.log
    try:
        assert m.start() == []
        deadline = time.monotonic() + 15
        while m.servers["raw"].status == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        m.close()
    assert b"raw server up" in (logs / "mcp-raw.log").read_bytes()
    home, proj = tmp_path / "home", tmp_path / "proj"
    home.mkdir()
    proj.mkdir()
    (proj / ".mcp.json").write_text('{"mcpServers": {"s": {"command": "x"}}}')
    (home / f".mcp-trust.json.{os.getpid()}.tmp").symlink_to(canary / "victim")   # the old temp name
    (home / "mcp-trust.json").symlink_to(canary / "index-000000000001")
    mcp_config.trust(proj, list(mcp_config.load(proj, home).untrusted.values()), home)
    assert "s" in mcp_config.load(proj, home).servers
    assert state(canary) == before


def test_caches_and_history(tmp_path, canary):
    """The KV and session files (sessions.safeio) and the history (engine.atomic) are written to a
    temp name and renamed: a symlink at the final path is replaced, its target never written."""
    from engine.atomic import atomic_write
    from sessions.kvfile import atomic_write as kv_write
    d = tmp_path / "store"
    d.mkdir()
    (d / "0123.kv").symlink_to(canary / "victim")
    (d / "history").symlink_to(canary / "index-000000000002")
    before = state(canary)
    kv_write(d / "0123.kv", [b"kv bytes"])
    atomic_write(d / "history", [b"history"])
    assert (d / "0123.kv").read_bytes() == b"kv bytes" and (d / "history").read_bytes() == b"history"
    assert state(canary) == before
