"""git through GitPython (the design card's library), under tools.gitsafe's protection.

GitPython on its own runs git with the repository's configuration in force: `git.Repo(path).git.status()`
starts the repository's core.fsmonitor, a diff its textconv (tests/test_gitpy.py shows both). Here
every call made through GitPython gets what gitsafe builds for the plain subprocess path:

- the environment of `gitsafe.Git.env` (GIT_* dropped, the `-c` overrides as GIT_CONFIG_COUNT, the
  work tree pinned), passed to `Git.execute(env=...)`;
- the command line of `gitsafe.Git.command` (`--no-pager`, `--no-textconv --no-ext-diff` on diffs);
  a command that is not git, or a shell string, is refused;
- its own process group and a time limit, the group killed past it, as gitsafe does.

What is avoided, and why:

- `git.Repo` is not used: its constructor makes the object database's Git (`git cat-file --batch`
  processes) before a caller could hand it a protected one, and its config readers and remote calls
  go around `execute`. Only `git.cmd.Git`, through `SafeGit.execute`, is used.
- `Git.execute` starts from `os.environ` and adds the caller's `env` on top: it cannot unset a
  variable, and an empty value is not "unset" to git (GIT_DIR="" is fatal). When the agent's own
  environment holds a GIT_* variable that gitsafe drops (GIT_DIR, GIT_EXTERNAL_DIFF,
  GIT_CONFIG_PARAMETERS ...), `run` does not go through GitPython for that call but through
  gitsafe's subprocess, with the exact environment. `SafeGit.execute` called directly refuses.

GitPython is imported on first use: its import runs `git version` (no repository is read).
This module imports nothing outside tools/.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from . import gitsafe

# GitPython sets these itself (C messages); they name no program
_GITPYTHON_ENV = {"LANGUAGE", "LC_ALL"}


def stray_variables(env: dict) -> list[str]:
    """GIT_* variables of this process that `env` leaves out: GitPython would pass them on."""
    return sorted(k for k in os.environ if k.startswith("GIT_") and k not in env)


_CLASS: list = []
calls = [0]     # calls made through GitPython in this process (the tests read it)


def _git_class():
    """GitPython's Git, its execute routed through the SafeGit that owns the instance (made once:
    GitPython is imported on first use)."""
    if not _CLASS:
        import git.cmd

        class _Git(git.cmd.Git):
            def execute(self, command, *args, **kw):
                return self._ds4_owner._execute(super().execute, command, *args, **kw)

        _CLASS.append(_Git)
    return _CLASS[0]


class SafeGit:
    """git in one work tree through GitPython's `Git.execute`, with gitsafe's environment and
    command line. `g` is the gitsafe.Git of that folder (its checks already passed); `env`, if
    given, replaces g.env for every call (the checkpoints add their private index and identity)."""

    def __init__(self, g: gitsafe.Git, env: dict | None = None):
        self.safe = g
        self.env = dict(g.env if env is None else env)
        self.git = _git_class()(str(g.top))
        self.git._ds4_owner = self      # every execute of this instance, whoever calls it

    @property
    def top(self) -> Path:
        return self.safe.top

    @property
    def prefix(self) -> str:
        return self.safe.prefix

    def _execute(self, execute, command, *args, **kw):
        if isinstance(command, (str, bytes)) or kw.get("shell"):
            raise gitsafe.GitError("git is run with an argument list, never through a shell")
        parts = [os.fspath(c) for c in command]
        if not parts or Path(parts[0]).name not in ("git", "git.exe"):
            raise gitsafe.GitError(f"not a git command: {parts[:1]}")
        stray = stray_variables(self.env)
        if stray:
            raise gitsafe.GitError(f"{', '.join(stray)} in this environment would reach git through "
                                   "GitPython, which cannot unset a variable")
        kw.update(env=self.env, shell=False)
        calls[0] += 1
        return execute(self.safe.command(*parts[1:]), *args, **kw)

    def run(self, *args: str, input: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """`git <args>` as gitsafe.Git.run does (bytes out, GitTimeout past the limit), through GitPython."""
        where = Path(cwd or self.safe.cwd)
        if stray_variables(self.env):      # exactness first: see the module's doc
            return gitsafe._spawn(self.safe.command(*args), where, self.env, self.safe.timeout, input)
        if not where.is_dir():
            raise gitsafe.GitError(f"{where}: no such directory")
        self.git._working_dir = str(where)
        try:
            # the wrapper terminates git when it is collected: held until git is done
            held = self.git.execute(["git", *args], subprocess.PIPE if input is not None else None,
                                    as_process=True, start_new_session=True)
            proc = held.proc
        except OSError as e:     # GitPython's GitCommandNotFound is an OSError
            raise gitsafe.GitMissing(f"git could not be started: {e}") from None
        try:
            out, err = proc.communicate(input, timeout=self.safe.timeout)
        except subprocess.TimeoutExpired:
            try:                # git and anything it started: the whole group
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.communicate()
            raise gitsafe.GitTimeout(f"git {args[0] if args else ''} took longer than "
                                     f"{self.safe.timeout:g} s and was stopped") from None
        del held
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def text(self, *args: str, input: bytes | None = None) -> tuple[int, str, str]:
        r = self.run(*args, input=input)
        return r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")


def safe_git(root: Path | str, *, timeout: float = gitsafe.GIT_TIMEOUT) -> SafeGit:
    """SafeGit for the work tree around `root`; raises gitsafe's errors as gitsafe.Git does."""
    return SafeGit(gitsafe.Git(root, timeout=timeout))
