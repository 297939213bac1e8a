"""KV cache files (spec/kvcache.md §2-3): exact round trips, the byte layout, rejection of bad files
without touching the live session, crash safety of the atomic write, hit counting and trailer
rewrites, and the `ds4-kv` inspector."""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import shutil
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, Session
from engine.gguf.synth import config_for, write_synthetic
from sessions import kv_cli
from sessions.kvfile import (FLAG_RESPONSES_KEY, FLAG_THINKING_KEY, FLAG_TOOL_MAP, KVFileError,
                             read_header, read_info, read_kv, replace_tool_map, sha1_name, touch,
                             write_kv)

T_SAVE, T_MORE, CTX = 300, 20, 512
NOW = 1_700_000_000                      # 2023-11-14 22:13:20 UTC
BOS = "<｜begin▁of▁sentence｜>"
TOOLS = {"call_0001": "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"ls\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
         "toolu_01AbC": "<｜DSML｜tool_calls>x</｜DSML｜tool_calls>"}
CACHE_NAME = re.compile(r"^[0-9a-f]{40}\.kv$")


# -- fixtures ------------------------------------------------------------------------------------
def synth(tmp_path_factory, name, recipe="q2", seed=21, **shape):
    cfg, vocab = config_for("tiny", **{"vocab": 465, "idx_n_head": 16, **shape})
    d = tmp_path_factory.mktemp("kvmodels")
    return Path(write_synthetic(d / name, cfg, recipe=recipe, vocab=vocab, seed=seed).path)


@pytest.fixture(scope="module")
def eng(small_model):
    # exact numerics: these tests check the file, not the arithmetic, and their ~1,500 tokens of
    # prefill (the saved session, the crash tests' two versions) cost about half of ds4's
    e = Engine.open(small_model, numerics="exact")
    yield e
    e.close()


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    """Same dims as small_model, Q4_K experts."""
    return synth(tmp_path_factory, "small-q4.gguf", recipe="q4", seed=6)


@pytest.fixture(scope="module")
def stream(eng):
    """A BOS and T_SAVE + T_MORE - 1 seeded random ids."""
    rng = np.random.default_rng(11)
    return [eng.tokenizer.special(BOS)] + rng.integers(0, eng.config.n_vocab, T_SAVE + T_MORE - 1).tolist()


def token_text(eng, tokens) -> bytes:
    return b"".join(eng.tokenizer.token_bytes(t) for t in tokens)


@pytest.fixture(scope="module")
def saved(eng, stream, tmp_path_factory):
    """A 300-token session (ctx 512) saved with a tool map under its SHA-1 name, the session
    itself (then decoded T_MORE more tokens: the uninterrupted run) and its logits at each step."""
    s = Session(eng, CTX)
    s.sync(stream[:T_SAVE])
    text = token_text(eng, stream[:T_SAVE])
    path = tmp_path_factory.mktemp("kv") / sha1_name(text)
    info = write_kv(path, s, text, tool_map=TOOLS, now=NOW)
    at_save = dict(tokens=s.tokens, logits=s.logits.copy(), payload=s.snapshot())
    cont = [s.eval(t).copy() for t in stream[T_SAVE:]]
    return dict(path=path, text=text, info=info, cont=cont, **at_save)


# -- 1. exact round trips ------------------------------------------------------------------------
def payload_counts(cfg, payload: bytes):
    L = cfg.n_layer
    T = struct.unpack_from("<13I", payload)[7]
    off = 52 + 4 * T + 4 * cfg.n_vocab
    return (list(struct.unpack_from(f"<{L}I", payload, off)), list(struct.unpack_from(f"<{L}I", payload, off + 4 * L)))


def test_save_load_continue_is_bit_identical(eng, stream, saved):
    n_comp, n_index = payload_counts(eng.config, saved["payload"])
    assert eng.config.compress_ratios == (0, 0, 4, 128, 4, 128)
    assert n_comp == [0, 0, 75, 2, 75, 2] and n_index == [0, 0, 75, 0, 75, 0]   # past many boundaries

    s = Session(eng, CTX)
    info = read_kv(saved["path"], s, expect_text=saved["text"], check_name=True)
    assert info.tokens == T_SAVE and info.text == saved["text"] and info.tool_map == TOOLS
    assert s.tokens == saved["tokens"] and s.pos == T_SAVE
    assert np.array_equal(s.logits, saved["logits"])          # before any eval
    assert s.snapshot() == saved["payload"]
    for t, want in zip(stream[T_SAVE:], saved["cont"]):
        assert np.array_equal(s.eval(t), want)


