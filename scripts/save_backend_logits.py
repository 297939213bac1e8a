"""Write tests/golden/backend_logits.npz: the numpy and cpu backends' logits on two tiny synthetic
models, in both numerics, as the engine computes them at the commit this runs on. A refactor of
the backend seam must leave them bit-identical (tests/test_backend_golden.py).

The cpu backend's results depend on the kernel build the machine selects (avx512vbmi, avx2, ...)
and NumPy's on its BLAS kernels, so the file records both; the test compares only where the
running machine selects the same ones, and skips with the reason elsewhere. Regenerate on the
commit that defines the reference (the file says which) with:

    .venv/bin/python scripts/save_backend_logits.py [--out tests/golden/backend_logits.npz]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {   # name -> (config_for kwargs, write_synthetic kwargs)
    "tiny_q2": (dict(vocab=465, idx_n_head=16), dict(recipe="q2", seed=21)),
    "tiny_q4": (dict(n_layer=3, ratios=[0, 4, 128], vocab=465), dict(recipe="q4", seed=22)),
}
PROMPT = 40          # prompt tokens, prefilled in chunks of CHUNK
CHUNK = 16
DECODE = 6           # greedy decode steps after the prompt


def machine() -> dict:
    from threadpoolctl import threadpool_info

    from engine.backends.cpu import kernels
    blas = [(i.get("internal_api"), i.get("architecture")) for i in threadpool_info() if i.get("user_api") == "blas"]
    return {"kernel_isa": kernels.isa() or "", "numpy": np.__version__, "blas": json.dumps(blas)}


def run(path: str, backend: str, numerics: str) -> np.ndarray:
    """Logits after each chunk of the prompt's prefill and after each greedy decode step."""
    from engine import Engine, Session
    rng = np.random.default_rng(7)
    with Engine.open(path, backend=backend, numerics=numerics, paging="none") as eng:
        s = Session(eng, 512, chunk=CHUNK)
        vocab = eng.config.n_vocab
        prompt = [int(t) for t in rng.integers(0, vocab, PROMPT)]
        rows = []
        for end in range(CHUNK, PROMPT + 1, CHUNK):
            s.sync(prompt[:end])
            rows.append(np.array(s.logits, dtype=np.float32))
        s.sync(prompt)
        rows.append(np.array(s.logits, dtype=np.float32))
        for _ in range(DECODE):
            tok = int(np.argmax(s.logits))
            s.eval(tok)
            rows.append(np.array(s.logits, dtype=np.float32))
        return np.stack(rows)


def write_models(folder: Path) -> dict[str, str]:
    from engine.gguf.synth import config_for, write_synthetic
    out = {}
    for name, (ckw, wkw) in MODELS.items():
        cfg, vocab = config_for("tiny", **ckw)
        out[name] = str(write_synthetic(folder / f"{name}.gguf", cfg, vocab=vocab, **wkw).path)
    return out


def compute(folder: Path, backends=("numpy", "cpu")) -> dict[str, np.ndarray]:
    from engine.backends.cpu import kernels
    arrays = {}
    for name, path in write_models(folder).items():
        for backend in backends:
            if backend == "cpu" and not kernels.available():
                continue
            for numerics in ("exact", "ds4"):
                arrays[f"{name}/{backend}/{numerics}"] = run(path, backend, numerics)
    return arrays


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "tests" / "golden" / "backend_logits.npz"))
    a = p.parse_args(argv)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        arrays = compute(Path(d))
    meta = dict(machine(), commit=commit, prompt=PROMPT, chunk=CHUNK, decode=DECODE)
    tmp = a.out + ".tmp.npz"
    np.savez_compressed(tmp, __meta__=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}: {len(arrays)} runs, {meta}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
