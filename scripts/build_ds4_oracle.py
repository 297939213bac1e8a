"""Build ds4 oracles: logits from ds4's own C CPU path on tiny synthetic models (issue 33).

ds4 (github.com/antirez/ds4) implements exactly one shape, DeepSeek V4 Flash, in fixed-size
constants.  This script copies a ds4 source tree into a private temp folder, edits that copy to
the tiny shape of one GGUF, builds its CPU path (`make` objects as ds4's Makefile builds `cpu`:
-O3 -ffast-math -march=native, -DDS4_NO_GPU), links scripts/ds4_oracle_driver.c (our own code,
on ds4's public session API) and runs it.  Nothing of ds4 enters the project: the copy lives in
/tmp and is deleted unless --keep.

Edits to the private copy of ds4.c (each is a literal or one-line regex replacement that must
match the stated number of times, else the script stops and says which edit failed):

 1. Fixed shape: every `DS4_N_*` constant of the "Fixed DeepSeek V4 Flash Shape" enum is set to
    the GGUF's metadata value (layers, embedding, vocab, heads, head dims, RoPE dims, output
    groups, LoRA ranks, experts, FFN width, hash layers, window, indexer, HC).  ds4 then
    validates the GGUF against them exactly as it validates Flash.
 2. Compression schedule: `ds4_layer_compress_ratio()` computes Flash's schedule (0, 0, then
    4/128 alternating); it returns the GGUF's `deepseek4.attention.compress_ratios` instead
    (a table), so models whose compressed layers come in another order load and run.
 3. Literal Flash sizes in the CPU path use the constants: the query LoRA rank (`1024` in the
    q projections' buffers and RMSNorm widths, decode scratch and batched prefill) becomes
    DS4_N_LORA_Q; the grouped output projection's `n_groups = 8` / `rank = 1024` become
    DS4_N_OUT_GROUP / DS4_N_LORA_O, and the decode scratch's `8u * 1024u` low buffer their
    product.  With Flash constants these are the same numbers.
 4. Compressor kind by tensor: ds4's compressor picks "FP8 round trip" (attention) or
    "Hadamard + FP4" (indexer) by comparing the row width with DS4_N_HEAD_DIM /
    DS4_N_INDEXER_HEAD_DIM.  The tiny shape makes both 128, so the indexer rows would get the
    attention treatment.  The copy decides by the norm tensor's name (`indexer` in it), which is
    exactly what unmodified ds4 does with Flash widths (512 vs 128).
 5. One accessor appended: `ds4_session_logits_oracle()` returns the session's logits buffer
    (the public header exposes only top-k log-probs).
 6. Only for models whose routed experts are Q4_K (the q4 recipe): ds4's CPU path has no Q4_K
    expert kernels (only its Metal and CUDA paths do; the CPU path stops with "expected IQ2_XXS
    expert tensors").  The copy gets OUR OWN scalar Q4_K x Q8_K block dot, written in the form
    of ds4's scalar Q2_K dot (integer sums per block, then `sumf += d*dx*isum - d*dmin*summs` in
    float32) with the block arithmetic of ds4's CUDA `dev_dot_q4_K_q8_K_block`; after the
    original dot functions, macros send the routed-expert call sites (gate/up pair, down) to it,
    and the four expert type checks accept Q4_K.  So a q4 oracle is ds4's CPU path everywhere
    except the routed experts' block dot, which is ours: it referees everything around the
    experts, not ds4's own Q4_K float order.  No other code changes.

 7. Only with --dump (never for the oracles' logits): a debug dump of the decode path's
    intermediates.  A helper writes, when DS4_ORACLE_DUMP names a file, records (tag[16], pos,
    layer, n, float32[n]) for positions below DS4_ORACLE_DUMP_POS (default 4); calls to it are
    added (nothing else changes) in layer_forward_raw_swa_one (HC input, attn input after the HC
    pre, post, comb, attn_norm, qr and qr_norm, q and kv after RoPE/FP8, heads before the inverse RoPE,
    the attention output, the HC after attention), layer_ffn_one_decode_scratch (FFN input,
    post, comb, ffn_norm, routed and shared outputs, the layer's output HC) and
    output_logits_one_decode_scratch (head weights, head embedding, its norm); the same tags,
    one record per row, in the batched prefill path's layer_attention_raw_swa_batch,
    layer_ffn_shared_batch and output_logits_one (head embedding and norm).  The driver's `dump`
    command feeds every token through the decode path (edit 8), `dump-prefill` syncs them in one
    call (`dump --prefill`); the reference's side is scripts/ds4_dump_compare.py.
 8. One more accessor appended: `ds4_session_oracle_decode_first()` marks a fresh session's
    (empty) checkpoint valid, so ds4_session_sync extends it token by token through its own
    decode loop instead of its batched prefill: the first token takes the decode path like every
    later one.  The driver uses it for the oracles' all-decode rows (below) and for `dump`.

Checked: with these edits, ds4 8d576642c39b (the newest commit when this was written; the shared
oracle's README names none) reproduces ../shared/ds4-oracle's decode and prefill logits bit for
bit (`check-shared`), so the edits are the ones that oracle was made with.

The driver writes, for the token ids: the logits after every id fed one at a time, twice: the
sync-first rows (the first id through ds4_session_sync, the prefill path, as a real prompt's first
token; the rest through ds4_session_eval, the decode path) and the all-decode rows (edit 8: the
first id through the decode path too; what a test that feeds every token through our decode path
one at a time must be compared with); and for a few positions p the last row of a fresh session
synced to ids[0..p] in one call.  `shared-decode` checks that the build reproduces
../shared/ds4-oracle bit for bit and then writes that model's all-decode rows to
tests/oracles/shared-decode/.

Oracles (tests/oracles/<name>/, see ORACLES below): the model is regenerated from `ds4-gguf synth`
arguments (ds4 loads what synth writes) and checked by sha256; the prompt is a chat rendered and
tokenized by ds4 itself (ds4_encode_chat_prompt, no thinking) from a text file of this project.

    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src make [NAME ...]
    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src check-shared
    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src shared-decode
    .venv/bin/python scripts/build_ds4_oracle.py readmes     # README.md of each from its oracle.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DRIVER = Path(__file__).with_name("ds4_oracle_driver.c")
OUT_ROOT = ROOT / "tests" / "oracles"
SHARED = ROOT.parent / "shared" / "ds4-oracle"

# DS4_N_* constant -> ModelConfig field
CONSTANTS = {
    "DS4_N_LAYER": "n_layer", "DS4_N_EMBD": "n_embd", "DS4_N_VOCAB": "n_vocab",
    "DS4_N_HEAD": "n_head", "DS4_N_HEAD_KV": "n_head_kv", "DS4_N_HEAD_DIM": "head_dim",
    "DS4_N_VALUE_DIM": "value_dim", "DS4_N_ROT": "n_rot", "DS4_N_OUT_GROUP": "o_groups",
    "DS4_N_LORA_Q": "q_lora_rank", "DS4_N_LORA_O": "o_lora_rank", "DS4_N_EXPERT": "n_expert",
    "DS4_N_EXPERT_USED": "n_expert_used", "DS4_N_EXPERT_SHARED": "n_expert_shared",
    "DS4_N_FF_EXP": "n_ff_exp", "DS4_N_HASH_LAYER": "n_hash_layer", "DS4_N_SWA": "n_swa",
    "DS4_N_INDEXER_HEAD": "idx_n_head", "DS4_N_INDEXER_HEAD_DIM": "idx_head_dim",
    "DS4_N_INDEXER_TOP_K": "idx_topk", "DS4_N_HC": "n_hc", "DS4_N_HC_SINKHORN_ITER": "sinkhorn_iters",
}

# edit 3: (old, new, expected matches)
LITERALS = [
    ("xmalloc(1024 * sizeof(qr[0]))", "xmalloc(DS4_N_LORA_Q * sizeof(qr[0]))", 2),
    ("xmalloc(1024 * sizeof(qr_norm[0]))", "xmalloc(DS4_N_LORA_Q * sizeof(qr_norm[0]))", 2),
    ("q_a_norm, 1024, DS4_RMS_EPS", "q_a_norm, DS4_N_LORA_Q, DS4_RMS_EPS", 3),
    ("scratch->qr = xmalloc(1024 * sizeof(float))", "scratch->qr = xmalloc(DS4_N_LORA_Q * sizeof(float))", 1),
    ("scratch->qr_norm = xmalloc(1024 * sizeof(float))",
     "scratch->qr_norm = xmalloc(DS4_N_LORA_Q * sizeof(float))", 1),
    ("scratch->attn_low = xmalloc((size_t)8u * 1024u * sizeof(float))",
     "scratch->attn_low = xmalloc((size_t)DS4_N_OUT_GROUP * DS4_N_LORA_O * sizeof(float))", 1),
    ("(size_t)n_tok * 1024 * sizeof(qr", "(size_t)n_tok * DS4_N_LORA_Q * sizeof(qr", 2),
    ("(uint64_t)t * 1024", "(uint64_t)t * DS4_N_LORA_Q", 3),
    ("                        q_a_norm,\n                        1024,\n",
     "                        q_a_norm,\n                        DS4_N_LORA_Q,\n", 1),
    ("const uint32_t n_groups = 8;", "const uint32_t n_groups = DS4_N_OUT_GROUP;", 3),
    ("const uint32_t rank = 1024;", "const uint32_t rank = DS4_N_LORA_O;", 3),
]

SCHEDULE_OLD = "    if (il < 2) return 0;\n    return (il & 1u) == 0 ? 4u : 128u;\n"
COMPRESSOR_OLD = ("    if (head_dim == DS4_N_HEAD_DIM) {\n        dsv4_fp8_kv_quantize_row_inplace_cpu(out_comp, "
                  "head_dim, DS4_N_ROT);\n    } else if (head_dim == DS4_N_INDEXER_HEAD_DIM) {\n")
COMPRESSOR_NEW = ("    if (!ds4_oracle_is_indexer(norm)) {\n        dsv4_fp8_kv_quantize_row_inplace_cpu(out_comp, "
                  "head_dim, DS4_N_ROT);\n    } else {\n")
INDEXER_HELPER = """} ds4_tensor;

