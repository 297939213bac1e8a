"""The MTP file: ds4's separate GGUF with DeepSeek V4 Flash's one multi-token-prediction block.

`DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf` (spec/model.md §7) holds 32 tensors named `mtp.0.*`:
the MTP-specific projections and norms (`e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`), its own HC
output head (`hc_head_{fn,base,scale}`) and one ratio-0 decoder block with its routed experts
stacked in `ffn_*_exps`. It has no embedding and no output matrix: those are the main model's.

As in ds4 (mtp_weights_bind, mtp_weights_validate_layout) the metadata is not read: every shape
follows from the MAIN file's config, and the types are ds4's (Q8_0 projections and shared expert,
F32 vectors, F16/F32 HC and router matrices, any block format for the routed experts, gate and up
alike). A file that does not fit is one ModelFileError line that names the tensor.
"""
from __future__ import annotations

import os

import numpy as np

from . import quants as Q
from ..errors import ModelFileError
from .config import ModelConfig
from .gguf_file import GGUFFile
from .layout import (ATTN, EXPS, FLOAT, HC, HC_FN, MATRIX, NORM, OUTPUT, PROJ, ROUTER_W, SHEXP, VEC,
                     TensorSpec, block_tensors)
from .model_file import MappedGGUF, QTensor

PREFIX = "mtp.0."
FILE_NAME = "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf"
MTP_LAYER = 1          # ds4 evaluates the block "as layer 1" (its SwiGLU clamp; no hash routing)

Q8 = frozenset({Q.Q8_0})
F32 = frozenset({Q.F32})
PLAIN = frozenset({Q.F16, Q.F32})
EXPERTS = MATRIX - FLOAT


MTP_FAMILIES = {PROJ: Q8, VEC: F32, HC_FN: PLAIN, ROUTER_W: PLAIN, EXPS: EXPERTS, SHEXP: Q8}


def mtp_tensors(c: ModelConfig) -> list[TensorSpec]:
    """The 32 tensors an MTP file for a model of config `c` holds, with ds4's shapes and types
    (ggml dim order: dims[0] = input width): its own projections, norms and HC head, then a
    ratio-0 decoder block (layout.block_tensors, its HC tensors first as ds4 writes them; the
    selection bias required)."""
    e = c.n_embd
    out = []

    def t(suffix, dims, family, comp):
        out.append(TensorSpec(PREFIX + suffix, tuple(dims), family, comp, MTP_LAYER))

    t("e_proj.weight", (e, e), Q8, ATTN)
    t("h_proj.weight", (e, e), Q8, ATTN)
    for n in ("enorm", "hnorm", "norm"):
        t(f"{n}.weight", (e,), F32, NORM)
    t("hc_head_fn.weight", (c.hc_dim, c.n_hc), PLAIN, HC)
    t("hc_head_base.weight", (c.n_hc,), F32, OUTPUT)
    t("hc_head_scale.weight", (1,), F32, OUTPUT)
    block = block_tensors(c, 0, False)
    for suffix, dims, kind, comp, _ in sorted(block, key=lambda b: not b[0].startswith("hc_")):
        t(suffix, dims, MTP_FAMILIES[kind], comp)
    return out


def is_mtp_file(g: GGUFFile) -> bool:
    """An MTP file: `mtp.0.*` tensors and no model of its own (no token embedding)."""
    return any(n.startswith(PREFIX) for n in g.tensors) and "token_embd.weight" not in g.tensors


