"""Binding the GGUF tensors of a DeepSeek V4 file to the forward pass, layer by layer.

Matrices stay QTensors (views of the map, decoded in row chunks when used). Only tiny vectors
(norm weights, HC scales and bases, sinks, biases, compressor position biases) are decoded to
float32 up front: together they are a few MiB even for the real model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..gguf import quants as Q
from ..gguf.config import CSA_RATIO
from ..errors import ModelFileError
from ..gguf.model_file import ModelFile, QTensor


def _hash_table(m: ModelFile, name: str, n_expert: int) -> np.ndarray:
    """The token -> experts table, checked: ids in range and distinct per token (a bad table would
    otherwise fail or silently mis-route in the middle of a forward pass)."""
    ids = m.tensor(name).int32()
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ModelFileError(m.path, f"tensor '{name}' holds expert ids outside 0..{n_expert - 1}")
    k = ids.shape[1]
    if k <= 8:
        # each pair of columns compared once (15 for the 6 experts a token uses), on the columns
        # made contiguous: 2 ms a real table (129,280 tokens), where sorting every row took 9
        cols = np.ascontiguousarray(ids.T)
        twice = np.zeros(ids.shape[0], bool)
        for i in range(k):
            for j in range(i + 1, k):
                twice |= cols[i] == cols[j]
    else:                       # (k^2 / 2 passes would cost more than the sort)
        srt = np.sort(ids, axis=1)
        twice = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
    if twice.any():
        row = int(np.flatnonzero(twice)[0])
        raise ModelFileError(m.path, f"tensor '{name}' routes token {row} to the same expert twice")
    return ids


def check_hash_tables(m: ModelFile) -> None:
    """What bind checks of the hash tables, for `ds4-gguf inspect`, which binds nothing."""
    for il in range(m.config.n_hash_layer):
        _hash_table(m, f"blk.{il}.ffn_gate_tid2eid.weight", m.config.n_expert)


def _vec(t: QTensor) -> np.ndarray:
    return Q.dequantize(t.type_id, t.data.reshape(-1)).astype(np.float32, copy=False)


@dataclass
class HCWeights:
    fn: QTensor           # [hc_mix, n_hc * n_embd]
    scale: np.ndarray     # [3]   (pre, post, comb)
    base: np.ndarray      # [hc_mix]


@dataclass
class CompressorWeights:
    ratio: int
    hd: int               # output row width
    kv: QTensor           # [w, n_embd], w = hd * (2 if overlapping else 1)
    gate: QTensor
    ape: np.ndarray       # [ratio, w] position bias of each slot of the window
    norm: np.ndarray      # [hd]


@dataclass
class IndexerWeights:
    q_b: QTensor          # [idx_heads * idx_dim, q_rank]
    proj: QTensor         # [idx_heads, n_embd]
    comp: CompressorWeights


@dataclass
class LayerWeights:
    il: int
    ratio: int
    hc_attn: HCWeights
    hc_ffn: HCWeights
    attn_norm: np.ndarray
    q_a: QTensor
    q_a_norm: np.ndarray
    q_b: QTensor
    kv: QTensor
    kv_norm: np.ndarray
    sinks: np.ndarray
    out_a: QTensor
    out_b: QTensor
    comp: CompressorWeights | None
    indexer: IndexerWeights | None
    ffn_norm: np.ndarray
    gate_inp: QTensor
    bias: np.ndarray | None       # selection bias (non-hash layers)
    tid2eid: np.ndarray | None    # [vocab, n_used] expert ids (hash layers)
    gate_exps: QTensor
    up_exps: QTensor
    down_exps: QTensor
    sh_gate: QTensor
    sh_up: QTensor
    sh_down: QTensor


@dataclass
class ModelWeights:
    embd: QTensor
    layers: list
    hc_head_fn: QTensor
    hc_head_scale: np.ndarray
    hc_head_base: np.ndarray
    out_norm: np.ndarray
    output: QTensor


def bind(m: ModelFile) -> ModelWeights:
    c = m.config
    t = m.tensor

    def hc(p, sub):
        return HCWeights(t(f"{p}hc_{sub}_fn.weight"), _vec(t(f"{p}hc_{sub}_scale.weight")),
                         _vec(t(f"{p}hc_{sub}_base.weight")))

    def compressor(p, prefix, ratio, hd):
        ape = t(f"{p}{prefix}_ape.weight")
        return CompressorWeights(ratio, hd, t(f"{p}{prefix}_kv.weight"), t(f"{p}{prefix}_gate.weight"),
                                 ape.rows(0, ape.n_rows), _vec(t(f"{p}{prefix}_norm.weight")))

    # a split run's rank binds only its part (ModelFile.keep, engine/model/layer_split.py): the
    # other layers, and the embedding or head it does not hold, stay None (nothing uploaded)
    keep = getattr(m, "keep", None)
    layers = []
    for il in range(c.n_layer):
        if keep is not None and not keep.has(il):
            layers.append(None)
            continue
        p = f"blk.{il}."
        r = c.ratio(il)
        comp = compressor(p, "attn_compressor", r, c.head_dim) if r else None
        idx = None
        if r == CSA_RATIO:
            idx = IndexerWeights(t(p + "indexer.attn_q_b.weight"), t(p + "indexer.proj.weight"),
                                 compressor(p, "indexer_compressor", r, c.idx_head_dim))
        bias = _vec(t(p + "exp_probs_b.bias")) if m.has(p + "exp_probs_b.bias") else None
        tid2eid = _hash_table(m, p + "ffn_gate_tid2eid.weight", c.n_expert) if c.is_hash_layer(il) else None
        layers.append(LayerWeights(
            il=il, ratio=r, hc_attn=hc(p, "attn"), hc_ffn=hc(p, "ffn"),
            attn_norm=_vec(t(p + "attn_norm.weight")), q_a=t(p + "attn_q_a.weight"),
            q_a_norm=_vec(t(p + "attn_q_a_norm.weight")), q_b=t(p + "attn_q_b.weight"),
            kv=t(p + "attn_kv.weight"), kv_norm=_vec(t(p + "attn_kv_a_norm.weight")),
            sinks=_vec(t(p + "attn_sinks.weight")), out_a=t(p + "attn_output_a.weight"),
            out_b=t(p + "attn_output_b.weight"), comp=comp, indexer=idx,
            ffn_norm=_vec(t(p + "ffn_norm.weight")), gate_inp=t(p + "ffn_gate_inp.weight"),
            bias=bias, tid2eid=tid2eid, gate_exps=t(p + "ffn_gate_exps.weight"),
            up_exps=t(p + "ffn_up_exps.weight"), down_exps=t(p + "ffn_down_exps.weight"),
            sh_gate=t(p + "ffn_gate_shexp.weight"), sh_up=t(p + "ffn_up_shexp.weight"),
            sh_down=t(p + "ffn_down_shexp.weight")))
    embed, head = keep is None or keep.embed, keep is None or keep.head
    return ModelWeights(
        embd=t("token_embd.weight") if embed else None, layers=layers,
        hc_head_fn=t("output_hc_fn.weight") if head else None,
        hc_head_scale=_vec(t("output_hc_scale.weight")) if head else None,
        hc_head_base=_vec(t("output_hc_base.weight")) if head else None,
        out_norm=_vec(t("output_norm.weight")) if head else None, output=t("output.weight") if head else None)


_EXPERT_FIELDS = frozenset({"gate_exps", "up_exps", "down_exps"})


def dense_arrays(obj) -> list[np.ndarray]:
    """The map views of every matrix of a layer (or any weights dataclass) except the routed
    experts: what a decode step reads whatever it routes to (paging hints)."""
    out = []
    if obj is None:             # a layer another rank holds (a split run)
        return out
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name in _EXPERT_FIELDS:
            continue
        if isinstance(v, QTensor):
            out.append(v.data)
        elif dataclasses.is_dataclass(v):
            out += dense_arrays(v)
    return out


def map_weights(obj, leaf):
    """A copy of a weights dataclass (ModelWeights, a layer's) with every QTensor and NumPy array
    in it, in nested dataclasses and lists too, replaced by leaf(field name, value) (a list's
    items under the list's name); every other value kept. The backends' binders convert with it
    (cupy's uploads, mlx's repacks)."""
    def conv(name, v):
        if isinstance(v, (QTensor, np.ndarray)):
            return leaf(name, v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return walk(v)
        if isinstance(v, list):
            return [conv(name, x) for x in v]
        return v

    def walk(o):
        return dataclasses.replace(o, **{f.name: conv(f.name, getattr(o, f.name)) for f in dataclasses.fields(o)})
    return walk(obj)
