"""What the TUI shows (issue 24, items 10-13): the progress bar while the system prompt is
prefilled, a status bar that is live during a turn, reset per turn and fitted to narrow terminals,
a compaction's summary streamed as it is written, and a restored session drawn as it was live.

The screen tests drive AgentApp with a scripted worker (the events the agent emits, in its order),
so they take a second; the agent's side of each (which events it emits, and when) is tested on the
small agent model, and one pilot test runs the whole /save, /new, /switch path on it.
"""
from __future__ import annotations

import json

import pytest

textual = pytest.importorskip("textual")

import helpers_tui  # noqa: E402
import prompts  # noqa: E402
from ds4agent import agent as agent_mod  # noqa: E402
from ds4agent import events as E  # noqa: E402
from ds4agent.agent import Agent, AgentConfig, transcript_from_text  # noqa: E402
from ds4agent.app import AgentApp, Ready, Timeline  # noqa: E402
from ds4agent.tui_widgets import (StatusBar, SummaryView, Thinking, ToolView, UserMessage,  # noqa: E402
                                  fit_status, prefill_bar, status_fields)
from engine import Engine  # noqa: E402
from engine.backends.registry import available_names  # noqa: E402
from helpers_tui import sync  # noqa: E402
from prompts import Message, ToolCall  # noqa: E402
from sessions import SessionStore  # noqa: E402

LONG_MODEL = "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf"


def status(**kw) -> E.Status:
    base = dict(model=LONG_MODEL, backend="cpu", ctx_used=5234, ctx_total=65536, prefill_tps=1864.0,
                gen_tps=12.3, session="3f2a9c1e", think_mode="high", busy="generating")
    base.update(kw)
    return E.Status(**base)


class ScriptedWorker:
    """Stands in for AgentWorker: the test emits the agent's events through app._emit."""

    def __init__(self, make_agent, emit):
        self.emit, self.failed, self.agent, self.sent = emit, None, None, []

    def send_user(self, text):
        self.sent.append(text)

    def send_command(self, line):
        self.sent.append(line)

    def interrupt(self):
        pass

    def answer(self, ans):
        pass

    def stop(self, timeout=None):
        pass


def scripted_app(**kw) -> AgentApp:
    return AgentApp(lambda emit: None, worker_factory=ScriptedWorker, history_path=None,
                    banner="ds4-agent · test banner", **kw)


def until(pilot, cond, what: str, timeout: float = 20.0):
    """helpers_tui.until, waiting 20 s by default, not 30: a scripted screen answers at once."""
    return helpers_tui.until(pilot, cond, what, timeout)


def shown(app, selector: str) -> str:
    return str(app.query_one(selector).render())


# -- pure: the status bar's fields and the bar, fitted to a width ----------------------------------
@pytest.mark.parametrize("width, kept, gone", [
    (200, ["● generating", "ctx 5.2k/65.5k 8%", "gen 12.3 t/s", "prefill 1,864 t/s", "think high",
           "session 3f2a9c1e", "cpu", "DeepSeek"], []),
    (80, ["● generating", "ctx", "gen 12.3 t/s", "think high", "DeepSeek", "cpu"], ["session"]),
    (60, ["● gen", "ctx 8%", "12.3 t/s", "think high", "DeepSeek"], ["session", "prefill", "cpu"]),
    (40, ["●", "ctx 8%", "high", "12.3 t/s"], ["session", "prefill", "cpu"]),
])
def test_status_fields_by_priority(width, kept, gone):
    t = fit_status(status_fields(status(), "generating"), width)
    assert t.cell_len <= width
    for part in kept:
        assert part in t.plain, (part, t.plain)
    for part in gone:
        assert part not in t.plain, (part, t.plain)


def test_status_says_no_speed_yet_and_short_states():
    t = fit_status(status_fields(status(gen_tps=0.0, prefill_tps=0.0), "prefill"), 200).plain
    assert "gen –" in t and "prefill –" in t and "0.0 t/s" not in t
    t = fit_status(status_fields(status(), "waiting for your approval"), 30).plain
    assert t.startswith("● approval") and len(t) <= 30


