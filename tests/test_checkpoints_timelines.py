"""Checkpoints with the other parts of issue 25 (review): a timeline keeps its checkpoints when
another timeline saved the same text first; /fork and /switch keep each branch's checkpoints to
itself, and /undo works on a Session the pool swapped in; an MCP tool that is not annotated
read-only gets a checkpoint first (a filesystem server writes files); the redo save of an /undo is
dropped once /redo is no longer possible."""
from __future__ import annotations

import os

import pytest

from ds4agent import events as E
from ds4agent.mcp_client import McpManager, McpTool, _tool
from ds4agent.mcp_config import McpConfig
from helpers_agent import SYSTEM, call, say, start_agent
import tools


def test_the_same_text_saved_by_another_timeline_keeps_this_ones_checkpoints(agent_engine, user_repo, sessions_root):
    first, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    second, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    step = (call("write", path="same.txt", content="x\n"), "ok")
    first.force(*step)
    first.submit("the very same turn")
    os.remove(user_repo / "same.txt")
    b2 = second.branch
    second.force(*step)
    second.submit("the very same turn")
    assert second.current_sha == first.current_sha          # one record, saved by `first`
    assert second.branch == b2 != first.branch              # ... and `second` stays on its branch
    assert "same.txt" in second.command("/checkpoints")
    assert "undid step 1" in second.command("/undo")
    assert not (user_repo / "same.txt").exists()
    # the first timeline's checkpoint is untouched by the second's undo
    assert "undone" not in first.command("/checkpoints")


def test_fork_switch_and_undo_keep_each_branch_to_itself(agent_engine, user_repo, sessions_root):
    agent, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    say(agent, "on the parent", call("write", path="p.txt", content="parent\n"), "ok")
    parent = agent.branch
    assert agent.command("/fork side").startswith("forked")
    parent_session = agent.timelines.left[parent].session               # its copy, in the pool
    assert "p.txt" in agent.command("/checkpoints")                     # the history both share
    say(agent, "on the fork", call("write", path="f.txt", content="fork\n"), "ok")
    fork_tokens = agent.session.tokens
    assert "undid step 2" in agent.command("/undo")
    assert not (user_repo / "f.txt").exists() and (user_repo / "p.txt").exists()   # the parent's step stays
    assert "undid step 1" in agent.command("/undo")                      # the shared one, on the fork's refs
    assert not (user_repo / "p.txt").exists()
    (user_repo / "p.txt").write_text("parent\n")                             # (files are shared: put it back)
    agent.command("/switch " + agent.store.info(agent.timelines.left[parent].current_sha).id)
    assert agent.branch == parent and agent.session is parent_session    # the pool's Session
    listing = agent.command("/checkpoints")
    assert "p.txt" in listing and "f.txt" not in listing and "undone" not in listing
    out = agent.command("/undo")
    assert "undid step 1" in out and "no prefill" in out, out
    assert not (user_repo / "p.txt").exists()
    assert agent.session.tokens != fork_tokens


def manager_with(tmp_path, *tools_):
    m = McpManager(McpConfig(allow=["mcp__fs__*"]), log_dir=tmp_path / "logs")   # (no approval asked)
    for t in tools_:
        m._tools[t.name] = t
    return m


def test_an_mcp_tool_that_may_write_gets_a_checkpoint(agent_engine, user_repo, sessions_root, tmp_path):
    write = _tool("fs", {"name": "write_file", "inputSchema": {"type": "object"}})
    read = _tool("fs", {"name": "read_file", "annotations": {"readOnlyHint": True}})
    odd = _tool("fs", {"name": "odd", "annotations": {"readOnlyHint": "yes"}})   # not a bool: may write
    assert not write.read_only and read.read_only and not odd.read_only
    m = manager_with(tmp_path, write, read, odd)

    def fake_call(name, args, emit=None, should_stop=None):
        if name == write.name:
            (user_repo / "mcp.txt").write_text("written by a server\n")
        return tools.ToolResult("done")
    m.call = fake_call
    agent, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    agent.mcp = m
    say(agent, "use the server", call(read.name), call(write.name, path="mcp.txt"), "ok")
    steps = agent.checkpoints._steps
    assert [s.meta["tool"] for s in steps.values()] == [write.name]       # the read-only one: none
    assert steps[1].files == ["mcp.txt"]
    assert "undid step 1" in agent.command("/undo") and not (user_repo / "mcp.txt").exists()


