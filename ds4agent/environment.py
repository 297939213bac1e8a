"""The environment facts of the system prompt: directory, OS, date, git summary, AGENTS.md."""
from __future__ import annotations

import datetime
import platform
from pathlib import Path

from prompts.system_prompt import AGENTS_MD_LIMIT, agent_system_text
from tools.base import ToolContext, ToolError
from tools.gitpy import safe_git
from tools.gitsafe import GitError, NotARepository
from tools.safefs import read_inside


def git_summary(root: Path) -> str:
    """Branch and counts of staged and changed files, for the project's folder only. Runs git
    through GitPython as tools.gitpy wraps it, with tools.gitsafe's environment and overrides: a
    cloned repository's config (fsmonitor, filters, hooks) runs nothing."""
    try:
        g = safe_git(root)
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
    return agent_system_text(cwd=str(root), os_name=f"{platform.system()} {platform.release()}",
                             date=datetime.date.today().isoformat(), git=git_summary(root),
                             agents_md=read_agents_md(root))


def read_agents_md(root: Path) -> str | None:
    """The project's AGENTS.md, read as the read tool reads: a regular file whose opened descriptor
    lies inside the project (a cloned repository can commit AGENTS.md as a symlink to
    /proc/self/environ or ~/.ssh/id_rsa, which would go into the prompt), of a bounded size (the
    prompt keeps its first AGENTS_MD_LIMIT characters; a multi-GB target is not read)."""
    root = Path(root)
    try:
        _, data = read_inside(ToolContext(root=root), root / "AGENTS.md", limit=4 * AGENTS_MD_LIMIT + 4096)
    except (OSError, ToolError):
        return None
    return data.decode("utf-8", "replace") if data is not None else None
