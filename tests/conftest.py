"""Shared fixtures: synthetic models are generated once per test session, never downloaded."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite's referee is the NumPy reference: Engine.open(backend="auto") would pick the C kernels
# when they are built. The kernels have their own tests (test_kernels.py, test_ops_cpu.py); a run
# may still choose them for everything with DS4_BACKEND=cpu.
os.environ.setdefault("DS4_BACKEND", "numpy")
# and the memory tests measure what a forward pass itself maps in: no prefault at open
os.environ.setdefault("DS4_PAGING", "none")

from engine.gguf.synth import config_for, write_synthetic

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ORACLE = SHARED / "ds4-oracle"


def need_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared/ folder beside the checkout holds it)")
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_q2(models_dir) -> Path:
    """The ds4-oracle shape, q2 recipe, seeded random weights (12 MB)."""
    cfg, vocab = config_for("tiny")
    return Path(write_synthetic(models_dir / "tiny-q2.gguf", cfg, recipe="q2", vocab=vocab, seed=1).path)


@pytest.fixture(scope="session")
def flash_q2_sparse(models_dir) -> Path:
    """The full published Flash shape and vocabulary, no data (an 86.7 GB sparse file)."""
    cfg, vocab = config_for("flash")
    return Path(write_synthetic(models_dir / "flash-q2.gguf", cfg, recipe="q2", vocab=vocab, fill="zero").path)


@pytest.fixture
def oracle_gguf() -> Path:
    return need_shared(ORACLE / "ds4-tiny-q2.gguf")


@pytest.fixture(scope="session")
def small_model(models_dir) -> Path:
    """A fast model for engine invariants: the tiny shape with a 512-id vocabulary and 16 indexer
    heads (so indexer scores have no ties), q2 experts."""
    cfg, vocab = config_for("tiny", vocab=465, idx_n_head=16)
    return Path(write_synthetic(models_dir / "small-q2.gguf", cfg, recipe="q2", vocab=vocab, seed=5).path)


@pytest.fixture(scope="session")
def agent_model(models_dir) -> Path:
    """For agent and UI tests: two layers (sliding window + ratio-128 compression) and a
    16k-entry vocabulary, so the ~11k characters of tool schemas are ~3k tokens and a turn is fast."""
    cfg, vocab = config_for("tiny", n_layer=2, ratios=[0, 128], vocab=16000)
    return Path(write_synthetic(models_dir / "agent-q2.gguf", cfg, recipe="q2", vocab=vocab, seed=9).path)
