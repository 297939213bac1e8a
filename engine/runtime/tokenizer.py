"""The DeepSeek V4 tokenizer, built from the GGUF's own metadata so a published file is self-sufficient.

Provenance: the vocabulary and merges are `tokenizer.ggml.tokens` / `tokenizer.ggml.merges` of the
GGUF (ds4's files carry the official DeepSeek V4 table); the pre-tokenizer is the one of the
official `tokenizer.json` (three regex splits in "isolated" mode, then GPT-2 byte-level mapping,
spec/model.md §6.2), which GGUF names "joyai-llm". The BPE itself runs in the `tokenizers`
library (the same Rust code the official tokenizer uses).

Special tokens are exactly ds4's seven markers (spec/protocol.md §1.2): BOS, EOS, <｜User｜>,
<｜Assistant｜>, <think>, </think>, ｜DSML｜, recognised anywhere in text. Every other added token
of the official table (FIM, <|EOT|>, <dsml:, ...) is BPE'd as plain text, as ds4 does.
Decoding follows ds4's token text (§1.3): a vocabulary string containing U+FF5C is emitted
verbatim, anything else is GPT-2 byte-decoded.
"""
from __future__ import annotations

import codecs
import contextlib
import functools
import gc
import re

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import ModelFileError
from ..gguf.config import check_merge_table, split_merges

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML)  # ds4's match order
PARALLEL_FROM = 32 * 1024                  # characters; shorter text is encoded in one call
GROUP_CHARS = 8 * PARALLEL_FROM            # characters of long text encoded together
# Where the pre-tokenizer always cuts, so the pieces' tokens are the whole's: after a newline
# followed by a character that is not whitespace, and before a space between two characters that
# are not (every split pattern that takes a space takes it first, and only a whitespace-only
# match goes on past one; no marker holds a space; Python's whitespace includes all of Unicode's
# White_Space, which is what the pattern's \s means).
_SAFE_CUT = re.compile(r"(?<=\n)(?=\S)|(?<=\S)(?= \S)")
LONG_PART = 2 * PARALLEL_FROM              # characters between safe cuts past which a part is
                                           # first checked against the limit in chunks
CHUNK = 8 * 1024                           # characters a chunk of such a check

