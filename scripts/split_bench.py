"""Measure a split run (issue 38; docs/performance.md, docs/distributed.md).

  hop:   the ring alone, under mlx.launch -n 2 (or more): rank 0 sends a decode step's HC
         state (T x n_hc x n_embd float32) and gets a logits row (vocab float32) back, N times;
         prints the mean round time through the link thread (what a split pass pays) and
         with plain send/recv in the caller's thread, and the bytes each way; then N messages
         posted one way and one round (a pipelined prefill's pattern): time a message, MB/s.
  model: one model, prefill P tokens then decode G, with --layers L (under mlx.launch) or
         without (one process); prints the rates and, split, the ring's messages and bytes
         (--no-pipeline: each prefill chunk awaits its answer, as before the pipeline).

  mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- python scripts/split_bench.py hop
  python scripts/split_bench.py model M.gguf --backend cpu
  mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- python scripts/split_bench.py model M.gguf --layers auto
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def hop(a) -> int:
    from engine.runtime import distributed as D
    g = D.group()
    link = D.Link(g)
    x = np.ones(a.tokens * a.n_hc * a.n_embd, np.float32)
    back = np.ones(a.vocab, np.float32)
    n = a.n
    if link.rank > 0:                     # a worker: pass each message on; the last rank answers rounds only
        while True:
            h, parts = link.recv()
            op = int(h[0])
            if op == D.CLOSE or link.rank < link.size - 1:
                link.send(op, 0, (), parts)
            elif op == D.FWD:
                link.send(op, 0, (), [back])
            if op == D.CLOSE:
                return 0
    for _ in range(3):                                       # (warm-up)
        link.exchange(D.FWD, 0, (), [x], timeout=60)
    t0 = time.perf_counter()
    for _ in range(n):
        link.exchange(D.FWD, 0, (), [x], timeout=60)
    t_thread = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        link.send(D.FWD, 0, (), [x])
        link.recv()
    t_direct = (time.perf_counter() - t0) / n
    # a pipelined prefill's messages: n posts one way (nothing comes back), then one round
    t0 = time.perf_counter()
    for _ in range(n):
        link.post(D.POST, 0, (), [x], timeout=60)
    link.exchange(D.FWD, 0, (), [x], timeout=60)
    t_post = (time.perf_counter() - t0) / (n + 1)
    link.exchange(D.CLOSE, 0, (), [], timeout=60)
    print(f"hop: {link.size} ranks, out {x.nbytes + 8 * D.HEADER:,} B (HC state of {a.tokens} token(s)), "
          f"back {back.nbytes + 8 * D.HEADER:,} B (logits of {a.vocab}); round {t_thread * 1e3:.2f} ms through "
          f"the link thread, {t_direct * 1e3:.2f} ms direct; posted one way {t_post * 1e3:.2f} ms a message "
          f"({x.nbytes / t_post / 1e6:.0f} MB/s) (means of {n}); load {os.getloadavg()[0]:.1f}")
    return 0


def model(a) -> int:
    from engine import Engine, EngineOptions, Session
    eng = Engine.open(a.model, EngineOptions(backend=a.backend, layers=a.layers, paging="none", threads=a.threads))
    rng = np.random.default_rng(0)
    V = eng.config.n_vocab
    prompt = rng.integers(0, min(V, 1000), a.prompt).tolist()
    split = getattr(eng.model, "split", None)
    if split is not None and a.no_pipeline:
        # each chunk a full round, its answer awaited (the prefill before the pipeline)
        split.post = lambda tokens, pos0, state: split.forward(tokens, pos0, state)
    sess = Session(eng, a.prompt + a.gen + 16, chunk=a.chunk)
    t0 = time.perf_counter()
    sess.sync(prompt)
    tp = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(a.gen):
        sess.eval(int(np.argmax(sess.logits)))
    tg = time.perf_counter() - t0
    where = f"{len(split.ranges)} ranks {split.ranges}" if split is not None else "one process"
    where += ", prefill not pipelined" if split is not None and a.no_pipeline else ""
    line = (f"model: {where}, backend {eng.backend}: prefill {a.prompt} tokens {a.prompt / tp:.2f} t/s, "
            f"decode {a.gen} tokens {a.gen / tg:.2f} t/s; load {os.getloadavg()[0]:.1f}")
    if split is not None:
        st = split.coord.link.stats
        line += f"; rank 0 sent {st['messages']} messages, {st['sent_bytes']:,} B"
    print(line, flush=True)
    eng.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    h = sub.add_parser("hop")
    h.add_argument("-n", type=int, default=200)
    h.add_argument("--tokens", type=int, default=1)
    h.add_argument("--n-hc", type=int, default=4)
    h.add_argument("--n-embd", type=int, default=4096)
    h.add_argument("--vocab", type=int, default=129280)
    m = sub.add_parser("model")
    m.add_argument("model")
    m.add_argument("--layers", default=None)
    m.add_argument("--backend", default="cpu")
    m.add_argument("--threads", type=int, default=None)
    m.add_argument("--prompt", type=int, default=64)
    m.add_argument("--gen", type=int, default=16)
    m.add_argument("--chunk", type=int, default=32)
    m.add_argument("--no-pipeline", action="store_true", help="split: await each prefill chunk's answer")
    a = p.parse_args(argv)
    return hop(a) if a.mode == "hop" else model(a)


if __name__ == "__main__":
    from engine.console import exit_now
    sys.stdout.flush()
    exit_now(main())
