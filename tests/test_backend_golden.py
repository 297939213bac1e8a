"""The numpy and cpu backends' logits, bit for bit, against tests/golden/backend_logits.npz: what
the engine computed before the backend seam moved (scripts/save_backend_logits.py says how it
was made; the file records the commit). Only where this machine selects the same kernel build
and BLAS kernels as the one that wrote it: elsewhere the test skips and says what differs."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "backend_logits.npz"


def _script():
    spec = importlib.util.spec_from_file_location("save_backend_logits", ROOT / "scripts" / "save_backend_logits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_logits_bit_identical_to_the_saved_ones(tmp_path):
    gen = _script()
    with np.load(GOLDEN) as z:
        saved = {k: z[k] for k in z.files}
    meta = json.loads(str(saved.pop("__meta__")))
    here = gen.machine()
    differs = {k: (meta[k], here[k]) for k in ("kernel_isa", "blas") if meta[k] != here[k]}
    if differs:
        pytest.skip(f"the golden logits were computed with other kernels: {differs} (saved, here)")
    now = gen.compute(tmp_path)
    assert set(now) == set(saved), (sorted(now), sorted(saved))
    for key, want in saved.items():
        got = now[key]
        assert got.shape == want.shape, key
        if not np.array_equal(got, want):
            d = np.abs(got - want)
            pytest.fail(f"{key}: not bit-identical (max-abs {d.max():.3g}, "
                        f"relative {d.max() / np.abs(want).max():.3g}) to commit {meta['commit'][:12]}")