def test_prefill_bar_labels_and_fits():
    t = prefill_bar(2048, 5235, 1500.0, 2.1, what="system prompt").plain
    assert t.startswith("prefill (system prompt) ") and "2048/5235 39%" in t and "ETA" in t
    assert "Esc stops it" in t
    narrow = prefill_bar(2048, 5235, 1500.0, 2.1, what="system prompt", width=60)
    assert narrow.cell_len <= 60 and "2048/5235" in narrow.plain
    start = prefill_bar(0, 5235, 0.0, 0.0, what="system prompt").plain
    assert "0/5235 0%" in start and "▶" in start         # shown at once: one cell, no speed yet


# -- the screen, from scripted events --------------------------------------------------------------
@sync
async def test_startup_prefill_shows_the_bar_before_the_first_chunk():
    app = scripted_app()
    async with app.run_test(size=(80, 24)) as pilot:
        app._emit(E.Status("tiny.gguf", "cpu", 0, 65536, 0.0, 0.0, "new", "high", "prefill"))
        app._emit(E.Prefill(0, 5235, 0.0, 0.0, "system prompt", False))
        await until(pilot, lambda: app.query_one("#prefill").display, "the prefill bar")
        assert "prefill (system prompt)" in shown(app, "#prefill") and "0/5235" in shown(app, "#prefill")
        assert "Esc" not in shown(app, "#prefill")          # the system prompt's prefill cannot be stopped
        assert "● prefill" in shown(app, "#status")
        app._emit(E.Prefill(4096, 5235, 2000.0, 0.6, "system prompt"))
        await until(pilot, lambda: "4096/5235" in shown(app, "#prefill"), "the bar to move")
        app._emit(E.Prefill(5235, 5235, 2000.0, 0.0, "system prompt"))
        app._emit(E.Status("tiny.gguf", "cpu", 5235, 65536, 2000.0, 0.0, "new", "high", ""))
        app._emit(Ready())
        await until(pilot, lambda: app.ready and not app.query_one("#prefill").display, "ready, bar gone")


@sync
async def test_status_bar_keeps_its_important_fields_at_80_and_60_columns():
    app = scripted_app()
    async with app.run_test(size=(80, 24)) as pilot:
        app._emit(status())
        await until(pilot, lambda: app.status is not None, "the status")
        await pilot.pause(0.1)
        bar = shown(app, "#status")
        for part in ("● generating", "ctx ", "gen 12.3 t/s", "think high", "DeepSeek", "cpu"):
            assert part in bar, (part, bar)
        await pilot.resize_terminal(60, 24)
        await until(pilot, lambda: "session" not in shown(app, "#status") and "cpu" not in shown(app, "#status"),
                    "the bar to fit again")
        bar = shown(app, "#status")
        assert len(bar) <= 58
        for part in ("● gen", "ctx", "12.3 t/s", "think high", "DeepSeek"):
            assert part in bar, (part, bar)
        # a live update (a Status every ~0.5 s while it generates) replaces the figures
        app._emit(status(gen_tps=30.5, ctx_used=6000))
        await until(pilot, lambda: "30.5 t/s" in shown(app, "#status"), "the live update")


