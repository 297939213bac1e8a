"""The DeepSeek V4 tokenizer, built from the GGUF's own metadata (tokens, merges, token types).

Byte-level BPE with the pre-tokenizer of the official `tokenizer.json` (spec/model.md §6.2, three
regex splits in "isolated" mode, then GPT-2 byte mapping), implemented with the `regex` module so
Unicode classes match the reference exactly. Added tokens (token type CONTROL or USER_DEFINED: BOS,
EOS, the chat markers, DSML) are recognised inside text by their exact strings and never split,
as the reference tokenizer does; everything else goes through BPE.
"""
from __future__ import annotations

import functools

import regex

CONTROL, USER_DEFINED = 3, 4

_SPLITS = [
    regex.compile(r"\p{N}{1,3}"),
    regex.compile(r"[一-龥぀-ゟ゠-ヿ]+"),
    regex.compile(r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                  r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
]


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _isolated(pattern, pieces):
    out = []
    for piece in pieces:
        last = 0
        for m in pattern.finditer(piece):
            if m.start() > last:
                out.append(piece[last:m.start()])
            if m.end() > m.start():
                out.append(m.group())
            last = m.end()
        if last < len(piece):
            out.append(piece[last:])
    return out


class Tokenizer:
    def __init__(self, tokens: list[str], merges: list[str], token_types=None):
        self.tokens = tokens
        self.id_of = {s: i for i, s in enumerate(tokens)}
        self.ranks = {}
        for i, m in enumerate(merges):
            a, _, b = m.partition(" ")
            self.ranks.setdefault((a, b), i)
        types = list(token_types) if token_types is not None else [1] * len(tokens)
        self.special_ids = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
        specials = sorted((tokens[i] for i in self.special_ids), key=len, reverse=True)
        self._special_re = regex.compile("|".join(regex.escape(s) for s in specials)) if specials else None
        self._b2u = bytes_to_unicode()
        self._u2b = {u: b for b, u in self._b2u.items()}
        self._cache: dict[str, list[int]] = {}
        self.bos_id = self.id_of.get("<｜begin▁of▁sentence｜>", 0)
        self.eos_id = self.id_of.get("<｜end▁of▁sentence｜>", 1)

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        return cls(meta["tokens"], meta["merges"], meta.get("token_type"))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def special(self, text: str) -> int:
        """The id of a special token by its exact string (KeyError if the vocabulary lacks it)."""
        return self.id_of[text]

    # -- encode --------------------------------------------------------------------------------
    def encode(self, text: str, specials: bool = True) -> list[int]:
        ids: list[int] = []
        last = 0
        if specials and self._special_re is not None:
            for m in self._special_re.finditer(text):
                self._encode_plain(text[last:m.start()], ids)
                ids.append(self.id_of[m.group()])
                last = m.end()
        self._encode_plain(text[last:], ids)
        return ids

    def _encode_plain(self, text: str, out: list[int]):
        if not text:
            return
        pieces = [text]
        for pat in _SPLITS:
            pieces = _isolated(pat, pieces)
        for piece in pieces:
            out.extend(self._bpe(piece))

    def _bpe(self, piece: str) -> list[int]:
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        word = [self._b2u[b] for b in piece.encode("utf-8")]
        ranks = self.ranks
        while len(word) > 1:
            best, best_rank = None, None
            for i in range(len(word) - 1):
                r = ranks.get((word[i], word[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            a, b = word[best], word[best + 1]
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == a and word[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids = []
        for sym in word:
            i = self.id_of.get(sym)
            if i is None:  # a symbol the (shrunk) vocabulary lacks: fall back to its bytes
                ids.extend(self.id_of[ch] for ch in sym)
            else:
                ids.append(i)
        if len(self._cache) < 100_000:
            self._cache[piece] = ids
        return ids

    # -- decode --------------------------------------------------------------------------------
    def token_bytes(self, i: int) -> bytes:
        s = self.tokens[i]
        if i in self.special_ids:
            return s.encode("utf-8")
        try:
            return bytes(self._u2b[ch] for ch in s)
        except KeyError:
            return s.encode("utf-8")

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")
