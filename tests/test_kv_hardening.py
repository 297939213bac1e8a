"""KV files on disk against a hostile or damaged folder: the shim's `--kv-disk-dir` prefix cache and
the agent's session store. FIFOs and symlinks are never opened or followed, a payload swapped in
from another file is refused, unreadable and junk files cost one scan and one summary warning,
lookups read no headers, temp files count in the budget, sidecars are schema-checked."""
from __future__ import annotations

import builtins
import hashlib
import json
import os
import threading
import time

import pytest

from engine import Session
from sessions import safeio
from sessions.kvfile import (EOS_TEXT, PREFIX_BYTES, KVFileError, is_subsequence, read_header, read_kv,
                             sha1_name, write_kv)
from sessions.prefix_cache import PrefixCache, token_text
from sessions.store import SessionStore, SessionStoreError

CTX = 192
BOS = "<｜begin▁of▁sentence｜>"
PROMPT = BOS + "You are a coding agent. Be brief.<｜User｜>Fix the bug in main.py now<｜Assistant｜>"


@pytest.fixture(scope="module")
def ids(small_engine):
    return small_engine.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def snaps(small_engine, ids):
    """Snapshots of the prompt, the prompt less 1 and 2 tokens, and one as long with another end,
    prefilled once (a restore is cheap, a prefill is not)."""
    s = Session(small_engine, CTX)
    s.sync(ids)
    out = {tuple(ids): s.snapshot()}
    for k in (1, 2, 3):
        s.rewind(1)
        out[tuple(ids[:-k])] = s.snapshot()
    for t in (67, 68, 69):
        s.eval(t)
    out[tuple(s.tokens)] = s.snapshot()
    return out


_SNAPS: dict = {}


@pytest.fixture(autouse=True)
def _share_snaps(snaps):
    _SNAPS.update(snaps)


