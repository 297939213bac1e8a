"""ds4-agent's command line: model discovery and guidance, headless exit status, system prompt."""
from __future__ import annotations

import subprocess

from ds4agent import cli
from ds4agent.environment import system_text


def test_no_model_gives_guidance_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DS4_MODEL", raising=False)
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert "no model found" in err and "DeepSeek-V4-Flash-IQ2XXS" in err and "ds4-gguf synth" in err


def test_model_from_config_file(tmp_path, monkeypatch, small_model):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(f'model = "{small_model}"\nctx = 4096\n')
    monkeypatch.setenv("DS4_AGENT_HOME", str(home))
    monkeypatch.delenv("DS4_MODEL", raising=False)
    monkeypatch.chdir(tmp_path)
    path, tried = cli.find_model(None, cli.load_config())
    assert path == str(small_model) and tried[-1] == str(small_model)
    assert cli.find_model("/explicit.gguf", {})[0] == "/explicit.gguf"


def test_bad_model_file_is_one_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--model", str(bad), "-p", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}: unsupported GGUF version 0 (supported: 3)"]


def test_system_prompt_has_environment_and_agents_md(tmp_path):
    subprocess.run(["git", "init", "-q", "-b", "trunk", str(tmp_path)], check=True)
    (tmp_path / "AGENTS.md").write_text("Always run `make check` before finishing.\n")
    text = system_text(tmp_path)
    assert f"Working directory: {tmp_path}" in text and "branch trunk" in text
    assert "Always run `make check`" in text and "OS: " in text and "Date: " in text
    plain = tmp_path.parent / (tmp_path.name + "-plain")   # outside any repository
    plain.mkdir()
    assert "not a git repository" in system_text(plain) and "AGENTS.md" not in system_text(plain)


def test_sigterm_ends_the_agent_like_ctrl_c(tmp_path, agent_model):
    """SIGTERM to a running agent raises KeyboardInterrupt (exit 130, exit handlers run: the bash
    tool's kill of escaped job processes is one), where Python's default ends it at once (-15)."""
    import os
    import signal
    import sys
    import time
    env = dict(os.environ, DS4_AGENT_HOME=str(tmp_path / "home"))
    p = subprocess.Popen([sys.executable, "-m", "ds4agent.cli", "--model", str(agent_model), "--ctx", "8192",
                          "-p", "write a long story"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        while True:                  # until the process catches SIGTERM (SigCgt bit 15)
            with open(f"/proc/{p.pid}/status") as f:
                caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
            if caught & (1 << (signal.SIGTERM - 1)) or p.poll() is not None:
                break
            assert time.monotonic() - t0 < 60
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)    # the model is still loading or working
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err.decode(errors="replace")[-2000:]
    assert b"Traceback" not in err


def test_agents_md_is_read_only_from_inside_the_project(tmp_path):
    """A cloned repository can commit AGENTS.md as a symlink to a file outside it (a key, the
    process environment): its bytes must not reach the prompt. A link inside the project is
    followed; a FIFO does not block; an oversized file is left out."""
    import os
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-42")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "AGENTS.md").symlink_to(secret)
    assert "TOPSECRET-42" not in system_text(proj)
    (proj / "AGENTS.md").unlink()
    (proj / "CLAUDE.md").write_text("use tabs")
    (proj / "AGENTS.md").symlink_to("CLAUDE.md")
    assert "use tabs" in system_text(proj)
    (proj / "AGENTS.md").unlink()
    os.mkfifo(proj / "fifo")
    (proj / "AGENTS.md").symlink_to("fifo")
    system_text(proj)                  # returns: the FIFO is opened non-blocking and refused
    (proj / "AGENTS.md").unlink()
    (proj / "AGENTS.md").write_text("x" * 10_000_000)
    assert "xxxxxxxxxx" not in system_text(proj)
