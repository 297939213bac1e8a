"""Checkpoints, /undo, /redo and /checkpoints with the real agent on the tiny model (forced DSML).

The acceptance tests of issue 25 part 1: edit + a bash that deletes a file, then /undo: the files
come back byte for byte, the KV timeline is back at the recorded turn start with no prefill, and the
user's index, branch and stash are untouched (a repository with staged changes and a stash); the
same outside git (shadow repository); /redo; a file someone else changed is asked about; /undo N in
the middle of a turn; a failed checkpoint never blocks the tool.
"""
from __future__ import annotations

import os
import subprocess

from ds4agent import events as E
from ds4agent.checkpoints import Checkpoints
from helpers_agent import call, say, start_agent, timeline
from helpers_git import files_of, git, user_state


def edit_and_delete(agent):
    return say(agent, "change it and clean up", call("edit", path="hello.py", old="'hi '", new="'hello '"),
               call("bash", command="rm gone.txt && echo removed"), "Done.")


def test_undo_restores_files_and_kv_without_prefill_and_leaves_git_alone(agent_engine, user_repo, sessions_root):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root)
    say(agent, "hello", "Hi.")                       # a turn before: the undo comes back to its end
    pos0, tokens0, n_msgs = agent.session.pos, agent.session.tokens, len(agent.transcript)
    files0, git0 = files_of(user_repo), user_state(user_repo)
    fin = edit_and_delete(agent)
    assert fin.tool_calls == 2 and all(ev.ok for ev in rec.of(E.ToolFinished))
    assert not (user_repo / "gone.txt").exists() and "'hello '" in (user_repo / "hello.py").read_text()
    steps = agent.checkpoints._steps
    assert [s.meta["start"]["pos"] for s in steps.values()] == [pos0, pos0]   # the turn's start
    assert steps[1].files == ["hello.py"] and steps[2].files == ["gone.txt"]
    prefill = agent.session.stats["prefill_tokens"]
    out = agent.command("/undo")
    assert "undid steps 1-2" in out and "no prefill" in out, out
    assert files_of(user_repo) == files0                                   # byte for byte
    assert agent.session.pos == pos0 and agent.session.tokens == tokens0
    assert agent.session.stats["prefill_tokens"] == prefill           # nothing re-prefilled
    assert len(agent.transcript) == n_msgs and agent.transcript[-1].content == "Hi."
    assert user_state(user_repo) == git0                                    # index, HEAD, refs, stash, status
    diff = [n.text for n in rec.of(E.Notice) if n.text.startswith("/undo:")][0]
    assert "gone.txt" in diff and "-    return 'hello ' + name" in diff
    # the conversation goes on from there, consistently
    say(agent, "next", "Again.")
    text = timeline(agent)
    assert "change it and clean up" not in text and text.endswith("Again.")
    assert agent.command("/redo").startswith("nothing to redo")      # a new turn happened
    listing = agent.command("/checkpoints")
    assert "hello.py" in listing and "gone.txt" in listing and "(undone)" in listing


def test_redo_puts_files_and_conversation_back(agent_engine, user_repo, sessions_root):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root)
    edit_and_delete(agent)
    after_files, after_tokens = files_of(user_repo), agent.session.tokens
    agent.command("/undo")
    assert (user_repo / "gone.txt").exists()
    prefill = agent.session.stats["prefill_tokens"]
    out = agent.command("/redo")
    assert "loaded, no prefill" in out, out
    assert files_of(user_repo) == after_files and agent.session.tokens == after_tokens
    assert agent.session.stats["prefill_tokens"] == prefill
    assert agent.transcript[-1].content == "Done."
    assert agent.command("/redo").startswith("nothing to redo")
    # and undo works again from there
    assert "undid steps 1-2" in agent.command("/undo")
    assert (user_repo / "gone.txt").read_text() == "bash deletes me\n"


def test_outside_git_a_shadow_repository(agent_engine, tmp_path, sessions_root):
    proj = tmp_path / "plain"
    proj.mkdir()
    (proj / "a.txt").write_text("original\n")
    agent, rec = start_agent(agent_engine, proj, sessions_root)
    say(agent, "work", call("write", path="b.txt", content="new file\n"),
        call("edit", path="a.txt", old="original", new="edited"), "ok")
    assert (proj / "b.txt").exists()
    assert "undid steps 1-2" in agent.command("/undo")
    assert files_of(proj) == {"a.txt": b"original\n"}
    assert not (proj / ".git").exists()
    assert list((sessions_root.parent / "checkpoints").glob("*.git"))


def test_a_file_changed_by_someone_else_is_asked_about(agent_engine, user_repo, sessions_root):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root, answer="y")
    say(agent, "write two files", call("write", path="x.txt", content="agent\n"),
        call("write", path="y.txt", content="agent\n"), "ok")
    (user_repo / "x.txt").write_text("the user's\n")          # after the agent left it
    rec.answer = "n"
    n_asked = len(rec.of(E.ApprovalNeeded))
    out = agent.command("/undo")
    asked = rec.of(E.ApprovalNeeded)[n_asked:]
    assert [a.name for a in asked] == ["undo"] and "x.txt" in asked[0].summary and "y.txt" not in asked[0].summary
    assert (user_repo / "x.txt").read_text() == "the user's\n" and not (user_repo / "y.txt").exists()
    assert "kept as they are" in out and "x.txt" in out


