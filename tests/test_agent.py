"""The agent loop on a tiny model: render once then append, tool calls through DSML, approvals,
interrupts, sessions, compaction, headless mode.

`agent.force(...)` makes the model emit given text (the engine still evaluates every forced token,
so the KV state stays real); everything else is the real loop.
"""
from __future__ import annotations

import io

import pytest

import prompts
from ds4agent import events as E
from ds4agent.agent import Agent, AgentConfig
from ds4agent.headless import run_headless
from engine import SamplingParams
from helpers_agent import SYSTEM, call, start_agent, timeline
from sessions import SessionStore


@pytest.fixture
def make(agent_engine, hello_project, sessions_root):
    def build(answer="y", **cfg):
        return start_agent(agent_engine, hello_project, sessions_root, answer, **cfg)
    return build


def test_plain_turn_streams_and_only_appends(make, agent_engine, hello_project):
    agent, rec = make()
    sys_tokens = agent.session.pos
    stats0 = dict(agent.session.stats)
    fin = agent.submit("hello there")
    assert fin.finish_reason == "stop" or fin.finish_reason == "length"
    assert [m.role for m in agent.transcript] == ["system", "user", "assistant"]
    text = timeline(agent)
    assert "<｜User｜>hello there<｜Assistant｜></think>" in text
    assert rec.text() and text.endswith(rec.text()[-5:])
    # the KV state is the truth: every token was evaluated exactly once, nothing re-prefilled
    st = agent.session.stats
    evaluated = (st["prefill_tokens"] - stats0["prefill_tokens"]) + (st["decode_tokens"] - stats0["decode_tokens"])
    assert evaluated == agent.session.pos - sys_tokens
    assert rec.of(E.Status)[-1].ctx_used == agent.session.pos


def test_forced_edit_call_is_approved_applied_and_answered(make, agent_engine, hello_project):
    agent, rec = make(answer="y")
    agent.force("I will edit it." + call("edit", path="hello.py", old="'hi '", new="'hello '"), "Done.")
    fin = agent.submit("say hello instead of hi")
    assert fin.tool_calls == 1 and fin.finish_reason == "stop"
    assert rec.of(E.ApprovalNeeded)[0].name == "edit"
    done = rec.of(E.ToolFinished)[0]
    assert done.ok and done.approved and "+    return 'hello ' + name" in done.diff
    assert "'hello '" in (hello_project / "hello.py").read_text()
    roles = [m.role for m in agent.transcript]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    text = timeline(agent)
    assert "<tool_result>" in text and text.endswith("Done.")
    assert agent.transcript[2].tool_calls[0].name == "edit"


def test_refused_approval_leaves_the_file(make, agent_engine, hello_project):
    agent, rec = make(answer="n")
    agent.force(call("write", path="new.txt", content="x"), "ok")
    agent.submit("write a file")
    done = rec.of(E.ToolFinished)[0]
    assert not done.ok and not done.approved and "did not approve" in done.text
    assert not (hello_project / "new.txt").exists()


def test_path_escape_and_bad_arguments_become_error_results(make, agent_engine, hello_project):
    agent, rec = make()
    agent.force(call("read", path="../../../../etc/passwd") + "", "x")
    agent.submit("read it")
    assert "outside the project" in rec.of(E.ToolFinished)[0].text
    agent.force(call("read", path="hello.py", bogus=1), "y")
    agent.submit("again")
    bad = rec.of(E.ToolFinished)[1]
    assert not bad.ok and "unknown argument" in bad.text
    agent.force(call("no_such_tool", a=1), "z")
    agent.submit("and again")
    assert "unknown tool" in rec.of(E.ToolFinished)[2].text


def test_bash_timeout_becomes_a_background_job(make, agent_engine, hello_project):
    agent, rec = make(yolo=True)
    agent.force(call("bash", command="sleep 3; echo late", timeout=1), "waiting")
    agent.submit("run it")
    res = rec.of(E.ToolFinished)[0]
    assert "job" in res.text.lower()
    assert not rec.of(E.ApprovalNeeded)          # --yolo asks nothing


def test_interrupt_mid_generation_keeps_the_timeline_usable(make, agent_engine, hello_project):
    agent, rec = make(max_turn_tokens=400)
    n = {"k": 0}
    orig = rec.__call__

    def emit(ev):
        orig(ev)
        if isinstance(ev, (E.TextDelta, E.ReasoningDelta)):
            n["k"] += 1
            if n["k"] == 3:
                agent.interrupt()
    agent.emit = emit
    fin = agent.submit("write a long story")
    assert fin.interrupted and fin.finish_reason == "interrupted"
    before = agent.session.pos
    agent.emit = rec
    agent.force("short")
    fin2 = agent.submit("now briefly")
    assert not fin2.interrupted
    text = timeline(agent)
    # the interrupted turn was closed with EOS before the next user turn
    assert "<｜end▁of▁sentence｜><｜User｜>now briefly" in text and agent.session.pos > before


