"""Config, layout and synthetic files against ds4's own file and the sizes of spec/model.md §8."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine import ModelFile
from engine.gguf.config import FLASH, flash_schedule
from engine.gguf.gguf_cli import main as gguf_main
from engine.gguf.gguf_file import GGUFFile
from engine.gguf.inspect import report
from engine.gguf.synth import config_for, write_synthetic
from engine.gguf.synth_vocab import deepseek_vocab


def _inventory(path):
    g = GGUFFile(path)
    keys = [(k, f.type, f.elem_type) for k, f in g.fields.items()]
    tensors = [(n, t.type_id, t.dims) for n, t in g.tensors.items()]
    return keys, tensors


def test_oracle_loads_with_its_config(oracle_gguf):
    with ModelFile.open(oracle_gguf) as m:
        c = m.config
        assert (c.n_layer, c.n_embd, c.n_vocab, c.n_head, c.head_dim) == (6, 256, 4096, 8, 128)
        assert c.compress_ratios == (0, 0, 4, 128, 4, 128) and c.n_hash_layer == 3
        assert (c.idx_n_head, c.idx_head_dim, c.idx_topk, c.n_swa) == (4, 128, 16, 16)
        assert m.recipe == "q2" and m.layout.extra == []
        assert not m.has("blk.0.exp_probs_b.bias") and m.has("blk.3.exp_probs_b.bias")
        assert "n_layer=6 (Flash: 43)" in c.flash_differences()


def test_synth_tiny_has_the_oracle_inventory(oracle_gguf, tiny_q2):
    """Same metadata keys (and value types, and order), tensor names, dtypes and dims as ds4 wrote."""
    assert _inventory(tiny_q2) == _inventory(oracle_gguf)


@pytest.mark.parametrize("recipe,types", [("q2", ("IQ2_XXS", "IQ2_XXS", "Q2_K")),
                                          ("q4", ("Q4_K", "Q4_K", "Q4_K")),
                                          ("mxfp4", ("MXFP4", "MXFP4", "MXFP4"))])
def test_synth_inspect_round_trip(recipe, types, models_dir, capsys):
    out = models_dir / f"rt-{recipe}.gguf"
    assert gguf_main(["synth", str(out), "--recipe", recipe, "--layers", "4", "--seed", "3"]) == 0
    assert gguf_main(["inspect", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert r["recipe"] == recipe and r["n_tensors"] == len(r["tensors"]) and not r["flash_shape"]
    got = {n.split(".")[2]: ty for n, ty, _, _ in r["tensors"] if n.startswith("blk.3.ffn_") and "_exps" in n}
    assert (got["ffn_gate_exps"], got["ffn_up_exps"], got["ffn_down_exps"]) == types
    assert r["config"]["compress_ratios"] == [0, 0, 4, 128]


def test_flash_sparse_file_matches_the_spec_sizes(flash_q2_sparse):
    """spec/model.md §8.1-8.2: file size and weight bytes per decoded token of the q2 file."""
    with ModelFile.open(flash_q2_sparse) as m:
        assert m.config.flash_differences() == [] and m.recipe == "q2"
        assert len(m.gguf.tensors) == 1328
        r = report(m)
    assert r["flash_shape"]
    assert r["bytes_per_token"] == {"short": 9_206_796_708, "long": 9_559_118_244}
    assert r["long_context_from"] == 2052
    assert r["components"]["routed experts"]["bytes"] == 43 * 256 * 7_077_888
    assert round(r["file_bytes"] / 1e9, 2) == 86.72  # spec: 86.71 GB of tensors + metadata


def _per_layer(ratios, recipe, models_dir, n_hash):
    cfg, vocab = config_for("flash", n_layer=len(ratios), ratios=ratios, vocab=512, n_hash_layer=n_hash)
    path = models_dir / f"one-layer-{'-'.join(map(str, ratios))}-{recipe}.gguf"
    write_synthetic(path, cfg, recipe=recipe, vocab=vocab, fill="zero")
    with ModelFile.open(path) as m:
        return report(m)["layers"][0]["bytes_per_token"]


def test_real_width_single_layer_bytes_match_spec(models_dir):
    """One real-width layer per kind; numbers are spec/model.md §8.2's per-layer column."""
    csa = _per_layer([4], "q2", models_dir, n_hash=0)
    assert csa["hyper-connections"] == 1_573_080
    assert csa["norms+sinks"] == 39_168
    assert csa["attention"] == 113_639_424
    assert csa["compressor"] == 16_787_456
    assert csa["indexer"] == 4_196_864 + 524_288 + 16_777_216
    assert csa["router"] == 2_097_152 + 1_024
    assert csa["shared expert"] == 26_738_688
    assert csa["routed experts"] == 42_467_328
    hca = _per_layer([128], "q2", models_dir, n_hash=1)
    assert hca["compressor"] == 8_521_728 and hca["indexer"] == 0
    assert hca["hash table"] == 24 and hca["router"] == 2_097_152
    q4 = _per_layer([0], "q4", models_dir, n_hash=0)
    assert q4["routed experts"] == 6 * 14_155_776 and q4["compressor"] == 0


