"""After a resume, /undo of the session's first turn rewinds the conversation to the cached system
prompt (issue 35 item 5: it said "the session saved at its start is gone"), and an interrupted
/compact says it was interrupted, not that it failed (item 12)."""
from __future__ import annotations

from ds4agent import events as E
from helpers_agent import call, say, start_agent


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
