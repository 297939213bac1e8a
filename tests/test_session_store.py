"""The agent's named-session store: save/list/load/rename/delete, lineage pruning, damaged files,
the system-prefix cache. One small prefill per module; every other timeline is a restored snapshot plus a
few decode steps."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from engine import Session
from helpers_sessions import prefix_snapshots
from sessions.kvfile import read_header, read_info
from sessions.prefix_cache import token_text
from sessions.store import (AmbiguousSession, SessionNotFound, SessionStore, SessionStoreError,
                            clip_title, title_from_text)

CTX = 192
BOS = "<｜begin▁of▁sentence｜>"
SYSTEM = BOS + "You are a helpful agent."
USER = "<｜User｜>Fix the  bug\nin main.py<｜Assistant｜>"


class Clock:
    def __init__(self, t=1_700_000_000.0):
        self.t = t

    def __call__(self):
        return self.t

    def tick(self, dt=10.0):
        self.t += dt
        return self.t


@pytest.fixture(scope="module")
def base(small_engine):
    """(system-prefix snapshot, conversation snapshot): prefilled once."""
    return prefix_snapshots(small_engine, CTX, SYSTEM, USER)


def session_from(eng, blob) -> Session:
    s = Session(eng, CTX)
    s.restore(blob)
    return s


def extend(s: Session, ids):
    for t in ids:
        s.eval(t)
    return s


def same_bits(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


def shas(store, scope="all"):
    return [e.sha for e in store.list(scope)]


# -- titles --------------------------------------------------------------------------------------
def test_title_from_rendered_text():
    assert title_from_text(SYSTEM) == "(no user prompt)"
    assert title_from_text(SYSTEM + "<｜User｜>  \n <｜Assistant｜>") == "(empty user prompt)"
    assert title_from_text(SYSTEM + USER + "ok<｜User｜>second") == "Fix the bug in main.py"
    assert title_from_text(SYSTEM + "<｜User｜>one<｜User｜>two<｜Assistant｜>") == "one"
    long = "word " * 40
    t = title_from_text("<｜User｜>" + long)
    assert t.endswith("...") and len(t.encode()) <= 70 and t.startswith("word word")
    assert title_from_text("<｜User｜>" + "x" * 67) == "x" * 67          # 67 bytes fit whole
    assert title_from_text("<｜User｜>" + "x" * 68) == "x" * 67 + "..."
    # never a broken UTF-8 character at the cut
    t = clip_title("é" * 50)
    assert t.endswith("...") and "\ufffd" not in t and len(t.encode()) <= 70


# -- save / list / load --------------------------------------------------------------------------
def test_save_list_load_without_prefill(small_engine, base, tmp_path, monkeypatch):
    clock = Clock()
    root = tmp_path / "sessions"
    a_store = SessionStore(root, project_dir=tmp_path / "projA", now=clock)
    b_store = SessionStore(root, project_dir=tmp_path / "projB", now=clock)
    assert (os.stat(root).st_mode & 0o777) == 0o700

    s = session_from(small_engine, base[1])
    a = a_store.save(s, think_mode="think")
    assert a.title == "Fix the bug in main.py" and a.tokens == s.pos and a.ok
    assert a.think_mode == "think" and a.project_dir == os.path.realpath(tmp_path / "projA")
    assert a.sha == hashlib.sha1(token_text(s)).hexdigest() and a.quant_bits == 2
    h, _ = read_header(a.path)
    assert h.reason_name == "agent-session" and h.tokens == s.pos
    assert read_info(a.path).text == token_text(s)          # a plain ds4 KV file
    assert json.loads(open(a_store.meta_path(a.sha)).read())["title"] == a.title

    clock.tick()
    hello = small_engine.tokenizer.encode("<｜User｜>hello<｜Assistant｜>")
    s2 = extend(session_from(small_engine, base[0]), hello)
    b = b_store.save(s2, think_mode="nothink", title="  my   own\ttitle ")
    assert b.title == "my own title"
    assert shas(a_store, "project") == [a.sha]
    assert shas(b_store, "project") == [b.sha]
    assert shas(a_store, "all") == [b.sha, a.sha]           # most recent first
    clock.tick()
    a_store.save(s, think_mode="think")                      # re-saving updates the time only
    assert shas(a_store, "all") == [a.sha, b.sha]
    assert a_store.info(a.id).created == a.created

    # load into a fresh session: nothing is evaluated, the logits are the saved ones
    fresh = Session(small_engine, CTX)

    def no_forward(*args, **kw):
        raise AssertionError("load must not run the model")
    monkeypatch.setattr(small_engine.model, "forward", no_forward)
    got = a_store.load(a.id, fresh)
    monkeypatch.undo()
    assert got.sha == a.sha and got.text == token_text(s)
    assert fresh.tokens == s.tokens and fresh.stats["prefill_tokens"] == 0
    assert same_bits(fresh.logits, s.logits)
    for t in small_engine.tokenizer.encode(" Sure."):
        assert same_bits(fresh.eval(t), s.eval(t))


def test_load_by_name_prefix_rename_delete_and_errors(small_engine, base, tmp_path):
    clock = Clock()
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=clock)
    s = session_from(small_engine, base[1])
    txt = token_text(s)
    # two siblings whose ids share a first hex digit, found by hashing before saving
    by_digit = {}
    for t in range(67, 93):
        sha = hashlib.sha1(txt + small_engine.tokenizer.token_bytes(t)).hexdigest()
        by_digit.setdefault(sha[0], []).append((t, sha))
    (t1, sha1), (t2, sha2) = next(v for v in by_digit.values() if len(v) >= 2)[:2]
    common = os.path.commonprefix([sha1, sha2])
    s.eval(t1)
    one = store.save(s, think_mode="think")
    clock.tick()
    s.rewind(1)
    s.eval(t2)
    two = store.save(s, think_mode="think")
    assert {one.sha, two.sha} == {sha1, sha2} and len(store.list()) == 2   # siblings: no pruning

    with pytest.raises(AmbiguousSession) as ex:
        store.load(common, Session(small_engine, CTX))
    assert one.id in str(ex.value) and two.id in str(ex.value)
    assert store.info(sha1[:len(common) + 1]).sha == sha1
    with pytest.raises(SessionNotFound):
        store.info("0123456789abcdef" if not sha1.startswith("0123") else "fedcba98")
    with pytest.raises(SessionNotFound):
        store.info("no such name")

    store.rename(one.id, "work")
    assert store.info("work").sha == one.sha and store.list()[1].name == "work"
    with pytest.raises(SessionStoreError):
        store.rename(two.id, "work")                          # names are unique
    with pytest.raises(SessionStoreError):
        store.rename(two.id, "bad\nname")
    fresh = Session(small_engine, CTX)
    assert store.load("work", fresh).sha == one.sha and fresh.tokens[-1] == t1
    store.rename("work", None)
    assert store.info(one.id).name is None
    with pytest.raises(SessionNotFound):
        store.info("work")

    store.delete(two.id)
    assert not os.path.exists(store.kv_path(two.sha)) and not os.path.exists(store.meta_path(two.sha))
    assert shas(store) == [one.sha]
    with pytest.raises(SessionNotFound):
        store.load(two.sha, fresh)
    with pytest.raises(SessionStoreError):
        store.save(s, "not the transcript", think_mode="think")


# -- prefix pruning ------------------------------------------------------------------------------
def test_linear_continuation_replaces_its_unnamed_ancestors(small_engine, base, tmp_path):
    clock = Clock()
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=clock)
    s = session_from(small_engine, base[1])
    a = store.save(s, think_mode="think")
    extend(s, [67, 68])
    b = store.save(s, think_mode="think")
    assert b.parent == a.sha and shas(store) == [b.sha]           # A is inside B: replaced
    extend(s, [69])
    c = store.save(s, think_mode="think")
    assert c.ancestors == (a.sha, b.sha) and shas(store) == [c.sha]
    store.rename(c.id, "final")
    extend(s, [70])
    d = store.save(s, think_mode="think")
    assert d.parent == c.sha and set(shas(store)) == {c.sha, d.sha}   # named: never pruned
    # a loaded session continues its lineage
    other = Session(small_engine, CTX)
    store.load(d.id, other)
    extend(other, [71])
    e = store.save(other, think_mode="think")
    assert e.parent == d.sha and set(shas(store)) == {c.sha, e.sha}


def test_branch_points_stay_while_another_session_descends(small_engine, base, tmp_path):
    clock = Clock()
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=clock)
    s1 = session_from(small_engine, base[1])
    a = store.save(s1, think_mode="think")
    # saved independently (restored from a snapshot, not loaded from A): shares A's text but is
    # not A's lineage, so it prunes nothing, and it makes A a branch point
    d = store.save(extend(session_from(small_engine, base[1]), [90]), think_mode="think")
    assert d.parent is None and set(shas(store)) == {a.sha, d.sha}
    b = store.save(extend(s1, [67]), think_mode="think")
    assert b.parent == a.sha and set(shas(store)) == {a.sha, b.sha, d.sha}   # D descends from A
    store.delete(d.id)
    store.delete(b.id)

    # a named branch point, two continuations of it
    store.rename(a.id, "base")
    s2, s3 = Session(small_engine, CTX), Session(small_engine, CTX)
    store.load("base", s2)
    store.load("base", s3)
    b1 = store.save(extend(s2, [68]), think_mode="think")
    b2 = store.save(extend(s3, [69]), think_mode="think")
    assert b1.parent == a.sha == b2.parent and set(shas(store)) == {a.sha, b1.sha, b2.sha}
    # the name went on with the first continuation; A stays, pinned as the snapshot named "base"
    assert (b1.name, b2.name) == ("base", None) and store.resolve("base").sha == b1.sha
    assert store.info(a.id).earlier_of == "base"
    store.rename(a.id, None)           # unpinned: A is kept now only as a branch point
    b1x = store.save(extend(s2, [70]), think_mode="think")
    # B1 was a linear step; A stays: B2 still descends from it
    assert set(shas(store)) == {a.sha, b1x.sha, b2.sha}
    store.delete(b2.id)
    b1y = store.save(extend(s2, [71]), think_mode="think")
    assert b1y.ancestors == (a.sha, b1.sha, b1x.sha) and shas(store) == [b1y.sha]


# -- damaged files -------------------------------------------------------------------------------
def test_damaged_files_are_listed_and_fail_to_load_cleanly(small_engine, base, tmp_path):
    clock = Clock()
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=clock)
    s = session_from(small_engine, base[1])
    saved = []
    for t in (67, 68, 69, 70):
        if saved:
            s.rewind(1)
        s.eval(t)
        saved.append(store.save(s, think_mode="think"))
        clock.tick()
    trunc, badmeta, badpayload, foreign = saved
    with open(trunc.path, "r+b") as f:                          # truncated KV file
        f.truncate(os.path.getsize(trunc.path) // 2)
    with open(store.meta_path(badmeta.sha), "w") as f:           # metadata is not JSON
        f.write("{not json")
    with open(badpayload.path, "r+b") as f:                      # header fine, payload magic not
        h, _ = read_header(badpayload.path)
        f.seek(52 + h.text_bytes)
        f.write(b"XXXX")
    os.unlink(store.meta_path(foreign.sha))                      # a KV file ds4 could have written

    every = {e.sha: e for e in store.list("all")}
    assert set(every) == {x.sha for x in saved}
    assert every[trunc.sha].error and "truncated" in every[trunc.sha].error
    assert every[badmeta.sha].error and "metadata" in every[badmeta.sha].error
    assert every[badpayload.sha].ok                              # only loading reads the payload
    assert every[foreign.sha].ok and not every[foreign.sha].has_meta
    assert every[foreign.sha].title == "Fix the bug in main.py" and every[foreign.sha].project_dir is None
    assert set(shas(store, "project")) == {trunc.sha, badpayload.sha}

    live = session_from(small_engine, base[0])
    before_tokens, before_logits = live.tokens, live.logits.copy()
    for bad in (trunc, badmeta, badpayload):
        with pytest.raises(SessionStoreError):
            store.load(bad.id, live)
        assert live.tokens == before_tokens and same_bits(live.logits, before_logits)
    got = store.load(foreign.id, live)                           # no metadata: still a session
    assert got.sha == foreign.sha and live.tokens == s.tokens
    store.rename(foreign.id, "adopted")
    assert store.info("adopted").project_dir == os.path.realpath(tmp_path)
    for bad in (trunc, badmeta):
        store.delete(bad.id)
    assert set(shas(store)) == {badpayload.sha, foreign.sha}


# -- the system-prefix cache ----------------------------------------------------------------------
def test_sysprompt_used_only_on_exact_text(small_engine, base, tmp_path):
    store = SessionStore(tmp_path / "s", project_dir=tmp_path)
    s = session_from(small_engine, base[0])
    text = token_text(s)
    assert not store.load_system_prefix(Session(small_engine, CTX), text)      # no file yet
    store.save_system_prefix(s, text)
    h, _ = read_header(store.sysprompt_path(s, text))
    assert h.reason_name == "agent-system"
    assert store.list("all") == []                                     # not a session

    fresh = Session(small_engine, CTX)
    assert store.load_system_prefix(fresh, text)
    assert fresh.tokens == s.tokens and same_bits(fresh.logits, s.logits)
    for other in (text + b" ", text[:-1], text.replace(b"helpful", b"helpfull")):
        t = Session(small_engine, CTX)
        assert not store.load_system_prefix(t, other) and t.pos == 0
    with pytest.raises(SessionStoreError):
        store.save_system_prefix(s, text + b"!")
    with open(store.sysprompt_path(s, text), "r+b") as f:
        f.truncate(100)
    t = Session(small_engine, CTX)
    assert not store.load_system_prefix(t, text) and t.pos == 0
