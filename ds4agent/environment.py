"""The environment facts of the system prompt: directory, OS, date, git summary, AGENTS.md."""
from __future__ import annotations

import datetime
import platform
from pathlib import Path

from prompts.system_prompt import agent_system_text
from tools.gitsafe import Git, GitError, NotARepository


def git_summary(root: Path) -> str:
    """Branch and counts of staged and changed files, for the project's folder only. Runs git
    through tools.gitsafe: a cloned repository's config (fsmonitor, filters, hooks) runs nothing."""
    try:
        g = Git(root)
        scope = ["--", "."] if g.prefix else []
        status, out, err = g.text("status", "--porcelain=v1", "--branch", "-z",
                                  "--untracked-files=normal", "--ignore-submodules=dirty", *scope)
    except NotARepository:
        return "not a git repository"
    except GitError as e:   # git missing, too slow, unreadable config: say so, never fail the prompt
        return f"git unavailable ({e})"
    if status != 0:
        return f"git status failed ({(err.strip().splitlines() or ['exit status %d' % status])[-1]})"
    entries = out.split("\0")
    head = entries[0][3:] if entries and entries[0].startswith("## ") else ""
    staged = changed = 0
    skip = False
    for e in entries[1:]:
        if skip or len(e) < 3:          # the source path of a rename or copy; the trailing ''
            skip = False
            continue
        x, y = e[0], e[1]
        staged += x not in " ?!"
        changed += y != " "
        skip = x in "RC"
    state = "clean" if not changed and not staged else f"{staged} staged, {changed} modified or untracked"
    return f"branch {_branch(head)}, {state}"


def _branch(head: str) -> str:
    for lead in ("No commits yet on ", "Initial commit on "):
        if head.startswith(lead):
            return head[len(lead):]
    if head.startswith("HEAD (no branch)"):
        return "detached HEAD"
    return head.split("...", 1)[0].split(" [", 1)[0] or "unknown branch"


def system_text(root: Path) -> str:
    root = Path(root)
    agents = root / "AGENTS.md"
    try:
        agents_md = agents.read_text(encoding="utf-8", errors="replace") if agents.is_file() else None
    except OSError:
        agents_md = None
    return agent_system_text(cwd=str(root), os_name=f"{platform.system()} {platform.release()}",
                             date=datetime.date.today().isoformat(), git=git_summary(root),
                             agents_md=agents_md)