@sync
async def test_compaction_summary_streams_then_folds():
    app = scripted_app()
    async with app.run_test(size=(100, 30)) as pilot:
        app._emit(Ready())
        await until(pilot, lambda: app.ready, "ready")
        app._emit(E.Notice("compacting (requested by /compact): summarizing the conversation", "warning"))
        app._emit(E.Prefill(0, 300, 0.0, 0.0, "compaction request"))
        app._emit(E.SummaryDelta("The user wants", 3, 1024, 20.0))
        await until(pilot, lambda: any(v.text for v in app.query(SummaryView)), "the summary block")
        view = app.query_one(SummaryView)
        assert not view.collapsed and "The user wants" in view.text
        assert "summary" in shown(app, "#prefill") and "3 tokens (at most 1024)" in shown(app, "#prefill")
        assert "ETA" not in shown(app, "#prefill") and "%" not in shown(app, "#prefill")
        assert app.query_one("#prefill").display
        app._emit(status(busy="generating"))                 # a live status does not hide the summary's bar
        app._emit(E.SummaryDelta(" hello.py fixed.", 9, 1024, 25.0))
        await until(pilot, lambda: "9 tokens" in shown(app, "#prefill"), "the bar to count")
        assert view.text == "The user wants hello.py fixed." and app.query_one("#prefill").display
        app._emit(E.Compacted(7000, 900, "The user wants hello.py fixed."))
        await until(pilot, lambda: view.collapsed, "the summary to fold")
        assert "summary kept" in str(view.title) and not app.query_one("#prefill").display
        # a failed compaction leaves what was written, marked as not used
        app._emit(E.SummaryDelta("half a", 2, 1024, 20.0))
        await until(pilot, lambda: len(app.query(SummaryView)) == 2 and list(app.query(SummaryView))[-1].text,
                    "a second summary")
        app._emit(E.Notice("compaction interrupted; the conversation is unchanged", "warning"))
        second = list(app.query(SummaryView))[-1]
        await until(pilot, lambda: second.collapsed, "the failed one to fold")
        assert "not used" in str(second.title)


def _restored_messages() -> list:
    edit = json.dumps({"path": "hello.py", "old": "helo", "new": "hello"})
    return [Message("system", "sys"),
            Message("user", "fix the typo"),
            Message("assistant", "I'll fix it.", "The greeting misspells hello.\n\nOne edit.",
                    [ToolCall(None, "edit", edit, "")]),
            Message("tool", "Edited hello.py: replaced 1 line (old lines 2-2, now 1 line).\n2 |     print('hello')"),
            Message("assistant", "Done.", "Checked.", []),
            Message("user", "run it"),
            Message("assistant", "", "", [ToolCall(None, "bash", json.dumps({"command": "false"}), "")]),
            Message("tool", "[job 1] `false` finished after 0.0 s: exit status 1.\n"),
            Message("assistant", "", "stopped while it reasoned", [])]


@sync
async def test_restored_session_is_drawn_as_it_was_live_and_keeps_the_header():
    app = scripted_app()
    async with app.run_test(size=(100, 40)) as pilot:
        app._emit(Ready())
        await until(pilot, lambda: app.ready, "ready")
        app._emit(Timeline(_restored_messages()))
        await until(pilot, lambda: len(app.query(ToolView)) == 2, "the restored tool blocks")
        await pilot.pause(0.2)
        kids = list(app.transcript.children)
        assert "test banner" in str(kids[0].render()) and kids[0].has_class("header")
        assert "Esc interrupts" in str(kids[1].render())
        thoughts = list(app.query(Thinking))
        assert len(thoughts) == 3 and all(t.collapsed for t in thoughts)
        assert str(thoughts[0].title).startswith("thought (") and thoughts[0].chars == len(
            "The greeting misspells hello.\n\nOne edit.")
        edit, bash = list(app.query(ToolView))
        assert edit.finished.ok and edit.finished.approved and "edit hello.py" in str(edit.query_one(".tool-head").render())
        assert "Edited hello.py" in str(edit.query_one(".tool-state").render())
        assert edit.query_one(".tool-body").has_class("diff") and "+hello" in str(edit.query_one(".tool-body").render())
        assert bash.finished.exit_status == 1 and "exit 1" in str(bash.query_one(".tool-state").render())
        assert [str(u.render()) for u in app.query(UserMessage)] == ["❯ fix the typo", "❯ run it"]
        # /new: an empty timeline, the header stays
        app._emit(Timeline([Message("system", "sys")]))
        await until(pilot, lambda: not list(app.query(ToolView)), "the cleared view")
        kids = list(app.transcript.children)
        assert len(kids) == 2 and all(k.has_class("header") for k in kids)