/* oracle build: the indexer compressor is the one whose tensors are named indexer_* */
static int ds4_oracle_is_indexer(const ds4_tensor *t) {
    static const char key[] = "indexer";
    for (uint64_t i = 0; i + sizeof(key) - 1 <= t->name.len; i++)
        if (memcmp(t->name.ptr + i, key, sizeof(key) - 1) == 0) return 1;
    return 0;
}
"""
Q4K_ANCHOR = "/* Locate one expert's 2D matrix inside a 3D GGUF expert tensor. */\n"
Q4K_DOT = """/* oracle build (edit 6): Q4_K routed experts on the CPU path; our code, see the build script */
static void ds4_oracle_dot_q4_K_q8_K(int n, float *s, const void *vx, const block_q8_K *y) {
    const block_q4_K *x = vx;
    float sumf = 0.0f;
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *sc = x[i].scales;
        int isum = 0, summs = 0;
        for (int j = 0; j < 8; j++) {
            const int d = j < 4 ? (sc[j] & 63) : ((sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4));
            const int m = j < 4 ? (sc[j + 4] & 63) : ((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
            summs += m * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
            const uint8_t *q4 = x[i].qs + (j >> 1) * 32;
            const int8_t *q8 = y[i].qs + j * 32;
            const int shift = (j & 1) ? 4 : 0;
            int dot = 0;
            for (int k = 0; k < 32; k++) dot += ((q4[k] >> shift) & 0x0f) * q8[k];
            isum += d * dot;
        }
        const float dall = y[i].d * f16_to_f32(x[i].d);
        const float dmin = y[i].d * f16_to_f32(x[i].dmin);
        sumf += dall * (float)isum - dmin * (float)summs;
    }
    *s = sumf;
}
#define ds4_vec_dot_iq2_xxs_pair_q8_K(n, s0, s1, x0, x1, y) \\
    (ds4_oracle_dot_q4_K_q8_K((n), (s0), (x0), (y)), ds4_oracle_dot_q4_K_q8_K((n), (s1), (x1), (y)))
#define ds4_vec_dot_q2_K_q8_K(n, s, x, y) ds4_oracle_dot_q4_K_q8_K((n), (s), (x), (y))

"""
Q4K_CHECKS = [("w0->type != 16 || w1->type != 16", "w0->type != 12 || w1->type != 12", 1),
              ("gate_w->type != 16 || up_w->type != 16", "gate_w->type != 12 || up_w->type != 12", 1),
              ("if (w->type != 10) ds4_die", "if (w->type != 12) ds4_die", 2)]
DUMP_HELPER = """
/* oracle build (edit 7): a debug dump of the decode path's intermediates */
static uint32_t ds4_oracle_pos;
static void ds4_oracle_dump(const char *tag, uint32_t il, const float *x, size_t n) {
    static FILE *f;
    static int init;
    static uint32_t max_pos = 4;
    if (!init) {
        init = 1;
        const char *p = getenv("DS4_ORACLE_DUMP"), *m = getenv("DS4_ORACLE_DUMP_POS");
        if (p) f = fopen(p, "wb");
        if (m) max_pos = (uint32_t)atoi(m);
    }
    if (!f || ds4_oracle_pos >= max_pos) return;
    char t[16] = {0};
    strncpy(t, tag, 15);
    int32_t h[3] = {(int32_t)ds4_oracle_pos, (int32_t)il, (int32_t)n};
    fwrite(t, 1, 16, f); fwrite(h, 4, 3, f); fwrite(x, 4, n, f); fflush(f);
}
/* the prefill path's batched buffers: row t is position pos0 + t (pos0: the batch's first) */
static uint32_t ds4_oracle_pos0;
static void ds4_oracle_dump_rows(const char *tag, uint32_t il, const float *x, size_t n, uint32_t n_tok) {
    for (uint32_t t = 0; t < n_tok; t++) {
        ds4_oracle_pos = ds4_oracle_pos0 + t;
        ds4_oracle_dump(tag, il, x + (size_t)t * n, n);
    }
}
"""
D = "ds4_oracle_dump"
HCE = "(size_t)DS4_N_HC * DS4_N_EMBD"
DUMP_EDITS = [   # (anchor, text before it, text after it)
    ("    memcpy(scratch->attn_residual, inp_hc", f"    ds4_oracle_pos = pos;\n    {D}(\"hc_in\", il, inp_hc, {HCE});\n", ""),
    ("    layer_attn_norm_one(scratch->attn_norm, model, layer, scratch->attn_cur);\n",
     f"    {D}(\"attn_x\", il, scratch->attn_cur, DS4_N_EMBD);\n    {D}(\"attn_post\", il, post, DS4_N_HC);\n"
     f"    {D}(\"attn_comb\", il, comb, DS4_N_HC * DS4_N_HC);\n",
     f"    {D}(\"attn_norm\", il, scratch->attn_norm, DS4_N_EMBD);\n"),
    ("    kv_cache_push_raw(cache, scratch->kv);\n",
     f"    {D}(\"qr\", il, scratch->qr, DS4_N_LORA_Q);\n"
     f"    {D}(\"qr_norm\", il, scratch->qr_norm, DS4_N_LORA_Q);\n    {D}(\"q\", il, scratch->q, DS4_N_HEAD * DS4_N_HEAD_DIM);\n"
     f"    {D}(\"kv\", il, scratch->kv, DS4_N_HEAD_DIM);\n", ""),
    ("    rope_tail_layer_inplace(scratch->heads, DS4_N_HEAD, DS4_N_HEAD_DIM, DS4_N_ROT, pos, il, true);\n",
     f"    {D}(\"heads\", il, scratch->heads, DS4_N_HEAD * DS4_N_HEAD_DIM);\n", ""),
    ("    hc_post_one(scratch->after_attn_hc, scratch->attn_out, scratch->attn_residual, post, comb, DS4_N_EMBD, n_hc);\n",
     f"    {D}(\"attn_out\", il, scratch->attn_out, DS4_N_EMBD);\n", f"    {D}(\"after_attn\", il, scratch->after_attn_hc, {HCE});\n"),
    ("    rms_norm_weight(scratch->ffn_norm, scratch->ffn_cur, ffn_norm, DS4_N_EMBD, DS4_RMS_EPS);\n",
     f"    {D}(\"ffn_x\", il, scratch->ffn_cur, DS4_N_EMBD);\n    {D}(\"ffn_post\", il, post, DS4_N_HC);\n"
     f"    {D}(\"ffn_comb\", il, comb, DS4_N_HC * DS4_N_HC);\n", f"    {D}(\"ffn_norm\", il, scratch->ffn_norm, DS4_N_EMBD);\n"),
    ("    hc_post_one(out_hc, scratch->ffn_out, inp_hc, post, comb, DS4_N_EMBD, n_hc);\n",
     f"    {D}(\"ffn_moe\", il, scratch->ffn_moe, DS4_N_EMBD);\n    {D}(\"ffn_shared\", il, scratch->ffn_shared, DS4_N_EMBD);\n",
     f"    {D}(\"out_hc\", il, out_hc, {HCE});\n"),
    ("    hc_weighted_sum_one(scratch->output_embd", f"    {D}(\"head_w\", 0, scratch->output_weights, DS4_N_HC);\n", ""),
    ("    matvec_q8_0_decode_scratch(logits, model, weights->output, scratch->output_norm, scratch);\n",
     f"    {D}(\"head_x\", 0, scratch->output_embd, DS4_N_EMBD);\n    {D}(\"head_norm\", 0, scratch->output_norm, DS4_N_EMBD);\n", ""),
]
R = "ds4_oracle_dump_rows"
# edit 7, prefill: the same tags from ds4's batched prefill (layer_attention_raw_swa_batch,
# layer_ffn_shared_batch, output_logits_one), one record per row; anchors as edit 3 left them
DUMP_PREFILL_EDITS = [
    ("    matmul_q8_0_batch(qr, model, layer->attn_q_a, attn_norm, n_tok);\n",
     f"    ds4_oracle_pos0 = pos0;\n    {R}(\"hc_in\", il, inp_hc, hc_dim, n_tok);\n"
     f"    {R}(\"attn_x\", il, attn_cur, DS4_N_EMBD, n_tok);\n    {R}(\"attn_post\", il, post, n_hc, n_tok);\n"
     f"    {R}(\"attn_comb\", il, comb, n_hc * n_hc, n_tok);\n    {R}(\"attn_norm\", il, attn_norm, DS4_N_EMBD, n_tok);\n",
     ""),
    ("        kv_cache_push_raw(cache, kv_t);\n",
     f"        ds4_oracle_pos = pos;\n        {D}(\"qr\", il, qr + (uint64_t)t * DS4_N_LORA_Q, DS4_N_LORA_Q);\n"
     f"        {D}(\"qr_norm\", il, qr_norm + (uint64_t)t * DS4_N_LORA_Q, DS4_N_LORA_Q);\n"
     f"        {D}(\"q\", il, q_t, q_dim);\n        {D}(\"kv\", il, kv_t, DS4_N_HEAD_DIM);\n", ""),
    ("        if (!prefix_batch_attn) {\n            tx = profile ? now_sec() : 0.0;\n"
     "            rope_tail_layer_inplace(heads + (uint64_t)t * q_dim,\n",
     f"        ds4_oracle_pos = pos;\n        {D}(\"heads\", il, heads + (uint64_t)t * q_dim, q_dim);\n", ""),
    ("    hc_post_batch(after_attn_hc,\n                  attn_out,\n                  attn_residual,\n",
     f"    {R}(\"attn_out\", il, attn_out, DS4_N_EMBD, n_tok);\n", ""),
    ("    if (profile) t_out = now_sec() - t0;\n\n    if (profile) {\n        fprintf(stderr,\n"
     "                \"ds4: prefill detail layer %u attn hc_norm",
     f"    {R}(\"after_attn\", il, after_attn_hc, hc_dim, n_tok);\n", ""),
    ("    if (routed_token_parallel) {\n        layer_routed_moe_tokens_parallel(moe, model, layer, norm, token_ids, n_tok, il);",
     f"    {R}(\"ffn_x\", il, ffn_cur, DS4_N_EMBD, n_tok);\n    {R}(\"ffn_post\", il, post, n_hc, n_tok);\n"
     f"    {R}(\"ffn_comb\", il, comb, n_hc * n_hc, n_tok);\n    {R}(\"ffn_norm\", il, norm, DS4_N_EMBD, n_tok);\n", ""),
    ("    layer_shared_ffn_batch(shared, model, layer, norm, n_tok);\n    if (profile) t_shared = now_sec() - t0;\n", "",
     f"    {R}(\"ffn_moe\", il, moe, DS4_N_EMBD, n_tok);\n    {R}(\"ffn_shared\", il, shared, DS4_N_EMBD, n_tok);\n"),
    ("    if (profile) t_post = now_sec() - t0;\n\n    if (profile) {\n        fprintf(stderr,\n"
     "                \"ds4: prefill detail layer %u ffn hc_norm=%.3f routed",
     f"    {R}(\"out_hc\", il, out_hc, (size_t)n_hc * DS4_N_EMBD, n_tok);\n", ""),
    ("    matvec_q8_0(logits, model, weights->output, norm);\n",
     f"    {D}(\"head_x\", 0, embd, DS4_N_EMBD);\n    {D}(\"head_norm\", 0, norm, DS4_N_EMBD);\n", ""),
]
DECODE_FIRST = ("\n/* oracle build (edit 8): a fresh session's first token through the decode path */\n"
                "void ds4_session_oracle_decode_first(ds4_session *s) { s->checkpoint_valid = true; }\n")
ACCESSOR = "\n/* oracle build: the session's logits */\nconst float *ds4_session_logits_oracle(ds4_session *s) { return s->logits; }\n"


def replace(text: str, old: str, new: str, count: int, what: str) -> str:
    n = text.count(old)
    if n != count:
        raise SystemExit(f"edit '{what}': expected {count} match(es) of {old!r}, found {n}; ds4 changed?")
    return text.replace(old, new)


def edit_source(text: str, cfg, q4k: bool = False, dump: bool = False) -> str:
    """The documented edits of the module docstring, each checked (6 only when `q4k`, 7 `dump`)."""
    for const, field in CONSTANTS.items():                                    # 1
        pat = re.compile(rf"^(\s*{const}\s*=\s*)\d+,", re.M)
        text, n = pat.subn(rf"\g<1>{int(getattr(cfg, field))},", text)
        if n != 1:
            raise SystemExit(f"edit 1: constant {const} matched {n} times; ds4 changed?")
    table = ", ".join(f"{int(r)}u" for r in cfg.compress_ratios)            # 2
    text = replace(text, SCHEDULE_OLD, "    static const uint32_t ratios[] = {" + table + "};\n"
                   "    return ratios[il];\n", 1, "2 schedule")
    for old, new, count in LITERALS:                                           # 3
        text = replace(text, old, new, count, f"3 {old[:40]}")
    text = replace(text, "} ds4_tensor;\n", INDEXER_HELPER, 1, "4 helper")  # 4
    text = replace(text, COMPRESSOR_OLD, COMPRESSOR_NEW, 2, "4 compressor")
    if q4k:                                                                    # 6
        text = replace(text, Q4K_ANCHOR, Q4K_DOT + Q4K_ANCHOR, 1, "6 q4_K dot")
        for old, new, count in Q4K_CHECKS:
            text = replace(text, old, new, count, f"6 {old}")
    if dump:                                                                   # 7
        text = replace(text, INDEXER_HELPER, INDEXER_HELPER + DUMP_HELPER, 1, "7 dump helper")
        for anchor, before, after in DUMP_EDITS + DUMP_PREFILL_EDITS:
            text = replace(text, anchor, before + anchor + after, 1, f"7 {anchor.strip()[:40]}")
    return text + ACCESSOR + DECODE_FIRST                                      # 5, 8


def model_config(gguf: Path):
    from engine.gguf.config import ModelConfig
    from engine.gguf.gguf_file import GGUFFile
    g = GGUFFile(gguf)
    try:
        return ModelConfig.from_gguf(g)
    finally:
        g.close()


def routed_q4k(gguf: Path) -> bool:
    from engine.gguf.gguf_file import GGUFFile
    from engine.gguf.quants import Q4_K
    g = GGUFFile(gguf)
    try:
        types = {t.type_id for n, t in g.tensors.items() if "_exps." in n}
    finally:
        g.close()
    return types == {Q4_K}


def build(src: Path, gguf: Path, work: Path, dump: bool = False) -> Path:
    """Edit a copy of `src` in `work` for `gguf`'s shape, build its CPU objects and the driver."""
    copy = work / "ds4"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns(".git", "*.o"))
    c = copy / "ds4.c"
    c.write_text(edit_source(c.read_text(), model_config(gguf), routed_q4k(gguf), dump))
    cflags = ["-O3", "-ffast-math", "-g", "-march=native", "-Wall", "-std=c99", "-D_GNU_SOURCE",
              "-fno-finite-math-only"]
    run(["cc", *cflags, "-DDS4_NO_GPU", "-c", "-o", "ds4_cpu.o", "ds4.c"], copy)
    run(["cc", *cflags, *(["-DDS4_ORACLE_DUMP"] if dump else []), "-I", str(copy), "-c", "-o", "driver.o",
         str(DRIVER)], copy)
    run(["cc", *cflags, "-o", "driver", "driver.o", "ds4_cpu.o", "-lm", "-pthread"], copy)
    return copy / "driver"


