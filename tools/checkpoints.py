"""Checkpoints of a project's work tree as git objects, taken without touching anything of the user's.

A checkpoint is a commit on a private ref, `refs/ds4-agent/<branch>/<n>`, whose tree is the work
tree as it was (tracked and untracked files, ignored ones left out, as `git add -A` sees them). It
is built with a private index file kept in the agent's own folder, never under the repository's
.git (`<shadow_root>/index/<sha1 of the git folder>/index-<branch>`, GIT_INDEX_FILE): `git add -A` into it, `write-tree`, `commit-tree`, `update-ref`. So the user's
index, HEAD, branch, stash and config are never read or written, and with the index's stat cache
warm a checkpoint hashes only the files that changed (git's objects dedupe the rest).

Outside a git repository a shadow repository (bare, ours) at `<shadow_root>/<sha1 of the project
path>.git` holds the checkpoints, with the project as its work tree.

Every git call goes through tools.gitsafe (the repository's config cannot run a program; a time
limit stops it). The commits carry a fixed identity from the environment, so no user config is
needed, and their message is one JSON line: the metadata survives restarts.
This module imports nothing of ours outside tools/.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .gitpy import SafeGit
from .gitsafe import Git, GitError, GitTimeout, NotARepository, _spawn
from .safefs import fd_path

REF_ROOT = "refs/ds4-agent"
MAX_FILE = 50 * 2**20     # an untracked file bigger than this is left out of checkpoints
KEEP_INDEXES = 20          # private index files kept (one per branch; ~100 bytes per tracked file)
_WRITERS = {"add", "write-tree", "commit-tree", "update-ref"}     # git commands that write under .git
# the reads: through GitPython (tools.gitpy); the rest through gitsafe's subprocess, same env
GIT_READS = {"rev-parse", "for-each-ref", "diff-tree", "ls-files"}
IDENTITY = {"GIT_AUTHOR_NAME": "ds4-agent", "GIT_AUTHOR_EMAIL": "ds4-agent@localhost",
            "GIT_COMMITTER_NAME": "ds4-agent", "GIT_COMMITTER_EMAIL": "ds4-agent@localhost"}


class CheckpointError(Exception):
    """A checkpoint could not be taken or restored; the message says why in one line."""


class CheckpointTimeout(CheckpointError):
    """git ran past the time limit (a work tree too large to checkpoint before every call)."""


@dataclass
class Ref:
    """One private ref: its name under the branch (`7`, `7-after`, `head`, `redo`), commit, tree,
    and the JSON metadata of the commit's message ({} when it is not ours)."""
    name: str
    commit: str
    tree: str
    meta: dict


