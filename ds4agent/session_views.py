"""Saved sessions as text: the rows of /list and `ds4-agent sessions list` (a tree: each save under
the one it continues, pending forks under their branch point), one session in detail (`sessions
show`), and the line that says how to come back to a session. Shared by the TUI's slash commands
and the command line, so both show a session the same way."""
from __future__ import annotations

import os
import shlex
import time

import prompts
from sessions import SessionInfo, SessionStore
from sessions.kvfile import KVFileError, read_info
from sessions.retention import replaced

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


def row(r: SessionInfo, current: str | None = None, number: int | None = None, depth: int = 0,
        branch: str | None = None, project: str | None = None, replaced: bool = False) -> str:
    """One session's line; `depth`: how far down the lineage tree it is. `*` when it is `current`
    (and, `branch` given, not a pending fork of it that is the live one). `project`: the project
    column of the every-project view; `replaced`: say why an older version is listed."""
    live_fork = branch is not None and any(f.branch == branch for f in r.forks)
    mark = "*" if current is not None and r.sha == current and not live_fork else " "
    num = f"{number:>3}. " if number is not None else ""
    where = f"{project}  " if project is not None else ""
    return (f"{mark} {num}{indent(depth)}{r.id}  {age(r.updated)}  {where}{label(r)}  "
            f"[{r.tokens} tokens, {r.think_mode or '?'}]" +
            ("  (replaced: /undo or /compact went back before it; --resume ID still continues it)"
             if replaced else "") +
            ("" if r.ok else f"  DAMAGED: {one_line(r.error, 160)}  ({r.path})"))


PROJECT_WIDTH = 32


def project_label(path: str | None) -> str:
    """A project folder for the project column: ~ for the home folder, the end of a long path."""
    if not path:
        return "(unknown project)"
    home = os.path.expanduser("~")
    p = "~" + path[len(home):] if home not in ("", "/") and (path == home or path.startswith(home + os.sep)) \
        else path
    return p if len(p) <= PROJECT_WIDTH else "…" + p[-(PROJECT_WIDTH - 1):]


def indent(depth: int) -> str:
    return "  " * (depth - 1) + "└ " if depth else ""


def fork_row(r: SessionInfo, f, depth: int, current: str | None, branch: str | None) -> str:
    """A pending fork: no file of its own yet (its text is its branch point's, `r`)."""
    mark = "*" if current == r.sha and branch == f.branch else " "
    return f"{mark} {indent(depth)}{'fork':8}  {age(f.created)}  {f.name}: no turn yet (same text as {r.id})"


MAX_DEPTH = 32            # forks of forks deeper than this are shown at this depth


def tree(rows: list[SessionInfo]) -> list[tuple[int, SessionInfo]]:
    """The rows as a lineage tree: (depth, row) in display order. A branch's saves are one flat
    group, newest first (a linear history reads as before); a fork's group is indented under the
    save it branched from (the nearest of its ancestors listed, of another branch). Groups are
    ordered newest first by the newest save in them and under them, so the conversation in use
    comes first. Records without a branch (older ones) go with their ancestor's group; a lineage
    that loops (damage) still lists every row once."""
    by = {r.sha: r for r in rows}
    up = {r.sha: next((by[a] for a in reversed(r.ancestors) if a in by and a != r.sha), None) for r in rows}

    def same(r, p):
        return r.branch is None or p.branch is None or r.branch == p.branch

    top: dict[str, str] = {}                       # row -> the first save of its group
    for r in rows:
        t, seen = r, {r.sha}
        while up[t.sha] is not None and same(t, up[t.sha]) and up[t.sha].sha not in seen:
            t = up[t.sha]
            seen.add(t.sha)
        top[r.sha] = t.sha
    groups: dict[str, list[SessionInfo]] = {}
    for r in rows:
        groups.setdefault(top[r.sha], []).append(r)
    under: dict[str | None, list[str]] = {}        # a save -> the groups that fork from it
    for g in groups:
        p = up[g]
        under.setdefault(p.sha if p is not None and top.get(p.sha) != g else None, []).append(g)
    newest = {g: max(r.updated for r in members) for g, members in groups.items()}
    for g in groups:                               # a group is as new as the newest fork under it
        p, seen = up[g], {g}
        while p is not None and top[p.sha] not in seen:
            seen.add(top[p.sha])
            newest[top[p.sha]] = max(newest[top[p.sha]], newest[g])
            p = up[top[p.sha]]
    out: list[tuple[int, SessionInfo]] = []
    done: set[str] = set()
    roots = sorted(under.get(None, ()), key=newest.get, reverse=True) + list(groups)
    stack = [("group", g, 0) for g in reversed(roots)]    # (an explicit stack: no recursion limit)
    while stack:
        kind, x, depth = stack.pop()
        if kind == "row":
            out.append((depth, x))
            kids = sorted(under.get(x.sha, ()), key=newest.get, reverse=True)
            stack += [("group", k, min(depth + 1, MAX_DEPTH)) for k in reversed(kids)]
        elif x not in done:
            done.add(x)
            stack += [("row", r, depth) for r in sorted(groups[x], key=lambda r: (r.updated, r.sha))]
    return out


def list_text(store: SessionStore, scope: str = "project", current: str | None = None,
              all_hint: str = "/list all", branch: str | None = None) -> str:
    """What /list shows: the lineage tree, newest first, `*` on the session you are in (`branch`:
    the live branch, to tell a pending fork from its branch point); damaged sessions of an unknown
    project are counted in the project view (their record cannot say where they belong)."""
    rows = store.list(scope)
    stray = [] if scope == "all" else [r for r in store.list("all") if not r.ok and r.project_dir is None]
    note = f"\n  ({len(stray)} damaged session(s) of unknown project: {all_hint} shows them)" if stray else ""
    if not rows:
        return "no saved sessions" + ("" if scope == "all" else f" in this project ({all_hint} shows every project)") + note
    lines = []
    older = replaced(rows)
    where = {r.sha: project_label(r.project_dir) for r in rows} if scope == "all" else {}
    width = max(map(len, where.values()), default=0)
    for depth, r in tree(rows):
        lines.append(row(r, current, depth=depth, branch=branch, replaced=r.sha in older,
                         project=where[r.sha].ljust(width) if where else None))
        lines += [fork_row(r, f, depth + 1, current, branch) for f in r.forks]
    return "\n".join(lines) + note


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
        lines.append(f"  name      {info.name}" + (" (a fork with no turn yet: its text is this record's)"
                                                  if info.fork_pending else ""))
    if info.earlier_of:
        lines.append(f"  saved as  {info.earlier_of} (the name has moved on to a later save)")
    lines += [f"  project   {info.project_dir or '(unknown)'}",
              f"  tokens    {info.tokens}" + (f" of a {info.ctx}-token context" if info.ctx else ""),
              f"  thinking  {info.think_mode or '?'}",
              f"  branch    {info.branch or '(none: saved before branches)'}",
              f"  model     {info.model or '?'}" + (f" ({info.quant_bits}-bit experts)" if info.quant_bits else ""),
              f"  created   {when(info.created)}",
              f"  updated   {when(info.updated)}",
              f"  file      {info.path} ({info.size / 2**20:.1f} MiB)"]
    if info.ancestors:
        kept = {e.sha: e for e in store.list("all")}
        lines.append("  continues " + " <- ".join(
            (f"{a[:8]}" + (f" ({label(kept[a])})" if a in kept else " (not kept)"))
            for a in reversed(info.ancestors)))
    lines += [f"  fork      {f.name} (no turn yet)" for f in info.forks]
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
