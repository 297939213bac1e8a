"""The shim's scheduler: N live KV slots (slot.py), one thread each, and the queue of requests
waiting for one (protocol.md §5.0, §7). Each request goes to the slot whose timeline it reuses
most; requests on different slots run at the same time (their forward passes share the engine:
serialized, or batched into one decode step where the engine batches).

Which slot (the rule docs/serve.md "Slots" states):
1. own slot: an idle slot whose whole timeline the prompt continues (token or text prefix, a live
   binding), else one whose timeline it keeps at least BRANCH_KEEP of, or loses at most
   BRANCH_SMALL tokens of while reusing BRANCH_PROMPT of the prompt (a branch of that
   conversation, cut back in place); the most reused tokens win.
2. a busy slot would be better by WAIT_TOKENS or more (the request shares that much more with the
   prompt the slot is running): the request waits for that slot instead; later requests in the
   queue may pass it.
3. else a new conversation: the least recently used idle slot (never-used slots first); its
   timeline is saved to the disk cache first when there is one (the slot's evict moment).
"""
from __future__ import annotations

import logging
import threading
import time
from engine import Engine
from prompts import ToolMemory
from sessions.prefix_cache import PrefixCache

from . import events as E
from .config import ServeConfig
from .job import Job, QueueFull
from .slot import Slot

__all__ = ["Job", "QueueFull", "Worker"]    # (Job and QueueFull live in job.py; callers import them here too)

log = logging.getLogger("ds4agent.serve")

# A request is a branch of a slot's conversation (a regenerated or edited last turn, cut back in
# place there) when it keeps at least this share of the slot's timeline. Less, and it is more
# likely another conversation on the same long prefix (a sub-agent under the same system prompt
# and tools): cutting would cost that conversation its tail, again at each of their turns, so it
# takes its own slot and prefills the shared prefix once.
BRANCH_KEEP = 0.8
# ... or when the cut loses at most BRANCH_SMALL tokens and what it keeps is at least
# BRANCH_PROMPT of the prompt: a short tail (a regenerated reply, a capped answer re-rendered
# differently, an edited short turn) costs little to prefill again; the prompt share keeps a
# conversation that shares only the template's first tokens from counting as a branch
BRANCH_SMALL = 256
BRANCH_PROMPT = 0.3
# A request waits for a busy slot when that slot would reuse at least this many more of its
# tokens than the best idle one: about what a prefill of that length costs against an unknown
# wait (at the cpu backend's real-width prefill, 1024 tokens are seconds to tens of seconds).
WAIT_TOKENS = 1024