SPLIT_PATTERNS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def pre_tokenizer():
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in SPLIT_PATTERNS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@contextlib.contextmanager
def _no_gc():
    """The cyclic collector off while the merge table's 128k pairs live: each tuple counts as a
    new container, and a few hundred of them start a collection, so building them ran dozens of
    collections over every object of the process, a full one among them (~7 ms alone, more in a
    process with a large heap), to free none. The pairs are gone before it is back on (their
    count with them), so no collection is merely put off. Off and on again only if it was on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _bpe(id_of: dict, merges: list):
    flat = split_merges(merges)
    if flat is not None:        # (every merge "a b": the pairs in C-level passes)
        pairs = list(zip(flat[::2], flat[1::2]))
    else:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bad = next((m for m in pairs if len(m) != 2), None)
        if bad is not None:
            raise ValueError(f"merge {' '.join(bad)!r} is not two tokens separated by a space")
    try:
        # (the library copies the vocabulary into its own tables: id_of needs no copy)
        return models.BPE(vocab=id_of, merges=pairs, fuse_unk=False)
    except Exception as e:   # the library raises a bare Exception ("Token `x` out of vocabulary")
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"the BPE tables do not load: {first}") from None


class Tokenizer:
    def __init__(self, tokens: list[str], merges: list[str], id_of: dict[str, int] | None = None):
        """id_of: {token: id} of these tokens when the caller has it (read_tokenizer_metadata)."""
        self.tokens = list(tokens)
        self.id_of = dict(zip(self.tokens, range(len(self.tokens)))) if id_of is None else id_of
        missing = [m for m in (BOS, EOS) if m not in self.id_of]
        if missing:
            raise ValueError(f"the vocabulary lacks {missing[0]!r}")
        with _no_gc():
            self._hf = _HFTokenizer(_bpe(self.id_of, merges))
        self._hf.pre_tokenizer = pre_tokenizer()
        self._hf.decoder = decoders.ByteLevel()
        present = [m for m in MARKERS if m in self.id_of]
        self._hf.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in present])
        self.special_ids = {self.id_of[m] for m in present}
        self.bos_id, self.eos_id = self.id_of[BOS], self.id_of[EOS]
        self._u2b = {u: b for b, u in bytes_to_unicode().items()}
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """From read_tokenizer_metadata's dict; a table that does not build is the file's error.
        The BPE library checks the merge table as it builds it (every piece and every result in
        the vocabulary), but its message names neither the file nor the merge: when it refuses
        one in a table read_tokenizer_metadata did not check ("merges_checked" False: Engine.open),
        check_merge_table names it in the words it would have used there."""
        try:
            return cls(meta["tokens"], meta["merges"], meta.get("id_of"))
        except ValueError as e:
            path = meta.get("path", "model")
            if meta.get("merges_checked") is False:
                check_merge_table(path, meta["merges"], set(meta["tokens"]))
            raise ModelFileError(path, f"tokenizer metadata: {e}") from None

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Build from a GGUF's tokenizer metadata alone (a vocab-only GGUF is enough)."""
        from ..gguf.config import read_tokenizer_metadata
        from ..gguf.gguf_file import GGUFFile
        with GGUFFile(path) as g:
            n = g.get("deepseek4.vocab_size")
            toks = g.fields.get("tokenizer.ggml.tokens")
            meta = read_tokenizer_metadata(g, n if isinstance(n, int) else len(toks.value) if toks else 0)
        return cls.from_metadata(meta)

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def special(self, text: str) -> int:
        """The id of a vocabulary string (a marker, or any added token) by its exact text."""
        return self.id_of[text]

    # -- encode --------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: the seven markers anywhere, byte-level BPE for the rest."""
        return self.encode_upto(text, None)[0]

    def encode_upto(self, text: str, limit: int | None) -> tuple[list[int], bool]:
        """(ids, complete): the text's tokens, or, once at least `limit` are known, only the
        first of them (complete False). A prompt that cannot fit is refused at that point."""
        if len(text) <= PARALLEL_FROM:
            return self._hf.encode(text, add_special_tokens=False).ids, True
        # Long text: cut where the pre-tokenizer always cuts (a newline followed by a character
        # that is not whitespace: no split pattern and no marker crosses that point), then let
        # the library encode the pieces on all cores, a group at a time: the library's
        # per-token records cost ~200 bytes a character, so a whole 10 MB text at once peaked
        # near 2 GB.
        parts, start = [], 0
        for m in _SAFE_CUT.finditer(text, PARALLEL_FROM // 2):
            if m.start() - start >= PARALLEL_FROM // 2:
                parts.append((start, m.start()))
                start = m.start()
        parts.append((start, len(text)))
        out: list[int] = []
        i = 0
        while i < len(parts):
            a, b = parts[i]
            if b - a > LONG_PART:
                # A long stretch with no safe cut (text without newlines or spaces) is one call
                # of the library, whose memory follows its length (~300 bytes a character): it
                # is first shown to fit what is left of the limit, else refused unread.
                if limit is not None and self._surely_at_least(text[a:b], limit - len(out)):
                    return out, False
                out.extend(self._hf.encode(text[a:b], add_special_tokens=False).ids)
                i += 1
            else:
                j, size = i, 0
                while j < len(parts) and (j == i or size < GROUP_CHARS) and \
                        parts[j][1] - parts[j][0] <= LONG_PART:
                    size += parts[j][1] - parts[j][0]
                    j += 1
                for e in self._hf.encode_batch([text[a:b] for a, b in parts[i:j]], add_special_tokens=False):
                    out.extend(e.ids)
                i = j
            if limit is not None and len(out) >= limit and i < len(parts):
                return out, False
        return out, True

    def _surely_at_least(self, part: str, need: int) -> bool:
        """Whether `part` (text with no safe cut) makes at least `need` tokens. First by its size
        (at most max_token_bytes bytes a token: a proof); then by encoding it in chunks cut
        anywhere, each cut allowed to add max_token_bytes tokens, a margin far over the 0-3 a
        cut adds to BPE pieces in practice. Memory: a few chunks at a time; time: stops once
        shown. False means only "not shown": the caller then encodes it whole, exactly."""
        if need <= 0:
            return True
        per = self.max_token_bytes
        if per is None:
            return False
        if len(part.encode("utf-8", "surrogatepass")) > (need - 1) * per:
            return True
        seen = cuts = 0
        starts = range(0, len(part), CHUNK)
        for k in range(0, len(starts), 8):          # 8 chunks a call: the library's threads
            batch = [part[a:a + CHUNK] for a in starts[k:k + 8]]
            seen += sum(len(e.ids) for e in self._hf.encode_batch(batch, add_special_tokens=False))
            cuts += len(batch) - (k == 0)
            if seen >= need + cuts * per:
                return True
        return False

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, so a text of n characters has
        at least n / max_token_chars tokens: the longest vocabulary string's UTF-8 length (a
        byte-level string is never shorter than the bytes it stands for, a marker is matched as
        its own text, and a character is at least one byte). None when some byte has no token of
        its own: BPE would then drop characters, and no such bound holds."""
        if any(ch not in self.id_of for ch in bytes_to_unicode().values()):
            return None
        return max(len(s.encode("utf-8")) for s in self.tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for, so text of n bytes has at least
        n / max_token_bytes tokens: BPE only makes tokens of byte-level characters (one byte of
        text each), and a marker stands for its own text. Tighter than max_token_chars on
        non-ASCII text (2-4 bytes a character). None where no such bound holds."""
        if self.max_token_chars is None:
            return None
        byte_level = set(bytes_to_unicode().values())
        plain = (len(t) for t in self.tokens if t not in MARKERS and all(ch in byte_level for ch in t))
        return max(max(plain, default=1), *(len(m.encode("utf-8")) for m in MARKERS if m in self.id_of))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    # -- decode --------------------------------------------------------------------------------
    def token_bytes(self, i: int) -> bytes:
        b = self._bytes_cache.get(i)
        if b is None:
            s = self.tokens[i]
            if "｜" in s:           # ds4 emits <｜...｜>-family strings verbatim
                b = s.encode("utf-8")
            else:                   # GPT-2 byte-level; unmapped code points are dropped
                b = bytes(self._u2b[ch] for ch in s if ch in self._u2b)
            self._bytes_cache[i] = b
        return b

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Token ids in, text out, never a broken UTF-8 sequence: a character split across tokens is
    held back until its last byte arrives (invalid bytes become U+FFFD)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self.tok.token_bytes(int(token_id)))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
