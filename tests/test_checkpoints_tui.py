"""/undo in the TUI: the diff shows as a notice, the question about a file someone else changed comes
up in the approval bar with a sensible line, and the answer reaches the worker (the app is unchanged:
a command's approval uses the tool calls' bar)."""
from __future__ import annotations

import time

import pytest

textual = pytest.importorskip("textual")

from ds4agent.app import AgentApp  # noqa: E402
from ds4agent.tui_widgets import ApprovalBar, NoticeLine  # noqa: E402
from helpers_tui import (HELLO, edit_call, finish_after_tool, idle, make_factory, press, running, send,  # noqa: E402
                         sync, until)


@pytest.mark.slow       # its own engine and system prefix, and a TUI turn: minutes on a loaded 2-core machine
@sync
async def test_undo_asks_in_the_approval_bar(tui_env, tui_project):
    app = AgentApp(make_factory(tui_env, max_turn_tokens=400, on_event=finish_after_tool("Fixed.")))
    async with running(app) as pilot:
        agent = app.worker.agent
        agent.cfg.yolo = True                       # the edit runs unasked ...
        agent.force(edit_call())
        await send(pilot, "fix the typo in hello.py")
        await idle(pilot, 1, timeout=180)
        assert "hello world" in (tui_project / "hello.py").read_text()
        agent.cfg.yolo = False                      # ... the undo asks
        (tui_project / "hello.py").write_text(HELLO + "# mine\n")      # someone else's change
        await send(pilot, "/undo")
        await until(pilot, lambda: app.approval is not None, "the undo question", timeout=60)
        line = str(app.approval.content)
        assert "Allow overwriting 1 file(s) changed outside the agent since: hello.py?" in line, line
        app.approval.shown_at = time.monotonic()
        await pilot.pause(ApprovalBar.GUARD_S + 0.05)
        await press(pilot, "n")
        await until(pilot, lambda: any("kept as they are" in str(n.content) for n in app.query(NoticeLine)),
                    "the undo's reply", timeout=60)
        notices = "\n".join(str(n.content) for n in app.query(NoticeLine))
        assert "/undo: the files go back to before step 1" in notices and "hello.py" in notices
        assert (tui_project / "hello.py").read_text() == HELLO + "# mine\n"
        assert app.approval is None and app.focused is app.input
