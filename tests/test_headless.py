"""Headless mode and the agent's limits (issue 24, items 1-4): the reasoning streams to stderr
(dimmed on a terminal, hidden by --quiet), a per-turn token cap through the agent API, -p and the
config file, a session that cannot be saved is said once and fails the run, and --ctx is checked
before anything starts."""
from __future__ import annotations

import io

import pytest

import prompts
from ds4agent import cli
from ds4agent import events as E
from ds4agent.agent import Agent, AgentConfig
from ds4agent.headless import DIM, run_headless
from engine import SamplingParams
from helpers_agent import SYSTEM, call
from sessions import SessionStore

class TTY(io.StringIO):
    def isatty(self):
        return True


def agent_factory(engine, project, root, *forced, store_cls=SessionStore, seen=None, **cfg):
    def make_agent(emit):
        def both(ev):
            if seen is not None:
                seen.append(ev)
            emit(ev)
        conf = AgentConfig(ctx=16384, think_mode=cfg.pop("think_mode", "high"),
                           max_turn_tokens=cfg.pop("max_turn_tokens", 64), sampling=SamplingParams(seed=3), **cfg)
        agent = Agent(engine, project, config=conf, store=store_cls(root=root, project_dir=project),
                      emit=both, system=SYSTEM)
        if forced:
            agent.force(*forced)
        return agent
    return make_agent


# -- 1. reasoning on stderr ----------------------------------------------------------------------
def test_reasoning_streams_to_stderr_and_the_answer_to_stdout(agent_engine, hello_project, sessions_root):
    out, err = io.StringIO(), io.StringIO()
    make_agent = agent_factory(agent_engine, hello_project, sessions_root, "weighing the options</think>The answer.")
    rc = run_headless(make_agent, "think first", out=out, err=err)
    assert rc == 0
    assert out.getvalue().strip() == "The answer."
    assert "weighing the options" in err.getvalue() and DIM not in err.getvalue()   # not a terminal: no colour
    assert "weighing" not in out.getvalue()


def test_reasoning_is_dimmed_on_a_terminal_and_quiet_hides_it(agent_engine, hello_project, sessions_root):
    out, err = io.StringIO(), TTY()
    run_headless(agent_factory(agent_engine, hello_project, sessions_root, "pondering</think>Yes."), "q",
                 out=out, err=err)
    e = err.getvalue()
    start = e.index(DIM)
    assert e.index("pondering") > start and "\x1b[0m" in e[e.index("pondering"):]   # dim on, then off again
    out, err = io.StringIO(), TTY()
    rc = run_headless(agent_factory(agent_engine, hello_project, sessions_root, "pondering</think>Yes."), "q",
                      quiet=True, out=out, err=err)
    assert rc == 0 and out.getvalue().strip() == "Yes."
    assert "pondering" not in err.getvalue() and DIM not in err.getvalue()


# -- 2. the per-turn token cap --------------------------------------------------------------------
def test_token_cap_through_the_agent_api_ends_the_turn_clearly(agent_engine, hello_project, sessions_root):
    seen = []
    agent = agent_factory(agent_engine, hello_project, sessions_root, seen=seen, think_mode="none",
                          max_turn_tokens=1000)(seen.append)
    agent.start()
    pos0 = agent.session.pos
    fin = agent.submit("write a long essay", max_tokens=5)
    assert fin.finish_reason == "length" and not fin.interrupted
    notes = [e.text for e in seen if isinstance(e, E.Notice)]
    assert "stopped at the 5-token limit" in notes
    # the user turn's own tokens, then at most 5 generated ones
    user = len(agent.tok.encode(prompts.USER + "write a long essay" + prompts.ASSISTANT + "</think>"))
    assert agent.session.pos - pos0 <= user + 1 + 5
    # the config's cap applies when submit is given none
    agent.cfg.max_tokens = 3
    seen.clear()
    assert agent.submit("again").finish_reason == "length"
    assert "stopped at the 3-token limit" in [e.text for e in seen if isinstance(e, E.Notice)]
    with pytest.raises(ValueError, match="at least 1"):
        agent.submit("x", max_tokens=0)


def test_token_cap_spent_by_a_tool_call_runs_the_tool_and_stops(agent_engine, hello_project, sessions_root):
    """The cap is over all of a turn's rounds: a tool call that spends it still runs (its result
    goes into the timeline), but the model is not asked to continue."""
    seen = []
    agent = agent_factory(agent_engine, hello_project, sessions_root, call("read", path="hello.py"), "It greets.",
                          seen=seen, think_mode="none")(seen.append)
    agent.start()
    fin = agent.submit("what does hello.py do?", max_tokens=4)
    assert (fin.finish_reason, fin.tool_calls, fin.interrupted) == ("length", 1, False)
    assert [m.role for m in agent.transcript] == ["system", "user", "assistant", "tool"]
    text = agent.tok.decode(agent.session.tokens)
    assert text.endswith("</tool_result>") and "It greets." not in text
    assert "stopped at the 4-token limit" in [e.text for e in seen if isinstance(e, E.Notice)]
    agent.force("fine")
    assert agent.submit("go on").finish_reason == "stop"      # the timeline takes the next turn


