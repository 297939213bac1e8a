"""The DeepSeek V4 hyper-parameters, read from `deepseek4.*` GGUF metadata into one typed config.

Every shape in the engine comes from here, never from constants, so a tiny synthetic model and the
real 43-layer Flash file go through the same code. Key names and accepted value types follow what
ds4 reads (spec/model.md §1.3): counts must be GGUF u32 exactly; floats may be stored as f32, f64,
u32 or i32. `flash_differences()` separately says whether a file has the published Flash shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from itertools import repeat

import numpy as np

from ..errors import ModelFileError
from .gguf_file import (T_ARRAY, T_BOOL, T_FLOAT32, T_FLOAT64, T_INT8, T_INT16, T_INT32, T_INT64, T_STRING,
                        T_UINT8, T_UINT16, T_UINT32, T_UINT64, GGUFFile)

ARCH = "deepseek4"
P = ARCH + "."
# The two compressor kinds of the architecture: ratio 4 = CSA (overlapping windows + lightning
# indexer), ratio 128 = HCA (plain windows); 0 = sliding window only.
CSA_RATIO, HCA_RATIO = 4, 128

# (attribute, key, kind, default if optional else None)
_KEYS = [
    ("n_layer", "block_count", "u32", None),
    ("n_embd", "embedding_length", "u32", None),
    ("n_vocab", "vocab_size", "u32", None),
    ("n_head", "attention.head_count", "u32", None),
    ("n_head_kv", "attention.head_count_kv", "u32", None),
    ("head_dim", "attention.key_length", "u32", None),
    ("value_dim", "attention.value_length", "u32", None),
    ("n_rot", "rope.dimension_count", "u32", None),
    ("q_lora_rank", "attention.q_lora_rank", "u32", None),
    ("o_lora_rank", "attention.output_lora_rank", "u32", None),
    ("o_groups", "attention.output_group_count", "u32", None),
    ("n_expert", "expert_count", "u32", None),
    ("n_expert_used", "expert_used_count", "u32", None),
    ("n_ff_exp", "expert_feed_forward_length", "u32", None),
    ("n_expert_shared", "expert_shared_count", "u32", None),
    ("n_hash_layer", "hash_layer_count", "u32", None),
    ("expert_group_count", "expert_group_count", "u32", 0),
    ("expert_group_used_count", "expert_group_used_count", "u32", 0),
    ("n_swa", "attention.sliding_window", "u32", None),
    ("idx_n_head", "attention.indexer.head_count", "u32", None),
    ("idx_head_dim", "attention.indexer.key_length", "u32", None),
    ("idx_topk", "attention.indexer.top_k", "u32", None),
    ("n_hc", "hyper_connection.count", "u32", None),
    ("sinkhorn_iters", "hyper_connection.sinkhorn_iterations", "u32", None),
    ("compress_ratios", "attention.compress_ratios", "int_array", None),
    ("swiglu_clamp", "swiglu_clamp_exp", "float_array", None),
    ("rope_orig_ctx", "rope.scaling.original_context_length", "u32|u64", None),
    ("rope_base", "rope.freq_base", "float", None),
    ("rope_scale_factor", "rope.scaling.factor", "float", None),
    ("yarn_beta_fast", "rope.scaling.yarn_beta_fast", "float", None),
    ("yarn_beta_slow", "rope.scaling.yarn_beta_slow", "float", None),
    ("compress_rope_base", "attention.compress_rope_freq_base", "float", None),
    ("expert_weights_scale", "expert_weights_scale", "float", None),
    ("expert_weights_norm", "expert_weights_norm", "bool", None),
    ("rms_eps", "attention.layer_norm_rms_epsilon", "float", None),
    ("hc_eps", "hyper_connection.epsilon", "float", None),
    ("context_length", "context_length", "u32|u64", 0),
]

_ACCEPT = {
    "u32": ({T_UINT32}, "u32"),
    "u32|u64": ({T_UINT32, T_UINT64}, "u32 or u64"),
    "float": ({T_FLOAT32, T_FLOAT64, T_UINT32, T_INT32}, "f32, f64, u32 or i32"),
    "bool": ({T_BOOL}, "bool"),
}
_ACCEPT_ARRAY = {
    "int_array": ({T_UINT32, T_INT32}, "array of u32 or i32"),
    "float_array": ({T_FLOAT32, T_FLOAT64}, "array of f32 or f64"),
}

# The published DeepSeek V4 Flash shape (spec/model.md §1.1).
FLASH = dict(
    n_layer=43, n_embd=4096, n_vocab=129280, n_head=64, n_head_kv=1, head_dim=512, value_dim=512,
    n_rot=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_expert=256, n_expert_used=6,
    n_ff_exp=2048, n_expert_shared=1, n_hash_layer=3, expert_group_count=0, expert_group_used_count=0,
    n_swa=128, idx_n_head=64, idx_head_dim=128, idx_topk=512, n_hc=4, sinkhorn_iters=20,
    rope_orig_ctx=65536, rope_base=10000.0, rope_scale_factor=16.0, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0, compress_rope_base=160000.0, expert_weights_scale=1.5,
    expert_weights_norm=True, rms_eps=1e-6, hc_eps=1e-6,
)


def flash_schedule(n_layer: int) -> tuple[int, ...]:
    """ds4's layer schedule: 0, 0, then 4 on even and 128 on odd layers."""
    return tuple(0 if i < 2 else (CSA_RATIO if i % 2 == 0 else HCA_RATIO) for i in range(n_layer))


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    value_dim: int
    n_rot: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    n_hash_layer: int
    expert_group_count: int
    expert_group_used_count: int
    n_swa: int
    idx_n_head: int
    idx_head_dim: int
    idx_topk: int
    n_hc: int
    sinkhorn_iters: int
    compress_ratios: tuple[int, ...]   # one per layer (extra metadata entries dropped)
    swiglu_clamp: tuple[float, ...]    # one per layer
    rope_orig_ctx: int
    rope_base: float
    rope_scale_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    compress_rope_base: float
    expert_weights_scale: float
    expert_weights_norm: bool
    rms_eps: float
    hc_eps: float
    context_length: int = 0

    # -- derived widths (spec/model.md §1.1) --
    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_nope(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def hc_dim(self) -> int:
        return self.n_hc * self.n_embd

    @property
    def hc_mix(self) -> int:
        """HC mixing weights per sublayer: n_hc pre + n_hc post + n_hc^2 comb."""
        return (2 + self.n_hc) * self.n_hc

    @property
    def o_group_in(self) -> int:
        return self.n_head * self.head_dim // self.o_groups

    def ratio(self, il: int) -> int:
        return self.compress_ratios[il]

    def is_hash_layer(self, il: int) -> bool:
        return il < self.n_hash_layer

    def compressor_width(self, il: int) -> int:
        """Width of the attention compressor's kv/gate: CSA windows overlap, so they carry 2 rows."""
        r = self.ratio(il)
        return 0 if r == 0 else self.head_dim * (2 if r == CSA_RATIO else 1)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelConfig":
        arch = g.get("general.architecture")
        if arch is None:
            raise ModelFileError(g.path, "missing metadata 'general.architecture' (not a model GGUF?)")
        if arch != ARCH:
            raise ModelFileError(g.path, f"architecture is {arch!r}, not {ARCH!r}: this engine runs "
                                         f"DeepSeek V4 Flash only")
        vals = {}
        for attr, key, kind, default in _KEYS:
            vals[attr] = _read_key(g, P + key, kind, default)
        n = vals["n_layer"]
        for attr in ("compress_ratios", "swiglu_clamp"):
            arr = vals[attr]
            if len(arr) < n:
                raise ModelFileError(g.path, f"metadata '{P}{dict((a, k) for a, k, _, _ in _KEYS)[attr]}' has "
                                             f"{len(arr)} entries, needs one per layer ({n})")
            vals[attr] = tuple(arr[:n].tolist())
        cfg = cls(**vals)
        cfg._validate(g.path)
        return cfg

    def _validate(self, path):
        def bad(msg):
            raise ModelFileError(path, msg)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and f.name not in ("n_hash_layer", "expert_group_count",
                                                   "expert_group_used_count", "context_length") and v <= 0:
                bad(f"metadata '{P}{_KEY_OF[f.name]}' is {v}; it must be positive")
        if self.n_head_kv != 1:
            bad(f"attention.head_count_kv is {self.n_head_kv}; DeepSeek V4 has one shared K=V head")
        if self.value_dim != self.head_dim:
            bad(f"attention.value_length {self.value_dim} != key_length {self.head_dim}; K and V are one row")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            bad(f"rope.dimension_count {self.n_rot} must be even and at most key_length {self.head_dim}")
        if self.n_head % self.o_groups:
            bad(f"attention.head_count {self.n_head} is not a multiple of output_group_count {self.o_groups}")
        if self.n_expert_used > self.n_expert:
            bad(f"expert_used_count {self.n_expert_used} exceeds expert_count {self.n_expert}")
        if self.n_hash_layer > self.n_layer:
            bad(f"hash_layer_count {self.n_hash_layer} exceeds block_count {self.n_layer}")
        if self.expert_group_count or self.expert_group_used_count:
            bad("expert_group_count / expert_group_used_count must be 0: DeepSeek V4 Flash has no "
                "group-limited routing")
        for il, r in enumerate(self.compress_ratios):
            if r not in (0, CSA_RATIO, HCA_RATIO):
                bad(f"attention.compress_ratios[{il}] is {r}; DeepSeek V4 layers use 0, 4 or 128")
        if not self.expert_weights_norm:
            bad("expert_weights_norm is false; DeepSeek V4 renormalises the routing weights")
        self._check_ranges(bad)

    def _check_ranges(self, bad):
        """Each value within the range the forward pass can use. A value outside it would fail (or
        hang, or silently compute NaNs) far from the file that caused it: a RoPE base of 0 divides by
        zero, a negative one raises to a complex power, 2^31 Sinkhorn iterations never finish."""
        for attr, (lo, hi) in _COUNT_RANGE.items():
            v = getattr(self, attr)
            if not lo <= v <= hi:
                bad(f"metadata '{P}{_KEY_OF[attr]}' is {v}; it must be in {lo}..{hi:,}")
        for attr, (lo, hi, what) in _FLOAT_RANGE.items():
            v = getattr(self, attr)
            if not (math.isfinite(v) and lo <= v <= hi):
                bad(f"metadata '{P}{_KEY_OF[attr]}' is {v!r}; it must be {what}")
        if self.yarn_beta_fast < self.yarn_beta_slow:
            bad(f"metadata '{P}rope.scaling.yarn_beta_fast' ({self.yarn_beta_fast:g}) is below yarn_beta_slow "
                f"({self.yarn_beta_slow:g}); YaRN's fast bound is the larger one")
        for il, c in enumerate(self.swiglu_clamp):
            if not (math.isfinite(c) and c > 0):
                bad(f"metadata '{P}swiglu_clamp_exp'[{il}] is {c!r}; it must be a finite number above 0")

    def flash_differences(self) -> list[str]:
        """Where this config departs from the published DeepSeek V4 Flash shape (empty: it is Flash)."""
        out = []
        for k, want in FLASH.items():
            got = getattr(self, k)
            if isinstance(want, float):
                if abs(got - want) > max(1.0, abs(want)) * 1e-6:
                    out.append(f"{k}={got} (Flash: {want})")
            elif got != want:
                out.append(f"{k}={got} (Flash: {want})")
        if self.compress_ratios != flash_schedule(self.n_layer):
            out.append("compress_ratios differ from the Flash schedule 0,0,4,128,4,...")
        if any(abs(c - 10.0) > 1e-5 for c in self.swiglu_clamp):
            out.append("swiglu_clamp_exp is not 10 on every layer")
        return out


_KEY_OF = {attr: key for attr, key, _, _ in _KEYS}
# Sane bounds for counts the forward pass loops over or allocates by, which no tensor shape checks
# (the published file: 43 layers, window 128, top-k 512, 20 iterations, original context 65536).
_COUNT_RANGE = {
    "n_layer": (1, 1024), "sinkhorn_iters": (1, 256), "n_swa": (1, 1 << 20), "idx_topk": (1, 1 << 20),
    "rope_orig_ctx": (1, 1 << 24), "context_length": (0, 1 << 32),
}
_ABOVE_0, _ABOVE_1, _BELOW_1 = math.ulp(0.0), math.nextafter(1.0, math.inf), math.nextafter(1.0, 0.0)
_F32_MAX = float(np.finfo(np.float32).max)   # the forward pass computes with these in float32
# attribute -> (least, greatest, how the message says it)
_FLOAT_RANGE = {
    # base**(-2/n_rot), and log(base) divides in the YaRN ramp: a base <= 1 is a division by zero or
    # a complex power
    "rope_base": (_ABOVE_1, _F32_MAX, "a finite number above 1"),
    "compress_rope_base": (_ABOVE_1, _F32_MAX, "a finite number above 1"),
    "rope_scale_factor": (1.0, _F32_MAX, "a finite number of at least 1"),
    # log(orig_ctx / (2 pi beta)) in float32: outside this it overflows or takes log(0)
    "yarn_beta_fast": (1e-3, 1e4, "in 0.001..10000"),
    "yarn_beta_slow": (1e-3, 1e4, "in 0.001..10000"),
    "expert_weights_scale": (_ABOVE_0, _F32_MAX, "a finite number above 0"),
    "rms_eps": (_ABOVE_0, _BELOW_1, "a finite number in (0, 1)"),
    "hc_eps": (_ABOVE_0, _BELOW_1, "a finite number in (0, 1)"),
}


def _read_key(g: GGUFFile, key: str, kind: str, default):
    f = g.fields.get(key)
    if f is None:
        if default is not None:
            return default
        raise ModelFileError(g.path, f"missing metadata key '{key}'")
    if kind in _ACCEPT_ARRAY:
        ok, desc = _ACCEPT_ARRAY[kind]
        if f.type != T_ARRAY or f.elem_type not in ok:
            raise ModelFileError(g.path, f"metadata '{key}' is {f.type_name}, expected {desc}")
        return np.asarray(f.value)
    ok, desc = _ACCEPT[kind]
    if f.type not in ok:
        raise ModelFileError(g.path, f"metadata '{key}' is {f.type_name}, expected {desc}")
    if kind == "float":
        return float(f.value)
    return f.value if kind == "bool" else int(f.value)


def read_tokenizer_metadata(g: GGUFFile, n_vocab: int, *, check_merges: bool = True) -> dict:
    """Tokenizer arrays, checked for presence, type, length and consistency (the tokenizer itself is
    tokenizer.py): every merge joins two vocabulary strings into a third, the special-token ids
    lie inside the vocabulary. The BPE library would refuse a bad merge table only when the engine
    builds it, with a message that names neither the file nor the key.

    check_merges=False leaves the merge table to the caller, who must build the tokenizer before
    handing the file on: Engine.open does (Tokenizer.from_metadata), where the BPE library checks
    the same three things on its own and `check_merges` runs only to name a merge it refused
    (the table's check is a quarter of the work of reading it). "merges_checked" says which."""
    tokens = _string_array(g, "tokenizer.ggml.tokens")
    if len(tokens) != n_vocab:
        raise ModelFileError(g.path, f"tokenizer.ggml.tokens has {len(tokens)} entries, "
                                     f"vocab_size is {n_vocab}")
    merges = _string_array(g, "tokenizer.ggml.merges")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        f = g.fields.get(key)
        if f is not None and f.type != T_STRING:
            raise ModelFileError(g.path, f"metadata '{key}' is {f.type_name}, expected string")
    id_of = _check_vocab(g.path, tokens)
    if check_merges:
        check_merge_table(g.path, merges, set(tokens))
    for key in _TOKEN_ID_KEYS:
        f = g.fields.get(key)
        if f is None:
            continue
        if f.type not in _INT_TYPES:
            raise ModelFileError(g.path, f"metadata '{key}' is {f.type_name}, expected an integer")
        if not 0 <= f.value < n_vocab:
            raise ModelFileError(g.path, f"metadata '{key}' is {f.value}, outside the vocabulary (0..{n_vocab - 1})")
    types = g.fields.get("tokenizer.ggml.token_type")
    if types is not None:
        if types.type != T_ARRAY or types.elem_type not in _INT_TYPES:
            raise ModelFileError(g.path, f"metadata 'tokenizer.ggml.token_type' is {types.type_name}, "
                                         f"expected array of integers")
        if len(types.value) != n_vocab:
            raise ModelFileError(g.path, f"tokenizer.ggml.token_type has {len(types.value)} entries, "
                                         f"vocab_size is {n_vocab}")
    return {"tokens": tokens, "merges": merges, "path": g.path, "merges_checked": check_merges, "id_of": id_of,
            "token_type": None if types is None else types.value,
            "model": g.get("tokenizer.ggml.model"), "pre": g.get("tokenizer.ggml.pre")}


_TOKEN_ID_KEYS = tuple(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "padding", "unknown",
                                                                   "separator", "cls", "mask"))
