#!/usr/bin/env python3
"""Issue 23's bar through HTTP: one streaming client alone, then N streaming clients at once, on
one `--serve` shim with N slots (the engine batching their decode steps), greedy, in the same run.

    python scripts/bench_serve_slots.py -m /tmp/f4.gguf [--backend cpu] [--clients 4]
                                        [--tokens 32] [--rounds 2] [--ctx 4096]

Each client streams /v1/chat/completions (thinking off, temperature 0, ignore_eos-like: a
max_tokens it reaches on a synthetic model) with a prompt of its own. Decode t/s of a stream is
its tokens after the first over the time from its first content chunk to its last (the client's
view: prefill and queueing excluded); the aggregate is all streams' tokens over the time from the
first stream's first chunk to the last stream's last. Each round runs alone, then N (a drift of
the machine falls on both alike). Printed per round and as medians: alone, each stream, the
aggregate, aggregate / alone (the bar: >= 3x) and alone / slowest stream (<= 1.5x). The engine
level of the same measurement (no HTTP) is scripts/bench_slots.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from ds4agent.serve import ServeConfig, ServerThread, Shim  # noqa: E402
from engine import Engine, EngineOptions  # noqa: E402


def stream(url: str, text: str, tokens: int) -> tuple[int, float, float]:
    """(content chunks after the first, time of the first, time of the last)."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0,
            "stream": True, "thinking": {"type": "disabled"}}
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            for c in d.get("choices", []):
                if c.get("delta", {}).get("content") or c.get("delta", {}).get("reasoning_content"):
                    times.append(time.perf_counter())
    if len(times) < 2:
        raise SystemExit(f"a stream sent {len(times)} content chunks: raise --tokens or check the model")
    return len(times) - 1, times[0], times[-1]


def round_(url: str, n: int, tokens: int, tag: str) -> list[tuple[int, float, float]]:
    out: list = [None] * n
    errors = []

    def run(i):
        try:
            out[i] = stream(url, f"{tag} client {i}: write a long story about the number {i}.", tokens)
        except BaseException as e:       # noqa: BLE001 - reported after the join
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096)
    a = p.parse_args()
    engine = Engine.open(a.model, EngineOptions(backend=a.backend))
    engine.wait_resident()
    shim = Shim(engine, ServeConfig(ctx=a.ctx, slots=a.clients))
    rows = []
    with ServerThread(shim) as url:
        round_(url, 1, 4, "warm-up")
        for r in range(a.rounds):
            (n1, f1, l1), = round_(url, 1, a.tokens, f"alone {r}")
            alone = n1 / (l1 - f1)
            many = round_(url, a.clients, a.tokens, f"many {r}")
            each = [n / (last - first) for n, first, last in many]
            agg = sum(n for n, _, _ in many) / (max(x[2] for x in many) - min(x[1] for x in many))
            rows.append((alone, agg, each))
            st = getattr(getattr(engine, "batcher", None), "stats", None)
            if st:       # how many decode rows each batched step carried, so far in the run
                print(f"  batcher: {st}", flush=True)
            print(f"round {r + 1}: alone {alone:.2f} t/s; {a.clients} at once: aggregate {agg:.2f} t/s, "
                  f"each {', '.join(f'{e:.2f}' for e in each)}; aggregate/alone {agg / alone:.2f}x, "
                  f"alone/slowest {alone / min(each):.2f}x", flush=True)
    alone = statistics.median(x[0] for x in rows)
    agg = statistics.median(x[1] for x in rows)
    slow = statistics.median(min(x[2]) for x in rows)
    print(f"median: alone {alone:.2f} t/s, aggregate {agg:.2f} t/s ({agg / alone:.2f}x; bar >= 3x), "
          f"slowest stream {slow:.2f} t/s ({alone / slow:.2f}x slower than alone; bar <= 1.5x); "
          f"backend {engine.backend}, {engine.model.ops.__class__.__module__}, machine load "
          f"{open('/proc/loadavg').read().split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