def test_max_tokens_flag_and_config_key_in_headless_mode(tmp_path, monkeypatch, agent_model, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DS4_AGENT_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    args = ["--model", str(agent_model), "--ctx", "16384", "--nothink", "--seed", "4", "-p", "write an essay"]
    assert cli.main(args + ["--max-tokens", "6"]) == 1
    err = capsys.readouterr().err
    assert "stopped at the 6-token limit" in err and "finished: length" in err
    (home / "config.toml").write_text("max_tokens = 2\n")
    assert cli.main(args) == 1
    assert "stopped at the 2-token limit" in capsys.readouterr().err
    (home / "config.toml").write_text("max_tokens = 0\n")
    assert cli.main(args) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: max_tokens in the config must be a whole number of at least 1, not 0"]


# -- 3. --ctx checked before the UI -----------------------------------------------------------------
@pytest.mark.parametrize("ctx, message", [
    ("-5", "error: --ctx must be a whole number of at least 1, not -5"),
    ("0", "error: --ctx must be a whole number of at least 1, not 0"),
    ("100", "error: --ctx 100 is too small: the system prompt alone takes"),
    ("99999999", "error: --ctx 99999999 is more than the model's context length (1048576)"),
])
def test_bad_ctx_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, agent_model, ctx, message):
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)

    def no_ui(*a, **k):
        raise AssertionError("the TUI started")
    monkeypatch.setattr("ds4agent.app.run_app", no_ui)
    assert cli.main(["--model", str(agent_model), "--ctx", ctx]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not (tmp_path / "home" / "sessions").exists()     # nothing was written


def test_ctx_from_the_config_is_checked_too(tmp_path, monkeypatch, capsys, agent_model):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('ctx = "big"\n')
    monkeypatch.setenv("DS4_AGENT_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--model", str(agent_model), "-p", "x"]) == 1
    assert capsys.readouterr().err.strip() == "error: ctx in the config must be a whole number of at least 1, not 'big'"


# -- 4. a session that cannot be saved ------------------------------------------------------------
class ReadOnlyStore(SessionStore):
    def save(self, *a, **k):
        raise OSError(30, "Read-only file system")


def test_a_session_that_cannot_be_saved_is_said_once_and_fails_the_run(agent_engine, hello_project, sessions_root):
    out, err = io.StringIO(), io.StringIO()
    rc = run_headless(agent_factory(agent_engine, hello_project, sessions_root, "done", think_mode="none",
                                    store_cls=ReadOnlyStore), "task", out=out, err=err)
    assert rc == 1 and out.getvalue().strip() == "done"
    assert err.getvalue().count("save failed") == 1, err.getvalue()
    assert "finished: stop" in err.getvalue()


# -- what stderr shows between the events -----------------------------------------------------------
class ScriptedAgent:
    """Stands in for Agent in run_headless: emits a fixed list of events for the turn."""

    def __init__(self, emit, events):
        self.emit, self.events = emit, events
        self.store, self.modified, self.cfg = None, False, AgentConfig()

    def start(self):
        pass

    def submit(self, text):
        for ev in self.events:
            self.emit(ev)

    def save_on_exit(self):
        pass


def test_prefill_line_and_one_unbroken_reasoning_block_on_a_terminal():
    status = E.Status("m", "numpy", 10, 100, 0.0, 0.0, "new", "high", "generating")
    events = [E.Prefill(0, 900, 0.0, 0.0), E.Prefill(450, 900, 90.0, 5.0), E.ReasoningDelta("weigh"),
              status, E.ReasoningDelta("ing "), E.Notice("saved", "info"), E.ReasoningDelta("it"),
              E.TextDelta("Answer."), E.TurnFinished()]
    out, err = io.StringIO(), TTY()
    assert run_headless(lambda emit: ScriptedAgent(emit, events), "t", out=out, err=err) == 0
    e = err.getvalue()
    assert "prefill 450/900 tokens (90 t/s, 5 s left)" in e
    assert e.index("\r\x1b[K", e.index("prefill 450")) < e.index("weigh")      # the line is cleared first
    assert f"{DIM}weighing it\x1b[0m\n" in e          # status and info notices do not break the block
    assert out.getvalue() == "Answer.\n"
    out, err = io.StringIO(), io.StringIO()          # not a terminal: no live line, no colour
    run_headless(lambda emit: ScriptedAgent(emit, events), "t", out=out, err=err)
    assert "prefill" not in err.getvalue() and "\x1b" not in err.getvalue() and "weighing it\n" in err.getvalue()


def test_ctx_check_of_a_file_whose_tokenizer_cannot_be_built_is_one_line(tmp_path):
    from types import SimpleNamespace
    broken = SimpleNamespace(path="x.gguf", tokenizer={"tokens": []}, config=SimpleNamespace(context_length=0))
    msg = cli.check_ctx(100, broken, "high", tmp_path)
    assert msg.startswith("x.gguf: cannot build the tokenizer: ") and "\n" not in msg


class ExitSaveFails(SessionStore):
    """The turn's save works; the one on exit fails."""
    saves = 0

    def save(self, *a, **k):
        ExitSaveFails.saves += 1
        if ExitSaveFails.saves > 1:
            raise OSError(28, "No space left on device")
        return super().save(*a, **k)


def test_an_exit_save_that_fails_fails_the_run_too(agent_engine, hello_project, sessions_root):
    out, err = io.StringIO(), io.StringIO()
    rc = run_headless(agent_factory(agent_engine, hello_project, sessions_root, "done", think_mode="none",
                                    store_cls=ExitSaveFails), "task", out=out, err=err)
    assert ExitSaveFails.saves == 2 and rc == 1
    assert err.getvalue().count("save failed") == 1


# -- issue 35 item 7: a reader that goes away ------------------------------------------------------
class ClosedPipe(io.StringIO):
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_stops_the_turn_and_raises_for_a_quiet_exit(agent_engine, hello_project,
                                                                              sessions_root):
    err = io.StringIO()
    make_agent = agent_factory(agent_engine, hello_project, sessions_root, "</think>" + "word " * 40)
    with pytest.raises(BrokenPipeError):       # engine/console.py turns it into a quiet exit 141
        run_headless(make_agent, "talk", out=ClosedPipe(), err=err)
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), err.getvalue()
