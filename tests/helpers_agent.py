"""Helpers shared by the agent tests (test_agent, test_checkpoints*, test_headless, test_fork,
test_mcp): the system prompt, an event recorder that answers approvals, forced tool calls as the
model writes them, and an agent on a project with the suite's test settings. Their fixtures
(agent_engine, sessions_root, hello_project, ...) are in conftest.py."""
from __future__ import annotations

import json
import uuid

import prompts
from ds4agent import events as E
from ds4agent.agent import Agent, AgentConfig
from engine import SamplingParams
from sessions import SessionStore

SYSTEM = "You are ds4-agent under test."


class Recorder:
    """The agent's emit: keeps every event and answers each approval with `answer`."""

    def __init__(self, answer="y"):
        self.events, self.answer, self.agent = [], answer, None

    def __call__(self, ev):
        self.events.append(ev)
        if isinstance(ev, E.ApprovalNeeded):
            self.agent.answer_approval(self.answer)

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]

    def text(self):
        return "".join(e.text for e in self.of(E.TextDelta))


def start_agent(engine, project, root, answer="y", mcp=None, **cfg):
    """(agent, recorder): a started agent on `project` saving under `root`; ctx 16384, no
    thinking, 24 tokens a turn, seed 1 unless `cfg` says otherwise; `mcp` is handed to the Agent
    as the CLI does."""
    rec = Recorder(answer)
    conf = AgentConfig(ctx=cfg.pop("ctx", 16384), think_mode=cfg.pop("think_mode", "none"),
                       max_turn_tokens=cfg.pop("max_turn_tokens", 24), chunk=cfg.pop("chunk", 2048),
                       sampling=SamplingParams(seed=1), **cfg)
    store = SessionStore(root=root, project_dir=project)
    agent = Agent(engine, project, config=conf, store=store, emit=rec, system=SYSTEM, mcp=mcp)
    rec.agent = agent
    agent.start()
    return agent, rec


def call(name, **args):
    """A tool call in DSML, as the model would write it (for agent.force)."""
    return prompts.render_tool_calls([prompts.ToolCall(None, name, json.dumps(args))])


def timeline(agent):
    return agent.tok.decode(agent.session.tokens)


def say(agent, text: str, *forced: str):
    """A turn whose text no other test's timeline has (tests/test_checkpoints_timelines.py checks
    that a save of the same text by another timeline leaves each its own branch and checkpoints)."""
    agent.force(*forced)
    return agent.submit(f"{text} [{uuid.uuid4().hex[:8]}]")