def run(cmd, cwd, env=None):
    r = subprocess.run([str(x) for x in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:3]))} ... failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def driver_env(work: Path) -> dict:
    # ds4 takes a single-instance lock (/tmp/ds4.lock by default): a private one per build
    return dict(os.environ, DS4_LOCK_FILE=str(work / "ds4.lock"))


def ds4_logits(driver: Path, gguf: Path, ids, positions, n_vocab: int, work: Path, threads: int = 2):
    """(sync-first decode [n_ids, n_vocab], all-decode [n_ids, n_vocab], prefill [len(positions),
    n_vocab]) float32 from the driver."""
    (work / "ids.txt").write_text("".join(f"{int(t)}\n" for t in ids))
    dec, alldec, pre = work / "decode.f32", work / "all_decode.f32", work / "prefill.f32"
    run([driver, "logits", gguf, work / "ids.txt", n_vocab, threads, dec, alldec, pre, *positions], work,
        driver_env(work))
    return (np.fromfile(dec, np.float32).reshape(len(ids), n_vocab),
            np.fromfile(alldec, np.float32).reshape(len(ids), n_vocab),
            np.fromfile(pre, np.float32).reshape(len(positions), n_vocab))


def ds4_tokenize(driver: Path, gguf: Path, system: str, user: str, work: Path) -> list[int]:
    (work / "system.txt").write_text(system)
    (work / "user.txt").write_text(user)
    run([driver, "tokenize", gguf, work / "system.txt", work / "user.txt", work / "ids.out"], work,
        driver_env(work))
    return [int(x) for x in (work / "ids.out").read_text().split()]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# name -> how it is made: `ds4-gguf synth` arguments (the model), the chat's text (a slice of a
