"""`ds4-agent -p TASK`: one task to completion without a UI, for scripts and CI.

The answer goes to stdout as it streams. The reasoning streams to stderr (dimmed when stderr is a
terminal; `quiet` hides it), so a thinking model shows it is working long before the answer; on a
terminal a live line shows a prefill's progress.
Tool calls and notices go to stderr too. Tools that need approval run only with --yolo (a
headless run cannot ask). Exit status 0 when the model finished its answer and the session was
saved, 1 on an error, an interruption, the token cap, a session that could not be saved or a
model that could not load.
"""
from __future__ import annotations

import json
import sys
import threading

from . import events as E
from .worker import AgentWorker

DIM, PLAIN = "\x1b[2m", "\x1b[0m"
STOP_GRACE_S = 20.0     # how long an interrupted run waits for the turn to stop and be saved


def _is_tty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


def run_headless(make_agent, task: str, *, resume: bool = False, quiet: bool = False,
                 out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    dim = _is_tty(err)
    calls: list[str] = []
    said: set[str] = set()
    state = {"finished": None, "thinking": False, "live": False, "errors": 0, "reader_gone": False,
             "awaiting": False, "reply": None}
    replied = threading.Event()

    def end_live():
        # the prefill's live line is overwritten in place; cleared before anything else is written
        if state["live"]:
            err.write("\r\x1b[K")
            state["live"] = False

    def end_thinking():
        # the reasoning block ends on its own line, out of the dim colour, before anything else on stderr
        if state["thinking"]:
            err.write((PLAIN if dim else "") + "\n")
            err.flush()
            state["thinking"] = False

    def emit(ev):
        if isinstance(ev, E.Prefill):
            if dim and not quiet and ev.total:
                _prefill_line(ev, err)
                state["live"] = True
            return
        if isinstance(ev, E.ReasoningDelta):
            if quiet or not ev.text:
                return
            end_live()
            if not state["thinking"]:
                err.write(DIM if dim else "")
                state["thinking"] = True
            err.write(ev.text)
            err.flush()
            return
        if isinstance(ev, E.TurnFinished):
            state["finished"] = ev
            return
        if isinstance(ev, E.Notice) and state["awaiting"]:
            state["reply"], state["awaiting"] = ev.text, False     # the resume's answer
            replied.set()
            return
        if isinstance(ev, E.ApprovalNeeded):
            worker.answer("n")
        text = _line(ev, calls)
        if text is None:
            return
        if isinstance(ev, E.Notice):
            state["errors"] += ev.level == "error"
            if text in said:          # a failure repeated (the turn's save, then the exit's): once
                return
            said.add(text)
        end_live()
        end_thinking()
        if not isinstance(ev, E.TextDelta):
            err.write(text)
            err.flush()
        else:
            _write_answer(text, out, state, worker)

    worker = AgentWorker(make_agent, emit)
    worker.ready.wait()
    if worker.failed:
        return 1
    if resume and not _resumed(worker, resume, state, replied, err):
        return 1
    _run_task(worker, task, lambda: (end_live(), end_thinking()), err)
    end_live()
    end_thinking()
    if state["reader_gone"]:
        raise BrokenPipeError("the reader of the answer went away")
    return _summary(worker.agent, state, calls, out, err)


def _write_answer(text: str, out, state: dict, worker):
    if state["reader_gone"]:
        return
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        # `ds4-agent -p ... | head -1`: nobody reads the answer any more; the turn stops (and is
        # saved), and the run ends quietly (engine/console.py)
        state["reader_gone"] = True
        worker.interrupt()


def _prefill_line(ev, err):
    """A long prefill (the system prompt on a first start, a big message) is minutes of silence
    on the real model: on a terminal one line, rewritten in place, says how far it is."""
    eta = f", {ev.eta_s:.0f} s left" if ev.tokens_per_s else ""
    err.write(f"\r\x1b[K{DIM}prefill {ev.done}/{ev.total} tokens"
              f"{f' ({ev.tokens_per_s:.0f} t/s{eta})' if ev.tokens_per_s else ''}{PLAIN}")
    err.flush()


def _resumed(worker, resume, state: dict, replied: threading.Event, err) -> bool:
    """Continue the session first: True the last one of the directory, else the sha `--resume
    NAME|ID|pick` chose. A resume that fails ends the run (False): the task never starts over as
    a new session unseen."""
    state["awaiting"] = True
    worker.send_command("/resume" if resume is True else f"/switch {resume}")
    replied.wait()
    if "switched to session" in (state["reply"] or ""):
        return True
    err.write(f"error: cannot resume: {(state['reply'] or 'no answer').strip()}\n")
    worker.stop(timeout=None)
    return False


def _run_task(worker, task: str, end_lines, err):
    """Run the task to its end. Ctrl+C or SIGTERM stops the turn and lets the worker save it (a
    second one leaves at once); a worker still inside the engine when the process ends is
    ds4agent/cli.py's to handle."""
    worker.send_user(task)
    try:
        worker.stop(timeout=None)
    except KeyboardInterrupt:
        end_lines()
        err.write("interrupted: saving the session (Ctrl+C again leaves at once)\n")
        err.flush()
        worker.interrupt()
        worker.done.wait(STOP_GRACE_S)
        raise


def _summary(agent, state: dict, calls: list[str], out, err) -> int:
    """The closing lines (tool calls, how the turn finished) and the exit status."""
    fin = state["finished"]
    out.write("\n")
    err.write(f"\n{len(calls)} tool call(s)" + ("".join(f"\n  {c}" for c in calls)) + "\n")
    if fin is None:
        return 1
    err.write(f"finished: {fin.finish_reason}\n")
    # the turn's save and the exit's both failed (said once above, as "save failed: ..."); any
    # error said on the way (the exit's save alone failing is one) fails the run as well
    unsaved = agent is not None and agent.store is not None and agent.cfg.autosave and agent.modified
    ok = fin.finish_reason == "stop" and not fin.interrupted and not unsaved and not state["errors"]
    return 0 if ok else 1


def _line(ev, calls: list[str]) -> str | None:
    """What an event prints (stdout for answer text, stderr for the rest), or None; a finished
    tool call also goes into the summary."""
    if isinstance(ev, E.TextDelta):
        return ev.text or None
    if isinstance(ev, E.ToolStarted):
        return f"\n[tool] {ev.name} {json.dumps(ev.arguments, ensure_ascii=False)[:300]}\n"
    if isinstance(ev, E.ToolFinished):
        status = "ok" if ev.ok else ("refused" if not ev.approved else "failed")
        calls.append(f"{ev.name}: {status}" + (f" (exit {ev.exit_status})" if ev.exit_status is not None else ""))
        return f"[tool] {ev.name} -> {status}\n"
    if isinstance(ev, E.ApprovalNeeded):
        return f"[approval] {ev.summary}: refused (headless; use --yolo to allow)\n"
    if isinstance(ev, E.Notice) and ev.level != "info":
        return f"[{ev.level}] {ev.text}\n"
    return None
