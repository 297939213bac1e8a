"""The ring between ranks: `mx.distributed` (MLX's ring backend, TCP) as a message link, with a
timeout on every wait (issue 38; docs/distributed.md).

Every exchange is one trip round the ring: rank 0 sends a message to rank 1, each worker handles
it and sends its result on, and the last rank's message comes back to rank 0; only a prefill's chunks before
its last are posted one way (POST below), which pipelines the prefill. A message is a header
(HEADER int64: op, session id, four arguments, and the kind and length of up to three payload
arrays) and then one body holding its payloads. Only neighbours talk, which is all the
ring backend needs to connect.

Waits: rank 0 waits at most `round_timeout(tokens)` for a round to come back (HOP_TIMEOUT_S, plus
HOP_TOKEN_S per token the round computes: a 2,048-token prefill chunk on a slow worker is
minutes); a worker waits for the next command without limit (rank 0 may sit at a prompt for
hours), and ends when its link to a neighbour closes. MLX's recv cannot be cancelled, so the
waits run in one link thread and the caller waits on it; a round that timed out leaves the link
broken, and the process ends through engine.console.exit_now (the stuck thread never returns).
"""
from __future__ import annotations

import os
import sys
import threading
from queue import Queue

import numpy as np

# rank 0's wait for a round's answer: a base, plus this per token computed in the round
HOP_TIMEOUT_S = float(os.environ.get("DS4_HOP_TIMEOUT", "60"))
HOP_TOKEN_S = float(os.environ.get("DS4_HOP_TOKEN_TIMEOUT", "1"))
# the start: every rank opens the file, and the workers bind their layers (a device upload)
OPEN_TIMEOUT_S = float(os.environ.get("DS4_OPEN_TIMEOUT", "1800"))

HEADER = 12          # op, sid, a, b, c, d, then (kind, n) for up to three payloads
MAX_PARTS = 3
KINDS = {1: np.uint8, 2: np.int64, 3: np.float32}
KIND_OF = {np.dtype(v): k for k, v in KINDS.items()}

# ops (every one travels the whole ring and comes back to rank 0, except POST)
HELLO, PLAN, NEW, FREE, RESET, TRUNC, CANTRUNC, FWD, SAVE, LOAD, COPY, CLOSE, ERR, POST, TAIL = range(1, 16)
# POST: a prefill chunk that is not the last of its prefill. It goes round the ring like FWD, but
# the last rank keeps its final row instead of answering, so rank 0 computes the next chunk while
# the workers compute this one (a pipeline). Nothing ever travels back to rank 0 while rank 0 may
# be sending: the only message towards rank 0 is the answer to a round, and rank 0 sends nothing
# while it waits for one. (MLX's ring sends block; two ranks sending each other large messages at
# once deadlocked.) TAIL: the logits of a session's last posted row (a prefill stopped early).


class HopError(ConnectionError):
    """A rank that died, a link that dropped, a hop that timed out, or a worker's failure: one
    line naming the rank. After one, the split engine refuses every further pass."""


def launched() -> bool:
    """Under mlx.launch (or the same environment): a hostfile naming more than one rank."""
    f = os.environ.get("MLX_HOSTFILE")
    return bool(f) and "MLX_RANK" in os.environ and os.path.isfile(f) and os.path.getsize(f) > 2


def this_rank() -> int:
    return int(os.environ.get("MLX_RANK", "0")) if launched() else 0


_GROUP: list = []


def group():
    """The process's ring group, made once (None when not launched)."""
    if not _GROUP:
        if not launched():
            return None
        import mlx.core as mx
        try:
            _GROUP.append(mx.distributed.init(strict=True, backend="ring"))
        except RuntimeError as e:
            raise HopError(f"rank {this_rank()}: cannot join the ring ({e})") from None
    return _GROUP[0]


_LINK: list = []
_FILTERED: list = []


def shared_link(g) -> "Link":
    """The process's one link (one thread, one lock): every engine opened in it shares it."""
    if not _LINK:
        _LINK.append(Link(g))
    return _LINK[0]


def filter_ring_noise():
    """Rank 0's stderr without the ring backend's own lines: a lost peer makes its C++ print
    "[ring] Socket N was closed by the peer" a dozen times, where the user needs the one line
    that names the rank. fd 2 goes through a pipe and a thread that drops lines starting with
    "[ring]"; at exit the pipe is drained and fd 2 restored. Once a process."""
    import atexit
    if _FILTERED:
        return
    _FILTERED.append(True)
    real = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def pump():
        buf = b""
        with os.fdopen(r, "rb", buffering=0) as f:
            while True:
                chunk = f.read(65536)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                keep = b"".join(ln + b"\n" for ln in lines if not ln.startswith(b"[ring]"))
                if keep:
                    os.write(real, keep)
        if buf and not buf.startswith(b"[ring]"):
            os.write(real, buf)

    t = threading.Thread(target=pump, name="ds4-stderr", daemon=True)
    t.start()

    @atexit.register
    def restore():
        try:
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
        os.dup2(real, 2)        # the pipe's last writer closes: the pump drains it and ends
        t.join(timeout=5)


def from_wire(xp, a):
    """A received payload (a host view of MLX's receive buffer) in the backend's namespace: the
    view itself for the host backends (no copy), an upload for a device backend."""
    return a if xp is np else xp.asarray(a)


