"""tools/checkpoints.py at its edges (issue 25 review): a project that is a subfolder of a
repository checkpoints and restores that folder only, never a file above or beside it, and never
removes the project folder itself; a folder named like a pathspec pattern is a name; a new file
over MAX_FILE is left out (not hashed, not restored) and said; symlinks and the executable bit
come back as they were."""
from __future__ import annotations

import os
import stat

import pytest

import tools.checkpoints as tc
from helpers_git import BRANCH, files_of, git, make_repo
from tools.checkpoints import CheckpointRepo


@pytest.fixture
def mono(tmp_path):
    """A repository with two projects side by side and a file at its top."""
    return make_repo(tmp_path / "mono", {"app/main.py": "app = 1\n", "lib/main.py": "lib = 1\n", "top.txt": "top\n"})


def test_a_subfolder_project_restores_only_its_folder(mono, tmp_path):
    cp = CheckpointRepo(mono / "app", tmp_path / "shadow")
    assert cp.prefix == "app"
    tree = cp.snapshot(BRANCH)
    # the agent (or anything) changes files inside and outside the project
    (mono / "app" / "main.py").write_text("app = 2\n")
    (mono / "app" / "new.py").write_text("made\n")
    (mono / "lib" / "main.py").write_text("lib = 2  # another project's work\n")
    (mono / "top.txt").unlink()
    (mono / "beside.txt").write_text("untracked, outside\n")
    now = cp.snapshot(BRANCH)
    assert {p for _, p in cp.changes(tree, now)} == {"app/main.py", "app/new.py"}
    changed, _ = cp.restore(BRANCH, tree, now)
    assert sorted(changed) == ["app/main.py", "app/new.py"]
    assert files_of(mono / "app") == {"main.py": b"app = 1\n"}
    # nothing outside the project moved back
    assert (mono / "lib" / "main.py").read_text() == "lib = 2  # another project's work\n"
    assert not (mono / "top.txt").exists() and (mono / "beside.txt").exists()
    assert "lib/main.py" not in cp.diff_text(now, tree) and "top.txt" not in cp.diff_text(now, tree)


def test_an_emptied_project_folder_is_not_removed(tmp_path):
    repo = tmp_path / "r"
    (repo / "proj").mkdir(parents=True)
    (repo / "keep.txt").write_text("k\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    cp = CheckpointRepo(repo / "proj", tmp_path / "shadow")
    empty = cp.snapshot(BRANCH)
    (repo / "proj" / "only.txt").write_text("the agent's\n")
    cp.restore(BRANCH, empty, cp.snapshot(BRANCH))
    assert (repo / "proj").is_dir() and os.listdir(repo / "proj") == []


def test_a_folder_named_like_a_pattern_is_a_name(tmp_path):
    repo = tmp_path / "r"
    (repo / "*").mkdir(parents=True)
    (repo / "x").mkdir()
    (repo / "*" / "a.txt").write_text("in star\n")
    (repo / "x" / "b.txt").write_text("in x\n")
    git(repo, "init", "-q", "-b", "main")
    cp = CheckpointRepo(repo / "*", tmp_path / "shadow")
    tree = cp.snapshot(BRANCH)
    (repo / "x" / "b.txt").write_text("changed\n")
    (repo / "*" / "a.txt").write_text("changed\n")
    changed, _ = cp.restore(BRANCH, tree, cp.snapshot(BRANCH))
    assert changed == ["*/a.txt"] and (repo / "x" / "b.txt").read_text() == "changed\n"


def test_a_big_new_file_is_left_out_and_said(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "MAX_FILE", 1000)
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "small.txt").write_text("s\n")
    cp = CheckpointRepo(proj, tmp_path / "shadow")
    tree = cp.snapshot(BRANCH)
    (proj / "data.bin").write_bytes(b"x" * 5000)
    (proj / "small.txt").write_text("t\n")
    now = cp.snapshot(BRANCH)
    assert cp.skipped == ["data.bin"]
    assert {p for _, p in cp.changes(tree, now)} == {"small.txt"}        # not hashed into the tree
    cp.restore(BRANCH, tree, now)
    assert (proj / "data.bin").stat().st_size == 5000                     # /undo leaves it alone
    assert (proj / "small.txt").read_text() == "s\n"
    git_dir = cp.git_dir
    blobs = git(proj, f"--git-dir={git_dir}", "cat-file", "--batch-all-objects", "--batch-check").decode()
    assert " blob 5000" not in blobs


@pytest.mark.skipif(os.name != "posix", reason="symlinks and modes")
def test_symlinks_and_the_executable_bit_come_back(tmp_path):
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (proj / "run.sh").chmod(0o755)
    (proj / "link").symlink_to("run.sh")
    cp = CheckpointRepo(proj, tmp_path / "shadow")
    tree = cp.snapshot(BRANCH)
    (proj / "run.sh").chmod(0o644)
    (proj / "link").unlink()
    (proj / "link").write_text("a file now\n")
    changed, _ = cp.restore(BRANCH, tree, cp.snapshot(BRANCH))
    assert sorted(changed) == ["link", "run.sh"]
    assert os.readlink(proj / "link") == "run.sh"
    assert stat.S_IMODE((proj / "run.sh").stat().st_mode) & 0o100


def test_a_folder_it_cannot_write_is_one_error(repo_ro, tmp_path, monkeypatch):
    """A read-only .git (tests run as root, so a chmod would not stop them: mkdir is made to fail)
    or shadow root: a CheckpointError in one line, which the agent turns into one warning."""
    from pathlib import Path
    real = Path.mkdir

    def denied(self, *a, **k):
        if "ds4-agent" in self.parts or "shadow" in self.parts:
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(tc.CheckpointError, match="Permission denied"):
        CheckpointRepo(repo_ro, tmp_path / "shadow").snapshot(BRANCH)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(tc.CheckpointError, match="cannot create"):
        CheckpointRepo(plain, tmp_path / "shadow" / "deeper")


@pytest.fixture
def repo_ro(tmp_path):
    return make_repo(tmp_path / "ro", {"a.txt": "a\n"}, commit=False)


def test_copied_refs_are_the_same_commits_and_independent(mono, tmp_path):
    cp = CheckpointRepo(mono, tmp_path / "shadow")
    t = cp.snapshot(BRANCH)
    c = cp.commit(BRANCH, "1", t, {"n": 1}, also=("head",))
    cp.commit(BRANCH, "redo", t, {"redo": True})
    fork = "0000000000f0"
    assert cp.copy_refs(BRANCH, fork) == 2                          # 1 and head; redo stays its own
    assert {n: r.commit for n, r in cp.refs(fork).items()} == {"1": c, "head": c}
    cp.delete(fork, ["1", "head"])
    assert set(cp.refs(BRANCH)) == {"1", "head", "redo"}
