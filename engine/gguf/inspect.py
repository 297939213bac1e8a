"""What `ds4-gguf inspect` reports: inventory, per-component totals and weight bytes per token.

Bytes read per decoded token follow spec/model.md §8.2: every dense weight of every layer once, the
routed experts' share for the experts a token uses (n_used of n_expert), one hash-table row, one
embedding row, the whole output head. The indexer's q_b projection is read only once a ratio-4 layer
holds more compressed rows than the indexer keeps (ds4 skips scoring until then), so the estimate
comes in two cases: context below and from (top_k + 1) * 4 tokens on.
"""
from __future__ import annotations

from collections import OrderedDict

from .config import CSA_RATIO
from .layout import (ATTN, COMPRESSOR, EMBED, HASH, HC, INDEXER, NORM, OUTPUT, ROUTED, ROUTER, SHARED)
from .model_file import ModelFile

COMPONENT_ORDER = [EMBED, OUTPUT, HC, NORM, ATTN, COMPRESSOR, INDEXER, ROUTER, SHARED, ROUTED, HASH]


def _layer_kind(m: ModelFile, il: int) -> str:
    c = m.config
    r = c.ratio(il)
    kind = {0: "sliding window", CSA_RATIO: "ratio 4 (CSA)"}.get(r, f"ratio {r} (HCA)")
    return kind + (", hash-routed" if c.is_hash_layer(il) else "")


def per_token_layer_bytes(m: ModelFile, il: int, long_context: bool) -> "OrderedDict[str, int]":
    c = m.config
    out = OrderedDict((k, 0) for k in COMPONENT_ORDER if k not in (EMBED, OUTPUT))
    for name, ti in m.layout.present.items():
        s = m.layout.specs[name]
        if s.layer != il:
            continue
        if s.component == ROUTED:
            out[ROUTED] += ti.nbytes // c.n_expert * c.n_expert_used
        elif s.component == HASH:
            out[HASH] += ti.nbytes // c.n_vocab
        elif name.endswith("indexer.attn_q_b.weight") and not long_context:
            continue
        else:
            out[s.component] += ti.nbytes
    return out


def report(m: ModelFile) -> dict:
    c, g = m.config, m.gguf
    comp_totals = OrderedDict((k, [0, 0]) for k in COMPONENT_ORDER)  # component -> [tensors, bytes]
    for name, ti in m.layout.present.items():
        t = comp_totals[m.layout.specs[name].component]
        t[0] += 1
        t[1] += ti.nbytes
    glob = 0
    for name, ti in m.layout.present.items():
        s = m.layout.specs[name]
        if s.layer == -1:
            glob += ti.nbytes // c.n_vocab if s.component == EMBED else ti.nbytes
    per_token = {}
    for long_ctx in (False, True):
        per_token["long" if long_ctx else "short"] = glob + sum(
            sum(per_token_layer_bytes(m, il, long_ctx).values()) for il in range(c.n_layer))
    kinds = OrderedDict()
    for il in range(c.n_layer):
        kinds.setdefault(_layer_kind(m, il), il)
    layers = [{"layer": il, "kind": k, "bytes_per_token": dict(per_token_layer_bytes(m, il, True))}
              for k, il in kinds.items()]
    flash = c.flash_differences()
    return {
        "path": m.path, "file_bytes": g.size, "gguf_version": g.version, "n_tensors": len(g.tensors),
        "name": g.get("general.name"), "architecture": g.get("general.architecture"),
        "recipe": m.recipe, "flash_shape": not flash, "flash_differences": flash, "config": c,
        "tokenizer": {"model": m.tokenizer["model"], "pre": m.tokenizer["pre"],
                      "tokens": len(m.tokenizer["tokens"]), "merges": len(m.tokenizer["merges"])},
        "components": {k: {"tensors": n, "bytes": b} for k, (n, b) in comp_totals.items() if n},
        "global_bytes_per_token": glob,
        "bytes_per_token": per_token,
        "long_context_from": (c.idx_topk + 1) * CSA_RATIO,
        "layers": layers,
        "tensors": [(ti.name, ti.type_name, list(ti.dims), ti.nbytes) for ti in g.tensors.values()],
        "extra_tensors": m.layout.extra,
    }