# -- the agent's side, on the small agent model ----------------------------------------------------
@pytest.fixture(scope="module")
def engine(agent_model):
    # what is shown does not depend on the numerics: the C kernels when built (a ~3k-token system
    # prefix in seconds, not half a minute), else the reference
    return Engine.open(agent_model, backend="cpu" if "cpu" in available_names() else "numpy")


@pytest.fixture(scope="module")
def warm(engine, tmp_path_factory):
    """One project and session store whose system prefix is prefilled once for the module."""
    root = tmp_path_factory.mktemp("display")
    (root / "proj").mkdir()
    (root / "proj" / "hello.py").write_text("print('helo')\n")
    make_agent(engine, root, []).start()
    return root


def make_agent(engine, root, events, **cfg):
    conf = dict(ctx=8192, think_mode="high", max_turn_tokens=40)
    conf.update(cfg)
    return Agent(engine, root / "proj", config=AgentConfig(**conf), emit=events.append, system="You are a test.",
                 store=SessionStore(root=root / "sessions", project_dir=root / "proj"), model_name="agent.gguf")


def test_agent_start_shows_the_bar_before_the_first_chunk(engine, tmp_path):
    evs: list = []
    (tmp_path / "proj").mkdir()
    a = make_agent(engine, tmp_path, evs, chunk=1024)       # a fresh store: no cached system prefix
    a.start()
    bars = [e for e in evs if isinstance(e, E.Prefill)]
    assert bars[0].done == 0 and bars[0].total == a.session.pos and bars[0].what == "system prompt"
    assert not any(b.stoppable for b in bars)
    assert [b.done for b in bars[1:]][-1] == a.session.pos and len(bars) >= 3
    # each chunk's Status carries the context filled so far and this prefill's speed
    live = [e for e in evs if isinstance(e, E.Status) and e.busy == "prefill" and e.ctx_used]
    assert live and live[0].ctx_used < a.session.pos and live[-1].prefill_tps > 0


def test_agent_status_is_live_and_per_turn(engine, warm, monkeypatch):
    monkeypatch.setattr(agent_mod, "STATUS_EVERY_S", 0.0)     # every token (0.5 s in use)
    evs: list = []
    a = make_agent(engine, warm, evs, think_mode="none", autosave=False)
    a.start()
    a.force("word " * 30 + prompts.EOS)
    evs.clear()
    a.submit("hello")
    done = next(i for i, e in enumerate(evs) if isinstance(e, E.TurnFinished))
    gen = [e for e in evs[:done] if isinstance(e, E.Status) and e.busy == "generating"]
    assert len(gen) >= 10, "the status bar is updated while the model generates"
    assert gen[0].gen_tps == 0.0 and gen[-1].gen_tps > 0
    assert gen[-1].ctx_used > gen[1].ctx_used
    first = next(e for e in evs if isinstance(e, E.Status))
    assert first.prefill_tps == 0.0 and first.gen_tps == 0.0     # this turn's, not the last one's
    # a turn stopped during its prefill shows no speed of the turn before it
    assert a.gen_tps > 0
    evs.clear()
    a.interrupt()
    orig = a._prefill_to

    def stop_first(target, **kw):
        a._interrupt.set()
        return orig(target, **kw)
    a._prefill_to = stop_first
    a.session.chunk = 4                           # so that the message takes more than one chunk
    fin = a.submit("stopped at once " * 10)
    assert fin.finish_reason == "interrupted"
    last = [e for e in evs if isinstance(e, E.Status)][-1]
    assert last.gen_tps == 0.0
    # /new (start again): a fresh timeline shows no speeds of the old one
    del a._prefill_to
    a.gen_tps = a.prefill_tps = 5.0
    evs.clear()
    a.start()
    last = [e for e in evs if isinstance(e, E.Status)][-1]
    assert last.gen_tps == 0.0 and last.prefill_tps == 0.0     # (the system prefix came from its cache)


