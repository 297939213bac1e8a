"""Synthetic DeepSeek V4 GGUFs in the exact ds4 layout, for any consistent shape.

The file carries the same metadata keys, tensor names, ggml dims and dtypes as ds4's published
files (and as `ds4-oracle/ds4-tiny-q2.gguf`), with seeded random weights at the scales the oracle
model used: embeddings N(0,1), projections N(0, 1/fan_in), norm weights 1+N(0,0.1), HC projections
N(0,0.05), HC bases N(0,0.5), HC scales 1+N(0,0.2), sinks N(0,1), compressor position biases
N(0,0.5), router N(0, 4/fan_in), router bias N(0,0.1), hash table = distinct random experts.
Block-quantized tensors are written as random valid blocks whose decoded values have those scales
(we cannot run ds4's quantizer here, and random blocks exercise every code path of a format).

Each tensor draws from its own generator, seeded by (seed, name), so a tensor's bytes do not depend
on which other tensors the file has. `fill="zero"` writes no data at all: the file is extended with
ftruncate (a sparse file), which makes real-width files of any size in milliseconds for layout and
size tests.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType

from . import quants as Q
from ..atomic import atomic_path
from .config import ARCH, FLASH, ModelConfig, flash_schedule
from .layout import (ATTN, COMPRESSOR, EMBED, HASH, HC, INDEXER, NORM, OUTPUT, ROUTED, ROUTER, SHARED,
                     TensorSpec, expected_tensors)
from .synth_vocab import FULL, deepseek_vocab, vocab_size_for

ALIGNMENT = 32
CHUNK_BYTES = 64 << 20  # generate big tensors 64 MiB at a time

# Routed-expert types per recipe (gate, up, down); every other tensor is typed as in the published files.
RECIPES = {
    "q2": (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K),
    "q4": (Q.Q4_K, Q.Q4_K, Q.Q4_K),
    "mxfp4": (Q.MXFP4, Q.MXFP4, Q.MXFP4),
}

# The tiny default: the shape of ds4-oracle (runnable by ds4's own code: widths multiples of 256
# for the 256-value expert blocks, indexer head dim 128 for the fixed Hadamard, head_dim - 64 a
# multiple of ds4's 64-value FP8 blocks).
TINY = dict(
    n_layer=6, n_embd=256, n_head=8, n_head_kv=1, head_dim=128, value_dim=128, n_rot=64,
    q_lora_rank=128, o_lora_rank=128, o_groups=2, n_expert=8, n_expert_used=2, n_ff_exp=256,
    n_expert_shared=1, n_hash_layer=3, expert_group_count=0, expert_group_used_count=0, n_swa=16,
    idx_n_head=4, idx_head_dim=128, idx_topk=16, n_hc=4, sinkhorn_iters=20, rope_orig_ctx=65536,
    rope_base=10000.0, rope_scale_factor=16.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
    compress_rope_base=160000.0, expert_weights_scale=1.5, expert_weights_norm=True, rms_eps=1e-6,
    hc_eps=1e-6,
)
TINY_VOCAB_BASE = 4096 - len(range(128800, 128847))  # 4096 ids in all


def _dense_type(spec: TensorSpec) -> int:
    """Published dtype of a non-routed tensor (spec/model.md §2.5 quant policy)."""
    if spec.component == HASH:
        return Q.I32
    if len(spec.dims) == 1:
        return Q.F32
    if spec.component in (ATTN, SHARED) or spec.name == "output.weight":
        return Q.Q8_0
    return Q.F16  # embedding, HC fns, compressors, indexer, router


def config_for(preset: str = "tiny", *, n_layer: int | None = None, ratios=None, vocab=None,
               **overrides) -> tuple[ModelConfig, int | str]:
    """A consistent config from a preset ('tiny' or 'flash') and overrides; returns (config, vocab).

    `vocab` is 'full' or a number of base tokens; the vocab size follows from it.
    """
    base = dict(TINY if preset == "tiny" else FLASH)
    base.pop("n_vocab", None)
    base.update(overrides)
    n = n_layer if n_layer is not None else base["n_layer"]
    base["n_layer"] = n
    if vocab is None:
        vocab = TINY_VOCAB_BASE if preset == "tiny" else FULL
    if ratios is None:
        ratios = flash_schedule(n)
    ratios = tuple(int(r) for r in ratios)
    if len(ratios) != n:
        raise ValueError(f"{len(ratios)} compress ratios for {n} layers")
    base["n_hash_layer"] = min(base["n_hash_layer"], n)
    cfg = ModelConfig(**base, n_vocab=vocab_size_for(vocab), compress_ratios=ratios,
                      swiglu_clamp=(10.0,) * n, context_length=1 << 20)
    return cfg, vocab


@dataclass
class SynthResult:
    path: str
    config: ModelConfig
    recipe: str
    n_tensors: int
    nbytes: int
    specs: list = field(default_factory=list)


def tensor_plan(cfg: ModelConfig, recipe: str) -> list[tuple[TensorSpec, int]]:
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r} (choose from {', '.join(RECIPES)})")
    gate_t, up_t, down_t = RECIPES[recipe]
    plan = []
    for s in expected_tensors(cfg):
        if s.name.startswith("blk.") and s.name.endswith("exp_probs_b.bias") and cfg.is_hash_layer(s.layer):
            continue  # the hash router has no bias (ds4 ignores one there anyway)
        if s.component == ROUTED:
            t = {"ffn_gate_exps": gate_t, "ffn_up_exps": up_t, "ffn_down_exps": down_t}[s.name.split(".")[2]]
        else:
            t = _dense_type(s)
        fmt = Q.FORMATS[t]
        if s.dims[0] % fmt.block_elems:
            raise ValueError(f"{s.name}: input width {s.dims[0]} is not a multiple of {fmt.name}'s "
                             f"{fmt.block_elems}-value blocks; pick widths that are")
        plan.append((s, t))
    return plan


def _std_and_mean(spec: TensorSpec) -> tuple[float, float]:
    name, fan_in = spec.name, spec.dims[0]
    if spec.component == EMBED:
        return 1.0, 0.0
    if spec.component in (NORM, OUTPUT, COMPRESSOR, INDEXER, HC) and len(spec.dims) == 1:
        if name.endswith("attn_sinks.weight"):
            return 1.0, 0.0
        if "hc_" in name and name.endswith("_base.weight"):
            return 0.5, 0.0
        if "hc_" in name and name.endswith("_scale.weight"):
            return 0.2, 1.0
        return 0.1, 1.0  # RMSNorm weights
    if spec.component == HC or name == "output_hc_fn.weight":
        return 0.05, 0.0
    if name.endswith("_ape.weight"):
        return 0.5, 0.0
    if spec.component == ROUTER:
        return (0.1, 0.0) if name.endswith(".bias") else (2.0 / np.sqrt(fan_in), 0.0)
    return 1.0 / np.sqrt(fan_in), 0.0


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


def write_tensor_data(f, plan, cfg: ModelConfig, seed: int) -> None:
    """Each (spec, type) of plan's seeded bytes, each tensor padded to ALIGNMENT (the data section
    of a main model or an MTP file, from the file's current, aligned position)."""
    for spec, t in plan:
        n = 0
        for chunk in _tensor_chunks(spec, t, cfg, seed):
            f.write(chunk)
            n += len(chunk)
        f.write(b"\0" * (-n % ALIGNMENT))


