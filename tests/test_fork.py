"""`/fork [NAME]`, the lineage tree in /list, instant /switch between branches (issue 25 part 2),
on the agent's tiny model. `agent.force(...)` makes the model emit given text (the engine still
evaluates every forced token, so the KV state is real); everything else is the real loop."""
from __future__ import annotations

import io
import json
import os
import re

import pytest

from ds4agent import sessions_cli
from ds4agent.agent import Agent, AgentConfig
from ds4agent.session_views import list_text, tree
from engine import SamplingParams
from helpers_agent import SYSTEM
from sessions import SessionInfo, SessionStore
from sessions.records import check_meta

@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """$DS4_AGENT_HOME for the module: its sessions/ holds the cached system prompt, so only the
    first agent prefills the tool prompt; `ds4-agent sessions` reads the same folder."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def make(agent_engine, git_project, home):
    def build(**cfg):
        conf = AgentConfig(ctx=4096 + 2048, think_mode="none", max_turn_tokens=24,
                           sampling=SamplingParams(seed=1), **cfg)
        store = SessionStore(root=home / "sessions", project_dir=git_project)
        agent = Agent(agent_engine, git_project, config=conf, store=store, system=SYSTEM)
        agent.start()
        return agent
    return build


def turn(agent, user: str, answer: str):
    agent.force(answer)
    fin = agent.submit(user)
    assert fin.finish_reason == "stop" and not agent.modified      # autosaved
    return agent.session.tokens


def text(agent) -> str:
    return agent.tok.decode(agent.session.tokens)


def on_disk(store) -> set[str]:
    return {e.sha for e in store.list("all")}


def count_loads(store) -> list[str]:
    """The saved sessions read from disk into a Session from now on (store.load's calls)."""
    loads, load = [], store.load

    def counted(ref, session, **kw):
        loads.append(ref)
        return load(ref, session, **kw)
    store.load = counted
    return loads


def test_fork_then_switch_each_branch_continues_its_own_tokens(make):
    agent = make()
    store = agent.store
    loads = count_loads(store)
    base = turn(agent, "plan the parser", "Plan: tokens first.")
    parent_sha, parent_branch, parent_name = agent.current_sha, agent.branch, agent.session_name
    live = agent.session
    prefill0 = dict(live.stats)
    out = agent.command("/fork try-regex")
    assert out.startswith("forked: you are on try-regex")
    # no prefill, no token changed: the live timeline goes on as the fork under a new branch id
    assert agent.session is live and live.stats == prefill0 and agent.session.tokens == base
    assert agent.session_name == "try-regex" and agent.branch != parent_branch and agent.current_sha == parent_sha
    assert list(agent.timelines.left) == [parent_branch]
    copy = agent.timelines.left[parent_branch].session
    assert copy is not live and copy.tokens == base and copy.stats["prefill_tokens"] == 0
    fork_branch = agent.branch

    fork1 = turn(agent, "try a regex", "Regex: done.")
    assert fork1[:len(base)] == base and "try a regex" in text(agent)
    f1 = store.resolve("try-regex")
    assert f1.branch == fork_branch and f1.parent == parent_sha and not f1.fork_pending
    assert store.resolve(parent_sha).forks == ()           # the fork has a record of its own now

    # back to the parent: instant (the copy in the pool), its own transcript and tokens
    prefilled = (live.stats["prefill_tokens"], copy.stats["prefill_tokens"])
    out = agent.command(f"/switch {parent_sha[:8]}")
    assert out.startswith(f"switched to session {parent_sha[:8]}")
    assert (live.stats["prefill_tokens"], copy.stats["prefill_tokens"]) == prefilled and loads == []
    assert agent.session is copy and agent.session.tokens == base and agent.branch == parent_branch
    assert agent.session_name == parent_name and [m.role for m in agent.transcript] == ["system", "user", "assistant"]
    parent2 = turn(agent, "write a hand parser", "Hand parser: done.")
    assert parent2[:len(base)] == base and "try a regex" not in text(agent) and "hand parser" in text(agent)
    p2 = store.info(agent.current_sha)
    assert p2.branch == parent_branch and p2.parent == parent_sha
    assert {parent_sha, f1.sha, p2.sha} <= on_disk(store)   # the branch point stays: two saves go on from it

    prefilled = (live.stats["prefill_tokens"], copy.stats["prefill_tokens"])
    agent.command("/switch try-regex")
    assert (live.stats["prefill_tokens"], copy.stats["prefill_tokens"]) == prefilled and loads == []
    assert agent.session is live and agent.session.tokens == fork1 and agent.branch == fork_branch
    assert agent.transcript[-1].content == "Regex: done."
    fork2 = turn(agent, "and the tests", "Tests: green.")
    assert fork2[:len(fork1)] == fork1 and "hand parser" not in text(agent)
    assert f1.sha not in on_disk(store) and {parent_sha, p2.sha, agent.current_sha} <= on_disk(store)

    # from disk once the pool is empty: the branch ids come back from the records
    agent.timelines.left.clear()
    agent.command(f"/switch {p2.id}")
    assert loads == [p2.sha]
    assert agent.session is not copy and agent.session.stats["prefill_tokens"] == 0
    assert agent.session.tokens == parent2 and agent.branch == parent_branch
    agent.timelines.left.clear()
    agent.command("/switch try-regex")
    assert agent.session.stats["prefill_tokens"] == 0 and agent.session.tokens == fork2
    assert agent.branch == fork_branch and agent.session_name == "try-regex"
    fork3 = turn(agent, "ship it", "Shipped.")
    assert fork3[:len(fork2)] == fork2 and store.resolve("try-regex").branch == fork_branch


def test_a_fork_not_yet_continued_is_kept_found_and_named(make, git_project):
    agent = make()
    store = agent.store
    base = turn(agent, "summarize the log", "Summary: two errors.")
    p, parent_branch = agent.current_sha, agent.branch
    agent.command("/fork")
    name = f"{p[:8]}-fork"
    assert agent.session_name == name
    pending = store.resolve(name)
    assert pending.fork_pending and pending.sha == p and pending.branch == agent.branch
    fork_branch = agent.branch
    # saving the unchanged fork (leaving) keeps the parent's record as it is and says the fork's name
    info = agent.save(quiet=True)
    assert info.name == name and info.branch == fork_branch
    rec = json.loads(open(store.meta_path(p)).read())
    assert rec["branch"] == parent_branch and [f["name"] for f in rec["forks"]] == [name]

    agent.command(f"/switch {p[:8]}")
    assert agent.branch == parent_branch
    turn(agent, "and the warnings", "One warning.")
    assert p in on_disk(store)                     # a pending fork starts there: not pruned
    listing = agent.command("/list")
    assert f"{name}: no turn yet (same text as {p[:8]})" in listing

    # a new agent (as after leaving) finds the fork by name: the parent's file under the fork's branch
    other = make()
    other.command(f"/switch {name}")
    assert other.session.tokens == base and other.branch == fork_branch and other.session_name == name
    assert other.session.stats["prefill_tokens"] == 0
    turn(other, "count the errors", "Two.")
    f1 = store.resolve(name)
    assert not f1.fork_pending and f1.branch == fork_branch and f1.parent == p
    assert store.resolve(p[:8]).forks == () and p in on_disk(store)
    assert sessions_cli.choose_resume(store, name) == f1.sha


def test_list_and_sessions_list_show_the_lineage_tree(make, git_project, home, monkeypatch):
    agent = make()
    turn(agent, "root question", "Root answer.")
    root = agent.current_sha
    agent.command("/fork side")
    turn(agent, "side question", "Side answer.")
    side = agent.current_sha
    agent.command(f"/switch {root[:8]}")
    turn(agent, "main question", "Main answer.")
    main = agent.current_sha
    agent.command("/fork idea")                    # pending, on main's save
    lines = agent.command("/list").splitlines()
    # the parent branch is one flat group, newest first (as the flat view); a fork's group is
    # indented under the save it branched from; the live timeline is the pending fork `idea`
    assert lines[0].startswith(f"  {main[:8]}") and "root question" in lines[0]
    assert lines[1].startswith("* └ fork") and f"idea: no turn yet (same text as {main[:8]})" in lines[1]
    assert lines[2].startswith(f"  {root[:8]}")
    assert lines[3].startswith(f"  └ {side[:8]}") and "side: root question" in lines[3]
    assert len(lines) == 4
    # the command line shows the same tree (its * is the session --resume continues)
    monkeypatch.setenv("DS4_AGENT_HOME", str(home))
    monkeypatch.chdir(git_project)
    out = io.StringIO()
    assert sessions_cli.main(["list"], out=out) == 0
    cli = out.getvalue().splitlines()
    def bare(ls):                      # without the marks (* differs) and the ages (time passes)
        return [re.sub(r"\d+[smhd] ago", "", ln[2:]) for ln in ls]
    assert bare(cli[:4]) == bare(lines) and cli[0].startswith(f"* {main[:8]}")


def test_tree_orders_by_lineage_and_survives_a_loop():
    def rec(sha, updated, branch, *anc):
        return SessionInfo(sha=sha * 40, path="", title=sha, updated=updated, branch=branch and branch * 12,
                           ancestors=tuple(a * 40 for a in anc))
    rows = [rec("d", 4, "1", "a", "b"), rec("c", 3, "2", "a"), rec("b", 2, "1", "a"), rec("a", 1, "1"),
            rec("e", 5, None)]
    # branch 1 is one group, newest first; c forked from a (branch 2): under a
    assert [(d, r.title) for d, r in tree(rows)] == [(0, "e"), (0, "d"), (0, "b"), (0, "a"), (1, "c")]
    # a fork of the fork, newer than e: the whole tree it is in comes first
    rows.append(rec("f", 6, "3", "a", "c"))
    assert [(d, r.title) for d, r in tree(rows)] == [(0, "d"), (0, "b"), (0, "a"), (1, "c"), (2, "f"), (0, "e")]
    # records without a branch (older ones) stay with their ancestor's group: the flat view
    old = [rec("b", 2, None, "a"), rec("a", 1, None), rec("x", 3, None)]
    assert [(d, r.title) for d, r in tree(old)] == [(0, "x"), (0, "b"), (0, "a")]
    loop = [rec("x", 1, "1", "y"), rec("y", 2, "2", "x")]
    assert sorted(r.title for _, r in tree(loop)) == ["x", "y"]


def test_branch_and_forks_fields_are_checked():
    ok = {"branch": "0123456789ab", "forks": [{"branch": "ba9876543210", "name": "idea", "created": 1.0}]}
    assert check_meta(ok) is None and check_meta({}) is None and check_meta({"branch": None}) is None
    for bad in ({"branch": "0123456789AB"}, {"branch": "0123456789abc"}, {"branch": 12},
                {"forks": {}}, {"forks": [{"branch": "x", "name": "a"}]},
                {"forks": [{"branch": "0123456789ab", "name": ""}]},
                {"forks": [{"branch": "0123456789ab", "name": "a\x00"}]},
                {"forks": [{"branch": "0123456789ab", "name": "a", "created": float("inf")}]}):
        assert check_meta(bad) is not None, bad


def test_a_record_without_branch_and_an_older_save_get_new_branches(make):
    agent = make()
    turn(agent, "old style", "Old answer.")
    sha = agent.current_sha
    path = agent.store.meta_path(sha)
    meta = json.loads(open(path).read())
    del meta["branch"]
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(path + ".tmp", path)
    agent.command("/new")
    agent.command(f"/switch {sha[:8]}")
    b1 = agent.branch
    agent.command("/new")
    agent.command(f"/switch {sha[:8]}")
    assert len(b1) == 12 and agent.branch != b1              # a fresh branch each time
    turn(agent, "go on", "Going.")
    first = agent.branch
    assert agent.store.resolve(agent.current_sha).branch == first
    agent.command("/save keep")                               # pinned: kept when the branch goes on
    kept = agent.current_sha
    turn(agent, "more", "More.")
    agent.command(f"/switch {kept[:8]}")                      # an older save of the branch: a new branch
    assert agent.branch != first
    agent.command("/switch keep")
    assert agent.branch == first                              # the name's holder is the branch's tip


def test_one_live_timeline_forks_without_a_copy_and_switches_from_disk(make):
    agent = make(live_timelines=1)
    base = turn(agent, "one", "First.")
    p = agent.current_sha
    live = agent.session
    agent.command("/fork solo")
    assert agent.timelines.left == {} and agent.session is live
    turn(agent, "the solo question", "Second.")
    agent.command(f"/switch {p[:8]}")
    assert agent.session is live and agent.session.tokens == base and agent.session_name != "solo"
    assert "solo question" not in text(agent) and agent.store.resolve("solo").parent == p


def test_a_save_takes_no_name_from_another_branch(make):
    agent = make()
    assert agent.command("/fork") == "nothing to fork yet: the session has no turn"
    turn(agent, "name me", "Named.")
    agent.command("/save main")
    p = agent.current_sha
    assert agent.command("/fork main").startswith("fork failed: the name 'main' is already used")
    assert agent.branch == agent.store.resolve("main").branch and agent.timelines.left == {}
    agent.command("/fork gone")
    assert agent.command("/delete gone").startswith(f"deleted session {p[:8]} (gone)")
    assert agent.current_sha == p and p in on_disk(agent.store)     # only the fork entry went
    turn(agent, "go on without a name", "Going.")
    mine = agent.store.info(agent.current_sha)
    assert mine.name is None and mine.parent == p
    assert agent.store.resolve("main").sha == p                     # the other branch keeps its name
