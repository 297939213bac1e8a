"""The shim's disk prefix cache: policy math, lookup by the longest cached text prefix, load,
cold/continued save moments, eviction under a budget with decaying hits, tool-id maps,
single-use big checkpoints. Small knobs (min 8-16, align 8, trim 4) on a tiny model."""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine import Session
from sessions.kvfile import pack_header, read_header, read_info, sha1_name, touch
from sessions.prefix_cache import (HIT_HALF_LIFE_S, PrefixCache, budget_required, chat_anchor,
                                   cold_store_len, continued_step, eviction_score,
                                   should_store_continued, store_len, token_text)

CTX = 192
BOS = "<｜begin▁of▁sentence｜>"
PROMPT = BOS + "You are a coding agent. Be brief.<｜User｜>Fix the bug in main.py now<｜Assistant｜>"
H = 3600


class Clock:
    def __init__(self, t=1_700_000_000):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def prompt(small_engine):
    """The prompt's tokens, a snapshot of it prefilled, and its logits at every position."""
    ids = small_engine.tokenizer.encode(PROMPT)
    s = Session(small_engine, CTX)
    logits = s.sync(ids, keep_logits=True)
    return ids, s.snapshot(), logits


def same_bits(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


def patch_header(path, **fields):
    h, _ = read_header(path)
    for k, v in fields.items():
        setattr(h, k, v)
    with open(path, "r+b") as f:
        f.write(pack_header(h))


def kv_names(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".kv"))


# -- policy math ---------------------------------------------------------------------------------
def test_policy_math():
    # ds4's defaults
    assert continued_step(10000, 2048) == 10240
    assert continued_step(10000, 0) == 10000 and continued_step(0, 2048) == 0
    assert continued_step(100, 2048) == 2048
    assert store_len(30000, min_tokens=512, trim=32, align=2048) == 28672      # 29968 -> down to 2048s
    assert store_len(600, min_tokens=512, trim=32, align=2048) == 600          # 568 -> 0 < min: full
    assert store_len(540, min_tokens=512, trim=32, align=2048) == 540          # not > min + trim
    assert cold_store_len(30000, -1) == 28672
    assert cold_store_len(30001, -1) == 0                                       # above cold_max
    assert cold_store_len(511, -1) == 0                                         # below min
    assert cold_store_len(20000, 3000) == 3000                                  # the chat anchor wins
    assert cold_store_len(20000, 300) == 18432                                  # anchor < min: ignored
    assert cold_store_len(20000, -1, cold_max_tokens=0) == 0                    # cold saves disabled
    # small knobs: min 16, trim 4, align 8
    k = dict(min_tokens=16, trim=4, align=8, cold_max_tokens=1000)
    assert cold_store_len(37, -1, **k) == 32 and cold_store_len(45, -1, **k) == 40
    assert cold_store_len(40, -1, **k) == 32 and cold_store_len(25, -1, **k) == 16
    assert cold_store_len(19, -1, **k) == 19 and cold_store_len(20, -1, **k) == 20   # no room to trim
    assert cold_store_len(23, -1, **dict(k, align=16)) == 16                     # 19 -> 16
    assert cold_store_len(45, 20, **k) == 20 and cold_store_len(45, 12, **k) == 40
    # chat anchor: last User before the first Assistant
    U, A = 1000, 1001
    toks = [0] + [5] * 20 + [U] + [6] * 5 + [U] + [7] * 3 + [A] + [U] + [8]
    assert chat_anchor(toks, U, A) == 27 and chat_anchor(toks, U, A, min_tokens=28) == -1
    assert chat_anchor([0, 5, A, U], U, A) == -1
    # continued: multiples of the step past the last frontier and >= min
    assert should_store_continued(10240, 0, min_tokens=512, step=10240)
    assert not should_store_continued(10240, 10240, min_tokens=512, step=10240)
    assert not should_store_continued(10000, 0, min_tokens=512, step=10240)
    assert not should_store_continued(16, 0, min_tokens=32, step=16)
    assert not should_store_continued(16, 0, min_tokens=0, step=0)
    # eviction score: (hits decayed by a 6 h half-life + 1) * tokens / size
    t0 = 1_000_000
    assert eviction_score(4, t0, t0, 100, 1000, t0 + 12 * H) == pytest.approx(2.0 * 0.1)
    assert eviction_score(4, 0, t0, 100, 1000, t0 + 6 * H) == pytest.approx(3.0 * 0.1)   # created
    assert eviction_score(4, 0, 0, 100, 1000, t0) == pytest.approx(0.1)                  # no time
    assert eviction_score(4, t0, t0, 100, 1000, t0 - 50) == pytest.approx(0.5)           # no decay
    assert eviction_score(1, t0, t0, 100, 1000, t0 + 7 * HIT_HALF_LIFE_S) == pytest.approx(0.1)  # < 0.01
    assert budget_required(100) == 101 and budget_required(101) == 103 and budget_required(1) == 2


