"""The batcher: decode steps of Sessions on several threads run as one batched forward pass.

Several timelines on one Engine (the serve slots, one thread each) each ask for a decode step at
about the same time; run one after the other, each step reads every weight again. The batcher
gathers the steps that are waiting and runs them as one `Model.forward_batch` (each weight read
once for all of them, each session's attention over its own KV), then hands each session its row
of logits. A prefill (a sync of many tokens) runs one chunk at a time, alternating with decode
batches, so a long prompt never stalls the others for longer than a chunk.

Use (off by default; engine.runtime.session.Engine):

    engine.start_batching(window_ms=4.0, prefill_chunk=256)   # --serve turns it on
    with session.generating():       # this session will ask for decode steps: wait for it
        for ...: session.eval(token) # (from its own thread; Session's API is unchanged)
    engine.stop_batching()

One executor thread of its own (started with the first request, ended when batching is off and
nothing is queued) runs every step: it gathers (until every session registered as generating has
a request in, or `window_ms` has passed), runs one batch and hands out the results; the callers
wait. Always the same thread, because the C kernels' OpenMP team belongs to the thread that
starts a parallel region: when the caller that happened to be free ran each step (the first
design), every serve slot's thread grew a team of its own, and the idle teams' workers spun for
their spin count on the 2 cores the running team needed: 4 streams stepped in 235 ms where the
same forward_batch takes 166 (scripts/bench_slots.py, docs/performance.md). One session alone
(or every generating session already waiting) runs at once: no window to wait.
Within one step the order is fixed: decode batches and prefill chunks alternate while both wait;
a prefill chunk's order is first come, first served (a session's next chunk queues behind others').

Errors stay with their session: a bad token or a full context is refused in the caller's thread
before it queues (Session.eval, Session.sync); if a batched pass still fails, each of its steps is
run again alone (a step writes its KV rows by position, so running it again is harmless) and only
the one that fails gets the error.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

import numpy as np

DECODE, PREFILL = "decode", "prefill"


class _Request:
    __slots__ = ("session", "tokens", "pos", "all_logits", "done", "result", "error")

    def __init__(self, session, tokens: list[int], all_logits: bool):
        self.session, self.tokens, self.all_logits = session, tokens, all_logits
        self.pos = session.pos
        self.done, self.result, self.error = False, None, None


class Batcher:
    """One per Engine (`engine.batcher`); `enabled` routes the Engine's Sessions through it."""

    def __init__(self, engine):
        self.engine = engine
        self.enabled = False
        self.window_s = 0.004
        self.prefill_chunk: int | None = 256
        self.max_batch: int | None = None
        self._cv = threading.Condition()
        self._decodes: list[_Request] = []
        self._prefills: deque[_Request] = deque()
        self._executor: threading.Thread | None = None
        self._generating: dict[int, int] = {}   # id(session) -> nesting depth of generating()
        self._last = PREFILL
        self._recent: set[int] = set()          # id(session) of the last decode batch
        # what ran: steps and rows, the largest batch, prefill chunks, batches run again alone
        self.stats = {"decode_steps": 0, "decode_rows": 0, "max_batch": 0, "prefill_chunks": 0, "retried": 0}
        self.trace: deque | None = None         # (kind, [id(session)...], tokens) per step, when kept

    # -- configuration -------------------------------------------------------------------------
    def configure(self, window_ms: float, prefill_chunk: int | None, max_batch: int | None, trace: int):
        if window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {window_ms}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        with self._cv:
            self.window_s = window_ms / 1000.0
            self.prefill_chunk = prefill_chunk
            self.max_batch = max_batch
            self.trace = deque(maxlen=trace) if trace else None
            self.stats = dict.fromkeys(self.stats, 0)      # (since this start)
            self._recent = set()

    # -- who is generating ---------------------------------------------------------------------
    @contextmanager
    def generating(self, session):
        with self._cv:
            self._generating[id(session)] = self._generating.get(id(session), 0) + 1
        try:
            yield session
        finally:
            with self._cv:
                n = self._generating.get(id(session), 0) - 1
                if n > 0:
                    self._generating[id(session)] = n
                else:
                    self._generating.pop(id(session), None)
                self._cv.notify_all()      # an executor may be waiting for this session

    # -- the caller's side ---------------------------------------------------------------------
    def run(self, session, tokens: list[int], all_logits: bool) -> np.ndarray:
        """Logits of `tokens` appended to `session`'s timeline (host float32, as
        Model.forward's): run in a batch with others' decode steps, or as one prefill chunk."""
        req = _Request(session, tokens, all_logits)
        with self._cv:
            (self._decodes.append if len(tokens) == 1 else self._prefills.append)(req)
            if self._executor is None or not self._executor.is_alive():
                self._executor = threading.Thread(target=self._execute, name="ds4-batcher", daemon=True)
                self._executor.start()
            self._cv.notify_all()
            try:
                while not req.done:
                    self._cv.wait()
            except BaseException:
                # the caller gives up (an interrupt): a step not yet taken leaves the queue; one
                # already running completes, its result unused (a step writes its KV rows by
                # position, so the session's next step simply writes them again)
                for q in (self._decodes, self._prefills):
                    if req in q:
                        q.remove(req)
                raise
        if req.error is not None:
            raise req.error
        return req.result

    # -- the executor's side -------------------------------------------------------------------
    def _execute(self):
        while True:
            with self._cv:
                while not (self._decodes or self._prefills):
                    if not self.enabled:
                        self._executor = None
                        return
                    self._cv.wait(0.5)      # (batching turned off with nothing queued: end)
                kind, batch = self._gather()
                if not batch:
                    continue
            try:
                self._run(kind, batch)
            except BaseException as e:      # (_run keeps errors per request; this is a last resort)
                for r in batch:
                    r.error = r.error or e
            with self._cv:
                self._last = kind
                if self.trace is not None:
                    self.trace.append((kind, [id(r.session) for r in batch], sum(len(r.tokens) for r in batch)))
                for r in batch:
                    r.done = True
                self._cv.notify_all()

    def _gather(self) -> tuple[str, list[_Request]]:
        """(kind, requests) of the next step, taken off the queues (called with the lock held)."""
        deadline = None
        while True:
            if not self._decodes and not self._prefills:
                return DECODE, []            # (the only waiting caller gave up)
            if self._prefills and self._last == DECODE:     # alternate while both wait
                return PREFILL, [self._prefills.popleft()]
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.window_s
            # decode steps wait for every generating session; a prefill chunk only for those
            # that were in the last decode batch (about to ask again: their step goes first),
            # not for one busy elsewhere
            if now >= deadline or not self._waiting_for(recent_only=not self._decodes):
                if self._decodes:
                    n = len(self._decodes) if self.max_batch is None else self.max_batch
                    batch, self._decodes = self._decodes[:n], self._decodes[n:]
                    self._recent = {id(r.session) for r in batch}
                    return DECODE, batch
                if self._prefills:
                    return PREFILL, [self._prefills.popleft()]
            # (a new request or a session leaving generating() wakes this early)
            self._cv.wait(max(deadline - now, 0.0005))

    def _waiting_for(self, recent_only: bool) -> bool:
        """Whether a session registered as generating (and, recent_only, in the last decode
        batch) has no request in yet."""
        want = self._generating.keys() & self._recent if recent_only else self._generating.keys()
        if not want:
            return False
        queued = {id(r.session) for r in self._decodes}
        queued.update(id(r.session) for r in self._prefills)
        return any(k not in queued for k in want)

    def _run(self, kind: str, batch: list[_Request]):
        eng = self.engine
        model = eng.model
        with eng.lock:
            if kind == PREFILL or len(batch) == 1:
                self._run_alone(batch[0])
            else:
                try:
                    out = model.ops.logits_to_host(model.forward_batch(
                        [r.tokens[0] for r in batch], [r.pos for r in batch], [r.session.state for r in batch]))
                except Exception:
                    self.stats["retried"] += 1
                    for r in batch:
                        self._run_alone(r)
                else:
                    for b, r in enumerate(batch):
                        r.result = out[b:b + 1] if r.all_logits else out[b]
        if kind == DECODE:
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += len(batch)
            self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        else:
            self.stats["prefill_chunks"] += 1

    def _run_alone(self, r: _Request):
        model = self.engine.model
        try:
            r.result = model.ops.logits_to_host(model.forward(np.asarray(r.tokens), r.pos, r.session.state,
                                                              all_logits=r.all_logits))
        except Exception as e:      # (the caller's thread raises it)
            r.error = e