class Link:
    """This rank's ends of the ring: send to the next rank, receive from the previous one."""

    def __init__(self, g):
        import mlx.core as mx
        self.mx, self.g = mx, g
        self.rank, self.size = g.rank(), g.size()
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.lock = threading.RLock()        # one round at a time (sessions on several threads)
        self.broken: HopError | None = None
        self.stats = {"sent_bytes": 0, "messages": 0, "rounds": 0, "posted": 0}
        self._jobs: Queue = Queue()
        threading.Thread(target=self._serve, name="ds4-ring", daemon=True).start()
        from ..console import threads_kept
        threads_kept()        # a thread that may sit in MLX: the command ends through os._exit

    def _serve(self):
        while True:
            fn, box, done = self._jobs.get()
            try:
                box["out"] = fn()
            except BaseException as e:       # (handed to the waiting caller)
                box["err"] = e
            done.set()

    def _call(self, fn, timeout):
        box, done = {}, threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            raise TimeoutError
        if "err" in box:
            raise box["err"]
        return box["out"]

    def send(self, op: int, sid: int = 0, args=(), parts=()):
        """Send one message to the next rank, in this thread (a worker's; rank 0 uses exchange)."""
        h, body = self._pack(op, sid, args, parts)
        mx = self.mx
        for a in (h, body) if body is not None else (h,):
            mx.eval(mx.distributed.send(mx.array(a), self.next, group=self.g, stream=mx.cpu))
        self.stats["messages"] += 1
        self.stats["sent_bytes"] += h.nbytes + (0 if body is None else body.nbytes)

    def recv(self):
        """(header int64 [HEADER], [payload arrays, host views]) of the next message from the
        previous rank, in this thread."""
        mx = self.mx
        h = mx.distributed.recv((HEADER,), mx.int64, self.prev, group=self.g, stream=mx.cpu)
        mx.eval(h)
        h = np.array(h)
        sizes = [(int(h[6 + 2 * i]), int(h[7 + 2 * i])) for i in range(MAX_PARTS) if h[6 + 2 * i]]
        total = sum(_padded(n * np.dtype(KINDS[k]).itemsize) for k, n in sizes)
        body = None
        if total:
            body = mx.distributed.recv((total,), mx.uint8, self.prev, group=self.g, stream=mx.cpu)
            mx.eval(body)
            body = np.array(body, copy=False)          # a view of MLX's buffer: no copy
        parts, at = [], 0
        for k, n in sizes:
            nb = n * np.dtype(KINDS[k]).itemsize
            parts.append(body[at:at + nb].view(KINDS[k]) if nb else np.zeros(0, KINDS[k]))
            at += _padded(nb)
        return h, parts

    def post(self, op: int, sid: int = 0, args=(), parts=(), timeout: float | None = None):
        """Rank 0's one-way message (POST): sent in the link thread, at most `timeout` s (the next
        rank takes it once it has finished the chunk before). None, or the exception of a send
        that failed."""
        def go():
            try:
                self.send(op, sid, args, parts)
            except BaseException as e:
                return e
            self.stats["posted"] += 1
            return None
        return self._call(go, timeout)

    def exchange(self, op: int, sid: int = 0, args=(), parts=(), timeout: float | None = None):
        """Rank 0's round: send to rank 1 and wait for the last rank's answer, in the link thread,
        at most `timeout` s. A failure comes back as (which, exception): "send" or "recv"."""
        def go():
            try:
                self.send(op, sid, args, parts)
            except BaseException as e:
                return "send", e
            try:
                got = self.recv()
            except BaseException as e:
                return "recv", e
            self.stats["rounds"] += 1
            return "ok", got
        return self._call(go, timeout)

    @staticmethod
    def _pack(op, sid, args, parts):
        """The header and one body holding every payload (each padded to 8 bytes): two sends a
        hop whatever it carries (each send is a wake-up on both sides)."""
        h = np.zeros(HEADER, np.int64)
        h[0], h[1] = op, sid
        h[2:2 + len(args)] = [int(x) for x in args]
        chunks = []
        for i, p in enumerate(parts):
            p = np.ascontiguousarray(p).reshape(-1)
            h[6 + 2 * i], h[7 + 2 * i] = KIND_OF[p.dtype], p.size
            b = p.view(np.uint8)
            chunks.append(b)
            pad = _padded(b.size) - b.size
            if pad:
                chunks.append(np.zeros(pad, np.uint8))
        body = np.concatenate(chunks) if chunks and sum(c.size for c in chunks) else None
        return h, body


def _padded(n: int) -> int:
    return -(-n // 8) * 8


def round_timeout(tokens: int = 0) -> float:
    return HOP_TIMEOUT_S + HOP_TOKEN_S * max(0, tokens)


def lost(e: BaseException, rank: int, timeout: float | None = None) -> HopError:
    """The one line for a failed hop with `rank` (the neighbour the hop talked to)."""
    if isinstance(e, TimeoutError):
        return HopError(f"rank {rank} did not answer within {timeout:.0f} s (the hop timeout: DS4_HOP_TIMEOUT="
                        f"{HOP_TIMEOUT_S:g} s + DS4_HOP_TOKEN_TIMEOUT={HOP_TOKEN_S:g} s a token); "
                        f"the split run stops")
    return HopError(f"rank {rank} is gone: its connection was lost ({str(e).strip() or type(e).__name__}); "
                    f"the split run stops")
