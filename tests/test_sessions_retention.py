"""Sessions do not pile up (issue 35 item 13): headless runs keep the newest N unnamed sessions of a
project, `sessions prune --max-size` brings the store under a budget (a dry run unless --yes),
`list --all` has a project column, and a save that /undo or /compact went back before says why it
is still listed."""
from __future__ import annotations

import pytest

from ds4agent import cli
from ds4agent.sessions_cli import main as sessions_main
from ds4agent.session_views import list_text
from engine import Engine, Session
from sessions import SessionStore
from sessions.retention import HEADLESS, parse_size, plan_prune, prune_headless, replaced, store_bytes

CTX = 192
TEXT = "<｜begin▁of▁sentence｜>You are a helpful agent.<｜User｜>hi<｜Assistant｜>"


@pytest.fixture(scope="module")
def snap(small_model):
    with Engine.open(small_model) as eng:
        s = Session(eng, CTX)
        s.sync(eng.tokenizer.encode(TEXT))
        yield eng, s.snapshot()


class Clock:
    def __init__(self):
        self.t = 1_700_000_000.0

    def __call__(self):
        self.t += 1.0
        return self.t


def save(store, snap, token: int, **kw):
    eng, blob = snap
    s = Session(eng, CTX)
    s.restore(blob)
    s.eval(token)
    return store.save(s, think_mode="none", **kw)


def test_headless_runs_keep_the_newest_unnamed_ones_of_their_project(snap, tmp_path):
    clock = Clock()
    proj, other = tmp_path / "proj", tmp_path / "other"
    proj.mkdir(), other.mkdir()
    store = SessionStore(root=tmp_path / "s", project_dir=proj, now=clock)
    tui = save(store, snap, 10)                               # a TUI session: never the rule's
    store.origin = HEADLESS
    named = save(store, snap, 11, name="keepme")              # named: kept
    runs = [save(store, snap, 20 + i) for i in range(5)]
    away = SessionStore(root=tmp_path / "s", project_dir=other, now=clock)
    away.origin = HEADLESS
    far = save(away, snap, 40)
    assert {r.origin for r in runs} == {HEADLESS} and tui.origin is None
    gone = prune_headless(store, keep=2)
    assert sorted(e.sha for e in gone) == sorted(r.sha for r in runs[:3])
    left = {e.sha for e in store.list("all")}
    assert left == {tui.sha, named.sha, runs[3].sha, runs[4].sha, far.sha}


def test_the_command_line_marks_headless_saves_and_applies_headless_keep(snap, tmp_path, monkeypatch, agent_model,
                                                                          capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("headless_keep = 2\n")
    monkeypatch.setenv("DS4_AGENT_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    made = []
    real = SessionStore

    class Store(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)
    monkeypatch.setattr("sessions.SessionStore", Store)
    runs = iter(range(50, 60))

    def fake_headless(make_agent, task, *, resume, quiet):
        save(made[-1], snap, next(runs))                     # what the run's agent saves
        return 0
    monkeypatch.setattr("ds4agent.headless.run_headless", fake_headless)
    for i in range(4):
        assert cli.main(["-m", str(agent_model), "--ctx", "16384", "-p", f"task {i}"]) == 0
    rows = real(root=home / "sessions", project_dir=tmp_path).list("project")
    assert len(rows) == 2 and all(r.origin == HEADLESS for r in rows)
    assert "removed 1 older unnamed headless session(s)" in capsys.readouterr().err
    (home / "config.toml").write_text("headless_keep = 0\n")
    assert cli.main(["-m", str(agent_model), "--ctx", "16384", "-p", "x"]) == 1
    assert "headless_keep in the config must be a whole number of at least 1" in capsys.readouterr().err


def test_prune_shows_the_plan_and_deletes_only_with_yes(snap, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    store = SessionStore(project_dir=tmp_path, now=Clock())
    old = [save(store, snap, 60 + i) for i in range(3)]
    named = save(store, snap, 70, name="mine")
    new = save(store, snap, 71)
    one = old[0].size
    budget = store_bytes(store) - 2 * one                    # two sessions must go
    assert sessions_main(["prune", "--max-size", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "would delete 2 unnamed session(s)" in out and "--yes" in out
    assert len(store.list("all")) == 5                       # a dry run
    assert sessions_main(["prune", "--max-size", str(budget), "--yes"]) == 0
    assert "deleted 2 session(s)" in capsys.readouterr().out
    assert {e.sha for e in store.list("all")} == {old[2].sha, named.sha, new.sha} and store_bytes(store) <= budget
    # nothing unnamed can bring it lower: said, exit 1
    assert sessions_main(["prune", "--max-size", "1", "--yes"]) == 0
    assert sessions_main(["prune", "--max-size", "1"]) == 1
    assert "nothing can be deleted" in capsys.readouterr().out
    assert {e.sha for e in store.list("all")} == {named.sha}
    assert plan_prune(store, 1).doomed == []


def test_sizes():
    assert parse_size("4096") == 4096 and parse_size("500M") == 500 << 20 and parse_size("1.5GB") == 3 << 29
    assert parse_size("2g") == 2 << 30 and parse_size("10KiB") == 10 << 10
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_list_all_has_a_project_column(snap, tmp_path):
    clock = Clock()
    a, b = tmp_path / "alpha", tmp_path / "beta-project"
    a.mkdir(), b.mkdir()
    sa = SessionStore(root=tmp_path / "s", project_dir=a, now=clock)
    save(sa, snap, 80)
    save(SessionStore(root=tmp_path / "s", project_dir=b, now=clock), snap, 81)
    lines = list_text(sa, "all").splitlines()
    # (a long path shows its end: the project's own folder)
    assert len(lines) == 2 and any("/alpha " in l for l in lines) and any("/beta-project " in l for l in lines)
    col = [l.index("hi") for l in lines]                       # the title starts in one column
    assert col[0] == col[1]
    assert "/alpha " not in list_text(sa, "project")


def test_a_save_its_branch_went_back_before_says_why_it_is_listed(snap, tmp_path):
    store = SessionStore(root=tmp_path / "s", project_dir=tmp_path, now=Clock())
    branch = "ab12cd34ef56"
    undone = save(store, snap, 90, branch=branch)
    kept = save(store, snap, 91, branch="0123456789ab", name="named")     # another branch, named
    went_on = save(store, snap, 92, branch=branch)        # the branch went on from an earlier point
    assert replaced(store.list("all")) == {undone.sha}
    text = list_text(store)
    line = next(l for l in text.splitlines() if undone.id in l)
    assert "replaced: /undo or /compact went back before it" in line
    assert all("replaced" not in l for l in text.splitlines() if kept.id in l or went_on.id in l)