# -- lookup and load -----------------------------------------------------------------------------
def test_lookup_picks_longest_valid_prefix_and_load_restores_it(small_engine, prompt, tmp_path):
    ids, _, ref_logits = prompt
    clock = Clock()
    d = tmp_path / "kv"
    full = token_text(small_engine, ids)
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=1000, now=clock)
    s = Session(small_engine, CTX)
    stored = {}
    for n in (12, 20, 28):
        s.sync(ids[:n])
        assert cache.store(s, reason="continued")
        stored[n] = os.path.join(d, sha1_name(token_text(s)))
    # longer entries that must be skipped: a diverging branch, a bigger context, another quant
    s.sync(ids[:24] + small_engine.tokenizer.encode(" and now some totally different text follows"))
    assert cache.store(s, reason="evict") and s.pos > 28
    for n, field in ((31, dict(ctx=4096)), (30, dict(quant_bits=4))):
        s.sync(ids[:n])
        assert cache.store(s, reason="continued")
        patch_header(os.path.join(d, sha1_name(token_text(s))), **field)
        stored[n] = os.path.join(d, sha1_name(token_text(s)))
    s.sync(ids[:6])                                  # too short for min 8 (stored with min 4)
    assert PrefixCache(d, min_tokens=4, cold_max_tokens=1000, now=clock).store(s)
    s.sync(ids[:6] + [3])                            # an entry that is no prefix at all
    assert PrefixCache(d, min_tokens=4, cold_max_tokens=1000, now=clock).store(s)
    assert len(kv_names(d)) == 8

    live = Session(small_engine, CTX)
    reject = PrefixCache(d, min_tokens=8, cold_max_tokens=1000, reject_different_quant=True, now=clock)
    assert reject.find(full, live).path == stored[28]
    assert cache.find(full, live).path == stored[30]          # cross-quant allowed by default
    assert cache.find(full).path == stored[31]                 # no session: no context filter
    assert PrefixCache(d, min_tokens=29, cold_max_tokens=1000).find(full, live).path == stored[30]
    assert cache.find(full[:len(token_text(small_engine, ids[:12])) - 1], live) is None
    assert cache.find(b"unrelated", live) is None

    clock.t += 100
    info, suffix = reject.load(reject.find(full, live), live, full)
    assert live.tokens == ids[:28] and live.stats["prefill_tokens"] == 0
    assert suffix == full[len(token_text(small_engine, ids[:28])):] and info.text + suffix == full
    assert same_bits(live.logits, ref_logits[27])                 # bit-identical restore
    h, _ = read_header(stored[28])
    assert h.hits == 1 and h.last_used == clock.t and reject.last_continued == 28
    assert same_bits(live.eval(ids[28]), ref_logits[28])

    # a file that fails validation is skipped, the session untouched, the next best one used
    with open(stored[28], "r+b") as f:
        f.seek(52 + h.text_bytes)
        f.write(b"XXXX")
    with open(os.path.join(d, sha1_name(full[:40])), "wb") as f:
        f.write(b"KVC garbage")
    other = Session(small_engine, CTX)
    logs = []
    reject._log = logs.append
    assert reject.load(reject.find(full, other), other, full) is None and other.pos == 0
    got = reject.restore(other, full)
    assert got is not None and other.tokens == ids[:20] and got[0].text + got[1] == full
    assert any("payload" in m for m in logs)


