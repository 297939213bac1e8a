"""Tools the model may call: read, write, edit, list, search, outline, bash (+ bash_status,
bash_stop), git, git_commit.

Each is a plain function with a JSON schema (tools.base.Tool) registered in REGISTRY. The caller
renders `schemas()` into the system prompt, asks the user before running a tool whose
`needs_approval` is set (write, edit, bash, git_commit; `summary()` gives the line to show), and
runs it with `call(name, arguments, ctx)`, which never raises for anything the model can get
wrong. This package imports nothing of ours outside tools/.
"""
from __future__ import annotations

from . import files, git_tool, outline, search, shell  # noqa: F401  (fills REGISTRY)
from .base import REGISTRY, Tool, ToolContext, ToolError, ToolResult, call, check_args

# The order the model sees them in: look, change, run, version control.
ORDER = ["read", "list", "search", "outline", "edit", "write", "bash", "bash_status", "bash_stop",
         "git", "git_commit"]

__all__ = ["REGISTRY", "Tool", "ToolContext", "ToolError", "ToolResult", "call", "check_args",
           "schemas", "tools", "summary", "close"]


def tools() -> list[Tool]:
    """Every registered tool in a stable order (ORDER, then any others by name)."""
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(REGISTRY.values(), key=lambda t: (rank.get(t.name, len(ORDER)), t.name))


def schemas() -> list[str]:
    """Each tool's OpenAI-style function schema as compact JSON text, in a stable order."""
    return [t.schema_json() for t in tools()]


def summary(name: str, args) -> str:
    """One line for an approval prompt: what the call would do. Never raises."""
    try:
        tool = REGISTRY.get(name)
        a = check_args(tool, args) if tool else {}
    except Exception:
        return f"{name} (invalid arguments)"
    short = lambda s, n=160: (s if len(s) <= n else s[:n - 3] + "...").replace("\n", "⏎ ")
    if name == "bash":
        return f"run: {short(a['command'])}"
    if name == "write":
        return f"write {a['path']} ({len(a['content'])} characters)"
    if name == "edit":
        if a.get("start_line") is not None:
            return f"edit {a['path']} lines {a['start_line']}-{a.get('end_line', a['start_line'])}"
        return f"edit {a['path']} (replace text)"
    if name == "git_commit":
        what = ", ".join(a.get("paths") or []) or ("all tracked changes" if a.get("all") else "staged changes")
        return f"git commit ({what}): {short(a['message'].splitlines()[0] if a['message'].strip() else '')}"
    return f"{name} {short(str(a))}"


def close(ctx: ToolContext) -> None:
    """End of a session: stop its bash jobs and remove temporary logs."""
    shell.close(ctx)