def test_undo_n_in_the_middle_of_a_turn_tells_the_model(agent_engine, user_repo, sessions_root):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    pos0 = agent.session.pos
    say(agent, "three files", *(call("write", path=f"{c}.txt", content=c) for c in "abc"), "ok")
    out = agent.command("/undo 1")
    assert "undid step 3" in out and "step(s) 1, 2 of that turn stay in the files" in out, out
    assert (user_repo / "a.txt").exists() and (user_repo / "b.txt").exists() and not (user_repo / "c.txt").exists()
    assert agent.session.pos == pos0                                  # the turn boundary
    say(agent, "go on", "fine")
    text = timeline(agent)
    assert "[ds4-agent: the user undid a turn of this conversation, except its first 2" in text
    assert "a.txt" in text.split("[ds4-agent:")[1] and text.endswith("fine")
    assert agent.command("/undo 9").startswith("there are only")
    assert agent.command("/undo x").startswith("usage")


def test_undo_falls_back_to_the_saved_turn_start(agent_engine, user_repo, sessions_root, monkeypatch):
    """When the state cannot be cut back in place, the session saved at the turn's start is
    loaded (no prefill), even though the store pruned it when the turn's own save continued it;
    when there is none, only the files go back, after asking."""
    agent, rec = start_agent(agent_engine, user_repo, sessions_root)
    say(agent, "hello", "Hi.")
    start_sha, tokens0 = agent.current_sha, agent.session.tokens
    edit_and_delete(agent)
    assert agent.current_sha != start_sha and not os.path.exists(agent.store.kv_path(start_sha))   # pruned
    monkeypatch.setattr(agent.session.state, "can_truncate", lambda *a: False)
    prefill = agent.session.stats["prefill_tokens"]
    out = agent.command("/undo")
    assert "(loaded, no prefill)" in out, out
    assert agent.session.tokens == tokens0 and agent.session.stats["prefill_tokens"] == prefill
    # again, with nothing saved to load and no cached system prompt (which a first turn's undo
    # falls back to: test_checkpoints_timelines.py): the files only, after asking
    agent2, rec2 = start_agent(agent_engine, user_repo, sessions_root, autosave=False)
    edit_and_delete(agent2)
    monkeypatch.setattr(agent2.session.state, "can_truncate", lambda *a: False)
    monkeypatch.setattr(agent2.store, "sysprompt_path", lambda *a: str(user_repo / "no-cached-prompt"))
    tokens = agent2.session.tokens
    rec2.answer = "n"
    assert agent2.command("/undo").startswith("undo cancelled")
    assert not (user_repo / "gone.txt").exists() and agent2.session.tokens == tokens
    rec2.answer = "y"
    out = agent2.command("/undo")
    assert "the conversation was not rewound" in out and (user_repo / "gone.txt").exists()
    assert agent2.session.tokens == tokens


def test_a_failed_checkpoint_does_not_block_the_tool(agent_engine, user_repo, sessions_root, monkeypatch):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    monkeypatch.setenv("PATH", str(user_repo / "no-git-here"))
    say(agent, "write", call("write", path="w.txt", content="written\n"), call("write", path="v.txt", content="v\n"), "ok")
    assert (user_repo / "w.txt").read_text() == "written\n" and (user_repo / "v.txt").exists()
    warnings = [n.text for n in rec.of(E.Notice) if "no checkpoint" in n.text]
    assert len(warnings) == 1 and "git is not installed" in warnings[0]      # said once
    # git past its time limit: one warning, and no more checkpoints this session (each would wait)
    monkeypatch.undo()
    agent.checkpoints = Checkpoints(agent)
    agent.checkpoints._load()[0].git.timeout = 1e-4
    say(agent, "again", call("write", path="w.txt", content="1\n"), call("write", path="w.txt", content="2\n"), "ok")
    assert (user_repo / "w.txt").read_text() == "2\n"
    warnings = [n.text for n in rec.of(E.Notice) if "no checkpoint" in n.text][1:]
    assert len(warnings) == 1 and "checkpoints are off for this session" in warnings[0], warnings
    assert agent.command("/undo").startswith("checkpoints are off")


def test_checkpoints_off_and_restart(agent_engine, user_repo, sessions_root):
    agent, rec = start_agent(agent_engine, user_repo, sessions_root, yolo=True, checkpoints=False)
    say(agent, "write", call("write", path="w.txt", content="x"), "ok")
    assert b"ds4-agent" not in git(user_repo, "for-each-ref")
    assert "off" in agent.command("/undo")
    agent, rec = start_agent(agent_engine, user_repo, sessions_root, yolo=True)
    say(agent, "write", call("write", path="w.txt", content="y"), "ok")
    agent.checkpoints = Checkpoints(agent)      # a restart on the same branch: read from the refs
    assert "w.txt" in agent.command("/checkpoints")
    assert "undid step 1" in agent.command("/undo")
    assert (user_repo / "w.txt").read_text() == "x"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=user_repo, capture_output=True).returncode == 0
