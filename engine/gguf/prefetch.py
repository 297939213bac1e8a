"""Read-ahead for `lowmem` paging: the bytes a forward step is about to use, asked of the kernel
from a background thread, in page-aligned merged ranges, in file order, in pieces the kernel honours.

Three things measured on a 2-core VM (virtio disk, read_ahead_kb 8192) made this module:

- POSIX_FADV_WILLNEED and MADV_WILLNEED read at most max(read_ahead_kb, max_sectors_kb) of a
  range (Linux's force_page_cache_ra caps each call): asked for a 32 MiB matrix, the kernel read
  its first 8 MiB and dropped the rest; with the default read_ahead_kb of 128 it would read
  128 KiB-1 MiB, less than one expert matrix. So a range is asked for in pieces of that cap.
- The hints ran in the forward pass's thread (mmap.madvise holds the GIL and, in a memory cgroup at
  its limit, reclaims pages before it can read): 0.3-0.65 s of a 1.1-5 s decode step went to
  them. Here one thread makes the calls (os.posix_fadvise releases the GIL) while the step computes.
- A fault on a MADV_NORMAL map reads 8 MiB around the faulting page (read-around), most of it
  neighbouring experts nobody routed to; MADV_RANDOM reads 4 KiB. Once every routed expert's
  bytes are asked for ahead, a fault there is the exception, and `expert_advice` says which.

Requests carry the step they were made in; the thread skips what an older step asked for and has
not yet been issued (the step that needed it is over).
"""
from __future__ import annotations

import atexit
import mmap
import os
import queue
import threading
import weakref

PAGE = mmap.PAGESIZE
# the cap where the block device cannot be found (overlay, NFS): Linux's default read_ahead_kb,
# the smallest cap in common use (a too-small piece costs one more syscall, never bytes)
DEFAULT_CAP = 128 << 10

# a step of at most this many rows has its routed experts asked for once routing has picked them;
# a longer chunk picks most of a layer's experts, more than a memory-limited page cache holds
# ahead of use, so its experts come in through the faults' own readahead
EXPERT_HINT_TOKENS = 16

_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def expert_advice(n_tokens: int) -> int:
    """The madvise advice for the routed expert tensors during a step of n_tokens rows:
    MADV_RANDOM where every expert the step reads was asked for ahead (a stray fault reads 4 KiB,
    not 8 MiB of unrouted neighbours), MADV_NORMAL for a long chunk, which leans on read-around.
    DS4_EXPERT_ADVICE=normal keeps MADV_NORMAL throughout (the A/B in docs/performance.md, "lowmem's hot path")."""
    if n_tokens <= EXPERT_HINT_TOKENS and os.environ.get("DS4_EXPERT_ADVICE") != "normal":
        return mmap.MADV_RANDOM
    return mmap.MADV_NORMAL


class StepHints:
    """Model.pager for a GGUFFile in lowmem paging: called with map views the step will read
    soon (the thread asks for them); now(views) for what it reads next (asked for in the caller's
    thread, so a thread that lags behind a loaded machine never leaves them to 4 KiB faults);
    begin_step(n_tokens) at each forward step's start."""

    def __init__(self, gguf):
        self.gguf = gguf

    def __call__(self, arrays) -> None:
        self.gguf.willneed(arrays)

    def now(self, arrays) -> None:
        self.gguf.willneed(arrays, now=True)

    def begin_step(self, n_tokens: int) -> None:
        self.gguf.begin_step(n_tokens)


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        p.close()


def page_ranges(spans, page: int = PAGE) -> list[tuple[int, int]]:
    """[(lo, hi)] file byte ranges covering every (offset, nbytes) span, lo rounded down and hi up
    to `page`, sorted, overlapping or touching ranges merged. Empty spans are dropped."""
    out: list[list[int]] = []
    for off, n in sorted((int(o), int(n)) for o, n in spans if n > 0):
        lo, hi = off - off % page, -(-(off + n) // page) * page
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def pieces(ranges, cap: int) -> list[tuple[int, int]]:
    """[(offset, length)]: each range cut into pieces of at most `cap` bytes, in order."""
    return [(p, min(cap, hi - p)) for lo, hi in ranges for p in range(lo, hi, cap)]


def willneed_cap(fd: int) -> int:
    """The most bytes one WILLNEED call on this file reads: max(read_ahead_kb, max_sectors_kb) of
    its block device (Linux sysfs), rounded down to pages; DEFAULT_CAP where it cannot be read."""
    try:
        dev = os.fstat(fd).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        q = base + "/queue" if os.path.isdir(base + "/queue") else base + "/../queue"   # (a partition)
        kb = [int(open(f"{q}/{k}").read()) for k in ("read_ahead_kb", "max_sectors_kb")]
    except (OSError, ValueError):
        return DEFAULT_CAP
    cap = max(kb) << 10
    return max(PAGE, cap - cap % PAGE)


class Prefetcher:
    """POSIX_FADV_WILLNEED for byte ranges of one file, issued by a daemon thread in request order
    (see the module doc). `submit` returns at once. `issued` counts the bytes asked for; `trace`
    (a list, when set) records each issued (offset, length) piece, for tests."""

    def __init__(self, path: str, cap: int | None = None):
        self.fd = os.open(path, os.O_RDONLY)
        self.cap = cap or willneed_cap(self.fd)
        self.issued = 0
        self.skipped = 0
        self.trace: list | None = None
        self.step = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="ds4-prefetch", daemon=True)
        self._closed = False
        _LIVE.add(self)
        self._thread.start()

    def begin_step(self) -> None:
        """A new forward step: what earlier steps asked for and is still queued is dropped."""
        self.step += 1

    def submit(self, ranges) -> None:
        if self._closed or not ranges:
            return
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put((self.step, list(ranges)))

    def issue(self, ranges) -> None:
        """WILLNEED for these ranges in the caller's thread, before this returns (the reads
        themselves stay asynchronous)."""
        if self._closed:
            return
        for off, n in pieces(ranges, self.cap):
            try:
                os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)
            except OSError:
                return
            self.issued += n
            if self.trace is not None:
                self.trace.append((off, n))

    def wait(self, timeout: float | None = None) -> bool:
        """True once every submitted request has been issued or skipped (tests, benchmarks)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()
        os.close(self.fd)

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            step, ranges = job
            for off, n in pieces(ranges, self.cap):
                if step != self.step or self._closed:      # (a later step began: not needed now)
                    self.skipped += n
                    continue
                try:
                    os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)
                except OSError:
                    break           # a hint: the faults read what it did not
                self.issued += n
                if self.trace is not None:
                    self.trace.append((off, n))
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()