def layout_problems(g: GGUFFile, c: ModelConfig) -> list[str]:
    """Every way the file misses what an MTP file for config `c` must hold (empty: it fits)."""
    if not is_mtp_file(g):
        what = "a main model file" if "token_embd.weight" in g.tensors else "a GGUF without mtp.0.* tensors"
        return [f"not an MTP file ({what}); --mtp takes ds4's {FILE_NAME}"]
    problems = []
    for s in mtp_tensors(c):
        ti = g.tensors.get(s.name)
        if ti is None:
            problems.append(f"missing tensor '{s.name}'")
        elif ti.dims != s.dims:
            problems.append(f"tensor '{s.name}' has shape {list(ti.dims)}, expected {list(s.dims)} "
                            f"(from the main model's metadata: a file for another model?)")
        elif ti.type_id not in s.family:
            want = "/".join(sorted(Q.type_name(t) for t in s.family))
            problems.append(f"tensor '{s.name}' has type {ti.type_name}, expected {want}")
    gate, up = g.tensors.get(PREFIX + "ffn_gate_exps.weight"), g.tensors.get(PREFIX + "ffn_up_exps.weight")
    if gate and up and gate.type_id != up.type_id:
        problems.append(f"routed gate ({gate.type_name}) and up ({up.type_name}) experts' types differ")
    return problems


class MTPFile(MappedGGUF):
    """An MTP GGUF mapped read-only and checked against the main model's config."""

    def __init__(self, g: GGUFFile, config: ModelConfig):
        self.gguf, self.config, self.path = g, config, g.path

    @classmethod
    def open(cls, path, config: ModelConfig) -> "MTPFile":
        g = GGUFFile(path)          # (a missing, empty or malformed file: ModelFileError here)
        try:
            problems = layout_problems(g, config)
            if problems:
                more = len(problems) - 1
                raise ModelFileError(g.path, problems[0] + (f" (and {more} more)" if more else ""))
        except BaseException:
            g.close()
            raise
        return cls(g, config)

    def tensor(self, name: str) -> QTensor:
        ti = self.gguf.tensors[PREFIX + name]
        n_rows = int(np.prod(ti.dims[1:], dtype=np.int64))
        raw = self.gguf.tensor_bytes(ti.name)
        return QTensor(ti.name, ti.type_id, ti.dims, raw.reshape(n_rows, ti.nbytes // n_rows))

    def nbytes(self) -> int:
        return self.gguf.size


def write_synthetic_mtp(path, cfg: ModelConfig, *, recipe: str = "q4", seed: int = 1,
                        name: str = "ds4-agent-synthetic-mtp") -> str:
    """An MTP file for a synthetic main model of config `cfg`, with ds4's types (routed experts
    per `recipe`, as synth.RECIPES) and seeded random weights at the main file's scales."""
    from gguf import GGUFWriter
    from gguf.constants import GGMLQuantizationType

    from ..atomic import atomic_path
    from .config import ARCH
    from .synth import ALIGNMENT, RECIPES, write_tensor_data
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r} (choose from {', '.join(RECIPES)})")
    gate_t, up_t, down_t = RECIPES[recipe]
    routed = {"ffn_gate_exps.weight": gate_t, "ffn_up_exps.weight": up_t, "ffn_down_exps.weight": down_t}
    plan = []
    for s in mtp_tensors(cfg):
        suffix = s.name[len(PREFIX):]
        t = routed.get(suffix) or (Q.Q8_0 if s.family == Q8 else Q.F32 if s.family == F32 else Q.F16)
        if s.dims[0] % Q.FORMATS[t].block_elems:
            raise ValueError(f"{s.name}: input width {s.dims[0]} is not a multiple of "
                             f"{Q.FORMATS[t].name}'s blocks")
        plan.append((s, t))
    path = os.fspath(path)
    with atomic_path(path) as tmp:
        w = GGUFWriter(tmp, ARCH)
        w.add_string("general.name", name)
        for s, t in plan:
            nbytes = Q.row_bytes(t, s.dims[0]) * int(np.prod(s.dims[1:], dtype=np.int64))
            w.add_tensor_info(s.name, tuple(reversed(s.dims)), np.dtype(np.float32), nbytes,
                              raw_dtype=GGMLQuantizationType(t))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        f.flush()
        f.write(b"\0" * (-f.tell() % ALIGNMENT))
        write_tensor_data(f, plan, cfg, seed)
        w.close()
    return path
