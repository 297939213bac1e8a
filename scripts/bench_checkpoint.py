"""What a checkpoint costs on a 10,000-file repository (issue 25: < 200 ms, and only what changed stored).

Makes a repository of N small files in a few folders (committed), then times what the agent does
before a file-changing tool call (tools/checkpoints.py: `git add -A` into the private index,
`write-tree`, `commit-tree`, `update-ref`): the first checkpoint (a cold private index: every file
hashed), then warm ones after changing 3 files each, and a restore (/undo) of the first. Prints
milliseconds (median of the warm ones) and the object store's growth (`git count-objects -v`),
which shows that git's objects dedupe: each warm checkpoint adds the 3 blobs and the trees above them.

  .venv/bin/python scripts/bench_checkpoint.py [--files 10000] [--rounds 5] [--dir DIR]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.checkpoints import CheckpointRepo  # noqa: E402

BRANCH = "be4c00000000"   # (a branch id is 12 hex digits)
GIT = ["git", "-c", "gc.auto=0", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "-c", "commit.gpgSign=false"]


def make_repo(root: Path, n: int):
    root.mkdir(parents=True)
    subprocess.run(GIT + ["init", "-q", str(root)], check=True)
    for i in range(n):
        d = root / f"pkg{i % 20}" / f"mod{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.py").write_text(f"# file {i}\nVALUE = {i}\n\ndef f():\n    return VALUE * 2\n")
    subprocess.run(GIT + ["add", "-A"], cwd=root, check=True)
    subprocess.run(GIT + ["commit", "-q", "-m", "files"], cwd=root, check=True)


def objects(root: Path) -> dict:
    out = subprocess.run(["git", "count-objects", "-v"], cwd=root, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split(": ") for line in out.splitlines())}


def cpu_ms() -> float:
    """CPU time (user + system) of this process and the git processes it waited for: less at the
    mercy of a loaded machine than the wall time."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime) * 1000


CPU: list[float] = []


def checkpoint(cp: CheckpointRepo, n: int, parent: str | None) -> tuple[float, str, str]:
    """What the agent does before a tool call: snapshot, commit, two refs (the step's and head)."""
    t0, c0 = time.perf_counter(), cpu_ms()
    tree = cp.snapshot(BRANCH)
    commit = cp.commit(BRANCH, str(n), tree, {"n": n}, parent, also=("head",))
    CPU.append(cpu_ms() - c0)
    return (time.perf_counter() - t0) * 1000, tree, commit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", help="where to make the repository (default: a temp folder)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp) / "repo"
        t0 = time.perf_counter()
        make_repo(root, a.files)
        print(f"repository: {a.files} files, made and committed in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        cp = CheckpointRepo(root, Path(tmp) / "shadow")
        print(f"open (git version, config read): {(time.perf_counter() - t0) * 1000:.0f} ms")
        o0 = objects(root)
        cold, tree0, parent = checkpoint(cp, 1, None)
        o1 = objects(root)
        print(f"first checkpoint (cold private index): {cold:.0f} ms; objects +{o1['count'] - o0['count']}")
        warm = []
        for r in range(a.rounds):
            for k in range(3):
                p = root / f"pkg{k}" / f"mod{k}" / f"f{k}.py"
                p.write_text(p.read_text() + f"# round {r}\n")
            before = objects(root)["count"]
            ms, _, parent = checkpoint(cp, r + 2, parent)
            warm.append(ms)
            print(f"  warm checkpoint {r + 1}: {ms:.0f} ms, objects +{objects(root)['count'] - before}")
        warm_cpu = CPU[1:]
        same, _, _ = checkpoint(cp, a.rounds + 2, parent)
        print(f"warm checkpoints after changing 3 files: median {statistics.median(warm):.0f} ms "
              f"(min {min(warm):.0f}, max {max(warm):.0f}; CPU time median {statistics.median(warm_cpu):.0f} ms); "
              f"nothing changed: {same:.0f} ms")
        print(f"first checkpoint's CPU time: {CPU[0]:.0f} ms")
        t0 = time.perf_counter()
        changed, _ = cp.restore(BRANCH, tree0, cp.snapshot(BRANCH))
        print(f"restore of the first checkpoint ({len(changed)} files): {(time.perf_counter() - t0) * 1000:.0f} ms")
        o2 = objects(root)
        print(f"object store: {o0['count']} loose objects ({o0['size']} KiB) after the commit, "
              f"{o2['count']} ({o2['size']} KiB) after {a.rounds + 2} checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