def _tensor_chunks(spec: TensorSpec, type_id: int, cfg: ModelConfig, seed: int):
    """Yield the tensor's bytes in order, at most ~CHUNK_BYTES at a time."""
    rng = _rng(seed, spec.name)
    if type_id == Q.I32:  # hash table: n_used distinct experts per token id
        rows = np.argsort(rng.random((cfg.n_vocab, cfg.n_expert)), axis=1)[:, :cfg.n_expert_used]
        yield rows.astype("<i4").tobytes()
        return
    std, mean = _std_and_mean(spec)
    fmt = Q.FORMATS[type_id]
    n_blocks = int(np.prod(spec.dims, dtype=np.int64)) // fmt.block_elems
    per_chunk = max(1, CHUNK_BYTES // fmt.block_bytes)
    for start in range(0, n_blocks, per_chunk):
        k = min(per_chunk, n_blocks - start)
        if mean:
            vals = (mean + std * rng.standard_normal(k * fmt.block_elems)).astype(np.float32)
            yield _encode_float(type_id, vals)
        else:
            yield Q.random_blocks(type_id, rng, k, std).tobytes()


def _encode_float(type_id: int, vals: np.ndarray) -> bytes:
    if type_id == Q.F32:
        return vals.astype("<f4").tobytes()
    if type_id == Q.F16:
        return vals.astype("<f2").tobytes()
    if type_id == Q.BF16:
        return (vals.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    raise ValueError(f"vectors with a mean are written as float, not {Q.type_name(type_id)}")


def write_synthetic(path, cfg: ModelConfig, *, recipe: str = "q2", vocab: int | str = TINY_VOCAB_BASE,
                    seed: int = 0, fill: str = "random", name: str = "ds4-agent-synthetic") -> SynthResult:
    """Write a DeepSeek V4 GGUF for `cfg`. fill: 'random' (seeded weights) or 'zero' (sparse file)."""
    if fill not in ("random", "zero"):
        raise ValueError("fill is 'random' or 'zero'")
    if vocab_size_for(vocab) != cfg.n_vocab:
        raise ValueError(f"vocab {vocab!r} gives {vocab_size_for(vocab)} tokens, config says {cfg.n_vocab}")
    plan = tensor_plan(cfg, recipe)
    tokens, ttypes, merges = deepseek_vocab(vocab)

    path = os.fspath(path)
    with atomic_path(path) as tmp:
        w = GGUFWriter(tmp, ARCH)
        _add_metadata(w, cfg, name, tokens, ttypes, merges)
        total = 0
        for spec, t in plan:
            nbytes = Q.row_bytes(t, spec.dims[0]) * int(np.prod(spec.dims[1:], dtype=np.int64))
            # numpy order (reversed ggml dims); the writer reverses it back
            w.add_tensor_info(spec.name, tuple(reversed(spec.dims)), np.dtype(np.float32), nbytes,
                              raw_dtype=GGMLQuantizationType(t))
            total += -(-nbytes // ALIGNMENT) * ALIGNMENT
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        f.flush()
        data_start = -(-f.tell() // ALIGNMENT) * ALIGNMENT
        if fill == "zero":
            f.truncate(data_start + total)
        else:
            f.write(b"\0" * (data_start - f.tell()))
            write_tensor_data(f, plan, cfg, seed)
        w.close()
    return SynthResult(path, cfg, recipe, len(plan), os.path.getsize(path), [s for s, _ in plan])


def _add_metadata(w: GGUFWriter, c: ModelConfig, name, tokens, ttypes, merges):
    # Same keys, value types and order as ds4's files (see ds4-oracle/README.md).
    w.add_string("general.name", name)
    w.add_uint32(f"{ARCH}.block_count", c.n_layer)
    w.add_uint64(f"{ARCH}.context_length", c.context_length or 1 << 20)
    for key, v in [
        ("embedding_length", c.n_embd), ("vocab_size", c.n_vocab), ("attention.head_count", c.n_head),
        ("attention.head_count_kv", c.n_head_kv), ("attention.key_length", c.head_dim),
        ("attention.value_length", c.value_dim), ("rope.dimension_count", c.n_rot),
        ("attention.q_lora_rank", c.q_lora_rank), ("attention.output_lora_rank", c.o_lora_rank),
        ("attention.output_group_count", c.o_groups), ("expert_count", c.n_expert),
        ("expert_used_count", c.n_expert_used), ("expert_feed_forward_length", c.n_ff_exp),
        ("expert_shared_count", c.n_expert_shared), ("hash_layer_count", c.n_hash_layer),
        ("attention.sliding_window", c.n_swa), ("attention.indexer.head_count", c.idx_n_head),
        ("attention.indexer.key_length", c.idx_head_dim), ("attention.indexer.top_k", c.idx_topk),
        ("hyper_connection.count", c.n_hc), ("hyper_connection.sinkhorn_iterations", c.sinkhorn_iters),
    ]:
        w.add_uint32(f"{ARCH}.{key}", v)
    w.add_key_value(f"{ARCH}.attention.compress_ratios", list(c.compress_ratios), GGUFValueType.ARRAY,
                    GGUFValueType.INT32)
    w.add_key_value(f"{ARCH}.swiglu_clamp_exp", list(c.swiglu_clamp), GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    w.add_uint32(f"{ARCH}.rope.scaling.original_context_length", c.rope_orig_ctx)
    w.add_float32(f"{ARCH}.rope.freq_base", c.rope_base)
    w.add_string(f"{ARCH}.rope.scaling.type", "yarn")
    for key, v in [("rope.scaling.factor", c.rope_scale_factor), ("rope.scaling.yarn_beta_fast", c.yarn_beta_fast),
                   ("rope.scaling.yarn_beta_slow", c.yarn_beta_slow),
                   ("attention.compress_rope_freq_base", c.compress_rope_base),
                   ("expert_weights_scale", c.expert_weights_scale)]:
        w.add_float32(f"{ARCH}.{key}", v)
    w.add_bool(f"{ARCH}.expert_weights_norm", c.expert_weights_norm)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_eps)
    w.add_float32(f"{ARCH}.hyper_connection.epsilon", c.hc_eps)
    _add_tokenizer(w, tokens, ttypes, merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_uint32("tokenizer.ggml.padding_token_id", 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_bool("tokenizer.ggml.add_eos_token", False)


def _add_tokenizer(w: GGUFWriter, tokens, ttypes, merges):
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "joyai-llm")
    w.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", ttypes, GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_key_value("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING)


def write_vocab_only(path, vocab: int | str = FULL, name: str = "ds4-agent-vocab") -> str:
    """A GGUF with only the tokenizer metadata (no tensors): what `Tokenizer.from_gguf` needs."""
    tokens, ttypes, merges = deepseek_vocab(vocab)
    path = os.fspath(path)
    with atomic_path(path) as tmp:
        w = GGUFWriter(tmp, ARCH)
        w.add_string("general.name", name)
        w.add_uint32(f"{ARCH}.vocab_size", len(tokens))
        _add_tokenizer(w, tokens, ttypes, merges)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
    return path
