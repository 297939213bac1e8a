"""Git helpers shared by the checkpoint tests (test_checkpoints*.py): git with a fixed identity, a
repository built from a dict of files, the work tree as bytes, and the user's git state that a
checkpoint must leave untouched."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

BRANCH = "0123456789ab"
GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgSign=false"]


def git(root, *args):
    return subprocess.run(["git", *GIT_ID, *args], cwd=root, check=True, capture_output=True).stdout


def write_files(root: Path, files: dict[str, str | bytes]) -> None:
    """Each relative path's text (or bytes) under root, folders made as needed."""
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            p.write_bytes(data)
        else:
            p.write_text(data)


def make_repo(root: Path, files: dict[str, str | bytes], *, commit: bool = True) -> Path:
    """A repository on branch main at root holding `files`, committed as "first" (or left
    untracked without `commit`)."""
    root.mkdir(parents=True, exist_ok=True)
    write_files(root, files)
    git(root, "init", "-q", "-b", "main")
    if commit:
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "first")
    return root


def add_user_work(root: Path, *, stashed: dict, staged: dict, unstaged: dict) -> Path:
    """The state a user's repository is in mid-work, on top of make_repo: a branch "side", a stash
    (`stashed` written, then stashed), a staged change (`staged`, added by path) and `unstaged`
    files written last (edits after staging, untracked and ignored files)."""
    git(root, "branch", "side")
    write_files(root, stashed)
    git(root, "stash", "-q")
    write_files(root, staged)
    git(root, "add", *staged)
    write_files(root, unstaged)
    return root


def files_of(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        for n in names:
            p = Path(dirpath) / n
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def user_state(root: Path) -> dict:
    """Everything of the user's that a checkpoint must not touch."""
    refs = [r for r in git(root, "for-each-ref", "--format=%(refname) %(objectname)").decode().splitlines()
            if not r.startswith("refs/ds4-agent/")]
    return {"index": (root / ".git" / "index").read_bytes(), "HEAD": (root / ".git" / "HEAD").read_bytes(),
            "refs": refs, "stash": git(root, "stash", "list"), "config": (root / ".git" / "config").read_bytes(),
            "status": git(root, "status", "--porcelain")}
