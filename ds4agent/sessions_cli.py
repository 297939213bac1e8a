"""`ds4-agent sessions [list|show|delete]` and the choice behind `--resume NAME|ID|pick`.

Saved sessions outside the TUI: nothing here loads the model (a session's record and the head of
its KV file say all that is shown). The store is the agent's (`$DS4_AGENT_HOME/sessions` or
`~/.ds4-agent/sessions`) and the project is the current directory, as for the agent itself.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from sessions import SessionStore, SessionStoreError

from .session_views import list_text, row, show_text

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
        else:
            info = store.delete(a.ref)
            out.write(f"deleted session {info.id} ({info.label})\n")
    except SessionStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
