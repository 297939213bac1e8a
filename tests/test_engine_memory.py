"""Weights stay in the map: a decode step reads only the rows it needs.

Checked two ways: by recording every block range the dequantizer is handed during one decode
step (only the selected experts' slabs of a routed-expert tensor are ever touched, and no call
decodes more than one chunk of rows), and by the peak RSS of one real-width decode step in a fresh
process, which must stay far below the file size.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine import Engine, Session
from engine.gguf import quants
from engine.gguf.synth import config_for, write_synthetic
from engine.model import ds4_matmul


def test_decode_touches_only_selected_expert_slabs(small_model, monkeypatch):
    with Engine.open(small_model) as e:
        c = e.config
        s = Session(e, 256)
        s.sync([0, 5, 9, 77, 300])
        g = e.file.gguf
        spans = {n: (g.tensor_bytes(n).__array_interface__["data"][0], t.nbytes) for n, t in g.tensors.items()}
        touched = []
        real = quants.dequantize

        def spy(type_id, raw, *dtype):      # (dtype: float64 decodes for the exact Q8 matmuls)
            touched.append((raw.__array_interface__["data"][0], raw.size))
            return real(type_id, raw, *dtype)
        monkeypatch.setattr(quants, "dequantize", spy)
        # ds4's integer dots decode a copy of an expert's blocks with its scales replaced
        # (ds4_matmul._with_scales): the copy's source is what the map gave, so record that
        copies = {}
        real_ws = ds4_matmul._with_scales

        def with_scales(blocks, *a):
            out = real_ws(blocks, *a)
            copies[out.__array_interface__["data"][0]] = blocks
            return out
        monkeypatch.setattr(ds4_matmul, "_with_scales", with_scales)
        s.eval(123)
    touched = [(copies[a].__array_interface__["data"][0], copies[a].size) if a in copies else (a, n)
               for a, n in touched]
    per_expert_tensor = {}
    for addr, size in touched:
        owner = [n for n, (a, nb) in spans.items() if a <= addr < a + nb]
        if not owner:  # the one embedding row, gathered by token id (a copy of those bytes)
            assert size == g.tensors["token_embd.weight"].nbytes // c.n_vocab
            continue
        assert len(owner) == 1
        name = owner[0]
        a, nb = spans[name]
        assert addr + size <= a + nb
        if "_exps" in name:
            slab = nb // c.n_expert
            first, last = (addr - a) // slab, (addr + size - 1 - a) // slab
            assert first == last, f"{name}: one call spans experts {first}..{last}"
            per_expert_tensor.setdefault(name, set()).add(first)
        else:
            assert size <= max(256 * g.tensors[name].nbytes // max(1, np.prod(g.tensors[name].dims[1:])), 1 << 20)
    assert per_expert_tensor, "no routed expert was evaluated"
    assert all(len(v) <= c.n_expert_used for v in per_expert_tensor.values())


CHILD = r"""
import json, resource, sys
from engine import Engine, Session
e = Engine.open(sys.argv[1])
s = Session(e, 256)
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
opened = rss()
s.sync([0, 1, 2])
before = rss()
s.eval(3)
after = rss()
print(json.dumps({"opened_kib": opened, "before_kib": before, "after_kib": after}))
"""


def _decode_rss(models_dir, fill):
    cfg, vocab = config_for("flash", n_layer=1, ratios=[4], n_hash_layer=0, vocab=4049)
    path = models_dir / f"real-width-1-layer-{fill}.gguf"
    r = write_synthetic(path, cfg, recipe="q2", vocab=vocab, fill=fill)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    growth = (m["after_kib"] - m["before_kib"]) * 1024
    total = (m["after_kib"] - m["opened_kib"]) * 1024
    print(f"file {r.nbytes / 2**20:.0f} MiB ({fill}): one decode step grew peak RSS by {growth / 2**20:.1f} MiB, "
          f"a 3-token prefill plus that step by {total / 2**20:.1f} MiB")
    path.unlink()
    return growth, total, r.nbytes


def test_real_width_decode_step_allocates_no_whole_tensor(models_dir):
    """Sparse file (no data to page in): the growth is the step's own allocations, which a full
    dequantization of any real-width tensor (attn_q_b alone: 128 MiB of float32) would exceed."""
    growth, total, size = _decode_rss(models_dir, "zero")
    assert growth < 64 * 2**20


@pytest.mark.slow
def test_real_width_decode_step_peak_rss_is_far_below_file_size(models_dir):
    """Random weights (a 1.9 GiB file written for the test): mapped pages count in RSS, and a step
    pages in the dense weights plus 6 of the 256 experts only."""
    growth, total, size = _decode_rss(models_dir, "random")
    assert growth < size / 8 and total < size / 4