# file of this project at the commit that made it; oracle.json keeps the text itself)
ORACLES = {
    "s101-q2": dict(synth=["--seed", "101", "--recipe", "q2"],
                    system="You are a careful assistant.", text=("README.md", 0, 2600)),
    "s202-q2-16experts": dict(synth=["--seed", "202", "--recipe", "q2", "--experts", "16", "--experts-used", "4"],
                              system="", text=("engine/gguf/gguf_cli.py", 0, 2700)),
    "s303-q2-r128first": dict(synth=["--seed", "303", "--recipe", "q2", "--ratios", "0,0,128,4,128,4"],
                              system="Answer briefly.", text=("docs/agent.md", 0, 2600)),
    "s404-q4-8layers": dict(synth=["--seed", "404", "--recipe", "q4", "--ratios", "0,0,4,128,128,4,4,128"],
                            system="You are a coding agent.", text=("docs/sessions.md", 0, 2600)),
}
DECODE_KEEP = 300                     # every decode row below this position is kept
ALL_DECODE = "ds4_logits_all_decode.npz"   # the all-decode rows (edit 8), beside ds4_logits.npz
SHARED_DECODE = OUT_ROOT / "shared-decode"  # ../shared/ds4-oracle's model's all-decode rows
CHECKPOINTS = [0, 15, 16, 17, 63, 127, 128, 199, 255, 256, 383, 384, 511, 512, 639, 640, 767, 768,
               1023, 1024]


