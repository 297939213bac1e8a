"""`ds4-agent -p TASK`: one task to completion without a UI, for scripts and CI.

The answer goes to stdout as it streams; tool calls and notices go to stderr. Tools that need
approval run only with --yolo (a headless run cannot ask). Exit status 0 when the model finished
its answer, 1 on an error, an interruption, the token cap or a model that could not load.
"""
from __future__ import annotations

import json
import sys

from . import events as E
from .worker import AgentWorker


def run_headless(make_agent, task: str, *, resume: bool = False, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    calls: list[str] = []
    state = {"finished": None}

    def emit(ev):
        if isinstance(ev, E.TextDelta):
            out.write(ev.text)
            out.flush()
        elif isinstance(ev, E.ToolStarted):
            err.write(f"\n[tool] {ev.name} {json.dumps(ev.arguments, ensure_ascii=False)[:300]}\n")
        elif isinstance(ev, E.ToolFinished):
            status = "ok" if ev.ok else ("refused" if not ev.approved else "failed")
            calls.append(f"{ev.name}: {status}" + (f" (exit {ev.exit_status})" if ev.exit_status is not None else ""))
            err.write(f"[tool] {ev.name} -> {status}\n")
        elif isinstance(ev, E.ApprovalNeeded):
            err.write(f"[approval] {ev.summary}: refused (headless; use --yolo to allow)\n")
            worker.answer("n")
        elif isinstance(ev, E.Notice) and ev.level != "info":
            err.write(f"[{ev.level}] {ev.text}\n")
        elif isinstance(ev, E.TurnFinished):
            state["finished"] = ev

    worker = AgentWorker(make_agent, emit)
    worker.ready.wait()
    if worker.failed:
        return 1
    if resume:
        worker.send_command("/resume")
    worker.send_user(task)
    worker.stop(timeout=None)
    fin = state["finished"]
    out.write("\n")
    err.write(f"\n{len(calls)} tool call(s)" + ("".join(f"\n  {c}" for c in calls)) + "\n")
    if fin is None:
        return 1
    err.write(f"finished: {fin.finish_reason}\n")
    return 0 if fin.finish_reason == "stop" and not fin.interrupted else 1
