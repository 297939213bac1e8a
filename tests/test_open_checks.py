"""Opening's fast paths keep every check and every message (docs/performance.md "Opening").

GGUFFile reads a string array in bulk (one pass for where each string starts, one UTF-8 decode of the
whole run) and falls back to one string at a time for anything the bulk pass cannot vouch for;
Engine.open lets the BPE library's build be the merge table's check and runs the detailed check only
to name what it refused. These tests hold both fast paths to the answers and the error messages of
the slow ones.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from engine import Engine, ModelFile, ModelFileError
from engine.gguf import gguf_file
from engine.gguf.config import check_merge_table, split_merges
from engine.gguf.gguf_file import GGUFFile, _Cursor
from engine.model.weights import _hash_table
from engine.runtime.tokenizer import Tokenizer
from gguf_edit import rewrite

KEY = "test.strings"


def _gguf_with_strings(path: Path, raw: list[bytes], cut: int = 0) -> Path:
    """A GGUF (no tensors) whose one metadata entry is an array of these raw strings, less the last
    `cut` bytes of the file."""
    kv = struct.pack("<Q", len(KEY)) + KEY.encode() + struct.pack("<IIQ", 9, 8, len(raw))
    kv += b"".join(struct.pack("<Q", len(s)) + s for s in raw)
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv
    path.write_bytes(data[:len(data) - cut])
    return path


def _both(path: Path) -> tuple[list, list]:
    """The array read by the bulk reader (GGUFFile) and by the one-string-at-a-time reader."""
    with GGUFFile(path) as g:
        bulk = g.fields[KEY].value
        c = _Cursor(g.path, g._mm, g.size)
        c.pos = 4 + 4 + 8 + 8 + 8 + len(KEY) + 4 + 4 + 8
        each = g._read_strings_each(c, KEY, len(bulk))
        assert c.pos == g.size
    return bulk, each


STRINGS = ["a", "Ġthe", "", "ü", "日本語", "😀x", "", "", "x" * 256, "y" * 70000, "<｜User｜>", " a b ", "\n\t"]


def test_bulk_read_equals_one_at_a_time(tmp_path):
    raw = [s.encode() for s in STRINGS]
    bulk, each = _both(_gguf_with_strings(tmp_path / "s.gguf", raw))
    assert bulk == each == STRINGS
    assert [type(s) for s in bulk] == [str] * len(STRINGS)


@pytest.mark.parametrize("seed", range(6))
def test_random_arrays_read_right_whichever_way_the_starts_are_found(tmp_path, seed):
    """Strings built to fool the offsets found from zero runs (NUL runs of every length, empty
    strings, lengths around 256 and 65536, zero bytes after the array): whatever path a table takes,
    its strings come back exact."""
    rng = np.random.default_rng(seed)
    pieces = ["a", "Ġ", "ü", "日", "😀", "\x00", "\x00" * 6, "\x00" * 9, " "]
    plain = seed < 2                # (these take the zero-run path; the others may not)
    strs = []
    for _ in range(300):
        kind = 9 if plain else rng.integers(0, 10)
        if kind == 0:
            strs.append("")
        elif kind == 1:
            strs.append("z" * int(rng.choice([255, 256, 257, 65535, 65536])))
        else:
            strs.append("".join(rng.choice(pieces[:5] if plain or seed % 2 else pieces, int(rng.integers(1, 6)))))
    path = _gguf_with_strings(tmp_path / "r.gguf", [x.encode() for x in strs])
    with path.open("ab") as f:
        f.write(b"\x00" * 64 + b"\x05" + b"\x00" * 64)     # zero runs after the array
    with GGUFFile(path) as g:
        assert g.fields[KEY].value == strs
        first = 4 + 4 + 8 + 8 + 8 + len(KEY) + 4 + 4 + 8
        if plain:
            assert g._starts_by_zeros(first, len(strs)) is not None


def test_starts_from_zero_runs_match_the_walk(tmp_path):
    # (the first guess of the run's size is 32 bytes a string: short ones around a long one)
    strs = ["ab", "Ġthe", "x" * 256, "日本", "c"] + [f"t{i}" for i in range(40)]   # ("x" * 256: 0, 1, 0 ...)
    with GGUFFile(_gguf_with_strings(tmp_path / "z.gguf", [x.encode() for x in strs])) as g:
        first = 4 + 4 + 8 + 8 + 8 + len(KEY) + 4 + 4 + 8
        at, end = g._starts_by_zeros(first, len(strs))
        want = np.cumsum([0] + [8 + len(x.encode()) for x in strs])
        assert at.tolist() == want[:-1].tolist() and end == first + want[-1] == g.size
        # a length of 65536 or more, an empty string before a length that is a multiple of 256:
        # no answer (the walk finds them)
        for bad in (["y" * 65536], [""]):
            path = _gguf_with_strings(tmp_path / "b.gguf", [x.encode() for x in strs[:2] + bad + strs[2:]])
            with GGUFFile(path) as g2:
                assert g2._starts_by_zeros(first, len(strs) + 1) is None
                assert g2.fields[KEY].value == strs[:2] + bad + strs[2:]


def test_empty_array_and_single_empty_string(tmp_path):
    assert _both(_gguf_with_strings(tmp_path / "e.gguf", [])) == ([], [])
    assert _both(_gguf_with_strings(tmp_path / "one.gguf", [b""])) == ([""], [""])


def test_nul_inside_a_string_goes_the_slow_way_and_survives(tmp_path, monkeypatch):
    calls = []
    each = GGUFFile._read_strings_each

    def spy(self, c, key, count):
        calls.append(key)
        return each(self, c, key, count)
    monkeypatch.setattr(GGUFFile, "_read_strings_each", spy)
    # NUL runs of every length around the 8 a length leaves, at the ends and inside
    strs = ["ab", "\x00", "a\x00", "\x00" * 8 + "z", "q" + "\x00" * 9, "tail"]
    with GGUFFile(_gguf_with_strings(tmp_path / "n.gguf", [s.encode() for s in strs])) as g:
        assert g.fields[KEY].value == strs
    assert calls == [KEY]
    calls.clear()
    with GGUFFile(_gguf_with_strings(tmp_path / "ok.gguf", [b"ab", b"cd"])) as g:
        assert g.fields[KEY].value == ["ab", "cd"]
    assert calls == []              # the ordinary table stays on the bulk path


@pytest.mark.parametrize("bad, index", [(b"\xff", 0), (b"ok\xc3", 3), (b"\xed\xa0\x80", 5), (b"\xc3", 6)])
def test_bad_utf8_names_the_string(tmp_path, bad, index):
    raw = [b"a", b"b", b"c", b"d", b"e", b"f", b"g"]
    raw[index] = bad
    with pytest.raises(ModelFileError) as ei:
        GGUFFile(_gguf_with_strings(tmp_path / "u.gguf", raw))
    assert str(ei.value) == f"{tmp_path / 'u.gguf'}: metadata '{KEY}': string #{index} is not valid UTF-8"


@pytest.mark.parametrize("cut, index", [(1, 3), (4, 3), (7, 3), (12, 3), (13, 2), (16, 2)])
def test_truncated_array_names_the_string(tmp_path, cut, index):
    # four strings of 4 bytes, 12 bytes each with its length: cutting into the last one's bytes or
    # length names #3, a byte more names #2 (cut further and the count check before speaks first)
    raw = [b"abcd", b"efgh", b"ijkl", b"mnop"]
    path = _gguf_with_strings(tmp_path / "t.gguf", raw, cut=cut)
    with pytest.raises(ModelFileError) as ei:
        GGUFFile(path)
    assert str(ei.value) == (f"{path}: truncated metadata '{KEY}': string #{index} of 4 runs past "
                             f"the end of the file")


def test_absurd_length_is_truncation_not_a_crash(tmp_path):
    path = tmp_path / "big.gguf"
    _gguf_with_strings(path, [b"ab", b"cd"])
    data = bytearray(path.read_bytes())
    first = 4 + 4 + 8 + 8 + 8 + len(KEY) + 4 + 4 + 8
    struct.pack_into("<Q", data, first + 8 + 2, 2 ** 64 - 1)      # the second string's length
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"string #1 of 2 runs past the end of the file"):
        GGUFFile(path)


def test_long_run_is_read_one_string_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_file, "_BULK_BYTES", 16)
    raw = [s.encode() for s in STRINGS]
    bulk, each = _both(_gguf_with_strings(tmp_path / "l.gguf", raw))
    assert bulk == each == STRINGS


def test_real_vocabulary_reads_the_same_both_ways(tiny_q2):
    with GGUFFile(tiny_q2) as g:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            arr = g.fields[key].value
            assert len(arr) > 1000
            raw = b"".join(struct.pack("<Q", len(s.encode())) + s.encode() for s in arr)
            start = bytes(g._mm).find(raw)
            c = _Cursor(g.path, g._mm, g.size)
            c.pos = start
            assert g._read_strings_each(c, key, len(arr)) == arr


# -- the merge table ----------------------------------------------------------------------------
def test_split_merges():
    assert split_merges([]) == []
    assert split_merges(["a b", "Ġ t", "ab c"]) == ["a", "b", "Ġ", "t", "ab", "c"]
    # anything but one space between two non-empty pieces: None (the callers go merge by merge)
    for bad in (["a b c"], ["ab", "a b c"], ["a b c", "ab"], [" a"], ["a "], [""], ["a  b"], ["a b", "ab"]):
        assert split_merges(bad) is None, bad


def test_check_merge_table_keeps_the_first_space_rule():
    vocab = {"a", "b", "ab", "b c", "ab c", "c"}
    check_merge_table("f.gguf", ["a b", "a b c"], vocab)     # "a" + "b c": the first space splits
    for merges, msg in ((["a b", "b a"], "tokenizer.ggml.merges[1] 'b a': 'ba' is not in the vocabulary"),
                        (["a zz"], "tokenizer.ggml.merges[0] 'a zz': 'zz' is not in the vocabulary"),
                        (["a b", "abc"], "tokenizer.ggml.merges[1] is 'abc', not two tokens separated by a space"),
                        (["a "], "tokenizer.ggml.merges[0] is 'a ', not two tokens separated by a space")):
        with pytest.raises(ModelFileError) as ei:
            check_merge_table("f.gguf", merges, vocab)
        assert str(ei.value) == f"f.gguf: {msg}"


def _with_merges(src: Path, dst: Path, edit) -> Path:
    with GGUFFile(src) as g:
        merges = list(g.fields["tokenizer.ggml.merges"].value)
        vocab = set(g.fields["tokenizer.ggml.tokens"].value)
    edit(merges, vocab)
    return rewrite(src, dst, set_fields={"tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY,
                                                                    GGUFValueType.STRING)}) or dst


def _flip(start):
    """Flip the first merge from `start` on whose flipped result is not a token."""
    def edit(merges, vocab):
        i = next(i for i in range(start, len(merges)) if "".join(reversed(merges[i].split(" "))) not in vocab)
        a, b = merges[i].split(" ")
        merges[i] = f"{b} {a}"
    return edit


def _set(i, text):
    def edit(merges, vocab):
        merges[i] = text
    return edit


@pytest.mark.parametrize("edit, words", [
    (_flip(3), "is not in the vocabulary"),
    (_set(5, "Oy zz"), "tokenizer.ggml.merges[5] 'Oy zz': 'Oy' is not in the vocabulary"),
    (_set(7, "abc"), "tokenizer.ggml.merges[7] is 'abc', not two tokens separated by a space"),
    (_set(9, "a "), "tokenizer.ggml.merges[9] is 'a ', not two tokens separated by a space"),
])
def test_engine_open_names_a_bad_merge_as_model_file_open_does(tiny_q2, tmp_path, edit, words):
    path = _with_merges(tiny_q2, tmp_path / "m.gguf", edit)
    with pytest.raises(ModelFileError) as want:
        ModelFile.open(path)
    assert words in str(want.value) and str(path) in str(want.value)
    # the Engine's open skips the table's check, then the tokenizer's build refuses it: same line
    with ModelFile.open(path, check_merges=False) as m:
        assert m.tokenizer["merges_checked"] is False
    with pytest.raises(ModelFileError) as got:
        Engine.open(path, backend="numpy", paging="none")
    assert str(got.value) == str(want.value)


def test_engine_open_checks_the_table_once_and_builds_the_same_tokenizer(tiny_q2, monkeypatch):
    import engine.gguf.config as config
    calls = []
    real = config.check_merge_table
    monkeypatch.setattr(config, "check_merge_table", lambda *a: calls.append(1) or real(*a))
    eng = Engine.open(tiny_q2, backend="numpy", paging="none")
    try:
        assert calls == [] and eng.file.tokenizer["merges_checked"] is False
        with ModelFile.open(tiny_q2) as m:
            assert calls == [1] and m.tokenizer["merges_checked"] is True
            ref = Tokenizer(m.tokenizer["tokens"], m.tokenizer["merges"])
        text = "Hello, world! def f(x):\n    return x * 2  # ünïcödé 日本語 <｜User｜>hi"
        assert eng.tokenizer.encode(text) == ref.encode(text)
        assert eng.tokenizer.id_of == ref.id_of
    finally:
        eng.close()


def test_library_refusal_after_a_passing_check_keeps_the_librarys_words(monkeypatch):
    toks = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "a", "b", "ab"]
    with pytest.raises(ModelFileError, match=r"^m\.gguf: tokenizer\.ggml\.merges\[0\] 'b a': 'ba' is not in"):
        Tokenizer.from_metadata({"tokens": toks, "merges": ["b a"], "path": "m.gguf", "merges_checked": False})
    with pytest.raises(ModelFileError, match=r"^m\.gguf: tokenizer metadata: .*BPE tables"):
        Tokenizer.from_metadata({"tokens": toks, "merges": ["b a"], "path": "m.gguf", "merges_checked": True})


# -- the hash tables ----------------------------------------------------------------------------
class _Table:
    """The two things _hash_table asks of a ModelFile: tensor(name).int32() and path."""
    path = "h.gguf"

    def __init__(self, ids):
        self.ids = np.asarray(ids, np.int32)

    def tensor(self, name):
        return self

    def int32(self):
        return self.ids


@pytest.mark.parametrize("k", [1, 2, 6, 8, 9, 12])
def test_hash_table_duplicate_found_in_any_column_pair(k):
    rng = np.random.default_rng(k)
    ids = np.stack([rng.permutation(64)[:k] for _ in range(50)])
    assert _hash_table(_Table(ids), "t", 64) is not None
    for i in range(k):
        for j in range(i + 1, k):
            bad = ids.copy()
            bad[17, j] = bad[17, i]
            with pytest.raises(ModelFileError, match=r"^h\.gguf: tensor 't' routes token 17 to the same expert twice"):
                _hash_table(_Table(bad), "t", 64)
