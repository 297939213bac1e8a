#!/usr/bin/env python3
"""Deterministic corruptions of a DeepSeek V4 GGUF, for checking that every loader fails cleanly.

Each variant is one planted problem with a label: truncations at offsets in every section, byte and
bit flips in every section, out-of-range and wrongly-typed values of every metadata key the engine
reads, tensor directory corruptions (overlapping, misaligned or out-of-file offsets, dims, dtypes
re-typed in place, names) and tokenizer corruptions (flipped or garbage merges, a shortened token
array, duplicated tokens, token types, bos/eos ids outside the vocabulary). The same seed gives
the same bytes.

Metadata and directory variants are re-serialised from the parsed file with the original tensor
data appended unchanged (tensor offsets are relative to the data section, so only the header is
rewritten): building one costs a copy of the file, not a GGUF writer pass.

    python scripts/gguf_corrupt.py SRC.gguf OUTDIR [--seed N] [--list]

writes OUTDIR/NNN.gguf for each variant and OUTDIR/labels.txt (`NNN.gguf<TAB>label`).
The tests import this file by path and use `variants()` / `build()` without writing the whole set.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import struct
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.gguf.gguf_file import (_SCALAR, T_ARRAY, T_BOOL, T_FLOAT32, T_FLOAT64, T_INT32, T_STRING,  # noqa: E402
                              T_UINT32, T_UINT64, GGUFFile)

P = "deepseek4."
F16, F32, Q8_0 = 1, 0, 8

# Every deepseek4.* key ModelConfig reads, with the kind of value it holds.
COUNT_KEYS = [
    "block_count", "embedding_length", "vocab_size", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "rope.dimension_count", "attention.q_lora_rank",
    "attention.output_lora_rank", "attention.output_group_count", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_count", "hash_layer_count", "attention.sliding_window",
    "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k",
    "hyper_connection.count", "hyper_connection.sinkhorn_iterations",
    "rope.scaling.original_context_length", "context_length",
]
FLOAT_KEYS = [
    "rope.freq_base", "rope.scaling.factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "attention.compress_rope_freq_base", "expert_weights_scale", "attention.layer_norm_rms_epsilon",
    "hyper_connection.epsilon",
]
ARRAY_KEYS = ["attention.compress_ratios", "swiglu_clamp_exp"]


@dataclass
class Parsed:
    """A GGUF as editable parts: ordered fields, tensor directory entries, the data section bytes."""
    version: int
    fields: list            # [key, type, value, elem_type]
    tensors: list           # [name, dims (ggml order), type_id, relative offset]
    alignment: int
    data: bytes             # everything from the old data offset to the end of the file

    def copy(self) -> "Parsed":
        return Parsed(self.version, [list(f) for f in self.fields], [list(t) for t in self.tensors],
                      self.alignment, self.data)

    def field(self, key):
        for f in self.fields:
            if f[0] == key:
                return f
        raise KeyError(key)

    def tensor(self, name):
        for t in self.tensors:
            if t[0] == name:
                return t
        raise KeyError(name)


def parse(src) -> Parsed:
    g = GGUFFile(src)
    try:
        fields = [[k, f.type, f.value, f.elem_type] for k, f in g.fields.items()]
        tensors = [[t.name, t.dims, t.type_id, t.offset - g.data_offset] for t in g.tensors.values()]
        with open(src, "rb") as fh:
            fh.seek(g.data_offset)
            data = fh.read()
        return Parsed(g.version, fields, tensors, g.alignment, data)
    finally:
        g.close()


def _str(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _value(vtype, value, elem_type=None) -> bytes:
    if vtype in _SCALAR:
        return struct.pack(_SCALAR[vtype][0], value)
    if vtype == T_STRING:
        return _str(value)
    if vtype == T_ARRAY:
        out = [struct.pack("<IQ", elem_type, len(value))]
        if elem_type == T_STRING:
            out += [_str(s) for s in value]
        else:
            out.append(np.asarray(value).astype(_SCALAR[elem_type][1]).tobytes())
        return b"".join(out)
    raise ValueError(f"cannot encode type {vtype}")


def serialise(p: Parsed) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", p.version, len(p.tensors), len(p.fields))]
    for key, vtype, value, elem_type in p.fields:
        out += [_str(key), struct.pack("<I", vtype), _value(vtype, value, elem_type)]
    for name, dims, type_id, offset in p.tensors:
        out += [_str(name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims),
                struct.pack("<IQ", type_id, offset)]
    head = b"".join(out)
    head += b"\0" * (-len(head) % p.alignment)
    return head + p.data


def _section_bounds(src) -> dict:
    """Byte ranges of the header, metadata, tensor directory and data in the source file."""
    g = GGUFFile(src)
    try:
        size = g.size
        data_offset = g.data_offset
    finally:
        g.close()
    p = parse(src)
    kv_end = 24 + sum(len(_str(k)) + 4 + len(_value(t, v, e)) for k, t, v, e in p.fields)
    return {"header": (0, 24), "metadata": (24, kv_end), "tensor infos": (kv_end, data_offset),
            "data": (data_offset, size)}


# -- the variants ------------------------------------------------------------------------------
Edit = Callable[[Parsed], None]


def _set(key, vtype, value, elem_type=None) -> Edit:
    def edit(p):
        try:
            f = p.field(key)
            f[1:] = [vtype, value, elem_type]
        except KeyError:
            p.fields.append([key, vtype, value, elem_type])
    return edit


def _metadata_edits() -> list[tuple[str, Edit]]:
    out = []
    for k in COUNT_KEYS:
        key = P + k
        for label, vt, v in (("0", T_UINT32, 0), ("2^31-1", T_UINT32, 2**31 - 1), ("2^32-1", T_UINT32, 2**32 - 1),
                             ("f32 1.5", T_FLOAT32, 1.5), ("string", T_STRING, "12")):
            out.append((f"{key} = {label}", _set(key, vt, v)))
    for k in FLOAT_KEYS:
        key = P + k
        for label, vt, v in (("0", T_FLOAT32, 0.0), ("-1", T_FLOAT32, -1.0), ("NaN", T_FLOAT32, math.nan),
                             ("inf", T_FLOAT32, math.inf), ("1e38", T_FLOAT32, 1e38), ("1e-38", T_FLOAT32, 1e-38),
                             ("f64 1e300", T_FLOAT64, 1e300), ("i32 -1", T_INT32, -1), ("string", T_STRING, "1.0")):
            out.append((f"{key} = {label}", _set(key, vt, v)))
    for k in ARRAY_KEYS:
        key = P + k

        def shorten(p, key=key):
            f = p.field(key)
            f[2] = list(f[2])[:-1]

        def entry(value, key=key, et=None):
            def edit(p):
                f = p.field(key)
                arr = list(f[2])
                arr[len(arr) // 2] = value
                f[2] = arr
                if et is not None:
                    f[3] = et
            return edit
        out += [(f"{key} one entry short", shorten),
                (f"{key} of strings", _set(key, T_ARRAY, ["4"] * 6, T_STRING)),
                (f"{key} as a scalar", _set(key, T_UINT32, 4)),
                (f"{key} empty", _set(key, T_ARRAY, [], T_INT32 if "ratios" in k else T_FLOAT32))]
        if "ratios" in k:
            out += [(f"{key} entry -1", entry(-1, et=T_INT32)), (f"{key} entry 2^31-1", entry(2**31 - 1, et=T_INT32))]
        else:
            out += [(f"{key} entry {lab}", entry(v)) for lab, v in
                    (("NaN", math.nan), ("-inf", -math.inf), ("0", 0.0), ("-10", -10.0), ("1e38", 1e38))]
    out += [(P + "expert_weights_norm = false", _set(P + "expert_weights_norm", T_BOOL, False)),
            (P + "expert_weights_norm as u32", _set(P + "expert_weights_norm", T_UINT32, 1)),
            ("general.architecture as u32", _set("general.architecture", T_UINT32, 4)),
            ("general.alignment = 0", _set("general.alignment", T_UINT32, 0)),
            ("general.alignment = 3", _set("general.alignment", T_UINT32, 3)),
            ("general.alignment = 2^31", _set("general.alignment", T_UINT32, 2**31)),
            ("general.alignment as u64", _set("general.alignment", T_UINT64, 32))]
    return out


def _tokenizer_edits() -> list[tuple[str, Edit]]:
    TOK, MER = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"

    def merges(fn):
        def edit(p):
            f = p.field(MER)
            f[2] = fn(list(f[2]))
        return edit

    def tokens(fn):
        def edit(p):
            f = p.field(TOK)
            f[2] = fn(list(f[2]))
        return edit

    def swap_first(ms):
        a, b = ms[0].split(" ", 1)
        return [f"{b} {a}"] + ms[1:]

    def at(i, v):
        def fn(xs):
            xs[i % len(xs)] = v
            return xs
        return fn

    def dup(xs):
        xs[300] = xs[301]
        return xs

    def remove_marker(xs):
        return [("<x>" if s == "<｜begin▁of▁sentence｜>" else s) for s in xs]

    def unjoinable(p):
        toks = p.field(TOK)[2]
        vocab = set(toks)
        a, b = next((a, b) for a in toks[200:] for b in toks[200:] if a + b not in vocab)
        merges(at(13, f"{a} {b}"))(p)

    def type_len(p):
        f = p.field("tokenizer.ggml.token_type")
        f[2] = list(f[2])[:-3]

    out = [
        ("merges: every pair flipped", merges(lambda ms: [" ".join(reversed(m.split(" ", 1))) for m in ms])),
        ("merges: first pair flipped", merges(swap_first)),
        ("merges: garbage pair 'Oy zz'", merges(at(5, "Oy zz"))),
        ("merges: pair without a space", merges(at(7, "abc"))),
        ("merges: empty string", merges(at(9, ""))),
        ("merges: three parts", merges(at(11, "a b c"))),
        ("merges: pieces in vocab, joined token not", unjoinable),
        ("merges: duplicated pair", merges(lambda ms: ms + ms[:3])),
        ("merges: empty array", merges(lambda ms: [])),
        ("merges: array of u32", _set(MER, T_ARRAY, [1, 2, 3], T_UINT32)),
        ("merges: a string", _set(MER, T_STRING, "a b")),
        ("tokens: last one dropped", tokens(lambda xs: xs[:-1])),
        ("tokens: one extra", tokens(lambda xs: xs + ["zzextra"])),
        ("tokens: duplicate entry", tokens(dup)),
        ("tokens: BOS marker renamed", tokens(remove_marker)),
        ("tokens: empty string token", tokens(at(400, ""))),
        ("tokens: array of i32", _set(TOK, T_ARRAY, list(range(10)), T_INT32)),
        ("token_type: three short", type_len),
        ("token_type: array of strings", _set("tokenizer.ggml.token_type", T_ARRAY, ["1"] * 4, T_STRING)),
        ("token_type: as a string", _set("tokenizer.ggml.token_type", T_STRING, "1")),
        ("tokenizer.ggml.model as u32", _set("tokenizer.ggml.model", T_UINT32, 1)),
        ("tokenizer.ggml.pre as u32", _set("tokenizer.ggml.pre", T_UINT32, 1)),
    ]
    for k in ("bos_token_id", "eos_token_id", "padding_token_id"):
        key = "tokenizer.ggml." + k
        out += [(f"{key} = vocab size", lambda p, key=key: _set(key, T_UINT32, len(p.field(TOK)[2]))(p)),
                (f"{key} = 2^32-1", _set(key, T_UINT32, 2**32 - 1)),
                (f"{key} = i32 -1", _set(key, T_INT32, -1)),
                (f"{key} as a string", _set(key, T_STRING, "0"))]
    return out


def _tensor_edits() -> list[tuple[str, Edit]]:
    def on(name, fn):
        def edit(p):
            fn(p, p.tensor(name))
        return edit

    def overlap(p, t):
        i = p.tensors.index(t)
        t[3] = p.tensors[i - 1][3]

    def past_end(p, t):
        t[3] = len(p.data) + p.alignment * 4

    def retype(ty):
        def fn(p, t):
            t[2] = ty
        return fn

    def dims(new):
        def fn(p, t):
            t[1] = tuple(new(list(t[1])))
        return fn

    def rename(new):
        def fn(p, t):
            t[0] = new
        return fn

    def swap_offsets(p, t):
        i = p.tensors.index(t)
        t[3], p.tensors[i + 1][3] = p.tensors[i + 1][3], t[3]

    def hash_entry(value):
        def edit(p):
            t = p.tensor("blk.1.ffn_gate_tid2eid.weight")
            d = bytearray(p.data)
            struct.pack_into("<i", d, t[3] + 4 * 7, value)
            p.data = bytes(d)
        return edit

    emb, norm, q_b, kv = "token_embd.weight", "blk.1.attn_norm.weight", "blk.2.attn_q_b.weight", "blk.3.attn_kv.weight"
    hcfn, out_w = "blk.0.hc_attn_fn.weight", "output.weight"
    return [
        ("tensor: offset of the one before (overlap)", on(q_b, overlap)),
        ("tensor: last tensor's offset overlaps", lambda p: overlap(p, p.tensors[-1])),
        ("tensor: offsets of two neighbours swapped", on(norm, swap_offsets)),
        ("tensor: offset past the end", on(kv, past_end)),
        ("tensor: offset misaligned", on(kv, lambda p, t: t.__setitem__(3, t[3] + 1))),
        ("tensor: offset 2^63", on(kv, lambda p, t: t.__setitem__(3, 2**63))),
        ("tensor: F16 embedding re-typed F32", on(emb, retype(F32))),
        ("tensor: F16 embedding re-typed Q8_0", on(emb, retype(Q8_0))),
        ("tensor: F16 HC fn re-typed F32", on(hcfn, retype(F32))),
        ("tensor: F16 HC fn re-typed Q8_0", on(hcfn, retype(Q8_0))),
        ("tensor: F32 norm re-typed F16", on(norm, retype(F16))),
        ("tensor: Q8_0 output re-typed F16", on(out_w, retype(F16))),
        ("tensor: Q8_0 output re-typed Q4_K", on(out_w, retype(12))),
        ("tensor: Q8_0 matrix re-typed Q2_K", on(q_b, retype(10))),
        ("tensor: unknown type 99", on(q_b, retype(99))),
        ("tensor: dims doubled", on(q_b, dims(lambda d: [d[0], d[1] * 2]))),
        ("tensor: dims halved", on(q_b, dims(lambda d: [d[0], d[1] // 2]))),
        ("tensor: a dim of 0", on(q_b, dims(lambda d: [d[0], 0]))),
        ("tensor: a dim of 2^40", on(q_b, dims(lambda d: [d[0], 2**40]))),
        ("tensor: dims transposed", on(q_b, dims(lambda d: d[::-1]))),
        ("tensor: extra dim of 1", on(q_b, dims(lambda d: d + [1]))),
        ("tensor: five dims", on(norm, dims(lambda d: d + [1, 1, 1, 1]))),
        ("tensor: renamed to an unknown name", on(kv, rename("blk.3.attn_kvv.weight"))),
        ("tensor: duplicate name", on(kv, rename("blk.3.attn_q_b.weight"))),
        ("tensor: name not UTF-8", on(kv, rename(b"blk.3.\xff\xfe"))),
        ("hash table: expert id 2^31-1", hash_entry(2**31 - 1)),
        ("hash table: expert id -1", hash_entry(-1)),
    ]


def _structure_edits() -> list[tuple[str, Edit]]:
    def drop_field(key):
        def edit(p):
            p.fields.remove(p.field(key))
        return edit

    def dup_field(key):
        def edit(p):
            p.fields.append(list(p.field(key)))
        return edit

    return [("metadata: duplicate key", dup_field(P + "block_count")),
            ("metadata: general.architecture removed", drop_field("general.architecture")),
            ("metadata: tokenizer.ggml.merges removed", drop_field("tokenizer.ggml.merges")),
            ("header: version 2", lambda p: setattr(p, "version", 2)),
            ("tensor directory: last tensor dropped", lambda p: p.tensors.pop())]


def _byte_variants(raw: bytes, bounds: dict, seed: int) -> list[tuple[str, Callable[[], bytes]]]:
    rng = random.Random(seed)
    out = []
    cuts = [1, 4, 7, 12, 20, 23]
    for sec in ("metadata", "tensor infos", "data"):
        lo, hi = bounds[sec]
        n = {"metadata": 10, "tensor infos": 6, "data": 6}[sec]
        cuts += sorted({lo + (hi - lo) * i // n for i in range(n)} | {hi - 1})
    for c in sorted(set(cuts)):
        sec = next(s for s, (lo, hi) in bounds.items() if lo <= c < hi)
        out.append((f"truncated at byte {c} ({sec})", lambda c=c: raw[:c]))
    for sec, (lo, hi) in bounds.items():
        n = {"header": 6, "metadata": 12, "tensor infos": 8, "data": 6}[sec]
        # distinct positions (the magic is left alone: a foreign magic is one variant, not six)
        for i, pos in enumerate(rng.sample(range(lo + (4 if sec == "header" else 0), hi), n)):
            if i % 2:
                bit = rng.randrange(8)
                label, delta = f"bit {bit} flipped at byte {pos} ({sec})", 1 << bit
            else:
                label, delta = f"byte flipped at {pos} ({sec})", 0xFF

            def build(pos=pos, delta=delta):
                d = bytearray(raw)
                d[pos] ^= delta
                return bytes(d)
            out.append((label, build))
    return out


def variants(src, seed: int = 0) -> list[tuple[str, Callable[[], bytes]]]:
    """(label, build) for every variant; build() returns the corrupted file's bytes."""
    base = parse(src)
    raw = open(src, "rb").read()
    out = _byte_variants(raw, _section_bounds(src), seed)
    for label, edit in (_metadata_edits() + _tokenizer_edits() + _tensor_edits() + _structure_edits()):
        def build(edit=edit):
            p = base.copy()
            edit(p)
            return serialise(p)
        out.append((label, build))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print the labels only")
    a = ap.parse_args(argv)
    vs = variants(a.src, a.seed)
    if a.list or not a.outdir:
        for i, (label, _) in enumerate(vs):
            print(f"{i:03d}\t{label}")
        return 0
    os.makedirs(a.outdir, exist_ok=True)
    with open(os.path.join(a.outdir, "labels.txt"), "w", encoding="utf-8") as lf:
        for i, (label, build) in enumerate(vs):
            name = f"{i:03d}.gguf"
            with open(os.path.join(a.outdir, name), "wb") as f:
                f.write(build())
            lf.write(f"{name}\t{label}\n")
    print(f"wrote {len(vs)} variants to {a.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def mtp_variants(src, seed: int = 0) -> list[tuple[str, Callable[[], bytes]]]:
    """(label, build) for an MTP file (engine/gguf/mtp_file.py; issue 37): the byte-level
    truncations and flips, and edits of its tensor directory (types, shapes, names, offsets)."""
    base = parse(src)
    raw = open(src, "rb").read()
    out = [(f"mtp {label}", build) for label, build in _byte_variants(raw, _section_bounds(src), seed)]

    def on(name, fn):
        def edit(p):
            fn(p.tensor(name), p)
        return edit

    def set_item(i, value):
        return lambda t, p: t.__setitem__(i, value(t, p))

    e, n, g = "mtp.0.e_proj.weight", "mtp.0.enorm.weight", "mtp.0.ffn_gate_exps.weight"
    edits = [
        ("mtp tensor: Q8_0 e_proj re-typed F16", on(e, set_item(2, lambda t, p: F16))),
        ("mtp tensor: F32 enorm re-typed F16", on(n, set_item(2, lambda t, p: F16))),
        ("mtp tensor: routed gate re-typed Q2_K (up stays)", on(g, set_item(2, lambda t, p: 10))),
        ("mtp tensor: e_proj dims doubled", on(e, set_item(1, lambda t, p: (t[1][0], t[1][1] * 2)))),
        ("mtp tensor: e_proj a dim of 2^40", on(e, set_item(1, lambda t, p: (t[1][0], 2**40)))),
        ("mtp tensor: e_proj offset past the end", on(e, set_item(3, lambda t, p: len(p.data) + p.alignment * 4))),
        ("mtp tensor: e_proj renamed", on(e, set_item(0, lambda t, p: "mtp.0.e_projj.weight"))),
        ("mtp tensor: every name without its mtp.0. prefix",
         lambda p: [t.__setitem__(0, t[0][len("mtp.0."):]) for t in p.tensors]),
        ("mtp tensor directory: last tensor dropped", lambda p: p.tensors.pop()),
    ]
    for label, edit in edits:
        def build(edit=edit):
            p = base.copy()
            edit(p)
            return serialise(p)
        out.append((label, build))
    return out