def test_agent_compaction_streams_its_summary(engine, warm):
    evs: list = []
    a = make_agent(engine, warm, evs, think_mode="none", autosave=False)
    a.start()
    a.force("an answer" + prompts.EOS)
    a.submit("first question")
    summary = "The user asked a first question; nothing is pending."
    a.force(summary + prompts.EOS)
    evs.clear()
    assert a.compact("requested by /compact")
    deltas = [e for e in evs if isinstance(e, E.SummaryDelta)]
    assert "".join(d.text for d in deltas) == summary
    assert deltas[-1].tokens > deltas[0].tokens and deltas[-1].max_tokens == agent_mod.SUMMARY_MAX_TOKENS
    kept = next(e for e in evs if isinstance(e, E.Compacted))
    assert kept.summary == summary
    whats = [(e.what, e.stoppable) for e in evs if isinstance(e, E.Prefill) and e.done == 0]
    assert whats == [("compaction request", True), ("compacted context", False)]
    assert not any(isinstance(e, E.TextDelta) for e in evs)   # the summary is not an answer


def test_restored_turn_stopped_while_reasoning_is_reasoning():
    text = (prompts.BOS + "sys" + prompts.USER + "q" + prompts.ASSISTANT + "<think>half a thought" + prompts.EOS
            + prompts.USER + "q2" + prompts.ASSISTANT + "<think>done</think>the answer")
    msgs = transcript_from_text(text)
    assert [(m.role, m.content, m.reasoning) for m in msgs[1:]] == [
        ("user", "q", None), ("assistant", "", "half a thought"),
        ("user", "q2", None), ("assistant", "the answer", "done")]


@sync
async def test_switch_and_resume_draw_the_saved_turns_as_they_were(engine, warm):
    """/save, /new, /switch over the real agent, then a new app with --resume: the reasoning comes
    back folded, the tool call as a tool block with its result, and the header stays."""
    agents: list = []

    def factory(emit):
        a = make_agent(engine, warm, [], max_turn_tokens=60, yolo=True)
        a.emit = emit
        agents.append(a)
        return a

    async def submit(app, pilot, line):
        await app.on_input_area_submitted(type("Submitted", (), {"text": line})())
        await until(pilot, lambda: not app.busy and app._await_reply is None and not app.queue, line, 60)

    async def drawn_as_live(app, pilot):
        await until(pilot, lambda: list(app.query(ToolView)) and len(app.query(Thinking)) == 2, "the restored view")
        await pilot.pause(0.2)
        thoughts = list(app.query(Thinking))
        assert all(t.collapsed for t in thoughts) and "Read the file first." in thoughts[0]._initial
        view = app.query_one(ToolView)
        assert view.tool_name == "read" and view.finished is not None and view.finished.ok
        assert "banner" in str(list(app.transcript.children)[0].render())

    call = prompts.render_tool_calls([ToolCall(None, "read", json.dumps({"path": "hello.py"}))])
    app = AgentApp(factory, history_path=None, banner="ds4-agent · banner")
    try:
        async with app.run_test(size=(150, 40)) as pilot:
            await until(pilot, lambda: app.ready and not app.busy, "the agent to start", 120)
            agents[0].force("Read the file first.</think>Let me look." + call, "Looked.</think>It prints helo." + prompts.EOS)
            await submit(app, pilot, "what does hello.py print?")
            assert app.turns_finished == 1
            for line in ("/save alpha", "/new", "/switch alpha"):
                await submit(app, pilot, line)
            await drawn_as_live(app, pilot)
            assert isinstance(app.query_one("#status"), StatusBar) and "session alpha" in shown(app, "#status")
    finally:
        if app.worker is not None:
            app.worker.interrupt()
            app.worker.stop(10)
    # --resume: the app sends /resume once the model is ready
    app = AgentApp(factory, history_path=None, banner="ds4-agent · banner", initial=["/resume"])
    try:
        async with app.run_test(size=(150, 40)) as pilot:
            await until(pilot, lambda: app.ready and not app.busy and not app.queue, "the resume", 120)
            await drawn_as_live(app, pilot)
    finally:
        if app.worker is not None:
            app.worker.interrupt()
            app.worker.stop(10)