_INT_TYPES = frozenset({T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_UINT64, T_INT64})


def _string_array(g: GGUFFile, key: str) -> list:
    f = g.fields.get(key)
    if f is None:
        raise ModelFileError(g.path, f"missing metadata key '{key}'")
    if f.type != T_ARRAY or f.elem_type != T_STRING:
        raise ModelFileError(g.path, f"metadata '{key}' is {f.type_name}, expected array of string")
    return f.value


def _check_vocab(path, tokens: list) -> dict:
    """{token: id}, every token once (the tokenizer's table, made here once for both)."""
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) != len(tokens):
        seen = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise ModelFileError(path, f"tokenizer.ggml.tokens holds {t!r} twice (ids {seen[t]} and {i})")
            seen[t] = i
    # the engine recognises these two by their text (spec/protocol.md §1.2)
    for marker in ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"):
        if marker not in vocab:
            raise ModelFileError(path, f"tokenizer.ggml.tokens lacks the marker {marker!r}")
    return vocab


def split_merges(merges: list) -> list | None:
    """[a0, b0, a1, b1, ...] of the merges "a0 b0", "a1 b1", ..., in a few C-level passes, or None
    when some merge is not exactly two non-empty pieces around one space (the callers then go
    merge by merge, which names the bad one). Every merge has a space past its first character,
    and the table's pieces number twice its merges: so each has exactly one space."""
    n = len(merges)
    if n == 0:
        return []
    flat = " ".join(merges).split(" ")
    if len(flat) != 2 * n or "" in flat or min(map(str.find, merges, repeat(" ", n))) < 1:
        return None
    return flat


def check_merge_table(path, merges: list, vocab: set) -> None:
    """Every merge "a b" joins two vocabulary strings a, b into a third, a + b; else a
    ModelFileError naming the file, the key and the first bad merge."""
    flat = split_merges(merges)
    # the whole table in C-level passes first (127,741 merges on every open of the real file);
    # the loop below runs only on a bad table, to name its first bad merge
    if flat is not None and vocab.issuperset(flat) and vocab.issuperset(map(str.__add__, flat[::2], flat[1::2])):
        return
    for i, m in enumerate(merges):
        parts = m.split(" ", 1)
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ModelFileError(path, f"tokenizer.ggml.merges[{i}] is {m!r}, not two tokens separated by a space")
        a, b = parts
        for piece in (a, b, a + b):
            if piece not in vocab:
                raise ModelFileError(path, f"tokenizer.ggml.merges[{i}] {m!r}: {piece!r} is not in the vocabulary")
