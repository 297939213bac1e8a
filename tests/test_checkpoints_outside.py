"""Checkpoints write and delete nothing outside the repository (issue 32 item 3): `.git/ds4-agent`
committed as a symlink to another folder once made one approved write create a file there and
delete six `index-*`. The private indexes now live in the agent's own folder, and the folders git
writes a checkpoint into (objects/, refs/, refs/ds4-agent/) must not be symlinks."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from helpers_git import BRANCH, make_repo
from tools.checkpoints import CheckpointError, CheckpointRepo


def tree_state(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in d.rglob("*")}


@pytest.fixture
def setup(tmp_path):
    root = make_repo(tmp_path / "repo", {"a.txt": "one\n"})
    outside = tmp_path / "outside"
    outside.mkdir()
    for i in range(6):
        (outside / f"index-{i:012x}").write_bytes(b"not an index %d" % i)
    return root, outside


def _work(root: Path, shadow: Path):
    cp = CheckpointRepo(root, shadow)
    t1 = cp.snapshot(BRANCH)
    cp.commit(BRANCH, "1", t1, {"n": 1})
    (root / "b.txt").write_text("new\n")
    t2 = cp.snapshot(BRANCH)
    cp.commit(BRANCH, "1-after", t2, {"n": 1})
    cp.restore(BRANCH, t1, t2)
    return cp


def test_a_symlinked_private_folder_is_never_written_or_pruned(setup, tmp_path):
    root, outside = setup
    (root / ".git" / "ds4-agent").symlink_to(outside)
    before = tree_state(outside)
    cp = _work(root, tmp_path / "shadow")
    assert tree_state(outside) == before
    assert not (root / "b.txt").exists()           # the restore still worked
    assert cp.private.is_relative_to(tmp_path / "shadow")


@pytest.mark.parametrize("where", ["objects/fanout", "refs/ds4-agent", "refs/ds4-agent/branch"])
def test_symlinked_folders_git_would_write_into_are_refused(setup, tmp_path, where):
    root, outside = setup
    git = root / ".git"
    if where == "objects/fanout":
        # the folder the new file's blob goes to (b.txt, "new\n"): the old code wrote it there
        fan = hashlib.sha1(b"blob 4\0new\n").hexdigest()[:2]
        assert not (git / "objects" / fan).exists()
        (git / "objects" / fan).symlink_to(outside)
    elif where == "refs/ds4-agent":
        (git / "refs" / "ds4-agent").symlink_to(outside)
    else:
        (git / "refs" / "ds4-agent").mkdir()
        (git / "refs" / "ds4-agent" / BRANCH).symlink_to(outside)
    before = tree_state(outside)
    with pytest.raises(CheckpointError, match="symlink"):
        _work(root, tmp_path / "shadow")
    assert tree_state(outside) == before