def synth_model(args: list[str], out: Path) -> Path:
    """The oracle's model, written by `ds4-gguf synth` (the tests regenerate it the same way)."""
    from engine.gguf.gguf_cli import main as gguf_main
    if gguf_main(["synth", str(out), *args]) != 0:
        raise SystemExit(f"ds4-gguf synth {' '.join(args)} failed")
    return out


def prompt_text(name: str, spec: dict) -> tuple[str, str]:
    old = OUT_ROOT / name / "oracle.json"
    if old.exists():                  # regenerate from the text the oracle was made from
        j = json.loads(old.read_text())
        return j["system"], j["user"]
    path, start, n = spec["text"]
    return spec["system"], (ROOT / path).read_text()[start:start + n]


def make_oracle(name: str, src: Path, keep: bool) -> dict:
    spec = ORACLES[name]
    work = Path(tempfile.mkdtemp(prefix=f"ds4-oracle-{name}-"))
    try:
        gguf = synth_model(spec["synth"], work / "model.gguf")
        cfg = model_config(gguf)
        driver = build(src, gguf, work)
        system, user = prompt_text(name, spec)
        ids = ds4_tokenize(driver, gguf, system, user, work)
        last = len(ids) - 1
        prefill_at = [p for p in CHECKPOINTS if p < last] + [last]
        dec, alldec, pre = ds4_logits(driver, gguf, ids, prefill_at, cfg.n_vocab, work)
        rows = sorted(set(range(min(DECODE_KEEP, len(ids)))) | set(prefill_at))
        out = OUT_ROOT / name
        out.mkdir(parents=True, exist_ok=True)
        _write_npz(out / "ds4_logits.npz", decode_positions=np.array(rows, np.int32),
                   decode_logits=dec[rows], prefill_positions=np.array(prefill_at, np.int32),
                   prefill_logits=pre, token_ids=np.array(ids, np.int32))
        _write_npz(out / ALL_DECODE, decode_positions=np.array(rows, np.int32), decode_logits=alldec[rows])
        meta = dict(name=name, synth=spec["synth"], gguf_sha256=sha256(gguf), n_vocab=cfg.n_vocab,
                    compress_ratios=list(cfg.compress_ratios), ds4_commit=ds4_commit(src),
                    machine=machine(), system=system, user=user, token_ids=ids,
                    decode_positions=rows, prefill_positions=prefill_at,
                    self_check=self_check(dec, pre, prefill_at), all_decode_vs_sync_first=drift(alldec[rows], dec[rows]))
        _write_text(out / "oracle.json", json.dumps(meta, indent=1) + "\n")
        _write_text(out / "README.md", readme(meta, spec, q4k=routed_q4k(gguf)))
        return meta
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def readme(meta: dict, spec: dict, q4k: bool) -> str:
    src = spec["text"]
    n = len(meta["token_ids"])
    q4 = ("\nThe routed experts are Q4_K: ds4's CPU path has no Q4_K kernels, so the build adds our own "
          "Q4_K x Q8_K block dot (edit 6 of the script): this oracle referees everything around the "
          "experts, not ds4's own Q4_K float order.\n" if q4k else "")
    return f"""# ds4 oracle {meta['name']}

Logits from ds4's own C CPU path (antirez/ds4 {meta['ds4_commit'][:12]}, edited to this tiny shape
by `scripts/build_ds4_oracle.py`, whose docstring lists every edit) on a synthetic model.
{q4}
- Model: `ds4-gguf synth OUT.gguf {' '.join(meta['synth'])}` (sha256 `{meta['gguf_sha256']}`;
  the tests regenerate it and check the hash). Compress ratios {meta['compress_ratios']},
  vocab {meta['n_vocab']}.
- Prompt: {n} tokens, a chat (system {meta['system']!r}, user = `{src[0]}` characters
  {src[1]}..{src[1] + src[2]} at the commit that made it; both texts are in `oracle.json`) rendered
  and tokenized by ds4 itself (`ds4_encode_chat_prompt`, no thinking).
- Built and run on: {meta['machine']}; 2 threads.
- ds4 decode vs ds4's own prefill at the prefill checkpoints (the scale of what is reproducible):
  median {meta['self_check']['decode_vs_prefill_median']}, max {meta['self_check']['decode_vs_prefill_max']}.

## Files

- `oracle.json`: `synth` (the model's arguments), `gguf_sha256`, `token_ids`, `system`, `user`,
  `decode_positions`, `prefill_positions`, `ds4_commit`, `machine`, `self_check`,
  `all_decode_vs_sync_first` (ds4's two token-by-token row sets: max-abs at position 0, median, p90, top-1).
- `ds4_logits.npz` (float32): `decode_logits` [{len(meta['decode_positions'])}, vocab], the sync-first
  rows: the logits after the token at each of `decode_positions` (every position below 300 and
  the prefill checkpoints), all tokens fed one at a time, the first through `ds4_session_sync` (the
  prefill path, as a real prompt's first token) and the rest through `ds4_session_eval` (the
  decode path); `prefill_logits` [{len(meta['prefill_positions'])}, vocab], for each of
  `prefill_positions` a fresh session synced to tokens[0..p] in one call, the last row; also
  `token_ids`. Row i is the distribution of the token after position i.
- `ds4_logits_all_decode.npz` (float32): `decode_positions` and `decode_logits`, the all-decode
  rows: the same, but the first token takes ds4's decode path too (build edit 8). The tests feed
  every token through our decode path one at a time, so these rows judge them; the sync-first
  rows are printed beside them. ds4's two row sets differ by {drift_text(meta)}.

## Regenerate

    git clone https://github.com/antirez/ds4 /tmp/ds4-src && git -C /tmp/ds4-src checkout {meta['ds4_commit'][:12]}
    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src make {meta['name']}
"""