def session(eng, tokens) -> Session:
    s = Session(eng, CTX)
    blob = _SNAPS.get(tuple(tokens))
    if blob is not None:
        s.restore(blob)
    else:
        s.sync(list(tokens))
    return s


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def finishes(fn, timeout=10.0):
    """Run fn in a thread; its result, or a failure if it blocks (a FIFO opened for reading)."""
    out = {}

    def run():
        try:
            out["r"] = fn()
        except BaseException as e:     # re-raised in the caller's thread
            out["e"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"blocked for {timeout} s"
    if "e" in out:
        raise out["e"]
    return out.get("r")


def unblock(fifo):
    """Give a reader stuck on `fifo` its EOF (only needed when the code under test blocked)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


class Logs(list):
    def __call__(self, m):
        self.append(m)


def dead_pid() -> int:
    for pid in range(4_194_000, 4_000_000, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            continue
    pytest.skip("no free pid found to stand for a killed writer")


def swap_payloads(a, b):
    """Give file a the payload of file b (same token count, so the sizes agree)."""
    ra, rb = open(a, "rb").read(), open(b, "rb").read()
    ha, hb = read_header(a)[0], read_header(b)[0]
    assert ha.payload_bytes == hb.payload_bytes and ha.tokens == hb.tokens
    pa, pb = PREFIX_BYTES + ha.text_bytes, PREFIX_BYTES + hb.text_bytes
    with open(a, "wb") as f:
        f.write(ra[:pa] + rb[pb:pb + hb.payload_bytes] + ra[pa + ha.payload_bytes:])


# -- the prefix cache folder ---------------------------------------------------------------------
def test_fifo_in_the_cache_folder_is_skipped_with_one_warning(small_engine, ids, tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    fifos = [d / ("ab" * 20 + ".kv"), d / "stray-fifo"]
    for p in fifos:
        os.mkfifo(p)
    logs = Logs()
    try:
        cache = finishes(lambda: PrefixCache(d, min_tokens=8, cold_max_tokens=0, log=logs))
        s = session(small_engine, ids)
        assert finishes(lambda: cache.store(s))
        live = Session(small_engine, CTX)
        assert finishes(lambda: cache.restore(live, token_text(s) + b"more")) is not None
    finally:
        for p in fifos:
            unblock(p)
    warned = [m for m in logs if "unusable" in m]
    assert len(warned) == 1 and "FIFO" in warned[0] and "ab" * 20 in warned[0]
    assert os.path.exists(fifos[0]) and live.tokens == list(ids)       # left alone, not evicted


def test_symlink_to_an_outside_kv_file_is_never_followed_or_written(small_engine, ids, tmp_path):
    s = session(small_engine, ids)
    text = token_text(s)
    outside = PrefixCache(tmp_path / "outside", min_tokens=8, cold_max_tokens=0)
    assert outside.store(s)
    target = tmp_path / "outside" / sha1_name(text)
    before = sha256(target)
    d = tmp_path / "kv"
    d.mkdir()
    link = d / sha1_name(text)
    os.symlink(target, link)
    os.symlink(target, d / (sha1_name(text) + ".tmp.1-ab"))       # shaped like a temp file
    logs = Logs()
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=0, log=logs)
    live = Session(small_engine, CTX)
    assert cache.find(text + b"more", live) is None and cache.restore(live, text + b"more") is None
    assert live.pos == 0 and any("symbolic link" in m for m in logs)
    assert cache.store(s, tool_map={"call_1": "x"})                 # a save to that very name
    # the temp-shaped link was removed at start (the link, not what it points at: issue 32 item 12)
    assert sha256(target) == before and not os.path.lexists(d / (sha1_name(text) + ".tmp.1-ab"))
    assert not os.path.islink(link) and read_header(link)[0].tokens == len(ids)
    assert cache.restore(live, text + b"more") is not None and sha256(target) == before


def test_swapped_payload_is_refused_with_a_warning_and_never_used(small_engine, ids, tmp_path):
    other = list(ids[:-3]) + [67, 68, 69]                            # same token count, other text
    a, b = session(small_engine, ids), session(small_engine, other)
    d = tmp_path / "kv"
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=0)
    assert cache.store(a) and cache.store(b)
    pa, pb = d / sha1_name(token_text(a)), d / sha1_name(token_text(b))
    swap_payloads(pa, pb)
    logs = Logs()
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=0, log=logs)
    live = Session(small_engine, CTX)
    prompt = token_text(a) + b" and more"
    assert cache.find(prompt, live).path == str(pa)
    assert cache.restore(live, prompt) is None and live.pos == 0    # the old code loaded b's tokens
    assert any("do not match the cached text" in m for m in logs) and os.path.exists(pa)
    opened = count_opens(lambda: cache.restore(live, prompt))
    assert str(pa) not in opened                                      # not tried again
    with pytest.raises(KVFileError, match="do not match"):
        read_kv(pa, live)


def test_visible_key_must_be_the_tokens_text_with_parts_left_out(small_engine, ids, tmp_path):
    s = session(small_engine, ids)
    text = token_text(s)
    cut = text.index(b"Be brief.")
    ok = text[:cut] + text[cut + len(b"Be brief."):] + EOS_TEXT     # reasoning-like part dropped
    p = tmp_path / "v.kv"
    write_kv(p, s, ok, key_kind="thinking-visible")
    assert read_kv(p, Session(small_engine, CTX)).text == ok
    write_kv(p, s, ok.replace(b"main.py", b"other.py"), key_kind="responses-visible")
    live = Session(small_engine, CTX)
    with pytest.raises(KVFileError, match="do not match"):
        read_kv(p, live)
    assert live.pos == 0
    assert is_subsequence(b"", b"") and is_subsequence(b"ace", b"abcde") and not is_subsequence(b"aec", b"abcde")
    big = bytes(range(256)) * 500
    assert is_subsequence(big[:70000] + big[90000:], big) and not is_subsequence(big + b"x", big)


def test_unreadable_files_one_summary_warning(small_engine, ids, tmp_path, monkeypatch):
    d = tmp_path / "kv"
    d.mkdir()
    (d / ("cd" * 20 + ".kv")).mkdir()                                # a directory with a cache name
    locked = d / ("ef" * 20 + ".kv")
    locked.write_bytes(b"KVC" + b"\0" * 60)
    os.chmod(locked, 0)                                              # root reads it anyway, hence:
    real_open, real_bopen = os.open, builtins.open

    def deny(path, *a, **k):
        if os.fspath(path).endswith(locked.name):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *a, **k)

    def bdeny(path, *a, **k):
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(locked.name):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_bopen(path, *a, **k)
    monkeypatch.setattr(os, "open", deny)
    monkeypatch.setattr(builtins, "open", bdeny)
    logs = Logs()
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=0, log=logs)
    assert cache.entries() == [] and len(logs) == 1
    assert "skipped 2 unusable files" in logs[0] and "Permission denied" in logs[0] and "directory" in logs[0]
    monkeypatch.undo()
    assert cache.store(session(small_engine, ids)) and len([m for m in logs if "unusable" in m]) == 1


def count_opens(fn) -> list[str]:
    """The paths fn opens, by any of the ways the code opens files."""
    seen = []
    real_open, real_bopen = os.open, builtins.open

    def o(path, *a, **k):
        seen.append(os.fspath(path))
        return real_open(path, *a, **k)

    def bo(path, *a, **k):
        if isinstance(path, (str, os.PathLike)):
            seen.append(os.fspath(path))
        return real_bopen(path, *a, **k)
    os.open, builtins.open = o, bo
    try:
        fn()
    finally:
        os.open, builtins.open = real_open, real_bopen
    return seen


def test_ten_thousand_junk_files_start_fast_and_lookups_read_no_headers(small_engine, ids, tmp_path):
    d = tmp_path / "kv"
    seed = PrefixCache(d, min_tokens=8, cold_max_tokens=0)
    s = session(small_engine, ids)
    assert seed.store(s)
    good = str(d / sha1_name(token_text(s)))
    for i in range(5000):
        (d / f"junk-{i}.bin").write_bytes(b"x")
        (d / (hashlib.sha1(b"%d" % i).hexdigest() + ".kv")).write_bytes(b"KVC junk %d" % i)
    logs = Logs()
    t0 = time.perf_counter()
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=0, log=logs)
    start_s = time.perf_counter() - t0
    assert start_s < 2.0, start_s
    assert len(logs) == 1 and "skipped 5000 unusable files" in logs[0] and "and 4997 more" in logs[0]
    prompt = token_text(s) + b" more"
    live = Session(small_engine, CTX)
    opened = count_opens(lambda: cache.restore(live, prompt))
    assert live.tokens == list(ids) and set(opened) <= {good}, sorted(set(opened))[:5]
    t0 = time.perf_counter()
    for _ in range(20):
        assert cache.find(prompt, live).path == good
    per_find = (time.perf_counter() - t0) / 20
    assert per_find < 0.05, per_find
    # a store changes the folder: the next lookup re-lists it but opens none of the junk again
    s2 = session(small_engine, ids[:-2])
    assert cache.store(s2)
    opened = count_opens(lambda: cache.find(prompt, live))
    assert not [p for p in opened if "junk" in p or p.endswith(".kv")]
    assert len([m for m in logs if "unusable" in m]) == 1


def test_temp_files_count_against_the_budget_and_dead_writers_are_cleaned(small_engine, ids, tmp_path):
    d = tmp_path / "kv"
    probe = PrefixCache(d, min_tokens=8, cold_max_tokens=0)
    s = session(small_engine, ids)
    assert probe.store(s)
    size = os.path.getsize(d / sha1_name(token_text(s)))
    os.unlink(d / sha1_name(token_text(s)))
    dead = d / f"{'1' * 40}.kv.tmp.{dead_pid()}-dead"                # a killed writer's
    mine = d / f"{'2' * 40}.kv.tmp.{os.getpid()}-gone"                # ours, no longer written
    live_other = d / f"{'3' * 40}.kv.tmp.{os.getppid()}-busy"          # a running writer's
    nopid = d / f"{'4' * 40}.kv.tmp.k3y9"                              # mkstemp-style, fresh
    for p in (dead, mine, live_other, nopid):
        p.write_bytes(b"\0" * (size // 4))
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep me")
    os.symlink(outside, d / f"{'5' * 40}.kv.tmp.{dead_pid()}-link")
    cache = PrefixCache(d, space_mb=(size * 2.2) / 2**20, min_tokens=8, cold_max_tokens=0)
    assert not dead.exists() and not mine.exists() and live_other.exists() and nopid.exists()
    assert outside.read_bytes() == b"keep me" and not os.path.lexists(d / f"{'5' * 40}.kv.tmp.{dead_pid()}-link")
    assert cache.temp_bytes() == 2 * (size // 4)
    assert cache.store(s) and cache.store(session(small_engine, ids[:-1]))
    # 2 files + 2 live temp files do not fit 2.2 files: one file went (without the temps both fit)
    assert len(cache.entries()) == 1 and cache.total_bytes() <= cache.budget_bytes


def test_writes_never_follow_a_symlink_at_the_final_name(small_engine, ids, tmp_path):
    s = session(small_engine, ids)
    outside = tmp_path / "victim"
    outside.write_bytes(b"victim")
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(outside, d / "x.kv")
    write_kv(d / "x.kv", s, token_text(s))
    assert outside.read_bytes() == b"victim" and not os.path.islink(d / "x.kv")
    os.unlink(d / "x.kv")
    os.symlink(outside, d / "x.kv")
    with pytest.raises(safeio.UnsafeFile):
        safeio.open_regular(d / "x.kv", "r+b")
    assert outside.read_bytes() == b"victim"


# -- the agent's session store -------------------------------------------------------------------
def make_agent(eng, store, project):
    from ds4agent.agent import Agent, AgentConfig
    return Agent(eng, project, config=AgentConfig(ctx=CTX, chunk=64, think_mode="none"), store=store)


def test_store_fifos_and_symlinks_are_damaged_never_opened(small_engine, ids, tmp_path):
    clock = iter(range(1_700_000_000, 1_700_001_000, 10))
    root, project = tmp_path / "s", tmp_path / "p"
    project.mkdir()
    store = SessionStore(root, project_dir=project, now=lambda: next(clock))
    a = store.save(session(small_engine, ids), think_mode="none")
    other = list(ids[:-3]) + [67, 68, 69]
    b = store.save(session(small_engine, other), think_mode="none")
    os.unlink(store.meta_path(b.sha))
    os.mkfifo(store.meta_path(b.sha))                               # a FIFO sidecar
    fifo = root / ("f" * 40 + ".kv")
    os.mkfifo(fifo)                                                  # a FIFO session file
    outside = SessionStore(tmp_path / "outside", project_dir=project)
    c = outside.save(session(small_engine, ids[:-1]), think_mode="none")
    for p in (c.path, outside.meta_path(c.sha)):
        os.symlink(p, root / os.path.basename(p))                  # links to a valid session
    hashes = {p: sha256(p) for p in (c.path, outside.meta_path(c.sha))}
    try:
        every = {e.sha: e for e in finishes(lambda: store.list("all"))}
        assert every[a.sha].ok and "FIFO" in every[b.sha].error and "FIFO" in every["f" * 40].error
        assert "symbolic link" in every[c.sha].error
        live = Session(small_engine, CTX)
        for sha in (b.sha, "f" * 40, c.sha):
            with pytest.raises(SessionStoreError, match="unreadable"):
                finishes(lambda: store.load(sha, live))
        assert live.pos == 0
        agent = make_agent(small_engine, store, project)
        listing = finishes(lambda: agent.command("/list all"))
        assert listing.count("DAMAGED") == 3 and "FIFO" in listing
        assert "damaged session(s) of unknown project" in finishes(lambda: agent.command("/list"))
        saved = store.save(session(small_engine, ids[:-1]), think_mode="none")   # the linked name, saved
        assert saved.sha == c.sha and saved.ok and not os.path.islink(saved.path)
        assert {p: sha256(p) for p in hashes} == hashes
    finally:
        unblock(fifo)
        unblock(store.meta_path(b.sha))


def test_resume_says_the_newest_session_is_damaged(small_engine, ids, tmp_path):
    clock = iter(range(1_700_000_000, 1_700_001_000, 10))
    root, project = tmp_path / "s", tmp_path / "p"
    project.mkdir()
    store = SessionStore(root, project_dir=project, now=lambda: next(clock))
    old = store.save(session(small_engine, ids[:-1]), think_mode="none")
    new = store.save(session(small_engine, ids), think_mode="none")
    with open(new.path, "r+b") as f:
        f.truncate(100)
    agent = make_agent(small_engine, store, project)
    out = finishes(lambda: agent.command("/resume"))
    assert out.startswith(f"session {new.id} is damaged, not resumed: ") and "truncated" in out
    assert f"switched to session {old.id}" in out and agent.session.tokens == list(ids[:-1])
    os.unlink(old.path)
    out = agent.command("/resume")
    assert "damaged" in out and "no saved session in this directory to resume" in out


def test_store_refuses_a_payload_that_does_not_spell_the_text(small_engine, ids, tmp_path):
    store = SessionStore(tmp_path / "s", project_dir=tmp_path)
    a = store.save(session(small_engine, ids), think_mode="none")
    b = store.save(session(small_engine, list(ids[:-3]) + [67, 68, 69]), think_mode="none")
    swap_payloads(a.path, b.path)
    live = session(small_engine, ids[:-2])
    with pytest.raises(SessionStoreError, match="do not match"):
        store.load(a.id, live)                    # the old code loaded b's tokens under a's text
    assert live.tokens == list(ids[:-2])
    assert store.load(b.id, live).sha == b.sha and live.tokens == list(ids[:-3]) + [67, 68, 69]


DEEP = 100_000


@pytest.mark.parametrize("field,raw", [
    ("deep", None), ("tokens", '"many"'), ("tokens", "[1]"), ("tokens", "Infinity"), ("tokens", "-1"),
    ("tokens", str(2 ** 64)), ("tokens", "1e400"), ("tokens", "true"), ("created", '"x"'),
    ("updated", "NaN"), ("ancestors", '["not-a-sha"]'), ("parent", "7"), ("name", "123"),
    ("quant_bits", "3"), ("record", "[]"), ("huge", None)])
def test_bad_sidecars_show_as_damaged(small_engine, ids, tmp_path, field, raw):
    root, project = tmp_path / "s", tmp_path / "p"
    project.mkdir()
    store = SessionStore(root, project_dir=project)
    x = store.save(session(small_engine, ids), think_mode="none")
    meta = json.loads(open(store.meta_path(x.sha)).read())
    if field == "deep":
        text = json.dumps(meta)[:-1] + ', "x": ' + "[" * DEEP + "]" * DEEP + "}"
    elif field == "record":
        text = raw
    elif field == "huge":
        text = json.dumps(dict(meta, title="t" * (2 << 20)))
    else:
        text = json.dumps(dict(meta, **{field: "@@"})).replace('"@@"', raw)
    with open(store.meta_path(x.sha), "w") as f:
        f.write(text)
    for truncated in (False, True):            # with the KV header, and without (tokens from the record)
        if truncated:
            with open(x.path, "r+b") as f:
                f.truncate(10)
        e = store.list("all")[0]
        assert e.error and "metadata" in e.error and isinstance(e.tokens, int)
        with pytest.raises(SessionStoreError):
            store.load(x.id, Session(small_engine, CTX))
        agent = make_agent(small_engine, store, project)
        assert "DAMAGED" in agent.command("/list all") and "unknown project" in agent.command("/list")
        assert "no saved session" in agent.command("/resume")


def test_ds4_kv_reports_a_fifo_without_blocking(small_engine, ids, tmp_path, capsys):
    from sessions.kv_cli import main
    fifo = tmp_path / ("a" * 40 + ".kv")
    os.mkfifo(fifo)
    s = session(small_engine, ids)
    real = tmp_path / sha1_name(token_text(s))
    write_kv(real, s, token_text(s))
    link = tmp_path / "link.kv"
    os.symlink(real, link)
    try:
        assert finishes(lambda: main([str(fifo), str(link)])) == 1
    finally:
        unblock(fifo)
    out, err = capsys.readouterr()
    assert "is a FIFO" in err and err.count("error: ") == 1 and "Traceback" not in out + err


def test_temp_names_that_are_links_or_fifos_are_removed_at_start_unfollowed(tmp_path):
    """Issue 32 item 12: temp-named symlinks and FIFOs in the KV folder (and the sessions folder)
    were never cleaned. They are removed at start: the names only, nothing they point at is
    touched, and no FIFO is opened (opening one would hang the start)."""
    from sessions import SessionStore
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    for d, make in ((tmp_path / "kv", lambda: PrefixCache(tmp_path / "kv", min_tokens=8)),
                    (tmp_path / "sessions", lambda: SessionStore(tmp_path / "sessions", project_dir=tmp_path))):
        d.mkdir()
        names = {"link": f"{'1' * 40}.kv.tmp.{os.getpid()}-ab",          # a live pid: not stale by age
                 "dirlink": f"{'2' * 40}.kv.tmp.1-cd",
                 "dangling": f"{'3' * 40}.kv.tmp.k3y9",
                 "fifo": f"{'4' * 40}.kv.tmp.{os.getppid()}-ef"}
        os.symlink(outside / "precious", d / names["link"])
        os.symlink(outside, d / names["dirlink"])
        os.symlink(tmp_path / "nowhere", d / names["dangling"])
        os.mkfifo(d / names["fifo"])
        (d / f"{'5' * 40}.kv.tmp.1-gh").mkdir()                            # a folder: left alone
        (d / f"{'5' * 40}.kv.tmp.1-gh" / "x").write_bytes(b"x")
        make()
        left = sorted(os.listdir(d))
        assert not any(n in left for n in names.values()), (d, left)
        assert f"{'5' * 40}.kv.tmp.1-gh" in left
    assert (outside / "precious").read_bytes() == b"keep me" and os.listdir(outside) == ["precious"]