def test_synth_is_deterministic_per_seed(models_dir):
    cfg, vocab = config_for("tiny", n_layer=3)
    a = write_synthetic(models_dir / "a.gguf", cfg, vocab=vocab, seed=7).path
    b = write_synthetic(models_dir / "b.gguf", cfg, vocab=vocab, seed=7).path
    c = write_synthetic(models_dir / "c.gguf", cfg, vocab=vocab, seed=8).path
    ba, bb, bc = (open(p, "rb").read() for p in (a, b, c))
    assert ba == bb and ba != bc and len(ba) == len(bc)


def test_synth_weights_have_sane_scales(tiny_q2):
    with ModelFile.open(tiny_q2) as m:
        c = m.config
        emb = m.tensor("token_embd.weight").rows(0, 512)
        assert 0.8 < emb.std() < 1.2
        qa = m.tensor("blk.0.attn_q_a.weight").rows(0, c.q_lora_rank)
        assert 0.7 < qa.std() * np.sqrt(c.n_embd) < 1.3
        gate = m.tensor("blk.3.ffn_gate_exps.weight").expert(5).rows(0, c.n_ff_exp)
        assert np.isfinite(gate).all() and 0.6 < gate.std() * np.sqrt(c.n_embd) < 1.4
        norm = m.tensor("blk.2.attn_norm.weight").vector()
        assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15
        tid = m.tensor("blk.0.ffn_gate_tid2eid.weight").int32()
        assert tid.shape == (c.n_vocab, c.n_expert_used)
        assert tid.min() >= 0 and tid.max() < c.n_expert
        assert (np.sort(tid, axis=1)[:, 1:] != np.sort(tid, axis=1)[:, :-1]).all()  # distinct per token


def test_tiny_vocab_is_a_prefix_of_the_real_one_plus_specials():
    full_t, full_ty, full_m = deepseek_vocab("full")
    t, ty, m = deepseek_vocab(4049)
    assert len(full_t) == 129280 and len(full_m) == 127741
    assert t[:4049] == full_t[:4049] and len(t) == 4096
    for s in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<|EOT|>",
              "<｜tool▁calls▁begin｜>", "<｜begin▁sys｜>", "<｜latest_reminder｜>"):
        assert s in t
    have = set(t)
    assert m and all(a in have and b in have and a + b in have for a, b in (x.split(" ", 1) for x in m))
    rank = {x: i for i, x in enumerate(full_m)}
    assert [rank[x] for x in m] == sorted(rank[x] for x in m)  # rank order kept


def test_flash_schedule_and_constants():
    assert flash_schedule(6) == (0, 0, 4, 128, 4, 128)
    assert flash_schedule(43).count(4) == 21 and flash_schedule(43).count(128) == 20
    assert FLASH["n_vocab"] == 129280


def test_console_scripts_run(tiny_q2):
    for args in (["-m", "engine.gguf.gguf_cli", "inspect", str(tiny_q2)], ["-m", "ds4agent.ds4_cli", "-m", str(tiny_q2), "-p", "hi", "-n", "2"],
                 ["-m", "ds4agent.cli", "--help"]):
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
