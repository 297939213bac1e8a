"""A resume at another --ctx never starts over unseen (issue 35 item 1): the command line adopts
the session's context when it fits memory, saying so, or refuses with the fix; a /switch that
cannot load says why in plain words; a headless resume that fails ends the run, saving nothing."""
from __future__ import annotations

import io

import pytest

from ds4agent import cli
from ds4agent.agent import Agent, AgentConfig
from ds4agent.headless import run_headless
from ds4agent.resume_ctx import ResumeContextError, resume_ctx
from engine import SamplingParams, Session
from helpers_agent import SYSTEM
from sessions import SessionStore, SessionStoreError

SAVED_CTX = 16384


@pytest.fixture
def saved(agent_engine, tmp_path):
    """A session saved at SAVED_CTX in a store of a project folder."""
    project = tmp_path / "proj"
    project.mkdir()
    store = SessionStore(root=tmp_path / "home" / "sessions", project_dir=project)
    s = Session(agent_engine, SAVED_CTX)
    s.sync(agent_engine.tokenizer.encode("<｜User｜>hello<｜Assistant｜></think>hi"))
    info = store.save(s, think_mode="none")
    return store, info, project


def test_a_smaller_ctx_adopts_the_sessions_when_it_fits_and_refuses_with_the_fix_when_not(saved, agent_engine):
    store, info, _ = saved
    assert resume_ctx(store, info.sha, 32768, agent_engine.config, avail=None) == (32768, None)
    ctx, note = resume_ctx(store, info.sha, 1024, agent_engine.config, avail=None)
    assert ctx == SAVED_CTX and note.count("\n") == 0 and f"--ctx {SAVED_CTX}" in note and info.id in note
    assert resume_ctx(store, True, 1024, agent_engine.config, avail=None)[0] == SAVED_CTX  # the last one
    with pytest.raises(ResumeContextError, match=f"run with --ctx {SAVED_CTX}"):
        resume_ctx(store, info.sha, 1024, agent_engine.config, avail=1 << 10)


def test_loading_into_a_smaller_context_says_so_in_plain_words(saved, agent_engine):
    store, info, _ = saved
    with pytest.raises(SessionStoreError) as e:
        store.load(info.sha, Session(agent_engine, 1024))
    msg = str(e.value)
    assert "payload" not in msg and f"{SAVED_CTX}-token context" in msg and f"--ctx {SAVED_CTX}" in msg


def test_the_command_line_continues_the_session_at_its_context(saved, agent_model, monkeypatch, capsys):
    store, info, project = saved
    monkeypatch.setenv("DS4_AGENT_HOME", str(store.root.rsplit("/sessions", 1)[0]))
    monkeypatch.chdir(project)
    seen = {}

    def fake_headless(make_agent, task, *, resume, quiet):
        seen["resume"] = resume
        return 0
    monkeypatch.setattr("ds4agent.headless.run_headless", fake_headless)
    made = []
    monkeypatch.setattr("ds4agent.agent.AgentConfig", lambda **kw: made.append(AgentConfig(**kw)) or made[-1])
    assert cli.main(["-m", str(agent_model), "--ctx", "8192", "--resume", info.id, "-p", "go on"]) == 0
    err = capsys.readouterr().err
    assert made[0].ctx == SAVED_CTX and seen["resume"] == info.sha
    assert err.strip().splitlines() == [f"note: session {info.id} was saved with a {SAVED_CTX}-token context: "
                                        f"continuing it at --ctx {SAVED_CTX} (not 8192)"]


def test_a_headless_resume_that_fails_runs_nothing_and_saves_nothing(saved, agent_engine, sessions_root):
    store, info, project = saved
    before = sorted(e.sha for e in store.list("all"))
    ran = []

    def make_agent(emit):
        conf = AgentConfig(ctx=1024, think_mode="none", sampling=SamplingParams(seed=1))
        agent = Agent(agent_engine, project, config=conf, store=SessionStore(root=store.root, project_dir=project),
                      emit=emit, system=SYSTEM)
        agent.submit = lambda text: ran.append(text)
        agent.start = lambda: None        # no system prompt: the resume fails before any work
        return agent
    err = io.StringIO()
    assert run_headless(make_agent, "continue", resume=info.sha, out=io.StringIO(), err=err) == 1
    assert ran == [] and sorted(e.sha for e in store.list("all")) == before
    line = err.getvalue().strip().splitlines()[0]
    assert line.startswith("error: cannot resume: switch failed: ") and f"--ctx {SAVED_CTX}" in line, err.getvalue()