def test_interrupt_mid_prefill_cancels_the_message(make, agent_engine, hello_project):
    agent, rec = make(chunk=16)
    before_tokens, before_msgs = agent.session.tokens, len(agent.transcript)
    orig = rec.__call__

    def emit(ev):
        orig(ev)
        if isinstance(ev, E.Prefill) and ev.done >= 16:
            agent.interrupt()
    agent.emit = emit
    fin = agent.submit("word " * 120)
    assert fin.interrupted
    assert agent.session.tokens == before_tokens and len(agent.transcript) == before_msgs


def test_autosave_save_list_switch_without_prefill(make, agent_engine, hello_project, monkeypatch):
    agent, rec = make()
    agent.force("first answer")
    agent.submit("first question")
    rows = agent.store.list()
    assert len(rows) == 1 and rows[0].tokens == agent.session.pos    # autosaved after the turn
    assert "first question" in rows[0].title
    out = agent.command("/save mywork")
    assert "mywork" in out
    saved, snapshot = agent.session.tokens, agent.current_sha[:8]
    agent.force("second answer")
    agent.submit("second question")
    listed = agent.command("/list")
    assert "first question" in listed
    # the name went on with the conversation (marked current); the named save stays as a snapshot
    assert f"* {agent.current_sha[:8]}" in listed and "mywork: first question" in listed
    assert f"  {snapshot}" in listed and "(earlier save of mywork)" in listed
    calls = {"n": 0}
    real = agent_engine.model.forward

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)
    monkeypatch.setattr(agent_engine.model, "forward", counting)
    out = agent.command(f"/switch {snapshot}")
    assert out.startswith("switched to session") and calls["n"] == 0
    assert agent.session.tokens == saved
    assert [m.role for m in agent.transcript][:3] == ["system", "user", "assistant"]
    assert agent.history(1) == ["first question"]
    monkeypatch.undo()
    agent.force("third")
    agent.submit("continue here")
    assert "first question" in timeline(agent) and "second question" not in timeline(agent)


def test_compaction_keeps_summary_and_recent_tail(make, agent_engine, hello_project):
    agent, rec = make()
    for i in range(3):
        agent.force(f"answer {i}")
        agent.submit(f"question {i}")
    before = agent.session.pos
    agent.force("SUMMARY: the user asked three questions.")
    assert agent.compact("test") is True
    ev = rec.of(E.Compacted)[-1]
    assert ev.before_tokens == before and "three questions" in ev.summary
    text = timeline(agent)
    assert "Durable task-state summary follows" in text and "three questions" in text
    assert "question 2" in text                      # the recent tail is verbatim
    agent.force("after")
    assert agent.submit("go on").finish_reason == "stop"


def test_think_and_ctx_commands(make, agent_engine, hello_project):
    agent, rec = make()
    assert agent.command("/think on") == "thinking: high"
    assert "runs as high" in agent.command("/think max")
    assert agent.command("/ctx").startswith("context: ")
    assert "unknown command" in agent.command("/nope")


def test_headless_runs_a_task(agent_engine, hello_project, sessions_root):
    def make_agent(emit):
        conf = AgentConfig(ctx=16384, think_mode="none", max_turn_tokens=16, sampling=SamplingParams(seed=2))
        agent = Agent(agent_engine, hello_project, config=conf,
                      store=SessionStore(root=sessions_root, project_dir=hello_project), emit=emit, system=SYSTEM)
        agent.force(call("read", path="hello.py"), "It greets.")
        return agent
    out, err = io.StringIO(), io.StringIO()
    rc = run_headless(make_agent, "what does hello.py do?", out=out, err=err)
    assert rc == 0 and "It greets." in out.getvalue()
    assert "1 tool call(s)" in err.getvalue() and "read: ok" in err.getvalue()


def test_a_turn_cut_at_the_token_cap_says_length(agent_engine, hello_project, sessions_root):
    """A turn the cap cuts ends "length" (the TUI shows "stopped at the token limit", headless exits
    1), not "stop" as if the model had finished its answer."""
    seen = []

    def make_agent(emit):
        def both(ev):
            seen.append(ev)
            emit(ev)
        conf = AgentConfig(ctx=16384, think_mode="none", max_turn_tokens=3, sampling=SamplingParams(seed=2))
        return Agent(agent_engine, hello_project, config=conf,
                     store=SessionStore(root=sessions_root, project_dir=hello_project), emit=both, system=SYSTEM)
    out, err = io.StringIO(), io.StringIO()
    rc = run_headless(make_agent, "write a long essay", out=out, err=err)
    fin = [e for e in seen if isinstance(e, E.TurnFinished)][-1]
    assert (fin.finish_reason, fin.interrupted, rc) == ("length", False, 1)
    assert "finished: length" in err.getvalue()