def drift_text(meta: dict) -> str:
    d = meta["all_decode_vs_sync_first"]
    return (f"max-abs {d['pos0']} at position 0, median {d['median']}, p90 {d['p90']} "
            f"(top-1 agreement {d['top1']:.1%})")


def shared_readme(meta: dict) -> str:
    n = len(meta["decode_positions"])
    return f"""# ds4 all-decode rows for ../shared/ds4-oracle's model

`ds4_logits_all_decode.npz` (float32): `decode_positions` [{n}] (every position below
{DECODE_KEEP} and the shared oracle's prefill checkpoints) and `decode_logits` [{n}, 4096], the
logits ds4's CPU path gives after each token of `../shared/ds4-oracle/tokens.json` when every
token, the first included, is fed one at a time through its decode path (build edit 8 of
`scripts/build_ds4_oracle.py`). The shared oracle's own `decode_logits_all` feed the first token
through `ds4_session_sync` (the prefill path); `tests/test_ds4_oracles.py` feeds every token
through our decode path, so these rows judge it and the shared rows are printed beside them.

- Made with antirez/ds4 {meta['ds4_commit'][:12]} on {meta['machine']}; 2 threads.
- The same build first reproduced the shared oracle's decode and prefill logits bit for bit (the
  command writes nothing otherwise). The model is `../shared/ds4-oracle/ds4-tiny-q2.gguf`
  (sha256 `{meta['gguf_sha256']}`, checked by the test before it uses these rows).
- ds4's two row sets differ by {drift_text(meta)}.
- `oracle_decode.json`: the positions, the model's sha256, the ds4 commit, the machine, the drift.

## Regenerate

    git clone https://github.com/antirez/ds4 /tmp/ds4-src && git -C /tmp/ds4-src checkout {meta['ds4_commit'][:12]}
    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src shared-decode
"""


