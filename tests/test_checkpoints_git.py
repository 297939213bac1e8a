"""tools/checkpoints.py: work-tree checkpoints as commits on private refs, through tools.gitsafe.

Checked here: a checkpoint holds tracked and untracked files and leaves ignored ones out; a restore
brings the files back byte for byte (deleted, changed, new, a file where a folder was) and never
touches ignored files; the user's index, HEAD, branches and stash are byte/ref-identical after a
checkpoint and a restore; outside git a shadow repository holds them; only changed files cost new
objects; a repository's config cannot make the checkpoint run a program.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers_git import BRANCH, add_user_work, files_of, git, make_repo, user_state
from tools.checkpoints import CheckpointError, CheckpointRepo


@pytest.fixture
def repo(tmp_path):
    """A repository with history, a branch, a stash, a staged change, an untracked and an ignored file."""
    root = make_repo(tmp_path / "repo", {".gitignore": "*.log\nbuild/\n", "a.txt": "one\n", "src/m.py": "x = 1\n"})
    return add_user_work(root, stashed={"a.txt": "stashed\n"}, staged={"a.txt": "staged\n"},
                         unstaged={"a.txt": "staged then edited\n", "new.txt": "untracked\n",
                                   "run.log": "ignored\n", "build/out.bin": b"\0\1"})


def test_checkpoint_and_restore_leave_the_users_git_alone(repo, tmp_path):
    before = user_state(repo)
    files0 = files_of(repo)
    cp = CheckpointRepo(repo, tmp_path / "shadow")
    assert not cp.shadow
    tree = cp.snapshot(BRANCH)
    cp.commit(BRANCH, "1", tree, {"n": 1})
    names = {p for _, p in cp.changes("4b825dc642cb6eb9a060e54bf8d69288fbee4904", tree)}   # git's empty tree
    assert names == {".gitignore", "a.txt", "src/m.py", "new.txt"}       # untracked in, ignored out
    # the agent's work: an edit, a deleted file, a new file, a file where a folder was, an ignored change
    (repo / "a.txt").write_text("agent edit\n")
    (repo / "new.txt").unlink()
    (repo / "made.txt").write_text("by the agent\n")
    (repo / "src" / "m.py").unlink()
    (repo / "src").rmdir()
    (repo / "src").write_text("now a file\n")
    (repo / "run.log").write_text("ignored, changed later\n")
    now = cp.snapshot(BRANCH)
    changed, after = cp.restore(BRANCH, tree, now)
    assert set(changed) == {"a.txt", "new.txt", "made.txt", "src", "src/m.py"}
    expect = dict(files0, **{"run.log": b"ignored, changed later\n"})     # ignored files are never touched
    assert files_of(repo) == expect
    assert after == tree
    assert user_state(repo) == before
    assert [r for r in git(repo, "for-each-ref", "--format=%(refname)").decode().split()
            if r.startswith("refs/ds4-agent/")] == [f"refs/ds4-agent/{BRANCH}/1"]


def test_refs_carry_the_metadata_and_can_be_deleted(repo, tmp_path):
    cp = CheckpointRepo(repo, tmp_path / "shadow")
    t1 = cp.snapshot(BRANCH)
    c1 = cp.commit(BRANCH, "1", t1, {"n": 1, "turn": 3, "files": ["a b.txt", "ü"]})
    (repo / "a.txt").write_text("changed\n")
    t2 = cp.snapshot(BRANCH)
    cp.commit(BRANCH, "1-after", t2, {"n": 1}, parent=c1)
    refs = CheckpointRepo(repo, tmp_path / "shadow").refs(BRANCH)       # a new process sees them
    assert refs["1"].meta == {"n": 1, "turn": 3, "files": ["a b.txt", "ü"]} and refs["1"].tree == t1
    assert refs["1-after"].tree == t2
    assert cp.changes(t1, t2) == [("M", "a.txt")]
    text = cp.diff_text(t1, t2)
    assert "a.txt | 2 +-" in text and "-staged then edited" in text and "+changed" in text
    cp.delete(BRANCH, ["1", "1-after"])
    assert cp.refs(BRANCH) == {}
    with pytest.raises(CheckpointError):
        cp.refs("../../x")


def test_only_changed_files_cost_objects(repo, tmp_path):
    for i in range(50):
        (repo / f"f{i}.txt").write_text(f"file {i}\n" * 20)
    cp = CheckpointRepo(repo, tmp_path / "shadow")
    cp.snapshot(BRANCH)

    def loose():
        return sum(len(files) for d, _, files in os.walk(repo / ".git" / "objects")
                   if len(Path(d).name) == 2)
    n0 = loose()
    (repo / "f7.txt").write_text("changed\n")
    cp.snapshot(BRANCH)
    assert loose() - n0 == 2           # the new blob and the new root tree, nothing else
    # a new branch's index starts from the newest other one: nothing is hashed again
    n1 = loose()
    cp.snapshot("00000000000f")
    assert loose() == n1


def test_outside_git_a_shadow_repository_holds_them(tmp_path):
    proj = tmp_path / "plain"
    (proj / "d").mkdir(parents=True)
    (proj / "d" / "x.txt").write_bytes(b"bytes \xff\n")
    (proj / "y.txt").write_text("y\n")
    os.chmod(proj / "y.txt", 0o755)
    shadow = tmp_path / "home" / "checkpoints"
    cp = CheckpointRepo(proj, shadow)
    assert cp.shadow and cp.git_dir.parent == shadow and (cp.git_dir / "HEAD").exists()
    assert not (proj / ".git").exists()
    files0 = files_of(proj)
    tree = cp.snapshot(BRANCH)
    cp.commit(BRANCH, "1", tree, {"n": 1})
    (proj / "d" / "x.txt").unlink()
    (proj / "y.txt").write_text("changed\n")
    (proj / "z.txt").write_text("new\n")
    changed, _ = cp.restore(BRANCH, tree, cp.snapshot(BRANCH))
    assert sorted(changed) == ["d/x.txt", "y.txt", "z.txt"]
    assert files_of(proj) == files0 and os.access(proj / "y.txt", os.X_OK)
    assert not (proj / ".git").exists()
    assert CheckpointRepo(proj, shadow).refs(BRANCH)["1"].tree == tree    # found again


def test_restore_keeps_the_files_it_is_told_to(repo, tmp_path):
    cp = CheckpointRepo(repo, tmp_path / "shadow")
    tree = cp.snapshot(BRANCH)
    (repo / "a.txt").write_text("someone else\n")
    (repo / "new.txt").write_text("agent\n")
    changed, _ = cp.restore(BRANCH, tree, cp.snapshot(BRANCH), keep={"a.txt"})
    assert changed == ["new.txt"]
    assert (repo / "a.txt").read_text() == "someone else\n" and (repo / "new.txt").read_text() == "untracked\n"


def test_a_repositorys_config_runs_nothing(repo, tmp_path):
    """core.fsmonitor, a clean filter and hooks named by the repository are never run."""
    marker = tmp_path / "ran"
    script = tmp_path / "evil.sh"
    script.write_text(f"#!/bin/sh\necho ran >> {marker}\ncat\n")
    script.chmod(0o755)
    git(repo, "config", "core.fsmonitor", str(script))
    git(repo, "config", "filter.evil.clean", str(script))
    git(repo, "config", "filter.evil.smudge", str(script))
    (repo / ".gitattributes").write_text("*.txt filter=evil\n")
    hooks = repo / ".git" / "hooks"
    for h in ("reference-transaction", "post-commit", "post-checkout", "post-index-change"):
        (hooks / h).write_text(f"#!/bin/sh\necho {h} >> {marker}\n")
        (hooks / h).chmod(0o755)
    cp = CheckpointRepo(repo, tmp_path / "shadow")
    tree = cp.snapshot(BRANCH)
    cp.commit(BRANCH, "1", tree, {"n": 1})
    (repo / "a.txt").write_text("changed\n")
    cp.restore(BRANCH, tree, cp.snapshot(BRANCH))
    assert not marker.exists()
    assert (repo / "a.txt").read_text() == "staged then edited\n"


def test_git_missing_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(Exception) as e:
        CheckpointRepo(tmp_path, tmp_path / "shadow")
    assert "git is not installed" in str(e.value)
