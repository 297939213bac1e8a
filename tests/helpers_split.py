"""Starting the ranks of a split run in tests, and a driver every rank runs (tests/test_distributed.py).

`spawn` starts one process per rank with the environment mlx.launch gives its ranks (MLX_RANK, and
MLX_HOSTFILE naming a JSON list of one "ip:port" list per rank), on loopback ports free now.

The driver (`python helpers_split.py MODE MODEL ...`) opens the model with --layers on every rank;
rank 0 does MODE, the others serve inside Engine.open and never return.
  tokens  PROMPT_IDS N CHUNK: greedy, prints `gen[i] id` lines
  save    PROMPT_IDS CHUNK OUT: prefill, write the session payload to OUT
  resume  PAYLOAD N: load a payload, fork it; greedy N more on each, then rewind 5 and 4 more
  hang    PROMPT_IDS SAVED: prefill, save to SAVED, print `ready`, then decode until stopped
  suite   SPEC.json: several runs in one launch (process start and imports are most of a small
          run's time): each run opens its own model and backend on every rank, does its check on
          rank 0 and closes; the workers serve one engine a run (`OneEngine`), then the next.
          Rank 0 prints each run's lines prefixed with its tag.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_env(rank: int, hostfile: Path, **extra) -> dict:
    # ranks that take turns on a shared machine must not spin their idle threads at each other
    env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), DS4_PAGING="none",
               OMP_WAIT_POLICY="PASSIVE")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def spawn(tmp: Path, argvs: list[list[str]], **extra) -> list[subprocess.Popen]:
    """One process per argv, rank i running argvs[i]."""
    hostfile = tmp / f"hosts-{os.getpid()}-{len(list(tmp.glob('hosts-*')))}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(len(argvs))]))
    return [subprocess.Popen(argv, env=rank_env(r, hostfile, **extra), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(HERE))
            for r, argv in enumerate(argvs)]


def driver(*args) -> list[str]:
    return [sys.executable, str(HERE / "helpers_split.py"), *map(str, args)]


def finish(procs, timeout: float = 120) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, o, e))
    return out


def gen_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("gen[")]


def greedy(sess, n: int) -> list[str]:
    import numpy as np
    out = []
    for i in range(n):
        t = int(np.argmax(sess.logits))
        out.append(f"gen[{i}] {t}")
        if i + 1 < n:
            sess.eval(t)
    return out


def stop_then_greedy(sess, ids, n) -> list[str]:
    """A prefill stopped after its second chunk (progress says no), the logits there, then the
    rest of the prompt and greedy n: a split run posts the first chunks and settles the logits."""
    import hashlib
    sess.sync(ids, progress=lambda done, total: done < 2 * sess.chunk)
    out = [f"stopped {len(sess.tokens)} {int(sess.logits.argmax())} {hashlib.sha256(sess.logits.tobytes()).hexdigest()[:16]}"]
    sess.sync(ids)
    return out + greedy(sess, n)


def _suite(spec_path) -> int:
    import json as _json
    from engine import Engine, EngineOptions, Session
    from engine.runtime import distributed as D
    spec = _json.loads(Path(spec_path).read_text())
    link = D.shared_link(D.group())
    opts = [EngineOptions(backend=r["backend"], layers=r.get("layers", "auto"), paging="none", threads=1,
                          expert_cache=r.get("expert_cache")) for r in spec["runs"]]
    if link.rank > 0:
        from engine.runtime.split_worker import Worker, _quiet

        class Next(BaseException):
            pass

        class OneEngine(Worker):
            def _close(self, op, sid, a, parts):
                self.link.send(*super()._close(op, sid, a, parts))
                raise Next

        _quiet()
        for r, o in zip(spec["runs"], opts):
            try:
                OneEngine(link, r["model"], o, Engine).run()
            except Next:
                pass
        return 0
    ids = [int(x) for x in spec["ids"].split(",")]
    for r, o in zip(spec["runs"], opts):
        eng = Engine.open(r["model"], o)
        tag = r["tag"]
        if r["kind"] == "tokens":
            sess = Session(eng, 256, chunk=r["chunk"])
            st = link.stats
            before = dict(st)
            sess.sync(ids)
            print(f"{tag} prefill posted {st['posted'] - before['posted']} rounds {st['rounds'] - before['rounds']}")
            sess.reset()
            if r.get("expert_cache") is not None:     # (rank 0's own layers run from the cache)
                print(f"{tag} cache {eng.model.experts.stats()['misses'] > 0}")
            print("\n".join(f"{tag} {ln}" for ln in stop_then_greedy(sess, ids, r["n"])), flush=True)
        elif r["kind"] == "save":
            sess = Session(eng, 256, chunk=r["chunk"])
            sess.sync(ids)
            Path(r["out"]).write_bytes(sess.snapshot())
        elif r["kind"] == "resume":
            sess = Session(eng, 256)
            sess.restore(Path(r["src"]).read_bytes())
            fork = sess.fork()
            print("\n".join(f"{tag} {ln}" for ln in greedy(sess, r["n"])), flush=True)
            print("\n".join(f"{tag} fork {ln}" for ln in greedy(fork, r["n"])), flush=True)
            sess.rewind(5)                  # cut back in place on every rank, then on again
            print("\n".join(f"{tag} rewound {ln}" for ln in greedy(sess, 4)), flush=True)
        eng.close()
    return 0


def _main(argv) -> int:
    if argv[0] == "suite":
        return _suite(argv[1])
    from engine import Engine, EngineOptions, Session
    mode, model, layers, backend = argv[:4]
    rest = argv[4:]
    eng = Engine.open(model, EngineOptions(backend=backend, layers=layers, paging="none"))
    ids = lambda s: [int(x) for x in s.split(",")]          # noqa: E731
    if mode == "tokens":
        sess = Session(eng, 256, chunk=int(rest[2]))
        sess.sync(ids(rest[0]))
        print("\n".join(greedy(sess, int(rest[1]))), flush=True)
    elif mode == "save":
        sess = Session(eng, 256, chunk=int(rest[1]))
        sess.sync(ids(rest[0]))
        Path(rest[2]).write_bytes(sess.snapshot())
    elif mode == "resume":
        sess = Session(eng, 256)
        sess.restore(Path(rest[0]).read_bytes())
        fork = sess.fork()
        print("\n".join(greedy(sess, int(rest[1]))), flush=True)
        print("\n".join("fork " + ln for ln in greedy(fork, int(rest[1]))), flush=True)
        sess.rewind(5)                  # cut back in place on every rank, then on again
        print("\n".join("rewound " + ln for ln in greedy(sess, 4)), flush=True)
    elif mode == "hang":
        sess = Session(eng, 256, chunk=4)
        sess.sync(ids(rest[0]))
        Path(rest[1]).write_bytes(sess.snapshot())
        print("ready", flush=True)
        try:
            while True:
                sess.eval(int(sess.logits.argmax()))
                if sess.pos > 200:
                    sess.rewind(100)
        except OSError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
    eng.close()
    return 0


if __name__ == "__main__":
    from engine.console import exit_now
    exit_now(_main(sys.argv[1:]))
