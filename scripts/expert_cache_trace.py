"""Record a routing trace with the expert cache and replay it under each eviction policy.

    python scripts/expert_cache_trace.py MODEL.gguf [--tokens 64] [--prompt-file F] [--out trace.json]

The model reads the prompt's first 64 tokens, then its next ones one decode step each (the packaged bench text by default) with
`--expert-cache 0`, recording each layer's routed experts per decode step (ExpertCache.trace); then
`expert_cache.replay` gives the hit rate of every policy at cache sizes from one token's working
set of one layer up to every expert of the file. A synthetic file's random weights route nearly
uniformly, so its hit rates are a floor for a real model's (real routing repeats experts); the
hash layers' routing follows the token ids, which a real text repeats.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench import default_text  # noqa: E402
from engine.gguf import expert_cache as X  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.runtime.session import Engine, Session  # noqa: E402


def record(model: str, text: str, n_tokens: int, backend: str) -> tuple[list, dict]:
    """The trace of n_tokens decode steps that read the text's tokens one by one after a prompt
    of its first 64 (each step's input is the text's next token, not the argmax: a synthetic
    model's greedy output soon repeats one token, and a real conversation does not)."""
    with Engine.open(model, EngineOptions(backend=backend, expert_cache=0)) as e:
        toks = e.tokenizer.encode(text)[:64 + n_tokens]
        s = Session(e, len(toks) + 8)
        s.sync(toks[:64])
        e.model.experts.trace = trace = []
        for t in toks[64:]:
            s.eval(t)
        c = e.config
        return trace, {"n_layer": c.n_layer, "n_expert": c.n_expert, "n_used": c.n_expert_used,
                       "steps": len(toks) - 64, "hash_layers": c.n_hash_layer}


def table(trace: list, info: dict, shares=(1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)) -> list[dict]:
    total = info["n_layer"] * info["n_expert"]
    sizes = sorted({info["n_used"]} | {max(1, round(total * f)) for f in shares})
    dec = trace
    rows = []
    for n in sizes:
        if n < info["n_used"]:
            continue
        rows.append({"slots": n, "share": n / total,
                     **{p: X.replay(dec, n, p) for p in X.POLICIES}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-file")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", help="write the trace (JSON) here")
    ap.add_argument("--shares", default="0.0625,0.125,0.25,0.5,1",
                    help="cache sizes as shares of all the file's experts (comma-separated)")
    a = ap.parse_args(argv)
    text = Path(a.prompt_file).read_text() if a.prompt_file else default_text()
    trace, info = record(a.model, text, a.tokens, a.backend)
    if a.out:
        Path(a.out).write_text(json.dumps({"info": info, "trace": trace}))
    print(f"{info['n_layer']} layers x {info['n_expert']} experts, {info['n_used']} a token; "
          f"{info['steps']} decode steps after 64 prompt tokens")
    print("| slots | share of experts | " + " | ".join(X.POLICIES) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in X.POLICIES) + " |")
    for r in table(trace, info, [float(x) for x in a.shares.split(",")]):
        print(f"| {r['slots']} | {r['share']:.0%} | " + " | ".join(f"{r[p]:.1%}" for p in X.POLICIES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
