#!/usr/bin/env python3
"""Benchmark: tokenizer throughput on a long real text against the 2 MB/s target.

Writes a vocab-only GGUF (full 129,280-token DeepSeek V4 table, no tensors) to /tmp, builds the
tokenizer from it with `Tokenizer.from_gguf`, encodes the text three times and reports the best run
in MB/s (UTF-8 bytes per second) and its ratio to the target. For a peer it times HF `tokenizers`
loading the official tokenizer.json with added tokens restricted to ds4's seven markers, encoding
the same text in one call (no cutting, no parallelism), and says whether the ids agree.

    python scripts/bench_tokenizer.py [TEXT] [--runs 3] [--gguf /tmp/ds4-bench-vocab.gguf]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.gguf.synth import write_vocab_only  # noqa: E402
from engine.gguf.synth_vocab import tokenizer_json_path  # noqa: E402
from engine.runtime.tokenizer import MARKERS, Tokenizer  # noqa: E402

DEFAULT_TEXT = ROOT.parent / "shared" / "ds4-data" / "promessi_sposi.txt"
TARGET_MBPS = 2.0


def best_of(fn, runs: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def restricted_hf():
    from tokenizers import Tokenizer as HFTokenizer
    d = json.loads(tokenizer_json_path().read_text(encoding="utf-8"))
    d["added_tokens"] = [a for a in d["added_tokens"] if a["content"] in MARKERS]
    hf = HFTokenizer.from_str(json.dumps(d))
    # tokenizers renumbers added tokens missing from the model vocabulary: map markers back
    official = {a["content"]: a["id"] for a in d["added_tokens"]}
    remap = {hf.token_to_id(m): i for m, i in official.items()}
    return hf, remap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text", nargs="?", default=str(DEFAULT_TEXT), help=f"UTF-8 text file (default {DEFAULT_TEXT})")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gguf", default="/tmp/ds4-bench-vocab.gguf", help="where to write the vocab-only GGUF")
    a = ap.parse_args()

    path = Path(a.text)
    if not path.exists():
        print(f"{path}: no such file", file=sys.stderr)
        return 1
    text = path.read_text(encoding="utf-8")
    nbytes = len(text.encode("utf-8"))
    mb = nbytes / 1e6

    t = time.perf_counter()
    write_vocab_only(a.gguf, "full")
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    tok = Tokenizer.from_gguf(a.gguf)
    t_load = time.perf_counter() - t

    print(f"text: {path} ({len(text):,} chars, {nbytes:,} bytes); cpus: {os.cpu_count()}")
    print(f"vocab-only GGUF: {a.gguf} ({os.path.getsize(a.gguf) / 1e6:.1f} MB, written in {t_write:.2f} s), "
          f"Tokenizer.from_gguf {t_load:.2f} s")

    dt, ids = best_of(lambda: tok.encode(text), a.runs)
    mbps = mb / dt
    print(f"engine.runtime.tokenizer: {mbps:.2f} MB/s (best of {a.runs}: {dt:.3f} s), {len(ids):,} tokens, "
          f"{nbytes / max(len(ids), 1):.2f} bytes/token; ratio to the {TARGET_MBPS:g} MB/s target: "
          f"{mbps / TARGET_MBPS:.2f}x")

    try:
        hf, remap = restricted_hf()
    except ImportError:
        print("peer: HF tokenizers not installed")
        return 0
    hdt, enc = best_of(lambda: hf.encode(text, add_special_tokens=False), a.runs)
    hids = [remap.get(i, i) for i in enc.ids]
    hmbps = mb / hdt
    print(f"peer HF tokenizers (7 markers special, one call): {hmbps:.2f} MB/s (best of {a.runs}: "
          f"{hdt:.3f} s), {len(hids):,} tokens; ours/peer speed {mbps / hmbps:.2f}x; "
          f"ids {'identical' if hids == ids else 'DIFFER'}")
    return 0 if hids == ids else 2


if __name__ == "__main__":
    sys.exit(main())