def self_check(dec, pre, positions) -> dict:
    """ds4's decode vs its own prefill at the checkpoints: the scale of what is reproducible."""
    d = np.abs(dec[positions] - pre).max(axis=1)
    return {"decode_vs_prefill_median": round(float(np.median(d)), 4),
            "decode_vs_prefill_max": round(float(d.max()), 4)}


def drift(a: np.ndarray, b: np.ndarray) -> dict:
    """How far ds4's all-decode rows are from its sync-first rows: the seed the first row plants."""
    d = np.abs(a - b).max(axis=1)
    top = float((a.argmax(axis=1) == b.argmax(axis=1)).mean())
    return {"pos0": round(float(d[0]), 4), "median": round(float(np.median(d)), 4),
            "p90": round(float(np.quantile(d, 0.9)), 4), "top1": round(top, 4)}


def _write_npz(path: Path, **arrays) -> None:
    """Written to a temp name and renamed; left alone when it already holds these arrays (a zip's
    timestamps would make a reproduced oracle a new blob in git)."""
    if path.exists():
        with np.load(path) as old:
            if set(old.files) == set(arrays) and all(
                    old[k].dtype == np.asarray(v).dtype and np.array_equal(old[k], v) for k, v in arrays.items()):
                return
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def ds4_commit(src: Path) -> str:
    f = src / "DS4_COMMIT"           # written by whoever exported the tree (git archive has no .git)
    if f.exists():
        return f.read_text().strip()
    r = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def machine() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx512vbmi", "avx512f", "avx2", "fma") if f in flags]
    cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return f"{os.uname().machine} {' '.join(isa)}; {' '.join(cc)}; -O3 -ffast-math -march=native"


