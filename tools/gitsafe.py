"""Every git command the agent and its tools run: one place that builds the command line and the
environment, so that nothing a repository chooses is executed.

A repository's own configuration (.git/config, files it includes, .gitattributes) can name programs
git runs on its behalf: core.fsmonitor on every status, textconv and external diff drivers on diffs,
clean/smudge/process filters when a dirty file is compared, hooks when the index or a ref is
written, pagers, editors, gpg to check signatures, ssh/proxy/credential helpers on any transport
(a partial clone fetches missing objects lazily, even for `show`). Opening the agent in a cloned
repository must not run any of them, so every call here:

- starts from the caller's environment minus every GIT_* variable (GIT_DIR, GIT_EXTERNAL_DIFF,
  GIT_SSH_COMMAND, GIT_TRACE=<file> ...), keeping only the ones that choose the user's own config
  files and identity (_KEEP_ENV);
- overrides, at the highest precedence (GIT_CONFIG_COUNT, the environment form of `-c`, which also
  reaches any git that git itself starts), every key that names a program, with a value that runs
  nothing; drivers are named by the repository (filter.<name>.*, diff.<name>.*), so their names
  are read first with `git config --list --show-scope` (reading config runs nothing) and each is
  overridden;
- passes --no-textconv --no-ext-diff (and --no-show-signature) to the commands that make diffs;
- sets GIT_WORK_TREE to the folder that holds `.git`, so a repository's core.worktree cannot point
  the work tree at the user's home (a diff would then print files from there);
- forbids every transport (protocol.allow=never), writes no optional lock (status does not rewrite
  the index), and reads pathspecs literally (a path argument cannot smuggle `:(top)` magic).

The user's global and system config are kept (identity for commits, safe.directory); the keys
above are overridden there too, except the filter drivers the user defined there (git-lfs).
This module imports nothing of ours: tools/ stands alone.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

GIT_TIMEOUT = 60

# The GIT_* variables that may pass through: they choose which of the user's own config files are
# read, limit repository discovery, or give the commit identity. Nothing here names a program.
_KEEP_ENV = {"GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM",
             "GIT_CEILING_DIRECTORIES", "GIT_DISCOVERY_ACROSS_FILESYSTEM",
             "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"}

# Keys that run a program, with a value that runs none (an empty value is not always "unset" to
# git: an empty diff.external or textconv is an attempt to run "", hence `false`/`cat` below).
FIXED_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.fsmonitor", "false"),
    ("core.hooksPath", os.devnull),            # no hook can be found under /dev/null/
    ("core.pager", "cat"),
    ("core.editor", "true"),
    ("sequence.editor", "true"),
    ("core.askPass", ""),                      # empty: no askpass program at all
    ("core.sshCommand", "false"),
    ("core.gitProxy", "none"),
    ("core.alternateRefsCommand", "true"),
    ("credential.helper", ""),                 # empty resets the list of helpers
    ("protocol.allow", "never"),               # no transport: no ssh, proxy, remote helper, ext::
    ("log.showSignature", "false"),
    ("commit.gpgSign", "false"),
    ("tag.gpgSign", "false"),
    ("gpg.program", "false"),
    ("gpg.openpgp.program", "false"),
    ("gpg.x509.program", "false"),
    ("gpg.ssh.program", "false"),
    ("gpg.ssh.defaultKeyCommand", "false"),
    ("submodule.recurse", "false"),
    ("status.submoduleSummary", "false"),
    ("gc.auto", "0"),                          # a commit would start `git maintenance` / gc
    ("maintenance.auto", "false"),
    ("color.ui", "false"),
    ("core.quotePath", "false"),
)

# Per-driver keys found in the effective config, and what each becomes (pager.<command> becomes
# false). An empty filter command is "no filter" to git; required=false keeps a disabled filter
# from failing the command.
_DRIVER_CONFIG = {
    "filter": {"clean": "", "smudge": "", "process": "", "required": "false"},
    "diff": {"textconv": "cat", "command": "true"},
    "merge": {"driver": "false"},
    "credential": {"helper": ""},
    "remote": {"uploadpack": "false", "receivepack": "false", "vcs": "none"},
    "difftool": {"cmd": "false"}, "mergetool": {"cmd": "false"},
    "trailer": {"command": "false", "cmd": "false"},
    "hook": {"command": "true"},               # hooks defined in config (git 2.54+): hooksPath does not cover them
}

# At most this many drivers (filter.<name>, diff.<name>, pager.<command>, ...) are switched off:
# each costs up to four -c overrides in git's environment, and thousands of them outgrow it (git
# then cannot start) and slow every call. A repository past the cap gets no git at all, never git
# without the overrides.
MAX_DRIVERS = 1000

# Config the user wrote (not the repository): filter drivers defined there are kept.
_USER_SCOPES = {"global", "system"}
_LFS_PROGRAMS = ("lfs.extension.", "lfs.customtransfer.", "lfs.standalonetransferagent")

# Commands that can show a diff: git's own flags keep textconv, external diff and gpg out.
_DIFF_COMMANDS = {"diff": ["--no-textconv", "--no-ext-diff"],
                  "diff-files": ["--no-textconv", "--no-ext-diff"],
                  "diff-index": ["--no-textconv", "--no-ext-diff"],
                  "log": ["--no-textconv", "--no-ext-diff", "--no-show-signature"],
                  "show": ["--no-textconv", "--no-ext-diff", "--no-show-signature"]}


class GitError(Exception):
    """git cannot be run here; the message says why in words a user can act on."""


class GitMissing(GitError):
    pass


class NotARepository(GitError):
    pass


class GitTimeout(GitError):
    pass


def find_worktree(start: Path) -> Path | None:
    """The nearest folder at or above `start` holding a `.git` folder (with HEAD) or a `gitdir:`
    file, the way git discovers a repository."""
    p = Path(os.path.realpath(start))
    for d in (p, *p.parents):
        dotgit = d / ".git"
        try:
            if dotgit.is_dir() and (dotgit / "HEAD").exists():
                return d
            if dotgit.is_file():
                with open(dotgit, "rb") as f:
                    if f.read(8) == b"gitdir: ":
                        return d
        except OSError:
            continue
    return None


def _inside(p: str, top: Path) -> bool:
    return os.path.commonpath([p, str(top)]) == str(top)


def _check_git_dir(top: Path, timeout: float) -> None:
    """The repository found at `top` must be this work tree's own. A `.git` file (`gitdir:`), a
    `.git` symlink or a `commondir` file can point at another repository anywhere on the disk (a
    project unpacked from an archive), and every git call would then show that repository's
    files. Its git folder (and common folder) must lie inside `top`, or be git's own record of
    a linked work tree or submodule whose work tree is `top`."""
    r = _spawn(["git", "rev-parse", "--absolute-git-dir", "--git-common-dir"], top,
               _config_env(base_env(top), list(FIXED_CONFIG)), timeout, None)
    lines = r.stdout.decode("utf-8", "surrogateescape").splitlines()
    if r.returncode != 0 or len(lines) < 2:
        raise NotARepository(f"{top} is not inside a git work tree")
    gitdir = os.path.realpath(lines[0])
    common = os.path.realpath(os.path.join(top, lines[1]))
    if _inside(gitdir, top) and _inside(common, top):
        return
    if not _inside(gitdir, top) and _names_work_tree(gitdir, top):
        return
    where = common if _inside(gitdir, top) else gitdir
    raise NotARepository(f"{top}: its .git points at a repository elsewhere ({where}) that does "
                         "not name this folder as its work tree; git is not used here")


def _names_work_tree(gitdir: str, top: Path) -> bool:
    """Whether the git folder `gitdir` (outside `top`) is a linked work tree's record
    (`<gitdir>/gitdir` names top/.git) or a submodule's (its config's core.worktree is top)."""
    want = os.path.realpath(top / ".git")
    try:
        with open(os.path.join(gitdir, "gitdir"), "rb") as f:
            back = f.read(4096).decode("utf-8", "surrogateescape").strip()
        if os.path.isabs(back) and os.path.realpath(back) == want:
            return True
    except OSError:
        pass
    try:
        with open(os.path.join(gitdir, "config"), "rb") as f:
            text = f.read(1 << 20).decode("utf-8", "surrogateescape")
    except OSError:
        return False
    m = re.search(r"^\s*worktree\s*=\s*(.+?)\s*$", text, re.M)
    return bool(m) and os.path.realpath(os.path.join(gitdir, m.group(1))) == os.path.realpath(top)


def driver_overrides(entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """For each driver key (`section.<name>.key`, or `pager.<command>`) among the config
    `entries` (scope, name), the override that disables it. Filters the user defined in their own
    global or system config stay (git-lfs: without its clean filter every LFS file would read as
    modified); the repository only picks which applies, and cannot redefine one (its value would
    be overridden here)."""
    out: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()       # a set: 8,000 drivers took 22 s with a list's `in`
    drivers: set[str] = set()
    # git-lfs's filter runs programs its own config names (lfs.extension.<x>.clean, custom
    # transfer agents): set by the repository, the user's filter is no longer the user's choice
    keep_user = not any(scope not in _USER_SCOPES and name.lower().startswith(_LFS_PROGRAMS)
                        for scope, name in entries)
    for scope, name in entries:
        section, _, rest = name.partition(".")
        sub, _, key = rest.rpartition(".")
        section, key = section.lower(), key.lower()
        if section == "pager":
            pairs = [] if sub else [(f"pager.{rest}", "false")]
        elif section == "filter" and sub:
            pairs = [] if scope in _USER_SCOPES and keep_user else [
                (f"filter.{sub}.{k}", v) for k, v in _DRIVER_CONFIG["filter"].items()]
        elif sub and key in (_DRIVER_CONFIG.get(section) or {}):
            pairs = [(f"{section}.{sub}.{key}", _DRIVER_CONFIG[section][key])]
        else:
            pairs = []
        for p in pairs:
            if p not in seen:
                seen.add(p)
                out.append(p)
                drivers.add(p[0].rpartition(".")[0])
        if len(drivers) > MAX_DRIVERS:
            raise GitError(f"this repository's configuration defines more than {MAX_DRIVERS} "
                           "filter, diff or other drivers; git is not run here (each would need "
                           "an override to stay switched off)")
    return out


def _config_env(base: dict, pairs: list[tuple[str, str]]) -> dict:
    env = dict(base)
    env["GIT_CONFIG_COUNT"] = str(len(pairs))
    for i, (k, v) in enumerate(pairs):
        env[f"GIT_CONFIG_KEY_{i}"] = k
        env[f"GIT_CONFIG_VALUE_{i}"] = v
    return env


def base_env(worktree: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in _KEEP_ENV}
    env.update({"GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat", "PAGER": "cat",
                "GIT_EDITOR": "true", "GIT_SEQUENCE_EDITOR": "true", "GIT_ASKPASS": "",
                "GIT_OPTIONAL_LOCKS": "0", "GIT_LITERAL_PATHSPECS": "1", "GIT_NO_LAZY_FETCH": "1",
                "GIT_PROTOCOL_FROM_USER": "0", "GIT_NO_REPLACE_OBJECTS": "1",
                # no transport at all, whatever protocol.<name>.allow the repository sets (a git
                # that ignores GIT_NO_LAZY_FETCH would fetch a partial clone's missing blob
                # through an ext:: remote, which runs a command)
                "GIT_ALLOW_PROTOCOL": ""})
    if worktree is not None:
        env["GIT_WORK_TREE"] = str(worktree)
    return env


def _spawn(args: list[str], cwd: Path, env: dict, timeout: float,
           input: bytes | None) -> subprocess.CompletedProcess:
    if not cwd.is_dir():        # else Popen's FileNotFoundError would read as "git is missing"
        raise GitError(f"{cwd}: no such directory")
    try:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE,
                                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                start_new_session=True)
    except FileNotFoundError:
        raise GitMissing("git is not installed") from None
    except OSError as e:
        raise GitError(f"git could not be started: {e.strerror or e}") from None
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        try:                    # git and anything it started: the whole group
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.communicate()
        raise GitTimeout(f"git {args[1] if len(args) > 1 else ''} took longer than {timeout:g} s "
                         "and was stopped") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


# GIT_CONFIG_COUNT (the overrides) arrived in git 2.31; an older git would silently ignore them
MIN_VERSION = (2, 31)
_VERSIONS: dict[str, tuple[int, ...]] = {}


def _check_version(exe: str, timeout: float) -> None:
    if exe not in _VERSIONS:
        r = _spawn([exe, "--version"], Path("/"), base_env(None), timeout, None)
        m = re.search(rb"(\d+)\.(\d+)", r.stdout)
        _VERSIONS[exe] = tuple(int(x) for x in m.groups()) if m else (0, 0)
    if _VERSIONS[exe] < MIN_VERSION:
        have = ".".join(map(str, _VERSIONS[exe]))
        raise GitMissing(f"git {have} is too old to run safely here (the agent needs git "
                         f"{MIN_VERSION[0]}.{MIN_VERSION[1]} or newer to switch off a repository's "
                         "hooks, filters and helpers)")


class Git:
    """git in one folder of a work tree, made safe (see the module's doc). Raises GitMissing or
    NotARepository when there is nothing to run."""

    def __init__(self, cwd: Path | str, *, timeout: float = GIT_TIMEOUT):
        self.cwd = Path(os.path.realpath(cwd))
        self.timeout = timeout
        exe = shutil.which("git")
        if exe is None:
            raise GitMissing("git is not installed")
        _check_version(exe, self.timeout)
        top = find_worktree(self.cwd)
        if top is None:
            raise NotARepository(f"{self.cwd} is not inside a git work tree")
        self.top = top
        _check_git_dir(top, self.timeout)
        rel = os.path.relpath(self.cwd, top)
        self.prefix = "" if rel == "." else Path(rel).as_posix()   # the cwd inside the repository
        base = base_env(top)
        entries = self._config_entries(_config_env(base, list(FIXED_CONFIG)))
        self.env = _config_env(base, [*FIXED_CONFIG, *driver_overrides(entries)])

    @classmethod
    def owned(cls, git_dir: Path | str, work_tree: Path | str, *, timeout: float = GIT_TIMEOUT) -> "Git":
        """git on a repository the agent itself made (GIT_DIR=git_dir: the checkpoints' shadow
        repository of a project outside git) with `work_tree` as its work tree. The same overrides
        as any other call: the user's global and system config are still read."""
        self = cls.__new__(cls)
        self.timeout = timeout
        exe = shutil.which("git")
        if exe is None:
            raise GitMissing("git is not installed")
        _check_version(exe, timeout)
        self.cwd = self.top = Path(os.path.realpath(work_tree))
        self.prefix = ""
        base = base_env(self.top)
        base["GIT_DIR"] = str(git_dir)
        entries = self._config_entries(_config_env(base, list(FIXED_CONFIG)))
        self.env = _config_env(base, [*FIXED_CONFIG, *driver_overrides(entries)])
        return self

    def _config_entries(self, env: dict) -> list[tuple[str, str]]:
        """(scope, name) of every config entry git reads here, included files too."""
        r = _spawn(["git", "config", "--list", "--show-scope", "-z"], self.cwd, env, self.timeout, None)
        if r.returncode != 0:     # a broken config: run nothing rather than run unprotected
            msg = r.stderr.decode("utf-8", "replace").strip() or f"exit status {r.returncode}"
            raise GitError(f"git cannot read this repository's configuration: {msg}")
        fields = r.stdout.decode("utf-8", "surrogateescape").split("\0")
        # scope NUL name [LF value] NUL ...
        return [(scope, item.split("\n", 1)[0]) for scope, item in zip(fields[::2], fields[1::2])]

    def command(self, *args: str) -> list[str]:
        """The full command line for `git <args>`."""
        args = list(args)
        if args and args[0] in _DIFF_COMMANDS:
            args[1:1] = _DIFF_COMMANDS[args[0]]
        return ["git", "--no-pager", *args]

    def run(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
        """`git <args>` in cwd; stdout/stderr as bytes. Raises GitTimeout past the time limit."""
        return _spawn(self.command(*args), self.cwd, self.env, self.timeout, input)

    def text(self, *args: str, input: bytes | None = None) -> tuple[int, str, str]:
        r = self.run(*args, input=input)
        return (r.returncode, r.stdout.decode("utf-8", "replace"),
                r.stderr.decode("utf-8", "replace"))


def ls_files(base: Path, *args: str, timeout: float = 30) -> list[str] | None:
    """`git ls-files -z <args>` under base: the NUL-separated names (relative to base), or None
    when base is not in a work tree or git fails."""
    try:
        r = Git(base, timeout=timeout).run("ls-files", "-z", *args)
    except GitError:
        return None
    if r.returncode != 0:
        return None
    return [p for p in r.stdout.decode("utf-8", "surrogateescape").split("\0") if p]