# -- save moments --------------------------------------------------------------------------------
def test_cold_and_continued_save_moments(small_engine, prompt, tmp_path):
    ids, blob, _ = prompt
    tk = small_engine.tokenizer
    U, A = tk.special("<｜User｜>"), tk.special("<｜Assistant｜>")
    d = tmp_path / "kv"
    cache = PrefixCache(d, min_tokens=16, cold_max_tokens=1000, continued_interval=12, boundary_trim=4,
                        boundary_align=8)
    assert cache.continued_step() == 16

    # 1. the chat anchor: the system prefix, stored on the way to the full prompt
    anchor = ids.index(U)
    assert anchor >= 16 and cache.cold_store_target(ids, U, A) == anchor
    s = Session(small_engine, CTX)
    s.sync(ids[:anchor])
    assert cache.store(s, reason="cold")
    e = cache.entries()[0]
    assert e.tokens == anchor and read_info(e.path).text == token_text(small_engine, ids[:anchor])
    assert cache.last_continued == anchor
    # another conversation with the same system prompt reuses it
    other = tk.encode(PROMPT.split("<｜User｜>")[0] + "<｜User｜>Explain the tests<｜Assistant｜>")
    hit = cache.find(token_text(small_engine, other), s)
    assert hit is not None and hit.path == e.path

    # 2. no anchor: trim 4 then align 8 (37 tokens -> 33 -> 32), a continued frontier at once
    cache2 = PrefixCache(tmp_path / "kv2", min_tokens=16, cold_max_tokens=1000, continued_interval=12,
                         boundary_trim=4, boundary_align=8)
    plain = ids[anchor + 1:] * 6
    target = cache2.cold_store_target(plain[:37], U, A)
    assert target == 32
    s2 = Session(small_engine, CTX)
    s2.sync(plain[:target])
    assert cache2.should_store_continued(s2.pos)                  # 32 is a continued frontier too
    assert cache2.store(s2, reason="cold")
    assert not cache2.should_store_continued(s2.pos)              # ...already covered by the cold save
    # 3. decoding on: a continued save at every multiple of 16 past the last frontier
    saved = []
    for t in plain[32:49]:
        s2.eval(t)
        if cache2.should_store_continued(s2.pos):
            assert cache2.store(s2, reason="continued")
            saved.append(s2.pos)
    assert saved == [48]
    assert sorted(e.tokens for e in cache2.entries()) == [32, 48]
    assert {read_header(e.path)[0].reason_name for e in cache2.entries()} == {"cold", "continued"}
    cache2.reset_continued()
    assert cache2.should_store_continued(48)


def test_store_skips_and_checks(small_engine, prompt, tmp_path):
    ids, blob, _ = prompt
    s = Session(small_engine, CTX)
    s.restore(blob)
    cache = PrefixCache(tmp_path / "kv", min_tokens=len(ids) + 1, cold_max_tokens=0)
    assert not cache.store(s) and kv_names(tmp_path / "kv") == []          # below min
    tiny = PrefixCache(tmp_path / "kv", space_mb=0.05, min_tokens=8, cold_max_tokens=0)
    assert not tiny.store(s) and kv_names(tmp_path / "kv") == []           # over the budget
    ok = PrefixCache(tmp_path / "kv", min_tokens=8, cold_max_tokens=0)
    with pytest.raises(ValueError):
        ok.store(s, token_text(s) + b"x")                                  # not the timeline's text
    assert ok.store(s, b"visible transcript", reason="shutdown", key_kind="responses-visible")
    h, _ = read_header(os.path.join(tmp_path / "kv", sha1_name(b"visible transcript")))
    assert h.key_kind == "responses-visible" and h.reason_name == "shutdown"
    with pytest.raises(ValueError):
        PrefixCache(tmp_path / "kv", min_tokens=512, cold_max_tokens=100)  # cold max below min


