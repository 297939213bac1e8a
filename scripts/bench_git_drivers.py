"""Time one `git` tool call (status) in a repository whose .git/config defines N filter drivers
(issue 32 item 9). Each driver's clean filter would leave a marker file: the script also checks
that none ran.

    python scripts/bench_git_drivers.py 8000     # past tools.gitsafe.MAX_DRIVERS: refused, one line
    python scripts/bench_git_drivers.py 900      # under it: git runs with every driver off
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools import ToolContext, call


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo, mark = Path(tmp) / "repo", Path(tmp) / "ran"
        repo.mkdir()
        os.environ.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        (repo / "a.txt").write_text("x\n")
        (repo / ".gitattributes").write_text(f"*.txt filter=f{n - 1}\n")
        with open(repo / ".git" / "config", "a") as f:
            f.write("".join(f'[filter "f{i}"]\n\tclean = touch {mark}\n\tsmudge = touch {mark}\n'
                            for i in range(n)))
        t = time.monotonic()
        r = call("git", {"subcommand": "status"}, ToolContext(root=repo))
        took = time.monotonic() - t
        print(f"{n} drivers: git tool status took {took:.2f} s, ok={r.ok}, a filter ran: {mark.exists()}")
        print("  " + r.text.splitlines()[0][:200])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
