"""Names that follow the conversation, pinned snapshots, and the per-prefix system-prompt cache
(issue 24 items 6 and 7). One small prefill per module; every other timeline is a restored
snapshot plus a few decode steps."""
from __future__ import annotations

import json
import os

import pytest

from engine import Session
from helpers_sessions import prefix_snapshots
from sessions.kvfile import read_header
from sessions.prefix_cache import token_text
from sessions.store import SessionStore, SessionStoreError
from sessions.sysprompt_cache import LEGACY_SYSPROMPT

CTX = 192
SYSTEM = "<｜begin▁of▁sentence｜>You are a helpful agent."
USER = "<｜User｜>Fix the bug<｜Assistant｜>"


class Clock:
    def __init__(self, t=1_700_000_000.0):
        self.t = t

    def __call__(self):
        self.t += 1.0                  # every read is a new second: the order of saves is clear
        return self.t


@pytest.fixture(scope="module")
def base(small_engine):
    """(system-prefix snapshot, conversation snapshot): prefilled once."""
    return prefix_snapshots(small_engine, CTX, SYSTEM, USER)


def restored(eng, blob, *more) -> Session:
    s = Session(eng, CTX)
    s.restore(blob)
    for t in more:
        s.eval(t)
    return s


def extend(s: Session, *ids) -> Session:
    for t in ids:
        s.eval(t)
    return s


def on_disk(store) -> set[str]:
    return {e.sha for e in store.list("all")}


def test_a_name_follows_its_continuation_and_the_named_snapshot_stays(small_engine, base, tmp_path):
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=Clock())
    s = restored(small_engine, base[1])
    named = store.save(s, think_mode="high", name="work")           # /save work
    assert (named.name, named.pinned, named.earlier_of) == ("work", "work", None)
    # /switch work in another agent, one more turn, autosave
    live = Session(small_engine, CTX)
    store.load("work", live)
    c = store.save(extend(live, 67, 68), think_mode="high")
    assert c.name == "work" and c.parent == named.sha and c.pinned is None
    assert store.resolve("work").sha == c.sha                      # --resume work continues the turn
    snap = store.info(named.id)
    assert snap.name is None and snap.earlier_of == "work"         # the snapshot keeps what it was
    # the next turn: the name moves again; the autosave in between goes, the named snapshot stays
    d = store.save(extend(live, 69), think_mode="high")
    assert d.name == "work" and d.ancestors == (named.sha, c.sha)
    assert on_disk(store) == {named.sha, d.sha}
    assert store.list()[0].sha == d.sha                             # newest first: what --resume takes
    # deleting the holder gives the name back to the snapshot saved under it
    store.delete("work")
    assert store.resolve("work").sha == named.sha and store.info(named.id).name == "work"


def test_an_explicit_name_moves_only_along_its_own_lineage(small_engine, base, tmp_path):
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=Clock())
    s = restored(small_engine, base[1])
    a = store.save(s, think_mode="high", name="work")
    other = store.save(restored(small_engine, base[1], 90), think_mode="high")    # not a's lineage
    with pytest.raises(SessionStoreError, match="already used by session"):
        store.save(restored(small_engine, base[1], 91), think_mode="high", name="work")
    assert store.rename(other.id, "side").name == "side"
    # an unsaved continuation named with the name its ancestor holds takes it (and pins itself)
    b = store.save(extend(s, 67), think_mode="high", name="work")
    assert (b.name, b.pinned, store.info(a.id).name) == ("work", "work", None)
    assert on_disk(store) == {a.sha, b.sha, other.sha}
    # a name given to this save wins over the one it would inherit
    c = store.save(extend(s, 68), think_mode="high", name="fresh")
    assert c.name == "fresh" and store.resolve("work").sha == b.sha


def test_continues_carries_the_name_over_a_rebuilt_timeline(small_engine, base, tmp_path):
    """After a compaction the text no longer extends the saved one: the agent says which it
    continues, and only the name follows (no lineage, nothing pruned)."""
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=Clock())
    a = store.save(restored(small_engine, base[1], 67), think_mode="high", name="work")
    rebuilt = restored(small_engine, base[0], 70, 71)
    b = store.save(rebuilt, think_mode="high", continues=a.sha)
    assert b.name == "work" and b.parent is None and on_disk(store) == {a.sha, b.sha}
    assert store.info(a.id).earlier_of == "work"


def test_two_holders_after_a_crash_resolve_to_the_descendant(small_engine, base, tmp_path):
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=Clock())
    s = restored(small_engine, base[1])
    a = store.save(s, think_mode="high", name="work")
    b = store.save(extend(s, 67), think_mode="high")
    meta = json.loads(open(store.meta_path(a.sha)).read())
    meta["name"] = "work"                  # the name not yet taken off the old holder
    open(store.meta_path(a.sha), "w").write(json.dumps(meta))
    assert store.resolve("work").sha == b.sha


def test_records_from_before_pinning_keep_their_names_safe(small_engine, base, tmp_path):
    """A record written before `pinned` existed: its name was the user's, so it is pinned."""
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=Clock())
    s = restored(small_engine, base[1])
    a = store.save(s, think_mode="high", name="old")
    meta = json.loads(open(store.meta_path(a.sha)).read())
    del meta["pinned"]
    open(store.meta_path(a.sha), "w").write(json.dumps(meta))
    b = store.save(extend(s, 67), think_mode="high")
    assert b.name == "old" and store.info(a.id).earlier_of == "old" and on_disk(store) == {a.sha, b.sha}


def test_system_prefixes_are_cached_per_text_within_the_budget(small_engine, base, tmp_path):
    clock = Clock()
    store = SessionStore(tmp_path / "s", project_dir=tmp_path, now=clock, sysprompt_keep=2)
    open(os.path.join(store.root, LEGACY_SYSPROMPT), "wb").write(b"old single slot")
    prefixes = [restored(small_engine, base[0], *extra) for extra in ((), (67,), (68,))]
    texts = [token_text(p) for p in prefixes]
    paths = [store.sysprompt_path(p, t) for p, t in zip(prefixes, texts)]
    assert len(set(paths)) == 3 and all(os.path.basename(p).startswith("sysprompt-") for p in paths)
    store.save_system_prefix(prefixes[0], texts[0])             # "proj"
    store.save_system_prefix(prefixes[1], texts[1])             # "proj2"
    assert not os.path.exists(os.path.join(store.root, LEGACY_SYSPROMPT))
    for i in (0, 1, 0):                                          # proj, proj2, proj: no prefill
        fresh = Session(small_engine, CTX)
        assert store.load_system_prefix(fresh, texts[i]) and fresh.tokens == prefixes[i].tokens
    assert store.list("all") == []                               # cached prefixes are not sessions
    # a third one: the least recently used (proj2) goes, the count is 2
    store.save_system_prefix(prefixes[2], texts[2])
    assert [os.path.exists(p) for p in paths] == [True, False, True]
    assert not store.load_system_prefix(Session(small_engine, CTX), texts[1])
    # the disk budget: room for one file only keeps the newest
    size = read_header(paths[0])[1]
    small = SessionStore(tmp_path / "s", project_dir=tmp_path, now=clock,
                         sysprompt_budget_mb=1.5 * size / 2**20)
    small.save_system_prefix(prefixes[1], texts[1])
    assert [os.path.exists(p) for p in paths] == [False, True, False]
