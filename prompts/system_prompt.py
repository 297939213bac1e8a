"""The agent's system text: a template in prompts/system/agent.txt plus the environment facts the
application gathers (working directory, OS, date, git summary, the project's AGENTS.md)."""
from __future__ import annotations

from pathlib import Path

SYSTEM_DIR = Path(__file__).parent / "system"
AGENTS_MD_LIMIT = 16_000  # characters of AGENTS.md put in the prompt


def agent_system_text(*, cwd: str, os_name: str, date: str, git: str, agents_md: str | None) -> str:
    template = (SYSTEM_DIR / "agent.txt").read_text(encoding="utf-8")
    extra = ""
    if agents_md:
        body = agents_md if len(agents_md) <= AGENTS_MD_LIMIT else (
            agents_md[:AGENTS_MD_LIMIT] + f"\n[... AGENTS.md cut at {AGENTS_MD_LIMIT} characters ...]")
        extra = "\nProject instructions (AGENTS.md):\n" + body.rstrip() + "\n"
    return template.format(cwd=cwd, os=os_name, date=date, git=git, agents_md=extra).rstrip() + "\n"
