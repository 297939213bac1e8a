"""Config files read at start-up (`.mcp.json`, ~/.ds4-agent/mcp.json, mcp-trust.json, config.toml)
that are symlinks to /dev/zero or /dev/stdin, or FIFOs: each is one warning line, read without
hanging and without reading more than the size cap (issue 32 item 2; the old code read /dev/zero
until the memory ran out and hung on a FIFO). The reads run in a child with a memory limit and a
time limit, so the old behaviour fails the test instead of taking the machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from pathlib import Path
from ds4agent import mcp_config
home, proj = Path(sys.argv[1]), Path(sys.argv[2])
out = {"mcp": mcp_config.load(proj, home).warnings}
from ds4agent import cli
import io, contextlib
err = io.StringIO()
with contextlib.redirect_stderr(err):
    out["toml"] = [cli.load_config(), err.getvalue()]
print(json.dumps(out))
"""

HOSTILE = {
    "zero": lambda p: p.symlink_to("/dev/zero"),
    "stdin": lambda p: p.symlink_to("/dev/stdin"),
    "fifo": lambda p: os.mkfifo(p),
    "big": lambda p: p.write_bytes(b" " * (2 << 20)),
}


def _run(home, proj, timeout=20):
    rfd, wfd = os.pipe()          # stdin: a pipe that never ends (an old read of /dev/stdin hangs)
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(home), str(proj)], stdin=rfd,
                           capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, DS4_AGENT_HOME=str(home)))
    finally:
        os.close(rfd)
        os.close(wfd)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_config_files_are_one_line_each(tmp_path, kind):
    home, proj = tmp_path / "home", tmp_path / "proj"
    home.mkdir()
    proj.mkdir()
    HOSTILE[kind](proj / ".mcp.json")
    HOSTILE[kind](home / "mcp.json")
    HOSTILE[kind](home / "mcp-trust.json")
    HOSTILE[kind](home / "config.toml")
    out = _run(home, proj)
    warns = out["mcp"]
    assert len(warns) == 3 and all("\n" not in w for w in warns), warns
    assert any(str(proj / ".mcp.json") in w for w in warns)
    assert any(str(home / "mcp.json") in w for w in warns)
    assert any(str(home / "mcp-trust.json") in w for w in warns)
    cfg, err = out["toml"]
    assert cfg == {} and err.count("\n") == 1 and str(home / "config.toml") in err, err
    if kind in ("zero", "stdin"):           # inside the project a symlink is not followed
        assert any("symlink" in w for w in warns if ".mcp.json" in w)


def test_a_projects_mcp_json_symlink_is_not_followed_but_the_users_is(tmp_path):
    """The user may keep ~/.ds4-agent/mcp.json as a symlink (dotfiles); a repository's .mcp.json
    symlink is refused, even to a good file (it could lead anywhere)."""
    home, proj = tmp_path / "home", tmp_path / "proj"
    home.mkdir()
    proj.mkdir()
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"mcpServers": {"a": {"command": "x"}}}))
    (home / "mcp.json").symlink_to(real)
    from ds4agent import mcp_config
    assert mcp_config.load(proj, home).servers["a"].command == "x"
    (proj / ".mcp.json").symlink_to(real)
    cfg = mcp_config.load(proj, home)
    assert any("symlink" in w and ".mcp.json" in w for w in cfg.warnings)