def _size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:,.2f} {unit}"
    return f"{n} B"


def format_report(r: dict, show_tensors: bool = False) -> str:
    c = r["config"]
    L = []
    L.append(f"file        {r['path']}  ({r['file_bytes']:,} bytes = {_size(r['file_bytes'])}, "
             f"GGUF v{r['gguf_version']}, {r['n_tensors']} tensors)")
    L.append(f"model       {r['architecture']} {r['name']!r}, recipe {r['recipe']}")
    if r["flash_shape"]:
        L.append("shape       the published DeepSeek V4 Flash shape")
    else:
        L.append("shape       not the published Flash shape: " + "; ".join(r["flash_differences"][:6])
                 + (" ..." if len(r["flash_differences"]) > 6 else ""))
    sched = ",".join(map(str, c.compress_ratios))
    L.append(f"layers      {c.n_layer} (compress ratios {sched}; first {c.n_hash_layer} hash-routed)")
    L.append(f"widths      embd {c.n_embd}, vocab {c.n_vocab}, heads {c.n_head}x{c.head_dim} (rope {c.n_rot}), "
             f"q rank {c.q_lora_rank}, out {c.o_groups} groups x rank {c.o_lora_rank}")
    L.append(f"experts     {c.n_expert} routed, top-{c.n_expert_used}, {c.n_expert_shared} shared, ff {c.n_ff_exp}, "
             f"scale {c.expert_weights_scale:g}")
    L.append(f"attention   window {c.n_swa}, indexer {c.idx_n_head}x{c.idx_head_dim} top-{c.idx_topk}, "
             f"HC {c.n_hc} streams / {c.sinkhorn_iters} Sinkhorn iters")
    L.append(f"rope        base {c.rope_base:g} (compressed layers {c.compress_rope_base:g}, YaRN x{c.rope_scale_factor:g} "
             f"from {c.rope_orig_ctx})")
    t = r["tokenizer"]
    L.append(f"tokenizer   {t['model']}/{t['pre']}, {t['tokens']} tokens, {t['merges']} merges")
    L.append("")
    L.append(f"{'component':<20}{'tensors':>8}{'bytes':>18}{'':>14}")
    total = 0
    for k, v in r["components"].items():
        total += v["bytes"]
        L.append(f"{k:<20}{v['tensors']:>8}{v['bytes']:>18,}{_size(v['bytes']):>14}")
    L.append(f"{'total':<20}{sum(v['tensors'] for v in r['components'].values()):>8}{total:>18,}{_size(total):>14}")
    L.append("")
    bpt = r["bytes_per_token"]
    L.append(f"weight bytes read per decoded token: {bpt['short']:,} ({_size(bpt['short'])}) below "
             f"{r['long_context_from']} tokens of context, {bpt['long']:,} ({_size(bpt['long'])}) from there on")
    L.append(f"  global (embedding row, output head): {r['global_bytes_per_token']:,}")
    for lay in r["layers"]:
        parts = ", ".join(f"{k} {v:,}" for k, v in lay["bytes_per_token"].items() if v)
        L.append(f"  per layer, {lay['kind']} (e.g. layer {lay['layer']}): "
                 f"{sum(lay['bytes_per_token'].values()):,} = {parts}")
    if r["extra_tensors"]:
        L.append("")
        L.append(f"ignored tensors not in the layout ({len(r['extra_tensors'])}): "
                 + ", ".join(r["extra_tensors"][:8]) + (" ..." if len(r["extra_tensors"]) > 8 else ""))
    if show_tensors:
        L.append("")
        L.append(f"{'tensor':<40}{'type':<9}{'shape (ggml order)':<24}{'bytes':>16}")
        for name, ty, dims, nb in r["tensors"]:
            L.append(f"{name:<40}{ty:<9}{str(dims):<24}{nb:>16,}")
    return "\n".join(L)