def test_load_into_a_larger_context(eng, stream, saved):
    s = Session(eng, 2 * CTX)
    read_kv(saved["path"], s)
    assert s.tokens == saved["tokens"] and s.ctx == 2 * CTX
    assert np.array_equal(s.logits, saved["logits"])
    for t, want in zip(stream[T_SAVE:], saved["cont"]):
        assert np.array_equal(s.eval(t), want)


def test_reload_of_a_reload_and_check_name(eng, saved, tmp_path):
    s = Session(eng, CTX)
    read_kv(saved["path"], s)
    again = tmp_path / "again.kv"
    write_kv(again, s, saved["text"], tool_map=TOOLS, now=NOW)
    assert again.read_bytes() == saved["path"].read_bytes()     # byte-identical re-save
    with pytest.raises(KVFileError, match="does not match file name") as e:
        read_kv(again, Session(eng, CTX), check_name=True)
    assert e.value.path == str(again)
    with pytest.raises(KVFileError, match="differs from the expected text"):
        read_kv(again, Session(eng, CTX), expect_text=saved["text"] + b"x")
    with pytest.raises(ValueError, match="no tokens"):
        write_kv(tmp_path / "empty.kv", Session(eng, CTX), b"")


# -- 2. byte layout ------------------------------------------------------------------------------
def payload_size(cfg, T: int, ctx: int) -> int:
    """spec/kvcache.md §3.4 for any dims: head dim hd, indexer head dim ihd, vocab V, L layers;
    R = min(T, raw_window), n_comp = floor(T/ratio)."""
    hd, ihd, V, L = cfg.head_dim, cfg.idx_head_dim, cfg.n_vocab, cfg.n_layer
    R = min(T, cfg.n_swa, ctx)
    n = 52 + 4 * T + 4 * V + 4 * L + 4 * L + L * R * 4 * hd
    for r in cfg.compress_ratios:
        if r == 4:   # rows, attn frontier kv+score [2*hd x 8], indexer rows, indexer frontier [2*ihd x 8]
            n += 4 * hd * (T // 4) + 2 * (4 * 2 * hd * 8) + 4 * ihd * (T // 4) + 2 * (4 * 2 * ihd * 8)
        elif r == 128:  # rows, attn frontier kv+score [hd x 128]
            n += 4 * hd * (T // 128) + 2 * (4 * hd * 128)
    return n


def test_payload_formula_matches_the_spec_example():
    cfg, _ = config_for("flash")
    # §3.4: T = 20480, R = 128 on the published shape -> 305,882,508 bytes
    assert payload_size(cfg, 20480, 100000) == 305_882_508


def test_file_size_and_header_offsets(eng, saved):
    raw = saved["path"].read_bytes()
    text, payload = saved["text"], saved["payload"]
    assert len(payload) == payload_size(eng.config, T_SAVE, CTX)
    trailer_len = 8 + sum(8 + len(k.encode()) + len(v.encode()) for k, v in TOOLS.items())
    assert len(raw) == 52 + len(text) + len(payload) + trailer_len == saved["info"].size
    assert raw[0:3] == b"KVC"
    assert raw[3] == 1                                   # version
    assert raw[4] == 2                                   # q2 routed experts
    assert raw[5] == 1                                   # reason cold
    assert raw[6] == FLAG_TOOL_MAP and raw[7] == 0
    assert struct.unpack_from("<I", raw, 8)[0] == T_SAVE
    assert struct.unpack_from("<I", raw, 12)[0] == 0     # hits
    assert struct.unpack_from("<I", raw, 16)[0] == CTX
    assert raw[20:24] == b"\0\0\0\0"
    assert struct.unpack_from("<Q", raw, 24)[0] == NOW   # created_at
    assert struct.unpack_from("<Q", raw, 32)[0] == NOW   # last_used
    assert struct.unpack_from("<Q", raw, 40)[0] == len(payload)
    assert struct.unpack_from("<I", raw, 48)[0] == len(text)
    assert raw[52:52 + len(text)] == text and text.startswith(BOS.encode())
    p0 = 52 + len(text)
    assert raw[p0:p0 + 4] == b"DSV4" and raw[p0:p0 + len(payload)] == payload
    # payload header: magic, version, ctx, prefill_cap, raw_cap, raw_window, comp_cap, T, layers, dims, vocab, R
    c = eng.config
    assert struct.unpack_from("<13I", payload) == (0x34565344, 1, CTX, CTX, 16, 16, CTX // 4 + 2, T_SAVE,
                                                   c.n_layer, c.head_dim, c.idx_head_dim, c.n_vocab, 16)
    # KTM trailer at the end: "KTM", version 1, u32 N, then (u32 id_len, u32 dsml_len, id, dsml)*
    t = raw[p0 + len(payload):]
    assert t[:3] == b"KTM" and t[3] == 1 and struct.unpack_from("<I", t, 4)[0] == len(TOOLS)
    p, got = 8, {}
    for _ in TOOLS:
        il, dl = struct.unpack_from("<II", t, p)
        got[t[p + 8:p + 8 + il].decode()] = t[p + 8 + il:p + 8 + il + dl].decode()
        p += 8 + il + dl
    assert p == len(t) and got == TOOLS and list(got) == list(TOOLS)
    h, size = read_header(saved["path"])
    assert (h.version, h.quant_bits, h.reason_name, h.tokens, h.hits, h.ctx, h.payload_bytes, h.text_bytes,
            size) == (1, 2, "cold", T_SAVE, 0, CTX, len(payload), len(text), len(raw))


def test_sha1_name():
    assert sha1_name(b"abc") == "a9993e364706816aba3e25717850c26c9cd0d89d.kv"
    assert sha1_name("abc") == sha1_name(b"abc")
    assert sha1_name(BOS) == hashlib.sha1(BOS.encode()).hexdigest() + ".kv"
    assert CACHE_NAME.match(sha1_name(b""))


def test_reason_and_key_kind_bytes(eng, saved, tmp_path):
    s = Session(eng, CTX)
    read_kv(saved["path"], s)
    for reason, kind, code, flags in (("agent-session", "responses-visible", 6, FLAG_RESPONSES_KEY),
                                      ("evict", "thinking-visible", 3, FLAG_THINKING_KEY),
                                      ("unknown", "token-text", 0, 0)):
        p = tmp_path / f"{reason}.kv"
        write_kv(p, s, b"visible", reason=reason, key_kind=kind, now=NOW)
        raw = p.read_bytes()
        assert raw[5] == code and raw[6] == flags
        assert len(raw) == 52 + len(b"visible") + len(saved["payload"])     # no trailer
        h = read_info(p).header
        assert (h.reason_name, h.key_kind) == (reason, kind)
    raw = bytearray(p.read_bytes())
    raw[5] = 9                                            # values > 6 read as 0
    p.write_bytes(raw)
    assert read_header(p)[0].reason_name == "unknown"


# -- 3. bad files --------------------------------------------------------------------------------
def u32(buf: bytearray, off: int, v: int):
    struct.pack_into("<I", buf, off, v)


def u64(buf: bytearray, off: int, v: int):
    struct.pack_into("<Q", buf, off, v)


@pytest.fixture(scope="module")
def corpus(eng, saved, q4_model, tmp_path_factory):
    """name -> (path, message regex, counts as bad for `ds4-kv -m small_model`)."""
    d = tmp_path_factory.mktemp("bad")
    good = saved["path"].read_bytes()
    tl, pl = len(saved["text"]), len(saved["payload"])
    p0, p1 = 52 + tl, 52 + tl + pl                        # payload start, trailer start
    out = {}

    def put(name, data, msg, cli_bad=True):
        p = d / f"{name}.kv"
        p.write_bytes(bytes(data))
        out[name] = (p, msg, cli_bad)

    def patched(fn):
        b = bytearray(good)
        fn(b)
        return b

    put("zero-length", b"", r"truncated header: 0 bytes")
    put("cut-in-header", good[:30], r"truncated header: 30 bytes")
    put("cut-in-text", good[:52 + tl // 2], r"truncated: header promises")
    put("cut-in-payload", good[:p0 + pl // 2], r"truncated: header promises")
    put("cut-in-trailer-head", good[:p1 + 5], r"tool-id map section")
    put("cut-in-trailer-entry", good[:-5], r"tool-id map entry 1 runs past the end")
    put("wrong-magic", b"KVX" + good[3:], r"not a KV cache file")
    put("wrong-version", patched(lambda b: b.__setitem__(3, 2)), r"unsupported KV file version 2")
    put("quant-bits-3", patched(lambda b: b.__setitem__(4, 3)), r"quant bits 3")
    put("zero-tokens", patched(lambda b: u32(b, 8, 0)), r"holds no tokens")
    put("payload-bytes-past-eof", patched(lambda b: u64(b, 40, len(good))), r"truncated: header promises")
    put("payload-bytes-huge", patched(lambda b: u64(b, 40, 1 << 63)), r"truncated: header promises")
    put("payload-bytes-short", patched(lambda b: u64(b, 40, pl - 4)), r"tool-id map")
    put("text-length-huge", patched(lambda b: u32(b, 48, 0xFFFFFFF0)), r"truncated: header promises")
    put("token-count-mismatch", patched(lambda b: u32(b, 8, T_SAVE - 1)),
        r"token count mismatch \(header 299, payload 300\)")
    put("payload-magic", patched(lambda b: b.__setitem__(slice(p0, p0 + 4), b"XXXX")),
        r"payload: not a DSV4 session payload")
    put("payload-row-counts", patched(lambda b: u32(b, p0 + 52 + 4 * T_SAVE + 4 * eng.config.n_vocab + 8, 74)),
        r"payload: layer 2: payload row counts")
    put("payload-token-out-of-vocab", patched(lambda b: u32(b, p0 + 52, 1 << 20)),
        r"token ids outside the vocabulary")
    put("tool-entry-overrun", patched(lambda b: u32(b, len(good) - len(TOOLS["toolu_01AbC"].encode()) - 11 - 4, 1 << 20)),
        r"tool-id map entry 1 runs past the end")
    put("tool-count-too-large", patched(lambda b: u32(b, p1 + 4, 10 ** 7)), r"claims 10000000 entries")
    put("tool-count-plus-one", patched(lambda b: u32(b, p1 + 4, len(TOOLS) + 1)),
        r"tool-id map entry 2 runs past the end")
    put("tool-id-empty", patched(lambda b: u32(b, p1 + 8, 0)), r"tool-id map entry 0 has bad lengths")
    put("tool-map-magic", patched(lambda b: b.__setitem__(slice(p1, p1 + 3), b"KTX")), r"bad magic")
    put("trailer-without-flag", patched(lambda b: b.__setitem__(6, 0)),
        r"\d+ trailing bytes after the payload and no tool-id map flag")
    put("garbage-after-payload", good[:p1] + b"\0" * 7 + b"junk",   # flag still set: bad KTM section
        r"tool-id map section")
    nf = bytearray(good[:p1] + b"junk")
    nf[6] = 0
    put("garbage-without-flag", nf, r"4 trailing bytes after the payload")

    # files written by other models / sessions
    def written_by(model_path, name, ctx=CTX, n=40, **kw):
        e = Engine.open(model_path)
        s = Session(e, ctx)
        s.sync(list(range(3, 3 + n)))
        write_kv(d / f"{name}.kv", s, token_text(e, s.tokens), **kw)   # a payload spells its text
        return d / f"{name}.kv"

    out["other-dims"] = (written_by(synth(tmp_path_factory, "dims.gguf", n_layer=4, head_dim=256, value_dim=256),
                                    "other-dims"), r"payload layer count is 4, this model/session has 6", True)
    out["other-vocab"] = (written_by(synth(tmp_path_factory, "vocab.gguf", vocab=300), "other-vocab"),
                          r"payload vocab is 347, this model/session has 512", True)
    out["other-quant"] = (written_by(q4_model, "other-quant"), r"different quantization \(4-bit experts", True)
    s = Session(eng, 2 * CTX)
    s.sync(list(range(3, 43)))
    write_kv(d / "larger-ctx.kv", s, token_text(eng, s.tokens))
    # valid on its own (ds4-kv -m uses the header's context), too big for a 512-token session
    out["larger-ctx"] = (d / "larger-ctx.kv", r"context 1024 .*this session's context is 512", False)
    out["directory"] = (d / "a-directory.kv", r"is a directory", True)
    (d / "a-directory.kv").mkdir()
    out["missing"] = (d / "missing.kv", r"no such file", True)
    return out


BAD = ["zero-length", "cut-in-header", "cut-in-text", "cut-in-payload", "cut-in-trailer-head",
       "cut-in-trailer-entry", "wrong-magic", "wrong-version", "quant-bits-3", "zero-tokens",
       "payload-bytes-past-eof", "payload-bytes-huge", "payload-bytes-short", "text-length-huge",
       "token-count-mismatch", "payload-magic", "payload-row-counts", "payload-token-out-of-vocab",
       "tool-entry-overrun", "tool-count-too-large", "tool-count-plus-one", "tool-id-empty", "tool-map-magic",
       "trailer-without-flag", "garbage-after-payload", "garbage-without-flag", "other-dims", "other-vocab",
       "other-quant", "larger-ctx", "directory", "missing"]


@pytest.fixture(scope="module")
def live(eng, stream):
    """A live 50-token session that every bad file is offered to."""
    s = Session(eng, CTX)
    s.sync(stream[100:150])
    return dict(session=s, tokens=s.tokens, logits=s.logits.copy(), payload=s.snapshot())


@pytest.mark.parametrize("case", BAD)
def test_bad_file_is_rejected_and_the_session_is_untouched(case, corpus, live):
    path, msg, _ = corpus[case]
    s = live["session"]
    with pytest.raises(KVFileError) as e:
        read_kv(path, s)
    assert e.value.path == str(path) and str(e.value).startswith(f"{path}: ")
    assert re.search(msg, e.value.problem), e.value.problem
    assert s.tokens == live["tokens"] and np.array_equal(s.logits, live["logits"])
    assert s.snapshot() == live["payload"]


def test_live_session_continues_after_all_rejections(eng, stream, corpus, live):
    s = live["session"]
    for case in BAD:
        with pytest.raises(KVFileError):
            read_kv(corpus[case][0], s)
    ref = Session(eng, CTX)
    ref.sync(stream[100:150])
    for t in stream[150:155]:
        assert np.array_equal(s.eval(t), ref.eval(t))


def test_other_quant_is_accepted_on_request(eng, corpus, q4_model):
    path = corpus["other-quant"][0]
    s = Session(eng, CTX)                         # q2 model, same dims as the q4 one
    info = read_kv(path, s, allow_other_quant=True)
    assert info.header.quant_bits == 4 and s.tokens == list(range(3, 43))
    q4 = Session(Engine.open(q4_model), CTX)
    read_kv(path, q4)
    assert np.array_equal(s.logits, q4.logits) and s.snapshot() == q4.snapshot()
    with pytest.raises(KVFileError, match="layer count"):    # dims still have to match
        read_kv(corpus["other-dims"][0], Session(eng, CTX), allow_other_quant=True)


def test_larger_ctx_file_loads_into_a_session_large_enough(eng, corpus):
    s = Session(eng, 2 * CTX)
    read_kv(corpus["larger-ctx"][0], s)
    assert s.tokens == list(range(3, 43))


# -- 4. crash safety -----------------------------------------------------------------------------
PAD = "x" * (3 << 20)          # a 3 MB tool map entry: a write takes a while


def _writer_loop(path, versions, pad):
    """Child process: overwrite `path` with alternate versions until killed."""
    for i in range(10_000):
        s, text = versions[i % len(versions)]
        write_kv(path, s, text, tool_map={"call_pad": pad, f"call_{i}": "y"})
    os._exit(0)


def _versions(eng, stream, n_a=400, n_b=380):
    rng = np.random.default_rng(3)
    a, b = Session(eng, CTX), Session(eng, CTX)
    a.sync(rng.integers(0, eng.config.n_vocab, n_a).tolist())
    b.sync(rng.integers(0, eng.config.n_vocab, n_b).tolist())
    return a, b


@pytest.fixture(scope="module")
def ab(eng, stream):
    return _versions(eng, stream)


def _check_whole(path, s, expect):
    """read_kv of `path` into s succeeds and text, tokens and logits are one version's."""
    info = read_kv(path, s)
    v = expect[info.text]                     # KeyError: a text that is neither version's
    assert s.tokens == v.tokens and np.array_equal(s.logits, v.logits)
    assert info.tool_map["call_pad"] == PAD
    return info


def _current_text(path):
    return read_info(path).text


def _temps(tmp_path, path):
    return [n for n in os.listdir(tmp_path) if n.startswith(path.name + ".tmp.")]


def test_sigkill_during_write_never_leaves_a_torn_file(eng, ab, tmp_path):
    a, b = ab
    ta, tb = token_text(eng, a.tokens), token_text(eng, b.tokens)
    path = tmp_path / sha1_name(ta)
    t0 = time.perf_counter()
    write_kv(path, a, ta, tool_map={"call_pad": PAD})
    t_write = time.perf_counter() - t0
    expect = {ta: a, tb: b}
    check = Session(eng, CTX)
    rng = np.random.default_rng(7)
    fork = multiprocessing.get_context("fork")
    seen, polls = set(), 0
    for k in range(35):
        if k >= 25 and _temps(tmp_path, path):
            break                    # extra rounds only until one kill has landed inside a write
        # B first: one finished write changes the version the file holds
        p = fork.Process(target=_writer_loop, args=(str(path), [(b, tb), (a, ta)], PAD), daemon=True)
        p.start()
        try:
            deadline = time.perf_counter() + rng.uniform(0, 4 * t_write)
            # every 5th kill waits for a version change first, so both versions are checked even
            # when a loaded machine makes the writer slower than the first timed write
            wait_for = (tb if _current_text(path) == ta else ta) if k % 5 == 4 else None
            # every 5th kill (and every late one while no kill has landed in a write yet) waits
            # for the writer's temp file: on a loaded machine the forked writer may not reach
            # its first write before a random deadline, and then no kill would test a torn write
            wait_tmp = k % 5 == 2 or (k >= 25 and not _temps(tmp_path, path))
            hard_stop = time.perf_counter() + 30
            while time.perf_counter() < deadline or (
                    (wait_for is not None or wait_tmp) and time.perf_counter() < hard_stop):
                info = read_info(path)   # a concurrent reader never sees a torn file
                assert info.text in expect and info.tool_map["call_pad"] == PAD
                polls += 1
                if wait_for is not None and info.text == wait_for:
                    break            # kill right after the change: the file holds that version
                if wait_tmp and _temps(tmp_path, path):
                    break            # kill while a write is under way
                time.sleep(0.001)
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
        assert p.exitcode == -signal.SIGKILL
        seen.add(_check_whole(path, check, expect).text)
    names = os.listdir(tmp_path)
    temps = [n for n in names if n != path.name]
    assert all(n.startswith(path.name + ".tmp.") and not CACHE_NAME.match(n) for n in temps), names
    assert [n for n in names if CACHE_NAME.match(n)] == [path.name]   # a cache scan sees one entry
    assert len(temps) >= 1, "no kill landed inside a write"           # the kills did hit writes
    assert seen <= {ta, tb} and len(seen) == 2 and polls > 0
    print(f"25 SIGKILLs: {len(temps)} temp files left beside {path.name}")


def test_concurrent_readers_get_one_consistent_file(eng, ab, tmp_path):
    """read_kv while another process replaces the file: the text, header and payload returned all
    come from the same version (same-size versions, so a mixed read would go unnoticed otherwise)."""
    a, _ = ab
    rng = np.random.default_rng(5)
    b = Session(eng, CTX)
    b.sync(rng.permutation(a.tokens).tolist())      # same tokens reordered: same text length
    ta, tb = token_text(eng, a.tokens), token_text(eng, b.tokens)
    assert len(ta) == len(tb) and ta != tb
    path = tmp_path / "same-size.kv"
    write_kv(path, a, ta, tool_map={"call_pad": PAD})
    fork = multiprocessing.get_context("fork")
    p = fork.Process(target=_writer_loop, args=(str(path), [(a, ta), (b, tb)], PAD), daemon=True)
    p.start()
    s, n, stop = Session(eng, CTX), 0, time.perf_counter() + 1.5
    try:
        while time.perf_counter() < stop:
            _check_whole(path, s, {ta: a, tb: b})
            n += 1
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert n > 10


def test_touch_racing_a_writer_never_tears_the_file(eng, ab, tmp_path):
    a, b = ab
    ta, tb = token_text(eng, a.tokens), token_text(eng, b.tokens)   # different T, text and payload lengths
    path = tmp_path / "touched.kv"
    write_kv(path, a, ta, tool_map={"call_pad": PAD})
    fork = multiprocessing.get_context("fork")
    p = fork.Process(target=_writer_loop, args=(str(path), [(a, ta), (b, tb)], PAD), daemon=True)
    p.start()
    n, stop = 0, time.perf_counter() + 1.5
    try:
        while time.perf_counter() < stop:
            touch(path)
            info = read_info(path)
            assert (info.text, info.tokens) in ((ta, a.pos), (tb, b.pos))
            n += 1
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    _check_whole(path, Session(eng, CTX), {ta: a, tb: b})
    assert n > 10


# -- 5. touch and trailer rewrite ----------------------------------------------------------------
def test_touch_counts_hits_in_place(eng, saved, tmp_path):
    p = tmp_path / saved["path"].name
    shutil.copy(saved["path"], p)
    before = p.read_bytes()
    ino = os.stat(p).st_ino
    touch(p, now=NOW + 60)
    touch(p, now=NOW + 120)
    after = p.read_bytes()
    assert os.stat(p).st_ino == ino and len(after) == len(before)      # in place
    h = read_header(p)[0]
    assert (h.hits, h.last_used, h.created_at) == (2, NOW + 120, NOW)
    changed = [i for i in range(len(before)) if before[i] != after[i]]
    assert changed and all(12 <= i < 16 or 32 <= i < 40 for i in changed)
    s = Session(eng, CTX)
    read_kv(p, s, check_name=True)
    assert np.array_equal(s.logits, saved["logits"])


def test_replace_tool_map_rewrites_only_the_trailer(eng, saved, tmp_path):
    p = tmp_path / saved["path"].name
    shutil.copy(saved["path"], p)
    touch(p, now=NOW + 1)
    before = p.read_bytes()
    end = 52 + len(saved["text"]) + len(saved["payload"])
    new = {"call_new": "<｜DSML｜tool_calls>y</｜DSML｜tool_calls>"}
    replace_tool_map(p, new, now=NOW + 99)
    after = p.read_bytes()
    assert after[48:end] == before[48:end]                  # text and payload untouched
    h = read_header(p)[0]
    assert (h.hits, h.created_at, h.last_used, h.flags & FLAG_TOOL_MAP) == (1, NOW, NOW + 99, FLAG_TOOL_MAP)
    assert len(after) == end + 8 + 8 + len(b"call_new") + len(new["call_new"].encode())   # the old one is gone
    s = Session(eng, CTX)
    info = read_kv(p, s, check_name=True)
    assert info.tool_map == new and np.array_equal(s.logits, saved["logits"])
    replace_tool_map(p, {}, now=NOW + 500)                 # empty map: file left as it is
    assert p.read_bytes() == after
    # a file without a trailer gains one, and its flag
    plain = tmp_path / "plain.kv"
    write_kv(plain, s, token_text(eng, s.tokens), now=NOW)
    replace_tool_map(plain, TOOLS, now=NOW + 5)
    info = read_kv(plain, Session(eng, CTX))
    assert info.tool_map == TOOLS and info.header.flags == FLAG_TOOL_MAP and info.header.last_used == NOW + 5


# -- ds4-kv --------------------------------------------------------------------------------------
def run_cli(capsys, *args):
    rc = kv_cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_describes_a_good_file(saved, small_model, capsys):
    rc, out, err = run_cli(capsys, saved["path"])
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == str(saved["path"])
    assert "KVC v1, 2-bit routed experts, reason cold, flags 0x01 (tool-id map), key token-text" in out
    assert f"tokens:    {T_SAVE}   hits: 0   context: {CTX}" in out
    assert "created:   2023-11-14 22:13:20 UTC   last used: 2023-11-14 22:13:20 UTC" in out
    assert f"payload:   {len(saved['payload'])} bytes (DSV4 v1: context {CTX}, 6 layers" in out
    text_line = next(l for l in lines if l.startswith("  text:"))
    assert text_line.startswith(f'  text:      {len(saved["text"])} bytes: "{BOS}')
    assert text_line.endswith('"…') and "\n" not in text_line
    assert "name:      matches the text's SHA-1" in out
    assert "tool ids:  2: call_0001, toolu_01AbC" in out
    size = saved["info"].size
    assert f"size:      {size} bytes, expected {size}\n" in out
    assert lines[-1] == "  valid (structure; pass -m MODEL to load the payload)"
    rc, out, err = run_cli(capsys, saved["path"], "-m", small_model)
    assert rc == 0 and err == "" and f"valid (loaded into a {CTX}-token session" in out


def test_cli_preview_escapes_and_keys(eng, saved, tmp_path, capsys):
    s = Session(eng, CTX)
    read_kv(saved["path"], s)
    p = tmp_path / "x.kv"
    write_kv(p, s, "<｜User｜>a\nb\t\x01\\ \"q\"", key_kind="thinking-visible", reason="agent-system", now=NOW)
    rc, out, err = run_cli(capsys, p)
    assert rc == 0
    assert 'bytes: "<｜User｜>a\\nb\\t\\x01\\\\ \\"q\\""\n' in out
    assert "reason agent-system, flags 0x04 (thinking-visible key), key thinking-visible" in out
    assert "tool ids:  none" in out and "name:      not a cache-entry name" in out


def test_cli_bad_files_one_error_line_each(corpus, saved, small_model, capsys):
    bad = [corpus[c][0] for c in BAD if corpus[c][2]]
    rc, out, err = run_cli(capsys, saved["path"], *bad, "-m", small_model)
    assert rc == 1 and "Traceback" not in out + err
    errors = err.splitlines()
    assert len(errors) == len(bad) and all(e.startswith("error: ") for e in errors)
    for path, line in zip(bad, errors):
        assert line.startswith(f"error: {path}: ")
    assert out.count("\n  valid") == 1 and out.count("\n  invalid\n") == len(bad)
    for path, line in zip(bad, errors):      # said once: stderr has the problem, stdout the verdict
        assert line.split(": ", 2)[2] not in out
    # the larger-context file is fine by itself: ds4-kv loads it with the header's context
    rc, out, err = run_cli(capsys, corpus["larger-ctx"][0], "-m", small_model)
    assert rc == 0 and "valid (loaded into a 1024-token session" in out


def test_cli_structural_checks_without_a_model(corpus, capsys):
    for case in ("cut-in-payload", "token-count-mismatch", "trailer-without-flag", "payload-magic",
                 "tool-entry-overrun", "directory", "missing", "zero-length"):
        path, msg, _ = corpus[case]
        rc, out, err = run_cli(capsys, path)
        assert rc == 1 and re.search(msg, err) and err.count("\n") == 1, (case, err)
        assert err.startswith(f"error: {path}: ")
    # needs the model to tell: structurally fine
    rc, out, err = run_cli(capsys, corpus["other-dims"][0])
    assert rc == 0 and "4 layers, head dim 256" in out


def test_cli_renamed_entry_and_bad_model(saved, tmp_path, capsys):
    wrong = tmp_path / ("0" * 40 + ".kv")
    shutil.copy(saved["path"], wrong)
    rc, out, err = run_cli(capsys, wrong)
    assert rc == 1 and "does not match the SHA-1 of its text" in err
    rc, out, err = run_cli(capsys, saved["path"], "-m", tmp_path / "nope.gguf")
    assert rc == 1 and err.startswith(f"error: {tmp_path / 'nope.gguf'}: ") and "Traceback" not in err


def test_cli_model_check_bounds_the_header_context(saved, small_model, tmp_path, capsys):
    for ctx in (0, 1 << 30):
        p = tmp_path / f"ctx{ctx}.kv"
        raw = bytearray(saved["path"].read_bytes())
        u32(raw, 16, ctx)
        p.write_bytes(raw)
        rc, out, err = run_cli(capsys, p, "-m", small_model)     # no session of 2^30 tokens is made
        assert rc == 1 and err == f"error: {p}: context {ctx} in the header is outside 2..{1 << 20} for this model\n"
    short = tmp_path / "short-payload.kv"
    raw = bytearray(saved["path"].read_bytes())
    u64(raw, 40, 60)
    raw[6] = 0
    short.write_bytes(raw[:52 + len(saved["text"]) + 60])
    rc, out, err = run_cli(capsys, short)
    assert rc == 1 and "payload: 60 bytes, its header needs at least" in err


def test_stale_temp_files_are_removed_only_when_old(tmp_path):
    from sessions.kvfile import remove_stale_temps
    old, fresh, real = tmp_path / "a.kv.tmp.x1", tmp_path / "b.kv.tmp.x2", tmp_path / ("0" * 40 + ".kv")
    for p in (old, fresh, real):
        p.write_bytes(b"x")
    os.utime(old, (1000, 1000))
    assert remove_stale_temps(tmp_path, older_than_s=3600, now=1000 + 7200) == 1
    assert not old.exists() and fresh.exists() and real.exists()
