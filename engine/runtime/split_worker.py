"""A worker rank of a split run: it prints nothing, holds its layers and their KV state, and
answers the ring's messages until rank 0's process ends (engine/runtime/distributed.py has the
protocol, engine/runtime/split_engine.py rank 0's side).

A worker opens the same command line's model file, tells rank 0 a hash of its header and
tensor directory and its free memory (HELLO), binds only the layers rank 0's plan gives it
(PLAN), and then, per session id: makes, resets, cuts back, copies, saves and loads its layers'
state, and runs its layers on the HC state of each pass (FWD). When rank 0 closes its engine
(CLOSE) the worker frees its own and waits for the next HELLO; when rank 0's process ends, the
link closes and the worker ends with status 0.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from ..model import snapshot as snap
from ..model.layer_split import Keep, LayerRunner, PartialKVState
from . import distributed as D

PROTOCOL = 2          # 2: prefill chunks posted one way (POST, TAIL)


def file_identity(m) -> str:
    """sha256 of the file's header and tensor directory (every byte before the tensor data)."""
    with open(m.path, "rb") as f:
        return hashlib.sha256(f.read(m.gguf.data_offset)).hexdigest()


def free_memory() -> int:
    """MemAvailable (Linux), else the physical memory (macOS has no MemAvailable)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            avail = 1 << 30
    return int(avail)


def bind_engine(engine_cls, m, keep: Keep, backend: str, o, ops):
    """This rank's Engine over its layers (`keep`), with the routed experts in a bounded cache
    when asked (--expert-cache: the same steps as Engine.open, sized by this rank's share)."""
    cache = getattr(o, "expert_cache", None)
    if cache is not None:
        from ..gguf.expert_cache import expert_names
        if hasattr(ops, "unbound"):          # (mlx: its slots are the experts' arrays; not bound)
            ops.unbound = expert_names(m)
    m.keep = keep
    eng = engine_cls(m, backend, o.numerics, o.threads, ops)
    if cache is not None:
        from ..gguf.expert_cache import attach
        attach(eng.model, m, cache, dense=kept_dense_bytes(m, keep))
    return eng


def kept_dense_bytes(m, keep: Keep) -> int:
    """The bytes of the weights this rank binds other than the routed experts."""
    n = 0
    for name, ti in m.layout.present.items():
        if name.endswith("_exps.weight"):
            continue
        if name.startswith("blk."):
            n += ti.nbytes if keep.has(int(name.split(".")[1])) else 0
        elif name.startswith("token_embd"):
            n += ti.nbytes if keep.embed else 0
        else:
            n += ti.nbytes if keep.head else 0
    return n


def pack_json(x) -> np.ndarray:
    return np.frombuffer(json.dumps(x).encode(), np.uint8)


def unpack_json(a):
    return json.loads(np.array(a, copy=False).tobytes().decode())


def _quiet():
    """A worker prints nothing: stdout and stderr (the ring's own C++ messages too) go nowhere."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class Worker:
    def __init__(self, link: D.Link, path, options, engine_cls):
        self.link, self.path, self.o, self.engine_cls = link, path, options, engine_cls
        self.m = self.eng = self.runner = self.keep = None
        self.states: dict = {}
        self.tails: dict = {}           # the last rank: a session's last posted row (TAIL's input)
        self.failed: str | None = None  # a posted pass that failed here: told at the next round
        log = os.environ.get("DS4_SPLIT_LOG")
        self.log = open(f"{log}.rank{link.rank}", "a") if log else None

    def run(self):
        link = self.link
        while True:
            try:
                h, parts = link.recv()
            except Exception:           # rank 0 (or a neighbour) is gone: nothing left to serve
                self._exit(0)
            op = int(h[0])
            t0 = time.perf_counter()
            if self.failed is not None and op != D.ERR:
                # after a posted pass failed here: drop the posts behind it, and answer the next
                # round with the failure (nothing goes towards rank 0 outside a round)
                out = None if op == D.POST else (D.ERR, 0, (), [pack_json(self.failed)])
                self.failed = self.failed if op == D.POST else None
            else:
                try:
                    out = self.handle(op, h, parts)
                except Exception as e:      # the failure goes to rank 0 as one line naming this rank
                    msg = f"rank {link.rank}: {e}"
                    out = None if op == D.POST else (D.ERR, 0, (), [pack_json(msg)])
                    self.failed = msg if op == D.POST else None
            if self.log is not None:     # DS4_SPLIT_LOG: what this worker did, and how long each took
                print(f"op {op} sid {int(h[1])} args {h[2:6].tolist()} {time.perf_counter() - t0:.3f} s"
                      + (f" -> {unpack_json(out[3][0])}" if out and out[0] == D.ERR else ""), file=self.log, flush=True)
            if out is None:
                continue
            try:
                link.send(*out)
            except Exception:
                self._exit(0)

    def _exit(self, rc: int):
        from ..console import exit_now
        exit_now(rc)

    @property
    def last(self) -> bool:
        return self.link.rank == self.link.size - 1

    def handle(self, op, h, parts):
        sid, a = int(h[1]), [int(x) for x in h[2:6]]
        fn = getattr(self, "_" + {D.HELLO: "hello", D.PLAN: "plan", D.NEW: "new", D.FREE: "free", D.RESET: "reset",
                                  D.TRUNC: "trunc", D.CANTRUNC: "cantrunc", D.FWD: "fwd", D.SAVE: "save",
                                  D.LOAD: "load", D.COPY: "copy", D.CLOSE: "close", D.ERR: "err", D.POST: "fwd",
                                  D.TAIL: "tail"}[op])
        return fn(op, sid, a, parts)

    # -- start and end ---------------------------------------------------------------------------
    def _hello(self, op, sid, a, parts):
        from ..gguf.model_file import ModelFile
        infos = unpack_json(parts[0])
        self.tails.clear()
        self.states.clear()             # (a new engine on rank 0: the last one's sessions are gone)
        me = {"rank": self.link.rank, "free": free_memory(), "protocol": PROTOCOL}
        try:
            if self.m is not None:
                self.m.close()
            self.m = ModelFile.open(self.path, check_merges=False)
            me["hash"] = file_identity(self.m)
        except Exception as e:
            me["error"] = f"rank {self.link.rank}: {e}"
        return op, sid, a, [pack_json(infos + [me])]

    def _plan(self, op, sid, a, parts):
        from ..backends import registry
        info = unpack_json(parts[0])
        r = self.link.rank
        lo, hi = info["ranges"][r]
        self.keep = Keep((lo, hi), embed=False, head=self.last)
        o = self.o
        entry = registry.pick(o.backend)
        ops = registry.make_ops(entry, o.numerics)
        entry.setup(o.threads)
        self.eng = bind_engine(self.engine_cls, self.m, self.keep, entry.name, o, ops)
        self.runner = LayerRunner(self.eng.model, self.keep)
        info["status"].append({"rank": r, "backend": entry.name})
        return op, sid, a, [pack_json(info)]

    def _close(self, op, sid, a, parts):
        self.tails.clear()
        self.states.clear()
        if self.eng is not None:
            self.eng.close()
        self.m = self.eng = self.runner = None
        return op, sid, a, []

    def _err(self, op, sid, a, parts):
        return op, sid, a, parts          # (passed on to rank 0 as it came)

    # -- a session's state -------------------------------------------------------------------------
    def _fresh(self, ctx, rewind_cap):
        host = PartialKVState(self.eng.config, ctx, rewind_cap, self.keep.layers)
        return self.eng.model.ops.state_from_host(host)

    def _new(self, op, sid, a, parts):
        self.states[sid] = self._fresh(a[0], a[1])
        return op, sid, a, []

    def _free(self, op, sid, a, parts):
        for s in np.array(parts[0], copy=False).tolist() if parts else [sid]:
            self.states.pop(int(s), None)
            self.tails.pop(int(s), None)
        return op, sid, a, []

    def _reset(self, op, sid, a, parts):
        self.states[sid].reset()
        return op, sid, a, []

    def _trunc(self, op, sid, a, parts):
        self.states[sid].truncate(a[0], a[1])
        return op, sid, a, []

    def _cantrunc(self, op, sid, a, parts):
        ok = a[2] and self.states[sid].can_truncate(a[0], a[1])
        return op, sid, (a[0], a[1], int(ok)), []

    def _copy(self, op, sid, a, parts):
        ops, src = self.eng.model.ops, self.states[a[0]]
        host = ops.state_to_host(src)
        host = host.copy_to(np, np.array) if host is src else host
        self.states[sid] = ops.state_from_host(host)
        return op, sid, a, []

    def _save(self, op, sid, a, parts):
        """Append this rank's layers' blocks (in layer order) and their (layer, n_comp, n_index,
        bytes) rows to what the ranks before it sent."""
        T = a[0]
        st = self.states[sid]
        host = self.eng.model.ops.state_to_host(st)
        R = min(snap.raw_window(self.eng.config, st.ctx), T)
        blocks, rows = [np.array(parts[0], copy=False)], [np.array(parts[1], copy=False)]
        for il in range(*self.keep.layers):
            ls = host.layers[il]
            b = snap.layer_block(ls, T, R)
            blocks.append(np.frombuffer(b, np.uint8))
            rows.append(np.array([il, ls.n_comp, ls.n_index, len(b)], np.int64))
        return op, sid, a, [np.concatenate(blocks), np.concatenate(rows)]

    def _load(self, op, sid, a, parts):
        host = PartialKVState(self.eng.config, a[0], a[1], self.keep.layers)
        snap.load(self.eng.config, host, memoryview(np.array(parts[0], copy=False)))
        self.states[sid] = self.eng.model.ops.state_from_host(host)
        return op, sid, a, [] if self.last else parts

    # -- a pass ----------------------------------------------------------------------------------
    def _fwd(self, op, sid, a, parts):
        pos0, T, all_logits = a[0], a[1], bool(a[2])
        c, model = self.eng.config, self.eng.model
        tokens = np.array(parts[0], copy=False)
        X = D.from_wire(model.xp, parts[1]).reshape(T, c.n_hc, c.n_embd)
        X = self.runner.layers(X, tokens, pos0, self.states[sid])
        if self.last and op == D.POST:
            # a chunk nobody waits for: keep its last row (TAIL), send nothing back (D.POST)
            self.tails[sid] = np.array(model.ops.logits_to_host(X[-1:]), copy=True)
            return None
        if self.last:
            self.tails.pop(sid, None)
            return op, sid, a, [model.ops.logits_to_host(self.runner.head(X, all_logits))]
        # (logits_to_host: the backend's token boundary -- MLX evaluates the pass and every state)
        return op, sid, a, [tokens, model.ops.logits_to_host(X)]

    def _tail(self, op, sid, a, parts):
        """The logits of the last row posted for `sid` (the last rank makes them)."""
        if not self.last:
            return op, sid, a, []
        model = self.eng.model
        X = D.from_wire(model.xp, self.tails[sid])
        return op, sid, a, [model.ops.logits_to_host(self.runner.head(X, False))]


def worker_main(path, options, link: D.Link, engine_cls):
    """Serve the ring until rank 0's process ends; never returns. engine_cls: the Engine class
    (passed in: this module is below engine.runtime.session, which imports it)."""
    _quiet()
    Worker(link, path, options, engine_cls).run()