def test_resume_continues_the_session_the_user_left(make, agent_engine, hello_project):
    agent, rec = make()
    agent.force("a1")
    agent.submit("first")
    agent.command("/save one")
    one, one_id = agent.session.tokens, agent.current_sha
    agent.force("a2")
    agent.submit("second")                 # autosaved: the newest file (the name "one" moved to it)
    agent.command(f"/switch {one_id}")
    assert agent.command("/quit") == "quit"
    other, _ = make()
    assert other.command("/resume").startswith("switched to session")
    assert other.session.tokens == one


def assert_consistent(agent):
    """The live timeline equals a fresh render of the transcript (the KV state never drifts)."""
    import tools
    from prompts.render import assistant_prefix, render_messages
    live = timeline(agent) + (prompts.EOS if agent.pending_eos else "")
    rendered = render_messages(agent.transcript, tools.schemas(), agent.think_mode)
    prefix = assistant_prefix(agent.think_mode)
    if rendered.endswith(prefix) and not live.endswith(prefix):
        rendered = rendered[: -len(prefix)]
    assert live == rendered


def test_timeline_stays_consistent_on_every_path(make, agent_engine, hello_project):
    # ~700 tokens: ~45 chunks of 16 for the Esc to land between
    (hello_project / "big.txt").write_text("".join(f"line {i} of a long file\n" for i in range(100)))
    agent, rec = make()
    agent.force("plain answer")
    agent.submit("one")
    assert_consistent(agent)
    # Esc while the (long) tool result is being prefilled: the result still goes in whole. Small
    # chunks for this step only, so Esc lands between them (at 16-token chunks throughout, the
    # compactions' ~4k-token prefills took ~250 steps each: 353 s on a loaded machine)
    agent.session.chunk = 16
    orig = rec.__call__

    def emit(ev):
        orig(ev)
        if isinstance(ev, E.ToolFinished):
            agent.interrupt()
    agent.emit = emit
    agent.force(call("read", path="big.txt"))
    fin = agent.submit("read it")
    assert fin.interrupted and agent.transcript[-1].role == "tool"
    assert timeline(agent).endswith("</tool_result>")
    assert_consistent(agent)
    agent.session.chunk = 2048
    agent.emit = rec
    agent.force("after the interrupted tool round")
    agent.submit("go on")
    assert_consistent(agent)
    # a message that does not fit keeps the pending EOS of the previous answer
    assert agent.submit("word " * 20000).finish_reason == "error"
    assert_consistent(agent)
    agent.force("fine")
    agent.submit("short one")
    assert "</think>fine" in timeline(agent)
    assert_consistent(agent)


@pytest.mark.slow
def test_timeline_stays_consistent_through_compactions(make, agent_engine, hello_project):
    """Two compactions, each a fresh ~4k-token prefill (~40 s of CPU together): slow. The default
    run keeps compaction's consistency in test_compaction_keeps_summary_and_recent_tail and
    test_compaction_before_a_tool_continuation_adds_results_once."""
    agent, rec = make()
    agent.force("plain answer")
    agent.submit("one")
    agent.force("fine")
    agent.submit("short one")
    assert_consistent(agent)
    # compaction then more turns; switch back and compact again (no duplicated tools block)
    agent.force("SUMMARY: short.")
    assert agent.compact("test")
    assert_consistent(agent)
    agent.force("post")
    agent.submit("after compaction")
    assert_consistent(agent)
    agent.command("/save here")
    agent.command("/switch here")
    assert_consistent(agent)
    agent.force("SUMMARY: again.")
    assert agent.compact("again")
    assert timeline(agent).count("## Tools") == 1
    assert_consistent(agent)


def test_compaction_before_a_tool_continuation_adds_results_once(make, agent_engine, hello_project):
    agent, rec = make(ctx=16384)
    agent.force("a")
    agent.submit("q")
    real = agent.maybe_compact
    seen = {}

    def force_compact(reason):
        if "tool continuation" in reason:
            agent.force("SUMMARY: mid tool round.")
            seen["ok"] = agent.compact(reason)
            agent.force("done")
            return seen["ok"]
        return real(reason)
    agent.maybe_compact = force_compact
    agent.force(call("read", path="hello.py"), "unused")
    agent.submit("read hello")
    assert seen["ok"] and timeline(agent).count("<tool_result>") == 1
    assert_consistent(agent)