# -- eviction ------------------------------------------------------------------------------------
def test_eviction_under_budget_with_decaying_hits(small_engine, prompt, tmp_path):
    ids, blob, _ = prompt
    clock = Clock()
    t0 = clock.t
    d = tmp_path / "kv"
    s = Session(small_engine, CTX)
    s.restore(blob)
    s.eval(67)
    letters = dict(zip("ABCDE", range(67, 72)))     # one-byte tokens: equal sizes and token counts

    def put(cache, letter):
        s.rewind(1)
        s.eval(letters[letter])
        assert cache.store(s, reason="evict")
        return os.path.join(d, sha1_name(token_text(s)))

    probe = PrefixCache(d, min_tokens=8, cold_max_tokens=0, now=clock)
    size = os.path.getsize(put(probe, "A"))
    os.unlink(os.path.join(d, kv_names(d)[0]))
    cache = PrefixCache(d, space_mb=3.5 * size / 2**20, min_tokens=8, cold_max_tokens=0, now=clock)

    path = {"A": put(cache, "A"), "B": put(cache, "B")}
    for _ in range(4):
        touch(path["A"], t0)                        # A: 4 hits, 18 h before the eviction
    clock.t = t0 + 12 * H
    path["C"] = put(cache, "C")
    touch(path["C"], clock.t)
    touch(path["C"], clock.t)                       # C: 2 hits, 6 h before
    clock.t = t0 + 18 * H
    touch(path["B"], clock.t)                       # B: 1 hit, just now
    assert len(kv_names(d)) == 3

    # D is new and protected; A, the most hit but the oldest, now scores lowest (4/8 < 1 = 2/2 = 1/1)
    path["D"] = put(cache, "D")
    assert sorted(kv_names(d)) == sorted(os.path.basename(path[k]) for k in "BCD")
    # E (no hits, protected) survives; D (no hits, unprotected now) goes
    path["E"] = put(cache, "E")
    assert sorted(kv_names(d)) == sorted(os.path.basename(path[k]) for k in "BCE")
    # a smaller budget at open: E first (no hits), then of B and C (equal scores) the older, C
    smaller = PrefixCache(d, space_mb=1.5 * size / 2**20, min_tokens=8, cold_max_tokens=0, now=clock)
    assert kv_names(d) == [os.path.basename(path["B"])]
    assert smaller.total_bytes() == size
    # the protected file alone over the budget is not protected
    assert smaller.evict(protect=path["B"]) == []
    smaller.budget_bytes = size - 1
    assert smaller.evict(protect=path["B"]) == [path["B"]]


# -- tool maps, refresh, single use --------------------------------------------------------------
def test_tool_map_round_trip_and_same_name_refresh(small_engine, prompt, tmp_path):
    ids, blob, _ = prompt
    clock = Clock()
    d = tmp_path / "kv"
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=1000, now=clock)
    s = Session(small_engine, CTX)
    s.restore(blob)
    text = token_text(s)
    path = os.path.join(d, sha1_name(text))
    m1 = {"call_1": "<｜DSML｜invoke name=\"bash\">ls</｜DSML｜invoke>"}
    assert cache.store(s, reason="evict", tool_map=m1)
    assert read_info(path).tool_map == m1
    live = Session(small_engine, CTX)
    info, suffix = cache.load(cache.find(text + b"more", live), live, text + b"more")
    assert info.tool_map == m1 and suffix == b"more"
    body = open(path, "rb").read()
    h1, _ = read_header(path)

    clock.t += 60
    m2 = dict(m1, call_2="<｜DSML｜invoke name=\"read\">a.py</｜DSML｜invoke>")
    assert cache.store(s, reason="continued", tool_map=m2)          # same name: trailer only
    h2, _ = read_header(path)
    assert read_info(path).tool_map == m2
    assert open(path, "rb").read()[48:52 + h1.text_bytes + h1.payload_bytes] == body[48:52 + h1.text_bytes + h1.payload_bytes]
    assert (h2.created_at, h2.hits, h2.reason) == (h1.created_at, h1.hits, h1.reason) and h2.last_used == clock.t
    assert cache.store(s)                                             # no map given: kept as is
    assert read_info(path).tool_map == m2

    # an incompatible same-name file (other quant while rejecting) is replaced
    patch_header(path, quant_bits=4)
    strict = PrefixCache(d, min_tokens=8, cold_max_tokens=1000, reject_different_quant=True, now=clock)
    assert strict.find(text, live) is None
    assert strict.store(s, tool_map=m1)
    h3, _ = read_header(path)
    assert h3.quant_bits == 2 and h3.hits == 0 and read_info(path).tool_map == m1


def test_big_checkpoints_are_single_use(small_engine, prompt, tmp_path):
    ids, blob, _ = prompt
    d = tmp_path / "kv"
    cache = PrefixCache(d, min_tokens=8, cold_max_tokens=len(ids) - 1)
    s = Session(small_engine, CTX)
    s.restore(blob)
    full = token_text(s)
    assert cache.store(s, reason="evict")                              # tokens > cold_max
    s.sync(ids[:len(ids) - 1])
    assert cache.store(s, reason="evict")                              # tokens == cold_max
    live = Session(small_engine, CTX)
    big = cache.find(full, live)
    assert big.tokens == len(ids)
    assert cache.load(big, live, full) is not None and not os.path.exists(big.path)   # consumed
    small = cache.find(full, live)
    assert small.tokens == len(ids) - 1
    assert cache.load(small, live, full) is not None and os.path.exists(small.path)
    assert read_header(small.path)[0].hits == 1
