"""Saved sessions as text: the rows of /list and `ds4-agent sessions list`, one session in detail
(`sessions show`), and the line that says how to come back to a session. Shared by the TUI's
slash commands and the command line, so both show a session the same way."""
from __future__ import annotations

import shlex
import time

import prompts
from sessions import SessionInfo, SessionStore
from sessions.kvfile import KVFileError, read_info

SHOW_TURNS = 5


def one_line(s: str, n: int = 100) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def age(t: float, now: float | None = None) -> str:
    d = max(0, (time.time() if now is None else now) - t)
    for unit, sec in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= sec:
            return f"{int(d // sec)}{unit} ago"
    return f"{int(d)}s ago"


def label(r: SessionInfo) -> str:
    """name: title, or (earlier save of NAME) title for a named snapshot whose name moved on."""
    if r.name:
        return f"{r.name}: {r.title}"
    if r.earlier_of:
        return f"(earlier save of {r.earlier_of}) {r.title}"
    return r.title


def row(r: SessionInfo, current: str | None = None, number: int | None = None) -> str:
    mark = "*" if current is not None and r.sha == current else " "
    num = f"{number:>3}. " if number is not None else ""
    return (f"{mark} {num}{r.id}  {age(r.updated)}  {label(r)}  [{r.tokens} tokens, {r.think_mode or '?'}]" +
            ("" if r.ok else f"  DAMAGED: {one_line(r.error, 160)}  ({r.path})"))


def list_text(store: SessionStore, scope: str = "project", current: str | None = None,
              all_hint: str = "/list all") -> str:
    """What /list shows: newest first, `*` on the session you are in; damaged sessions of an
    unknown project are counted in the project view (their record cannot say where they belong)."""
    rows = store.list(scope)
    stray = [] if scope == "all" else [r for r in store.list("all") if not r.ok and r.project_dir is None]
    note = f"\n  ({len(stray)} damaged session(s) of unknown project: {all_hint} shows them)" if stray else ""
    if not rows:
        return "no saved sessions" + ("" if scope == "all" else f" in this project ({all_hint} shows every project)") + note
    return "\n".join(row(r, current) for r in rows) + note


def user_turns(text: str) -> list[str]:
    """The user messages of a rendered timeline (tool results left out)."""
    out = []
    for chunk in text.split(prompts.USER)[1:]:
        msg = chunk.partition(prompts.ASSISTANT)[0]
        if not msg.startswith("<tool_result>"):
            out.append(msg)
    return out


def show_text(store: SessionStore, info: SessionInfo) -> str:
    """One session in detail: its record, its lineage (which earlier saves are still on disk) and
    its last user messages."""
    def when(t):
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "?"
    lines = [f"session {info.sha}",
             f"  title     {info.title}"]
    if info.name:
        lines.append(f"  name      {info.name}")
    if info.earlier_of:
        lines.append(f"  saved as  {info.earlier_of} (the name has moved on to a later save)")
    lines += [f"  project   {info.project_dir or '(unknown)'}",
              f"  tokens    {info.tokens}" + (f" of a {info.ctx}-token context" if info.ctx else ""),
              f"  thinking  {info.think_mode or '?'}",
              f"  model     {info.model or '?'}" + (f" ({info.quant_bits}-bit experts)" if info.quant_bits else ""),
              f"  created   {when(info.created)}",
              f"  updated   {when(info.updated)}",
              f"  file      {info.path} ({info.size / 2**20:.1f} MiB)"]
    if info.ancestors:
        kept = {e.sha: e for e in store.list("all")}
        lines.append("  continues " + " <- ".join(
            (f"{a[:8]}" + (f" ({label(kept[a])})" if a in kept else " (not kept)"))
            for a in reversed(info.ancestors)))
    if not info.ok:
        lines.append(f"  DAMAGED   {info.error}")
        return "\n".join(lines)
    try:
        text = read_info(info.path, with_tool_map=False).text.decode("utf-8", "replace")
    except KVFileError as e:
        lines.append(f"  DAMAGED   {e.problem}")
        return "\n".join(lines)
    turns = user_turns(text)
    if turns:
        lines.append(f"  user turns ({len(turns)}, the last {min(len(turns), SHOW_TURNS)}):")
        lines += [f"    > {one_line(u, 200)}" for u in turns[-SHOW_TURNS:]]
    return "\n".join(lines)


def resume_hint(info: SessionInfo) -> str:
    """The line printed when the agent exits: where the session is and how to continue it."""
    ref = shlex.quote(info.name) if info.name and info.name.isprintable() and not info.name.startswith("-") \
        else info.id
    return (f"session {info.name or info.id} saved ({info.tokens} tokens) in {info.path}\n"
            f"continue it with: ds4-agent --resume {ref}")
