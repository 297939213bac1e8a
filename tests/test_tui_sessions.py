"""Sessions in the TUI (issue 24 items 6, 8, 9): a name that follows /switch and the next turn,
/list's mark on the current session, /delete, and the slash commands that cannot wait behind a
running turn (/quit, /new, /switch, /resume, /think stop it first). Pilot tests over the real
agent on the tiny model, with the TUI fixtures of conftest.py (one system-prefix prefill per module)."""
from __future__ import annotations

import time

import pytest

textual = pytest.importorskip("textual")

from ds4agent import app as app_mod  # noqa: E402
from ds4agent import events as E  # noqa: E402
from ds4agent.app import AgentApp  # noqa: E402
from ds4agent.tui_widgets import NoticeLine  # noqa: E402
from helpers_tui import idle, make_factory, running, send, sync, until  # noqa: E402
from sessions import SessionStore  # noqa: E402


def notices(app) -> list[str]:
    return [str(n.content) for n in app.query(NoticeLine)]


async def reply(pilot, app, needle: str, what: str):
    await until(pilot, lambda: any(needle in t for t in notices(app)) and not app.busy, what)
    return next(t for t in reversed(notices(app)) if needle in t)


async def streaming(pilot, app, n: int = 3):
    """Until the running turn has streamed n pieces of text or reasoning (it is surely generating)."""
    def count():
        return sum(isinstance(e, (E.TextDelta, E.ReasoningDelta)) for e in app.events_seen)
    start = count()
    await until(pilot, lambda: count() >= start + n, "streamed text")


@sync
async def test_switch_then_a_turn_keeps_the_name_and_list_marks_it(tui_env, tui_project):
    app = AgentApp(make_factory(tui_env, max_turn_tokens=6))
    store = SessionStore(root=tui_env["store_root"], project_dir=tui_env["proj"])
    async with running(app) as pilot:
        agent = app.worker.agent
        await send(pilot, "first session")
        await idle(pilot, 1)
        await send(pilot, "/save mysession")
        await reply(pilot, app, "as mysession", "/save")
        snapshot = agent.current_sha
        await send(pilot, "/new")
        await reply(pilot, app, "new session", "/new")
        await send(pilot, "/switch mysession")
        await reply(pilot, app, "switched to session", "/switch")
        await send(pilot, "one more turn")
        await idle(pilot, 2)
        # the new turn carries the name; the named save stays as its snapshot
        held = store.resolve("mysession")
        assert held.sha == agent.current_sha != snapshot and held.parent == snapshot
        assert app.status.session == "mysession"
        newest = [r for r in store.list() if r.ok][0]
        assert newest.sha == held.sha                     # what --resume continues
        await send(pilot, "/list")
        listing = await reply(pilot, app, "(earlier save of mysession)", "/list")
        lines = listing.splitlines()
        assert any(ln.startswith(f"* {held.id}") and "mysession: first session" in ln for ln in lines)
        assert any(ln.startswith(f"  {snapshot[:8]}") for ln in lines)
        # /delete: in /help, by id; the snapshot goes, the named conversation stays
        await send(pilot, "/help")
        assert "/delete ID|NAME" in await reply(pilot, app, "/delete", "/help")
        await send(pilot, f"/delete {snapshot[:8]}")
        assert "deleted session" in await reply(pilot, app, "deleted session", "/delete")
        assert snapshot not in {r.sha for r in store.list("all")}
        await send(pilot, "/delete nosuchsession")
        assert "no session 'nosuchsession'" in await reply(pilot, app, "delete failed", "/delete error")


@sync
async def test_quit_during_a_long_turn_stops_it_saves_and_says_how_to_resume(tui_env, tui_project):
    app = AgentApp(make_factory(tui_env, max_turn_tokens=4000))
    async with running(app) as pilot:
        agent = app.worker.agent
        await send(pilot, "write a very long story")
        await streaming(pilot, app)
        t0 = time.monotonic()
        await send(pilot, "/quit")
        await until(pilot, lambda: not app.worker._thread.is_alive(), "the worker to stop", timeout=20)
        assert time.monotonic() - t0 < 15                 # not the ~4000 tokens the turn had left
        await pilot.pause(0.3)                            # the stopped turn's last events arrive
    assert not app.return_code, "the app ended with an error (events drawn after exit?)"
    assert agent.last_finish.interrupted             # (the screen had gone before it could show it)
    assert not agent.modified and agent.exit_save is not None and agent.exit_save.sha == agent.current_sha
    note = agent.farewell()
    assert agent.exit_save.path in note and f"ds4-agent --resume {agent.current_sha[:8]}" in note


