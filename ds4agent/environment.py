"""The environment facts of the system prompt: directory, OS, date, git summary, AGENTS.md."""
from __future__ import annotations

import datetime
import platform
from pathlib import Path

from prompts.system_prompt import agent_system_text


def git_summary(root: Path) -> str:
    try:
        import git
        repo = git.Repo(root, search_parent_directories=True)
    except Exception:   # not a repository, or git unavailable: say so, never fail the prompt
        return "not a git repository"
    try:
        branch = repo.active_branch.name
    except TypeError:
        branch = "detached HEAD"
    except Exception:
        branch = "unknown branch"
    try:
        changed = len(repo.index.diff(None)) + len(repo.untracked_files)
        staged = len(repo.index.diff("HEAD")) if repo.head.is_valid() else len(list(repo.index.entries))
    except Exception:
        return f"branch {branch}"
    state = "clean" if not changed and not staged else f"{staged} staged, {changed} modified or untracked"
    return f"branch {branch}, {state}"


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