class Worker:
    """The slots, the queue of jobs not yet given to one, and what the app asks of both."""

    def __init__(self, engine: Engine, cfg: ServeConfig, *, memory: ToolMemory | None = None,
                 cache: PrefixCache | None = None):
        self.engine = engine
        self.tok = engine.tokenizer
        self.cfg = cfg
        self.memory = memory
        self.cache = cache
        self.lock = threading.Lock()           # guards bindings, memory, _forced and stats
        self.cache_lock = threading.RLock()    # one slot at a time stores or loads a checkpoint
        self.slots = [Slot(self, i) for i in range(max(1, cfg.slots))]
        self._cv = threading.Condition()       # guards _pending and every slot's job
        self._pending: list[Job] = []          # arrival order, not yet given to a slot
        self._changed = False                  # a job came or a slot freed since the last choice
        self._recent = self.slots[0]           # the slot given the latest job
        self._forced: list[str] = []
        self._started = False
        self._batching = False                 # this worker turned the engine's batcher on
        self.closing = False
        self._submit_lock = threading.Lock()
        self._job_s = 1.0                      # a job's run time, smoothed: the Retry-After estimate
        self.stats = {"requests": 0, "prefilled": 0, "reused": 0, "generated": 0}

    # -- views the app and tests read ----------------------------------------------------------
    @property
    def session(self):
        """The session of the slot given the latest job (the only one with --slots 1)."""
        return self._recent.session

    @property
    def busy(self) -> bool:
        return any(s.job is not None for s in self.slots)

    @property
    def _thread(self):
        return self.slots[0].thread

    def count(self, **kw: int):
        with self.lock:
            for k, v in kw.items():
                self.stats[k] += v

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self):
        self._started = True
        if len(self.slots) > 1 and hasattr(self.engine, "start_batching"):
            # the slots' decode steps share forward passes (each weight read once per step), and
            # a prefill runs in chunks between them (engine/runtime/batcher.py)
            self.engine.start_batching()
            self._batching = True
        for s in self.slots:
            s.thread = threading.Thread(target=self._loop, args=(s,), name=f"ds4-slot-{s.index}", daemon=True)
            s.thread.start()
        with self._cv:
            self._changed = True
            self._cv.notify_all()

    def submit(self, job: Job):
        """Queue a job, or raise QueueFull when --max-queue live jobs already wait."""
        if self.closing:
            job.emit(E.Failure("server shutting down", 503))
            return
        with self._submit_lock:
            self.check_room()
            with self._cv:
                if self.closing:        # stop() came meanwhile: its slots may have ended
                    job.emit(E.Failure("server shutting down", 503))
                    return
                self._pending.append(job)
                # the choice itself runs on an idle slot's thread, never on the app's event
                # loop (it compares the prompt with every slot's timeline: O(context) each)
                self._changed = True
                self._cv.notify_all()

    def check_room(self):
        """Raise QueueFull when --max-queue live jobs already wait. The app asks once before it
        reads and tokenizes a body (a refusal then costs nothing), and submit asks again."""
        live, free = self._load()
        # a new job waits when the free slots are all claimed by live jobs ahead of it
        if live >= free and live - free >= self.cfg.max_queue:
            raise QueueFull(live - free, self.retry_after())

    def _load(self) -> tuple[int, int]:
        """(live queued jobs, idle slots about to take them; none before start)."""
        with self._cv:
            live = sum(1 for j in self._pending if not j.cancel.is_set())
            free = sum(1 for s in self.slots if s.job is None) if self._started else 0
            return live, free

    def queued(self) -> int:
        with self._cv:
            return len(self._pending)

    def waiting(self) -> int:
        """Jobs queued whose client is still there (a job cancelled while queued is skipped),
        beyond those the idle slots are about to take."""
        live, free = self._load()
        return max(0, live - free)

    def retry_after(self) -> int:
        """Seconds until a queue place is likely free: about one job's run time (1-60)."""
        return int(min(60, max(1, round(self._job_s))))

    def stop(self, timeout: float | None = None):
        """Finish the running and queued jobs, then save every slot's live session (the shutdown
        moment)."""
        with self._cv:
            self.closing = True
            self._cv.notify_all()
        for s in self.slots:
            if s.thread is None or not s.stopped.wait(timeout):
                s._store_live("shutdown")
        if self._batching:
            self.engine.stop_batching()
            self._batching = False

    def force(self, *texts: str):
        """Test hook: the next generations emit these texts instead of sampling (one per job);
        every forced token is still evaluated, so the KV state stays real."""
        with self.lock:
            self._forced.extend(texts)

    # -- scheduling ----------------------------------------------------------------------------
    def _dispatch(self):
        """Give queued jobs to idle slots, oldest first (the caller, an idle slot's thread,
        holds _cv)."""
        self._changed = False
        idle = [s for s in self.slots if s.job is None]
        for job in list(self._pending):
            if job.cancel.is_set():
                self._pending.remove(job)        # the client left while queued
                continue
            if not idle:
                break
            slot = self._choose(job, idle)
            if slot is None:
                continue                         # it waits for its busy slot
            self._pending.remove(job)
            idle.remove(slot)
            slot.job = job
            self._recent = slot
        self._cv.notify_all()

    def _choose(self, job: Job, idle: list[Slot]) -> Slot | None:
        """The slot for `job` by the module doc's rule, or None when it waits for a busy one."""
        own, own_r, why = None, 0, ""
        for s in idle:
            r, lost = s.estimate(job)
            branch = r >= BRANCH_KEEP * (r + lost) or (
                lost <= BRANCH_SMALL and r >= BRANCH_PROMPT * len(job.tokens))
            if r and branch and (r > own_r or (r == own_r and s.last_used > own.last_used)):
                own, own_r, why = s, r, "continues" if not lost else "branch"
        busy_r, busy_s = 0, None
        for s in self.slots:
            if s.job is None or s.job is job:
                continue
            theirs = s.job.tokens
            r = _common(job.tokens, theirs)
            if r * 2 >= len(theirs) and r > busy_r:
                busy_r, busy_s = r, s
        if busy_s is not None and busy_r - own_r >= WAIT_TOKENS:
            if not job.trace.get("slot_wait"):
                job.trace["slot_wait"] = True
                log.info("slot %d is busy and shares %d tokens with a queued request: it waits for it",
                         busy_s.index, busy_r)
            return None
        if own is None:
            # never-used slots first, then the least recently used
            own, why = min(idle, key=lambda s: (s.last_used, s.index)), "new"
            if own.session.pos:
                why = f"new, lru: {own.session.pos} tokens evicted"
        job.trace["slot_choice"] = why + (", waited" if job.trace.get("slot_wait") else "")
        return own

    def _loop(self, slot: Slot):
        while True:
            with self._cv:
                while slot.job is None and not (self.closing and not self._pending):
                    if self._changed and self._pending:
                        self._dispatch()
                    else:
                        self._cv.wait()
                job = slot.job
            if job is None:
                break
            t0 = time.monotonic()
            try:
                if not job.cancel.is_set():     # the client left while it was given to the slot
                    slot.run(job)
            finally:
                with self._cv:
                    slot.job = None
                    slot.last_used = time.monotonic()
                    self._job_s = 0.7 * self._job_s + 0.3 * (time.monotonic() - t0)
                    self._changed = True
                    self._cv.notify_all()
        try:
            slot._store_live("shutdown")
        finally:
            slot.stopped.set()
        if getattr(self.engine.model.ops, "keep_threads", False):
            # parked, not returned: with MLX 0.32 a thread that ran MLX work and then ends
            # could abort the process as it exits ("terminate called without an active
            # exception", about 1 exit in 4); a parked daemon thread is left behind at exit
            threading.Event().wait()

    # -- live state the app asks about ---------------------------------------------------------
    def live_call_ids(self, api: str) -> frozenset:
        """The tool-call ids of every slot's live binding of this API (§7.3): a request that
        answers them is rendered as a live tail, and goes to the slot that holds them."""
        out: frozenset = frozenset()
        for s in self.slots:
            out |= s.live_call_ids(api)
        return out

    def disk_tool_maps(self) -> dict[str, str]:
        """Every tool id -> block pair the disk checkpoints' trailers hold (kvcache.md §2.4)."""
        from sessions.kvfile import KVFileError, read_info
        found: dict[str, str] = {}
        if self.cache is None:
            return found
        for e in self.cache.entries():
            if not e.header.flags & 1:
                continue
            try:
                found.update(read_info(e.path).tool_map or {})
            except (KVFileError, OSError):
                continue
        return found


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k