@sync
async def test_new_and_think_typed_during_a_turn_stop_it_then_act(tui_env, tui_project):
    app = AgentApp(make_factory(tui_env, max_turn_tokens=4000))
    async with running(app) as pilot:
        agent = app.worker.agent
        await send(pilot, "write a very long story")
        await streaming(pilot, app)
        await send(pilot, "queued question")          # an ordinary message waits its turn
        assert app.queue == ["queued question"]
        await send(pilot, "/think on")                # goes first and stops the turn
        await until(pilot, lambda: agent.cfg.think_mode == "high", "/think to run", timeout=20)
        fin = [e for e in app.events_seen if isinstance(e, E.TurnFinished)]
        assert fin[0].interrupted
        await streaming(pilot, app)                   # the queued question runs next
        users = [m.content for m in agent.transcript if m.role == "user"]
        assert users == ["write a very long story", "queued question"]
        before = agent.current_sha
        await send(pilot, "/new")
        await reply(pilot, app, "new session", "/new")
        assert [e for e in app.events_seen if isinstance(e, E.TurnFinished)][-1].interrupted
        assert not any(m.role == "user" for m in agent.transcript) and agent.current_sha is None
        assert before is not None                     # the stopped turn was saved before /new


def test_run_app_resumes_the_chosen_session_and_prints_the_way_back(monkeypatch, capsys):
    """run_app's part: `--resume SHA` becomes the first command, and once the UI has closed the
    agent's farewell (where it saved, how to continue) is printed on the terminal."""
    made = {}

    class FakeAgent:
        def farewell(self):
            return "session work saved (12 tokens) in /x.kv\ncontinue it with: ds4-agent --resume work"

    class FakeWorker:
        agent = FakeAgent()

        def interrupt(self):
            pass

        def stop(self, timeout=30.0):
            pass

    class FakeApp:
        def __init__(self, make_agent, **opts):
            made.update(opts)
            self.worker, self.return_code = FakeWorker(), 0

        def run(self):
            pass

    monkeypatch.setattr(app_mod, "AgentApp", FakeApp)
    assert app_mod.run_app(lambda emit: None, resume="ab" * 20, history_path=None) == 0
    assert made["initial"] == ["/switch " + "ab" * 20]
    assert "ds4-agent --resume work" in capsys.readouterr().out
    app_mod.run_app(lambda emit: None, resume=True, history_path=None)
    assert made["initial"] == ["/resume"]


# -- the agent's side, without the screen -----------------------------------------------------------
def _agent(env, **kw):
    agent = make_factory(env, **kw)(lambda ev: None)
    agent.start()                      # from the module's cached system prefix
    return agent


def test_deleting_the_session_you_are_in_is_not_undone_by_leaving(tui_env, tui_project):
    agent = _agent(tui_env, max_turn_tokens=4)
    agent.force("a1")
    agent.submit("q1")                 # autosaved
    sha = agent.current_sha
    out = agent.command(f"/delete {sha[:8]}")
    assert out.startswith(f"deleted session {sha[:8]}") and "the session you are in" in out
    agent.save_on_exit()
    assert agent.exit_save is None and agent.farewell() == ""
    assert sha not in {r.sha for r in agent.store.list("all")}
    agent.force("a2")
    agent.submit("q2")                 # continuing it saves it again, as a new session
    assert agent.current_sha not in (None, sha)
    assert "usage: /delete" in agent.command("/delete")


@pytest.mark.slow
def test_the_name_follows_a_compaction(tui_env, tui_project):
    """A compaction rebuilds the timeline (its text no longer extends the saved one): the agent
    tells the store which session it continues, so the name comes along."""
    agent = _agent(tui_env, max_turn_tokens=4)
    for i in range(2):
        agent.force(f"answer {i}")
        agent.submit(f"question {i}")
    assert "as compacted-work" in agent.command("/save compacted-work")
    before = agent.current_sha
    agent.force("SUMMARY: two questions.")
    assert agent.compact("test")
    agent.force("after")
    agent.submit("go on")
    held = agent.store.resolve("compacted-work")
    assert held.sha == agent.current_sha != before and held.parent is None
    assert agent.store.info(before[:8]).earlier_of == "compacted-work"
