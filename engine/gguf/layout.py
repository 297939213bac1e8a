"""The tensor inventory a DeepSeek V4 config implies, and the check of a file against it.

Names, ggml dimension order (dims[0] = input width) and dtype families follow what ds4 binds
(spec/model.md §2.3-2.4, ds4-oracle/README.md). Each tensor is tagged with the component it belongs
to, which `ds4-gguf inspect` uses for its totals and its bytes-read-per-token estimate.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from . import quants as Q
from .config import CSA_RATIO, ModelConfig
from ..errors import ModelFileError
from .gguf_file import GGUFFile, TensorInfo

# dtype families. Vectors (norms, biases, HC bases) are float; matrices may be float or any block
# format we can decode; the hash table is int32.
FLOAT = frozenset({Q.F32, Q.F16, Q.BF16})
QUANT = frozenset({Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4})
MATRIX = FLOAT | QUANT
INDEX = frozenset({Q.I32})
_FAMILY_NAMES = {FLOAT: "float (F32/F16/BF16)", MATRIX: "float or Q8_0/Q2_K/Q4_K/IQ2_XXS/MXFP4",
                 INDEX: "I32"}

# Components (for inspect totals and per-token traffic).
EMBED, OUTPUT, HC, NORM, ATTN, COMPRESSOR, INDEXER, ROUTER, SHARED, ROUTED, HASH = (
    "embedding", "output head", "hyper-connections", "norms+sinks", "attention", "compressor",
    "indexer", "router", "shared expert", "routed experts", "hash table")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[int, ...]
    family: frozenset
    component: str
    layer: int = -1          # -1 for global tensors
    required: bool = True


# what a block tensor is, for the type families a file allows it (block_tensors' callers map them:
# the main file any float or block format, ds4's MTP file its own types)
PROJ, VEC, HC_FN, ROUTER_W, EXPS, SHEXP, TABLE = "proj", "vec", "hc_fn", "router", "exps", "shexp", "table"
MAIN_FAMILIES = {PROJ: MATRIX, VEC: FLOAT, HC_FN: FLOAT, ROUTER_W: FLOAT, EXPS: MATRIX, SHEXP: MATRIX,
                 TABLE: INDEX}


def block_tensors(c: ModelConfig, ratio: int, hash_layer: bool) -> list[tuple]:
    """One V4 decoder block's tensors in the order ds4's quantizer writes them: (name suffix, dims,
    kind, component, required). The main file's layers and the MTP file's block are both this."""
    e, ff_sh = c.n_embd, c.n_ff_exp * c.n_expert_shared
    out = []

    def t(suffix, dims, kind, comp, required=True):
        out.append((suffix, tuple(dims), kind, comp, required))

    def hc(sub):
        t(f"hc_{sub}_fn.weight", (c.hc_dim, c.hc_mix), HC_FN, HC)
        t(f"hc_{sub}_scale.weight", (3,), VEC, HC)
        t(f"hc_{sub}_base.weight", (c.hc_mix,), VEC, HC)

    hc("attn")
    t("attn_norm.weight", (e,), VEC, NORM)
    t("attn_q_a.weight", (e, c.q_lora_rank), PROJ, ATTN)
    t("attn_q_a_norm.weight", (c.q_lora_rank,), VEC, NORM)
    t("attn_q_b.weight", (c.q_lora_rank, c.q_dim), PROJ, ATTN)
    t("attn_kv.weight", (e, c.head_dim), PROJ, ATTN)
    t("attn_kv_a_norm.weight", (c.head_dim,), VEC, NORM)
    t("attn_sinks.weight", (c.n_head,), VEC, NORM)
    t("attn_output_a.weight", (c.o_group_in, c.o_groups * c.o_lora_rank), PROJ, ATTN)
    t("attn_output_b.weight", (c.o_groups * c.o_lora_rank, e), PROJ, ATTN)
    if ratio:
        w = c.head_dim * (2 if ratio == CSA_RATIO else 1)     # (config.compressor_width)
        t("attn_compressor_ape.weight", (w, ratio), VEC, COMPRESSOR)
        t("attn_compressor_kv.weight", (e, w), VEC, COMPRESSOR)
        t("attn_compressor_gate.weight", (e, w), VEC, COMPRESSOR)
        t("attn_compressor_norm.weight", (c.head_dim,), VEC, COMPRESSOR)
    if ratio == CSA_RATIO:
        iw = 2 * c.idx_head_dim  # the indexer's own compressor overlaps like CSA
        t("indexer.attn_q_b.weight", (c.q_lora_rank, c.idx_n_head * c.idx_head_dim), VEC, INDEXER)
        t("indexer.proj.weight", (e, c.idx_n_head), VEC, INDEXER)
        t("indexer_compressor_ape.weight", (iw, ratio), VEC, INDEXER)
        t("indexer_compressor_kv.weight", (e, iw), VEC, INDEXER)
        t("indexer_compressor_gate.weight", (e, iw), VEC, INDEXER)
        t("indexer_compressor_norm.weight", (c.idx_head_dim,), VEC, INDEXER)
    hc("ffn")
    t("ffn_norm.weight", (e,), VEC, NORM)
    t("ffn_gate_inp.weight", (e, c.n_expert), ROUTER_W, ROUTER)
    if hash_layer:
        t("ffn_gate_tid2eid.weight", (c.n_expert_used, c.n_vocab), TABLE, HASH)
    # ds4 binds the selection bias optionally; a file without it routes with zero bias.
    t("exp_probs_b.bias", (c.n_expert,), VEC, ROUTER, False)
    t("ffn_gate_exps.weight", (e, c.n_ff_exp, c.n_expert), EXPS, ROUTED)
    t("ffn_up_exps.weight", (e, c.n_ff_exp, c.n_expert), EXPS, ROUTED)
    t("ffn_down_exps.weight", (c.n_ff_exp, e, c.n_expert), EXPS, ROUTED)
    t("ffn_gate_shexp.weight", (e, ff_sh), SHEXP, SHARED)
    t("ffn_up_shexp.weight", (e, ff_sh), SHEXP, SHARED)
    t("ffn_down_shexp.weight", (ff_sh, e), SHEXP, SHARED)
    return out


def expected_tensors(c: ModelConfig) -> list[TensorSpec]:
    e, v = c.n_embd, c.n_vocab
    # Order = the order ds4's quantizer writes (ds4-oracle): embedding, layers, output head.
    out = [TensorSpec("token_embd.weight", (e, v), MATRIX, EMBED)]
    for il in range(c.n_layer):
        out += [TensorSpec(f"blk.{il}.{suffix}", dims, MAIN_FAMILIES[kind], comp, il, req)
                for suffix, dims, kind, comp, req in block_tensors(c, c.ratio(il), c.is_hash_layer(il))]
    out += [
        TensorSpec("output_hc_base.weight", (c.n_hc,), FLOAT, OUTPUT),
        TensorSpec("output_hc_fn.weight", (c.hc_dim, c.n_hc), FLOAT, OUTPUT),
        TensorSpec("output_hc_scale.weight", (1,), FLOAT, OUTPUT),
        TensorSpec("output_norm.weight", (e,), FLOAT, OUTPUT),
        TensorSpec("output.weight", (e, v), MATRIX, OUTPUT),
    ]
    return out


_KNOWN_EXTRA = re.compile(r"^(mtp\.|nextn\.|blk\.\d+\.nextn\.)")


@dataclass
class LayoutReport:
    specs: dict[str, TensorSpec]       # every expected tensor, by name
    present: dict[str, TensorInfo]     # expected tensors found in the file
    problems: list[str]                # anything that makes the file unusable
    extra: list[str]                   # tensors the layout does not know (ignored)


def check_layout(g: GGUFFile, c: ModelConfig) -> LayoutReport:
    specs = {s.name: s for s in expected_tensors(c)}
    problems, present = [], {}
    for name, s in specs.items():
        ti = g.tensors.get(name)
        if ti is None:
            if s.required:
                problems.append(f"missing tensor '{name}'")
            continue
        present[name] = ti
        if ti.dims != s.dims:
            problems.append(f"tensor '{name}' has shape {list(ti.dims)}, expected {list(s.dims)} "
                            f"(from the metadata)")
        elif ti.type_id not in s.family:
            problems.append(f"tensor '{name}' has type {ti.type_name}, expected {_FAMILY_NAMES[s.family]}")
    for il in range(c.n_layer):
        gate, up = g.tensors.get(f"blk.{il}.ffn_gate_exps.weight"), g.tensors.get(f"blk.{il}.ffn_up_exps.weight")
        if gate and up and gate.type_id != up.type_id:
            problems.append(f"blk.{il}: routed gate ({gate.type_name}) and up ({up.type_name}) types differ")
    extra = sorted(n for n in g.tensors if n not in specs)
    return LayoutReport(specs, present, problems, extra)


def raise_on_problems(path, report: LayoutReport):
    if report.problems:
        more = len(report.problems) - 1
        suffix = f" (and {more} more problem{'s' * (more > 1)}; `ds4-gguf inspect` lists them)" if more else ""
        raise ModelFileError(path, report.problems[0] + suffix)


def recipe_name(g: GGUFFile, c: ModelConfig) -> str:
    """Which published expert recipe the file follows: 'q2', 'q4', 'mxfp4' or 'custom'.

    The published files share every non-expert type (Q8_0 projections, shared experts and output;
    F16 embedding, HC, compressors, indexer, router; F32 vectors) and differ in the routed experts.
    """
    def ty(n):
        t = g.tensors.get(n)
        return t.type_id if t else None
    fixed_ok = ty("token_embd.weight") == Q.F16 and ty("output.weight") == Q.Q8_0
    experts = set()
    for il in range(c.n_layer):
        p = f"blk.{il}."
        fixed_ok &= all(ty(p + n) == Q.Q8_0 for n in (
            "attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight",
            "attn_output_b.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"))
        experts.add((ty(p + "ffn_gate_exps.weight"), ty(p + "ffn_up_exps.weight"), ty(p + "ffn_down_exps.weight")))
    if not fixed_ok or len(experts) != 1:
        return "custom"
    return {(Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K): "q2", (Q.Q4_K, Q.Q4_K, Q.Q4_K): "q4",
            (Q.MXFP4, Q.MXFP4, Q.MXFP4): "mxfp4"}.get(experts.pop(), "custom")