def test_the_redo_save_goes_once_redo_is_impossible(agent_engine, user_repo, sessions_root):
    agent, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    say(agent, "hello", "Hi.")
    say(agent, "work", call("write", path="w.txt", content="w\n"), "ok")
    before_undo = agent.current_sha
    agent.command("/undo")
    assert os.path.exists(agent.store.kv_path(before_undo))            # /redo loads it
    say(agent, "something else", "fine")
    assert agent.command("/redo").startswith("nothing to redo")
    assert not os.path.exists(agent.store.kv_path(before_undo))        # no stray session in /list
    assert before_undo not in {e.sha for e in agent.store.list("all")}


def test_a_named_redo_save_is_kept(agent_engine, user_repo, sessions_root):
    agent, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    say(agent, "work", call("write", path="n.txt", content="n\n"), "ok")
    agent.command("/save keepme")
    named = agent.current_sha
    agent.command("/undo")
    say(agent, "other", "fine")
    assert os.path.exists(agent.store.kv_path(named))                  # the user named it


def test_undo_across_a_compaction_restores_files_and_says_the_conversation_cannot(agent_engine, user_repo,
                                                                                 sessions_root):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    say(agent, "one", "a")
    say(agent, "work", call("write", path="c.txt", content="c\n"), "ok")
    say(agent, "two", "b")
    agent.force("SUMMARY: wrote c.txt.")
    assert agent.compact("test")
    tokens = agent.session.tokens
    out = agent.command("/undo")
    assert "undid step 1" in out and "the conversation was not rewound" in out and "compacted" in out, out
    assert not (user_repo / "c.txt").exists() and agent.session.tokens == tokens  # the compacted one stays


def test_headless_takes_checkpoints_and_never_waits(agent_engine, user_repo, sessions_root):
    import io
    from ds4agent.agent import Agent, AgentConfig
    from ds4agent.headless import run_headless
    from engine import SamplingParams
    from sessions import SessionStore
    made = []

    def make_agent(emit):
        conf = AgentConfig(ctx=16384, think_mode="none", max_turn_tokens=16, yolo=True, sampling=SamplingParams(seed=2))
        agent = Agent(agent_engine, user_repo, config=conf,
                      store=SessionStore(root=sessions_root, project_dir=user_repo), emit=emit, system=SYSTEM)
        agent.force(call("write", path="h.txt", content="headless\n"), "Done.")
        made.append(agent)
        return agent
    out, err = io.StringIO(), io.StringIO()
    assert run_headless(make_agent, "write h.txt", out=out, err=err) == 0, err.getvalue()
    assert (user_repo / "h.txt").exists()
    steps = made[0].checkpoints._steps
    assert [s.meta["tool"] for s in steps.values()] == ["write"] and steps[1].files == ["h.txt"]


# -- issue 35 items 5 and 12 (here, where the module's system prompt is already cached) -------------
def test_undo_of_the_first_turn_after_a_resume_uses_the_cached_system_prompt(agent_engine, user_repo,
                                                                              sessions_root):
    first, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    system_tokens = first.session.tokens
    say(first, "write it", call("write", path="r.txt", content="r\n"), "done")
    say(first, "and more", "fine " * 30)      # the first turn is beyond what the loaded state can cut
    first.save_on_exit()
    assert (user_repo / "r.txt").exists() and first.current_sha
    again, _ = start_agent(agent_engine, user_repo, sessions_root, yolo=True)     # a new process: --resume
    assert again.command("/resume").startswith("switched to session")
    out = again.command("/undo 1")
    assert "undid step 1" in out and "not rewound" not in out, out
    assert "cached system prompt, no prefill" in out
    assert again.session.tokens == system_tokens and [m.role for m in again.transcript] == ["system"]
    assert not (user_repo / "r.txt").exists()


def test_an_interrupted_compaction_says_so(agent_engine, user_repo, sessions_root):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root)
    for i in range(2):
        say(agent, f"question {i}", f"answer {i}")
    before = agent.session.tokens
    agent.interrupt()
    assert agent.compact("test") is False
    notes = [n.text for n in rec.of(E.Notice)]
    assert "compaction interrupted; the conversation is unchanged" in notes, notes
    assert not any(n.startswith("compaction failed") for n in notes)
    assert agent.session.tokens == before
