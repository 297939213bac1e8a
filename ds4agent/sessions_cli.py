"""`ds4-agent sessions [list|show|delete|prune]` and the choice behind `--resume NAME|ID|pick`.

Saved sessions outside the TUI: nothing here loads the model (a session's record and the head of
its KV file say all that is shown). The store is the agent's (`$DS4_AGENT_HOME/sessions` or
`~/.ds4-agent/sessions`) and the project is the current directory, as for the agent itself.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from sessions import SessionStore, SessionStoreError

from .session_views import list_text, project_label, row, show_text

PICK = "pick"


class NoChoice(Exception):
    """The user left the picker without choosing."""


def _parser() -> argparse.ArgumentParser:
    from engine.cli_help import ArgumentParser
    p = ArgumentParser(prog="ds4-agent sessions",
                                description="the agent's saved sessions (the TUI's /list, /delete)")
    sub = p.add_subparsers(dest="cmd")
    ls = sub.add_parser("list", help="saved sessions of this directory, newest first (the default)")
    ls.add_argument("--all", action="store_true", help="every project's sessions")
    sh = sub.add_parser("show", help="one session: its record, lineage and last user messages")
    sh.add_argument("ref", metavar="ID|NAME", help="the session's name or the start of its id")
    de = sub.add_parser("delete", help="delete a saved session (its .kv file and its record)")
    de.add_argument("ref", metavar="ID|NAME", help="the session's name or the start of its id")
    pr = sub.add_parser("prune", help="delete unnamed sessions, oldest first, until the store fits a size "
                                      "(shows the plan; --yes deletes)")
    pr.add_argument("--max-size", required=True, metavar="SIZE",
                    help="the size the whole store may take: bytes, or a number with K, M, G or T (500M, 2G)")
    pr.add_argument("--yes", action="store_true", help="delete them (without it, only say what would go)")
    return p


def main(argv: list[str], *, out=None) -> int:
    out = out or sys.stdout
    a = _parser().parse_args(argv)
    try:
        store = SessionStore()
        if a.cmd in (None, "list"):
            rows = [r for r in store.list("project") if r.ok]
            newest = rows[0].sha if rows else None
            text = list_text(store, "all" if getattr(a, "all", False) else "project", current=newest,
                             all_hint="`ds4-agent sessions list --all`")
            out.write(text + "\n")
            if newest is not None:
                out.write("(* is the one `ds4-agent --resume` continues; `--resume NAME|ID` or "
                          "`--resume pick` chooses)\n")
        elif a.cmd == "show":
            out.write(show_text(store, store.resolve(a.ref)) + "\n")
        elif a.cmd == "prune":
            return _prune(store, a.max_size, a.yes, out)
        else:
            info = store.delete(a.ref)
            out.write(f"deleted session {info.id} ({info.label})\n")
    except SessionStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _prune(store: SessionStore, max_size: str, yes: bool, out) -> int:
    """Bring the store under `max_size` by deleting unnamed sessions, oldest first; a dry run
    unless `yes` (deleting is not undone, and the budget may be a typo)."""
    from sessions.retention import apply_prune, human, parse_size, plan_prune, store_bytes
    try:
        budget = parse_size(max_size)
    except ValueError as e:
        print(f"error: --max-size: {e}", file=sys.stderr)
        return 1
    plan = plan_prune(store, budget)
    out.write(f"the session store {store.root} holds {human(plan.total)}; the budget is {human(budget)}\n")
    if not plan.doomed:
        out.write("nothing to delete\n" if plan.fits else
                  "nothing can be deleted: what is left is named sessions, damaged ones (`sessions list "
                  "--all` shows them) and cached system prompts\n")
        return 0 if plan.fits else 1
    what = f"{len(plan.doomed)} unnamed session(s), oldest first ({human(plan.freed)})"
    out.write(("deleting " if yes else "would delete ") + what + ":\n")
    out.write("".join(row(e, project=project_label(e.project_dir)) + "\n" for e in plan.doomed))
    if yes:
        gone = apply_prune(store, plan)
        out.write(f"deleted {len(gone)} session(s); the store holds {human(store_bytes(store))} now\n")
    else:
        out.write(f"after: {human(plan.after)}. Named sessions are never deleted. "
                  "Run again with --yes to delete these.\n")
    if not plan.fits:
        out.write("(named sessions and cached system prompts alone are over the budget)\n")
    return 0


def choose_resume(store: SessionStore, ref: str, *, ask: Callable[[str], str] | None = None, out=None) -> str:
    """The sha of the session `--resume REF` continues (a fork with no turn yet: its name): REF is a name or the start of an id, or
    `pick` to choose from this directory's sessions by number on the terminal (plain input(),
    before any UI; the list and the question go to stderr, so `-p`'s answer alone is on stdout).
    SessionStoreError says why none can be; NoChoice when the user quits."""
    out = out or sys.stderr

    def ask_terminal(prompt: str) -> str:
        out.write(prompt)
        out.flush()
        return input()
    ask = ask or ask_terminal
    if ref != PICK:
        info = store.resolve(ref)
        if not info.ok:
            raise SessionStoreError(f"session {info.id} is damaged, it cannot be resumed: {info.error}")
        return info.name if info.fork_pending else info.sha    # a fork is its parent's file under its own name
    rows = [r for r in store.list("project") if r.ok]
    if not rows:
        raise SessionStoreError("no saved sessions in this directory to pick from "
                                "(`ds4-agent sessions list --all` shows every project's)")
    out.write("saved sessions of this directory, newest first:\n")
    out.write("".join(row(r, number=i) + "\n" for i, r in enumerate(rows, 1)))
    out.flush()
    while True:
        try:
            answer = ask(f"continue which one? [1-{len(rows)}, Enter: 1, q: quit] ").strip().lower()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")                # the terminal's line ends here, not after a typed answer
            raise NoChoice() from None
        if answer in ("q", "quit"):
            raise NoChoice()
        if not answer:
            return rows[0].sha
        if answer.isdigit() and 1 <= int(answer) <= len(rows):
            return rows[int(answer) - 1].sha
        out.write(f"  {answer!r} is not a number from 1 to {len(rows)}\n")
