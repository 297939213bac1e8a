"""`ds4-agent sessions [list|show|delete]` and `--resume NAME|ID|pick` (issue 24 item 8): saved
sessions outside the TUI, with no model loaded; a resume that cannot be is one line, exit 1,
before the model loads."""
from __future__ import annotations

import pytest

from ds4agent import cli
from ds4agent.sessions_cli import NoChoice, choose_resume
from engine import Engine, Session
from sessions import SessionStore, SessionStoreError

CTX = 192
TEXT = "<｜begin▁of▁sentence｜>You are a helpful agent.<｜User｜>Fix the bug<｜Assistant｜>"


@pytest.fixture(scope="module")
def snap(small_model):
    with Engine.open(small_model) as eng:
        s = Session(eng, CTX)
        s.sync(eng.tokenizer.encode(TEXT))
        yield eng, s.snapshot()


class Clock:
    t = 1_700_000_000.0

    def __call__(self):
        Clock.t += 1.0
        return Clock.t


@pytest.fixture
def saved(snap, tmp_path, monkeypatch):
    """Three sessions of this directory (the newest named "work", continuing the oldest) and one
    of another directory; the agent's home in tmp_path."""
    eng, blob = snap
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    proj = tmp_path / "proj"
    proj.mkdir()
    monkeypatch.chdir(proj)
    store = SessionStore(project_dir=proj, now=Clock())
    s = Session(eng, CTX)
    s.restore(blob)
    first = store.save(s, think_mode="high", name="work")
    other = Session(eng, CTX)
    other.restore(blob)
    other.eval(90)
    side = store.save(other, think_mode="none")
    s.eval(67)
    work = store.save(s, think_mode="high")                  # the name moved here
    elsewhere = SessionStore(project_dir=tmp_path, now=Clock())
    far = Session(eng, CTX)
    far.restore(blob)
    far.eval(91)
    away = elsewhere.save(far, think_mode="high")
    return store, first, side, work, away


def test_list_show_delete(saved, capsys):
    store, first, side, work, away = saved
    assert cli.main(["sessions"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"* {work.id}") and "work: Fix the bug" in lines[0]   # newest: --resume's
    assert any(ln.startswith(f"  {side.id}") for ln in lines)
    assert any(ln.startswith(f"  {first.id}") and "(earlier save of work)" in ln for ln in lines)
    assert away.id not in out and "--resume pick" in out
    assert cli.main(["sessions", "list", "--all"]) == 0
    assert away.id in capsys.readouterr().out

    assert cli.main(["sessions", "show", "work"]) == 0
    shown = capsys.readouterr().out
    assert f"session {work.sha}" in shown and "name      work" in shown
    assert f"continues {first.id} ((earlier save of work)" in shown
    assert "> Fix the bug" in shown and "tokens    " in shown

    assert cli.main(["sessions", "delete", side.id]) == 0
    assert f"deleted session {side.id}" in capsys.readouterr().out
    assert side.sha not in {r.sha for r in store.list("all")}
    assert cli.main(["sessions", "delete", side.id]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no session")


def test_resume_by_name_id_or_pick(saved):
    store, first, side, work, away = saved
    assert choose_resume(store, "work") == work.sha
    assert choose_resume(store, first.id) == first.sha
    assert choose_resume(store, away.id) == away.sha            # another project's, by id: asked for
    with pytest.raises(SessionStoreError, match="no session 'nope'"):
        choose_resume(store, "nope")

    def answers(*said):
        it = iter(said)

        def ask(prompt):
            assert "continue which one? [1-3" in prompt
            v = next(it)
            if isinstance(v, type) and issubclass(v, BaseException):
                raise v()
            return v
        return ask
    import io
    out = io.StringIO()
    assert choose_resume(store, "pick", ask=answers("2"), out=out) == side.sha   # newest first: work, side, first
    listing = out.getvalue()
    assert "  1. " + work.id in listing and "  3. " + first.id in listing and away.id not in listing
    assert choose_resume(store, "pick", ask=answers(""), out=out) == work.sha
    assert choose_resume(store, "pick", ask=answers("9", "x", "3"), out=out) == first.sha
    assert "'9' is not a number from 1 to 3" in out.getvalue()
    for quit_ in ("q", EOFError):
        with pytest.raises(NoChoice):
            choose_resume(store, "pick", ask=answers(quit_), out=out)


def test_a_resume_that_cannot_be_is_one_line_before_the_model_loads(saved, agent_model, capsys, monkeypatch):
    store, *_ = saved
    monkeypatch.setattr("builtins.input", lambda prompt="": "q")
    for ref, msg in (("nope", "error: no session 'nope'"), ("pick", "no session chosen")):
        assert cli.main(["--model", str(agent_model), "--ctx", "16384", "--resume", ref]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert msg in err[-1] and not any("Traceback" in e for e in err)
    for r in store.list("project"):
        store.delete(r.sha)
    assert cli.main(["--model", str(agent_model), "--ctx", "16384", "--resume", "pick"]) == 1
    assert "no saved sessions in this directory" in capsys.readouterr().err


def test_a_damaged_text_field_never_raises(saved, capsys):
    """Issue 32 item 8: a lone surrogate in any text field of a record (and a NUL in a path-like
    one) passed the schema check, then `sessions list`/`show` raised on printing it and every
    `--resume` met "embedded null byte". The schema now rejects them: the record is damaged, listed
    with its error, and nothing raises."""
    import json

    from ds4agent.session_views import list_text
    store, first, side, work, away = saved
    path = store.meta_path(work.sha)
    with open(path, encoding="utf-8") as f:
        good = json.load(f)
    cases = [(k, "x\ud800y") for k in ("title", "name", "pinned", "project_dir", "think_mode", "model")]
    cases += [(k, "x\0y") for k in ("project_dir", "think_mode", "model")]
    cases += [("forks", [{"branch": "0123456789ab", "name": "f\udc80"}])]
    for field, bad in cases:
        meta = dict(good, **{field: bad})
        with open(path, "w", encoding="ascii") as f:
            json.dump(meta, f)                       # "\ud800" is written as its JSON escape
        assert cli.main(["sessions"]) == 0, field
        assert cli.main(["sessions", "list", "--all"]) == 0, field
        assert cli.main(["sessions", "show", work.id]) in (0, 1), field
        out, err = capsys.readouterr()
        (out + err).encode("utf-8")                  # printable as it is
        assert "Traceback" not in err and "damaged" in out + err and field.rstrip("s") in out + err, field
        listing = list_text(store, "all") + list_text(store, "project")   # /list
        listing.encode("utf-8")
        assert choose_resume(store, first.id) == first.sha                  # --resume of another
        rows = [r for r in store.list("project") if r.ok]                   # /resume's choice
        assert work.sha not in {r.sha for r in rows} and first.sha in {r.sha for r in rows}
        with pytest.raises(SessionStoreError, match="damaged"):
            choose_resume(store, work.id)