class CheckpointRepo:
    """The checkpoint store of one project: the project's own repository, or a shadow one."""

    def __init__(self, project: Path | str, shadow_root: Path | str, *, timeout: float = 20.0):
        project = Path(os.path.realpath(project))
        try:
            try:
                self.git, self.shadow = Git(project, timeout=timeout), False
                self.top = self.git.top
                gd, common = self._git("rev-parse", "--absolute-git-dir", "--path-format=absolute",
                                       "--git-common-dir", index=False).splitlines()[:2]
                self.git_dir, self.common = Path(gd), Path(common)
            except NotARepository:
                self.shadow = True
                self.git_dir = Path(shadow_root) / (hashlib.sha1(str(project).encode("utf-8", "surrogateescape"))
                                                    .hexdigest() + ".git")
                if not (self.git_dir / "HEAD").exists():
                    _init_bare(self.git_dir, timeout)
                self.git = Git.owned(self.git_dir, project, timeout=timeout)
                self.common = self.git_dir
                self.top = self.git.top
        except GitError as e:            # no git, too old, a broken config: one line
            raise CheckpointError(str(e)) from None
        # The private indexes live in the agent's own folder, never under the repository's .git:
        # git opens GIT_INDEX_FILE by path itself, so a `.git/ds4-agent` committed as a symlink
        # would lead its writes (and our pruning) anywhere, and no check made by us before the
        # call could stop git from following it. A path the repository cannot name can.
        self.private = Path(shadow_root) / "index" / hashlib.sha1(
            str(self.git_dir).encode("utf-8", "surrogateescape")).hexdigest()
        # a project in a subfolder of a repository: its checkpoints hold, compare and restore that
        # folder only (the agent works there; files elsewhere in the repository are not its to undo)
        self.prefix = "" if self.shadow else self.git.prefix
        self._spec = ("--", _literal(self.prefix)) if self.prefix else ()
        self.skipped: list[str] = []        # untracked files too big to checkpoint, the last snapshot

    # -- plumbing -----------------------------------------------------------------------------
    def _git(self, *args: str, index: str | Path | bool = True, input: bytes | None = None) -> str:
        """stdout of `git <args>` at the top of the work tree; CheckpointError on a failure.
        index: True the branch's private index (set by the caller in self._index), a path, or
        False (none named: commands that read no index)."""
        # pathspec magic on: every pathspec passed here is ours, wrapped in :(literal) (_literal)
        verb = args[2] if args[0] == "-c" else args[0]
        if verb in _WRITERS:
            self._check_store()
            args = ("-c", "core.logAllRefUpdates=false", *args)    # no reflog under logs/ either
        env = dict(self.git.env, **IDENTITY, GIT_LITERAL_PATHSPECS="0")
        if index is not False:
            env["GIT_INDEX_FILE"] = str(self._index if index is True else index)
        try:
            if _subcommand(args) in GIT_READS:      # reads through GitPython, the same env (tools.gitpy)
                r = SafeGit(self.git, env).run(*args, input=input, cwd=self.top)
            else:
                r = _spawn(self.git.command(*args), self.top, env, self.git.timeout, input)
        except GitTimeout as e:
            raise CheckpointTimeout(str(e)) from None
        except GitError as e:
            raise CheckpointError(str(e)) from None
        if r.returncode != 0:
            msg = r.stderr.decode("utf-8", "replace").strip().splitlines()
            raise CheckpointError(f"git {verb} failed: {msg[-1] if msg else f'exit status {r.returncode}'}")
        return r.stdout.decode("utf-8", "surrogateescape")

    def _check_store(self):
        """git writes a checkpoint's objects under objects/ and its refs under refs/ds4-agent/
        of the repository: none of those folders may be a symlink (an unpacked archive can hold
        `.git/objects/ab -> /elsewhere`, and git would write through it). Checked before every
        snapshot and ref update; git's own writes are by path, so this is what can be checked."""
        for sub in ("objects", "refs", REF_ROOT):
            _no_symlinks(self.common / sub)

    def _use_index(self, branch: str):
        """The branch's private index; a new branch starts from the newest other one (its stat
        cache is as good: the work tree is the same), so a new session's first checkpoint is warm."""
        _check_branch(branch)
        try:
            self.private.mkdir(parents=True, exist_ok=True)
        except OSError as e:        # a read-only repository (or disk full): one line, the tool still runs
            raise CheckpointError(f"cannot write {self.private}: {e.strerror or e}") from None
        self._index = self.private / f"index-{branch}"
        if self._index.exists():
            return
        others = sorted(self.private.glob("index-*"), key=_mtime, reverse=True)
        others = [p for p in others if not p.name.endswith(".lock")]
        for old in others[KEEP_INDEXES - 1:]:
            _unlink(old)
        if others:
            tmp = self._index.with_name(self._index.name + ".seed")
            try:
                shutil.copyfile(others[0], tmp)
                os.replace(tmp, self._index)
            except OSError:
                _unlink(tmp)            # a cold index: slower, still right

    # -- taking ---------------------------------------------------------------------------------
    def snapshot(self, branch: str) -> str:
        """The tree of the work tree now (tracked and untracked, ignored left out)."""
        self._use_index(branch)
        # the untracked cache (kept in our index) skips reading the folders whose mtime is unchanged
        big = self._big_untracked()
        spec = [*self._spec] or (["--"] if big else [])
        spec += [f":(exclude,literal,top){p}" for p in big]
        self._git("-c", "core.untrackedCache=true", "add", "-A", "--ignore-errors", *spec)
        self.skipped = big
        return self._git("write-tree").strip()

    def _big_untracked(self) -> list[str]:
        """New files (in no checkpoint yet) over MAX_FILE: left out (each would be hashed and stored
        whole, seconds and its size on disk; /undo leaves them as they are)."""
        out = self._git("-c", "core.untrackedCache=true", "ls-files", "-z", "-o", "--exclude-standard", *self._spec)
        big = []
        for p in out.split("\0"):
            try:
                if p and os.lstat(self.top / p).st_size > MAX_FILE:
                    big.append(p)
            except OSError:
                pass
        return big

    def commit(self, branch: str, name: str, tree: str, meta: dict, parent: str | None = None,
               also: tuple[str, ...] = ()) -> str:
        """A commit of `tree` with `meta` as its message, at refs/ds4-agent/<branch>/<name> (and at
        the names in `also`, in the same transaction: one git call less)."""
        _check_branch(branch)
        args = ["commit-tree", tree] + (["-p", parent] if parent else [])
        sha = self._git(*args, index=False, input=json.dumps(meta, separators=(",", ":")).encode() + b"\n").strip()
        lines = "".join(f"update {REF_ROOT}/{branch}/{n} {sha}\n" for n in (name, *also))
        self._git("update-ref", "--stdin", index=False, input=lines.encode())
        return sha

    def copy_refs(self, src: str, dst: str) -> int:
        """Every step ref of branch `src` also under `dst` (the same commits: no object written), in
        one transaction; returns how many."""
        _check_branch(dst)
        refs = [r for r in self.refs(src).values() if r.name != "redo"]
        if refs:
            lines = "".join(f"update {REF_ROOT}/{dst}/{r.name} {r.commit}\n" for r in refs)
            self._git("update-ref", "--stdin", index=False, input=lines.encode())
        return len(refs)

    def set_ref(self, branch: str, name: str, commit: str):
        _check_branch(branch)
        self._git("update-ref", f"{REF_ROOT}/{branch}/{name}", commit, index=False)

    def delete(self, branch: str, names: list[str]):
        if names:
            lines = "".join(f"delete {REF_ROOT}/{branch}/{n}\n" for n in names)
            self._git("update-ref", "--stdin", index=False, input=lines.encode())

    def refs(self, branch: str) -> dict[str, Ref]:
        """Every private ref of the branch by name."""
        _check_branch(branch)
        out = self._git("for-each-ref", "--format=%(refname)%00%(objectname)%00%(tree)%00%(contents:subject)",
                        f"{REF_ROOT}/{branch}/", index=False)
        refs = {}
        for line in out.splitlines():
            parts = line.split("\0")
            if len(parts) != 4:
                continue
            name = parts[0].rsplit("/", 1)[-1]
            try:
                meta = json.loads(parts[3])
            except ValueError:
                meta = {}
            refs[name] = Ref(name, parts[1], parts[2], meta if isinstance(meta, dict) else {})
        return refs

    # -- comparing ------------------------------------------------------------------------------
    def changes(self, a: str, b: str) -> list[tuple[str, str]]:
        """(status, path) of every file that differs from tree a to tree b (A, D, M, T)."""
        if a == b:
            return []
        out = self._git("diff-tree", "-r", "-z", "--no-renames", "--name-status", a, b, *self._spec, index=False)
        f = out.split("\0")
        return [(f[i][:1], f[i + 1]) for i in range(0, len(f) - 1, 2)]

    def diff_text(self, a: str, b: str, limit: int = 20000) -> str:
        """A `--stat` list and the unified diff from tree a to tree b, cut at `limit` characters."""
        if a == b:
            return ""
        out = self._git("diff-tree", "-r", "-p", "--stat", "--no-renames", "--no-textconv", "--no-ext-diff",
                        a, b, *self._spec, index=False)
        return out if len(out) <= limit else out[:limit] + f"\n[... diff cut at {limit} characters]"

    # -- restoring ------------------------------------------------------------------------------
    def restore(self, branch: str, target: str, current: str,
                keep: set[str] = frozenset()) -> tuple[list[str], str]:
        """Make the work tree's files those of tree `target`, from `current` (a snapshot of the work
        tree now): files that differ are written, files absent from target are deleted, files in
        `keep` are left as they are, ignored files are never seen. Returns the paths changed and
        the tree of the work tree after."""
        inside = self.prefix + "/" if self.prefix else ""
        changes = [(s, p) for s, p in self.changes(current, target) if p not in keep and p.startswith(inside)]
        gone = [p for s, p in changes if s == "D"]
        write = [p for s, p in changes if s != "D"]
        for p in gone:               # first: a file may come back where a folder is now
            _remove(self.top, p, self.top / self.prefix if self.prefix else self.top)
        if write:
            tmp = self.private / f"restore-{os.getpid()}.idx"
            try:
                self._git("read-tree", target, index=tmp)
                self._git("checkout-index", "-f", "-z", "--stdin", index=tmp,
                          input="".join(p + "\0" for p in write).encode("utf-8", "surrogateescape"))
            finally:
                _unlink(tmp)
        # the tree after, which also gives the private index the new files' stat data
        return [p for _, p in changes], self.snapshot(branch)