def check_shared(src: Path, keep: bool, write: bool = False) -> None:
    """Rebuild ../shared/ds4-oracle's logits with these edits and say how far they are; with
    `write`, when they are bit for bit the same, write that model's all-decode rows (edit 8) to
    tests/oracles/shared-decode/."""
    work = Path(tempfile.mkdtemp(prefix="ds4-oracle-shared-"))
    try:
        gguf = SHARED / "ds4-tiny-q2.gguf"
        driver = build(src, gguf, work)
        ref = np.load(SHARED / "ds4_logits.npz")
        ids = json.loads((SHARED / "tokens.json").read_text())["token_ids"]
        pos = [int(p) for p in ref["positions"]]
        dec, alldec, pre = ds4_logits(driver, gguf, ids, pos, 4096, work)
        d_dec = float(np.abs(dec - ref["decode_logits_all"]).max())
        d_pre = float(np.abs(pre - ref["prefill_logits_at_positions"]).max())
        print("decode max |diff|:", d_dec, " prefill max |diff|:", d_pre)
        if write:
            if d_dec != 0.0 or d_pre != 0.0:
                raise SystemExit("the build does not reproduce ../shared/ds4-oracle bit for bit: nothing written")
            rows = sorted(set(range(min(DECODE_KEEP, len(ids)))) | set(pos))
            SHARED_DECODE.mkdir(parents=True, exist_ok=True)
            _write_npz(SHARED_DECODE / ALL_DECODE, decode_positions=np.array(rows, np.int32),
                       decode_logits=alldec[rows])
            meta = dict(of="../shared/ds4-oracle", gguf_sha256=sha256(gguf), ds4_commit=ds4_commit(src),
                        machine=machine(), decode_positions=rows,
                        all_decode_vs_sync_first=drift(alldec[rows], dec[rows]))
            _write_text(SHARED_DECODE / "oracle_decode.json", json.dumps(meta, indent=1) + "\n")
            _write_text(SHARED_DECODE / "README.md", shared_readme(meta))
            print("all-decode vs sync-first:", meta["all_decode_vs_sync_first"])
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def dump(name: str, src: Path, n_tokens: int, n_pos: int, out: Path, prefill: bool = False) -> None:
    """Build edit 7 for oracle NAME's model and write its decode intermediates (positions below
    n_pos) to out/NAME.dump and the logits of its first n_tokens ids, all decode, to out/NAME.f32;
    with `prefill`, the batched prefill path's intermediates of one sync of n_tokens ids to
    out/NAME-prefill.dump and its last row's logits to out/NAME-prefill.f32."""
    spec = ORACLES[name]
    work = Path(tempfile.mkdtemp(prefix=f"ds4-dump-{name}-"))
    try:
        gguf = synth_model(spec["synth"], work / "model.gguf")
        driver = build(src, gguf, work, dump=True)
        ids = json.loads((OUT_ROOT / name / "oracle.json").read_text())["token_ids"][:n_tokens]
        (work / "ids.txt").write_text("".join(f"{int(t)}\n" for t in ids))
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{name}-prefill" if prefill else name
        env = dict(driver_env(work), DS4_ORACLE_DUMP=str(out / f"{stem}.dump"), DS4_ORACLE_DUMP_POS=str(n_pos))
        run([driver, "dump-prefill" if prefill else "dump", gguf, work / "ids.txt", model_config(gguf).n_vocab, 1,
             out / f"{stem}.f32"], work, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds4-src", type=Path, help="a ds4 source tree (a checkout of antirez/ds4); "
                   "make and check-shared need it")
    p.add_argument("--keep", action="store_true", help="keep the temp build folder")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write tests/oracles/NAME (all when none named)")
    m.add_argument("names", nargs="*", metavar="NAME", help=", ".join(ORACLES))
    sub.add_parser("check-shared", help="rebuild ../shared/ds4-oracle's logits and compare")
    sub.add_parser("shared-decode", help="check-shared, then (bit for bit only) write its model's "
                   "all-decode rows to tests/oracles/shared-decode/")
    sub.add_parser("readmes", help="rewrite every oracle's README.md from its oracle.json")
    d = sub.add_parser("dump", help="a debug build (edit 7): NAME's decode intermediates into OUT")
    d.add_argument("name", metavar="NAME")
    d.add_argument("out", type=Path, metavar="OUT")
    d.add_argument("--tokens", type=int, default=8, help="ids fed, all through the decode path")
    d.add_argument("--positions", type=int, default=4, help="positions whose intermediates are written")
    d.add_argument("--prefill", action="store_true", help="the batched prefill path instead: one sync of "
                   "--tokens ids, the intermediates of its rows below --positions")
    a = p.parse_args(argv)
    if a.cmd != "readmes" and not (a.ds4_src and (a.ds4_src / "ds4.c").exists()):
        p.error(f"--ds4-src {a.ds4_src} is not a ds4 source tree (no ds4.c)")
    unknown = [n for n in getattr(a, "names", []) if n not in ORACLES]
    if unknown:
        p.error(f"unknown oracle {unknown[0]!r}; known: {', '.join(ORACLES)}")
    if a.cmd == "readmes":
        for name, spec in ORACLES.items():
            meta_path = OUT_ROOT / name / "oracle.json"
            if meta_path.exists():
                meta = json.loads(meta_path.read_text())
                q4k = "q4" in meta["synth"]
                _write_text(OUT_ROOT / name / "README.md", readme(meta, spec, q4k))
        if (SHARED_DECODE / "oracle_decode.json").exists():
            meta = json.loads((SHARED_DECODE / "oracle_decode.json").read_text())
            _write_text(SHARED_DECODE / "README.md", shared_readme(meta))
        return 0
    if a.cmd == "dump":
        if a.name not in ORACLES:
            p.error(f"unknown oracle {a.name!r}; known: {', '.join(ORACLES)}")
        dump(a.name, a.ds4_src, a.tokens, a.positions, a.out, a.prefill)
        return 0
    if a.cmd in ("check-shared", "shared-decode"):
        check_shared(a.ds4_src, a.keep, write=a.cmd == "shared-decode")
        return 0
    for name in a.names or list(ORACLES):
        meta = make_oracle(name, a.ds4_src, a.keep)
        print(f"{name}: {len(meta['token_ids'])} tokens, {len(meta['decode_positions'])} decode rows, "
              f"{len(meta['prefill_positions'])} prefill rows, {meta['self_check']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