# -- helpers -----------------------------------------------------------------------------------------
def _init_bare(git_dir: Path, timeout: float):
    from .gitsafe import FIXED_CONFIG, _config_env, base_env
    try:
        git_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {git_dir.parent}: {e.strerror or e}") from None
    env = _config_env(base_env(None), list(FIXED_CONFIG))
    try:
        r = _spawn(["git", "init", "-q", "--bare", str(git_dir)], git_dir.parent, env, timeout, None)
    except GitError as e:
        raise CheckpointError(str(e)) from None
    if r.returncode != 0:
        raise CheckpointError(f"cannot create the checkpoint repository {git_dir}: "
                              f"{r.stderr.decode('utf-8', 'replace').strip()}")


def _subcommand(args) -> str:
    """The git subcommand of `args` (after any `-c key=value`)."""
    i = 0
    while i < len(args) and args[i] == "-c":
        i += 2
    return args[i] if i < len(args) else ""


def _literal(path: str) -> str:
    return f":(literal,top){path}"     # a folder named `*` is a name, not a pattern


def _check_branch(branch: str):
    # the branch names a ref and a file: 12 hex digits from the agent, nothing else
    if not branch or not all(c in "0123456789abcdef" for c in branch):
        raise CheckpointError(f"bad branch id {branch!r}")


def _remove(top: Path, rel: str, stop: Path):
    """Delete one file (or symlink) of the work tree, then the folders it leaves empty, up to
    `stop` (the project folder: never itself, nothing above it)."""
    p = top / rel
    try:      # the folder is opened, then checked by its descriptor: a swap cannot redirect the unlink
        dfd = os.open(p.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointError(f"cannot delete {rel}: {e.strerror or e}") from None
    try:
        real = fd_path(dfd) or os.path.realpath(p.parent)
        if real != str(stop) and not real.startswith(str(stop) + os.sep):
            raise CheckpointError(f"{rel}: its folder is no longer inside the project; not deleted")
        st = os.stat(p.name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(p.name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise CheckpointError(f"cannot delete {rel}: {e.strerror or e}") from None
    finally:
        os.close(dfd)
    d = p.parent
    while d != stop and stop in d.parents:
        try:
            d.rmdir()
        except OSError:
            break
        d = d.parent


def _no_symlinks(d: Path):
    """d (when it exists) and the folders in it are real folders, not symlinks."""
    if not os.path.lexists(d):
        return
    try:
        if d.is_symlink() or not d.is_dir():
            raise CheckpointError(f"{d} is a symlink or not a folder: checkpoints are not taken "
                                  "here (git would write through it)")
        with os.scandir(d) as it:
            bad = next((e.path for e in it if e.is_symlink()), None)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointError(f"cannot read {d}: {e.strerror or e}") from None
    if bad is not None:
        raise CheckpointError(f"{bad} is a symlink: checkpoints are not taken here (git would "
                              "write through it)")


def _unlink(p: Path):
    try:
        p.unlink()
    except OSError:
        pass


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
