"""Background paging work on a mapped GGUF: the resident copy and the prefault, off the open path.

Both used to run inside `Engine.open`: copying a 9.5 GB file into huge pages took 1.3-38 s and a
whole-file MADV_POPULATE_READ seconds more, while ds4 and llama.cpp map the file and start in
~0.02 s. Here each runs in background threads and the engine serves from the map meanwhile.

`ResidentCopy` fills anonymous memory (transparent huge pages where the kernel offers them) with
the file's bytes at the file's offsets, in groups of whole tensors taken in file order. When a
group is complete its tensors are `ready`: `on_ready(names)` lets the owner point the weights
at the copy, then `release(lo, hi)` lets it drop the map's pages of that range. The bytes are the
file's, so a weight read before, during or after its switch gives bit-identical results.

`Populate` prefaults the map in chunks from a thread, through ctypes (which releases the GIL
during the call; `mmap.madvise` keeps it, and would stall the forward pass for the whole call).

Both stop between pieces when asked (`stop`), so closing the file never waits more than one piece.
"""
from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import sys
import threading
import time
import weakref

import numpy as np

from ..errors import ModelFileError

# a piece is one pread: large reads are what the page cache serves fastest; 64 MiB takes 20-250 ms
# here, which bounds how long stop() waits
PIECE = 64 << 20
# tensors are made ready in groups of at least this many bytes (the small norm and bias tensors
# between two matrices travel with them instead of a callback each)
GROUP = 64 << 20
# below this a file is copied in the caller's thread: at the slowest rate measured here
# (0.26 GB/s, 2 cores shared) 64 MiB takes 0.25 s, and a thread and a switch would buy nothing
SYNC_BYTES = 64 << 20

# the background threads' nice value: they take a core only when the compute threads leave it idle
# (between requests, in the Python between kernel calls). At the compute threads' own priority the
# copy shares a core with one of two OpenMP threads and every parallel region waits for the slower
# one: in alternating ds4-bench runs, first token 10.7-25.1 s at nice 0 against 7.3-13.0 s here
NICE = 19

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
# (Python adds the name in 3.13; the value is Linux's on x86 and arm64, macOS's elsewhere)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0x40)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)   # Linux value; older Pythons lack the name

# every live worker, so the interpreter's exit stops them before it tears the modules down
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for w in list(_LIVE):
        w.stop()


def _lower_priority() -> None:
    """This thread at nice NICE (Linux: a thread id names one thread; the compute threads keep
    their priority)."""
    if NICE and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except OSError:
            pass


def plan_groups(tensors, size: int, skip=frozenset()) -> list[tuple[int, int, list[str]]]:
    """[(lo, hi, names)] covering bytes 0..size in file order, each ending on a tensor boundary
    and holding at least GROUP bytes (the last one what is left). The first group starts at 0,
    so the header is copied too (the copy is the whole file, byte for byte). `skip`: names of
    tensors left out, their bytes in no group (the expert cache reads the routed experts itself:
    the copy's pages there are never touched, so they cost no memory)."""
    order = sorted(tensors, key=lambda t: t.offset)
    groups, lo, names = [], 0, []
    for i, t in enumerate(order):
        hi = order[i + 1].offset if i + 1 < len(order) else size
        if t.name in skip:
            if names:
                groups.append((lo, t.offset, names))
                names = []
            lo = hi
            continue
        names.append(t.name)
        if hi - lo >= GROUP or i + 1 == len(order):
            groups.append((lo, hi, names))
            lo, names = hi, []
    if not groups and not skip:
        groups.append((0, size, []))
    return groups


class ResidentCopy:
    """The file's bytes in anonymous memory, filled by `threads` threads (see the module doc)."""

    def __init__(self, path: str, size: int, groups: list[tuple[int, int, list[str]]]):
        self.path, self.size = path, size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if sum(hi - lo for lo, hi, _ in groups) < size:
            # a partial copy (the routed experts left to the expert cache): its untouched pages
            # cost nothing, and the kernel's overcommit check would refuse a reservation of the
            # whole file where the file is larger than the memory
            flags |= MAP_NORESERVE
        try:
            buf = mmap.mmap(-1, size, flags=flags)   # (size > 0: open checked)
        except (OSError, ValueError) as e:
            raise ModelFileError(path, f"cannot allocate {size:,} bytes of memory for a resident "
                                       f"copy: {getattr(e, 'strerror', None) or e}") from None
        try:
            buf.madvise(_MADV_HUGEPAGE)
        except (OSError, ValueError):
            pass      # no THP: still a private copy, just without the huge pages
        self._buf = buf
        self._view = memoryview(buf)          # where the reads land (the handed-out array is read-only)
        self.array = np.frombuffer(buf, dtype=np.uint8)[:size]
        self.array.flags.writeable = False
        self.ready: set[str] = set()          # tensors whose bytes are all copied
        self.error: BaseException | None = None
        self.seconds: float | None = None     # the whole copy's time, once complete
        self._groups = groups
        self._pieces = [(g, p, min(hi, p + PIECE)) for g, (lo, hi, _) in enumerate(groups)
                        for p in range(lo, hi, PIECE)]
        self._left = [len(range(lo, hi, PIECE)) for lo, hi, _ in groups]
        self._next = 0
        self._groups_left = len(groups)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def complete(self) -> bool:
        return self.seconds is not None

    def start(self, threads: int, drop_cache: bool, on_ready, release) -> None:
        """Begin filling in `threads` daemon threads and return. on_ready(names) runs in a worker
        once those tensors' bytes are all copied; release(lo, hi) after it."""
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise ModelFileError(self.path, f"cannot read: {e.strerror or e}") from None
        self._t0 = time.perf_counter()
        self._drop, self._on_ready, self._release = drop_cache, on_ready, release
        self._running = max(1, threads)
        _LIVE.add(self)
        for i in range(self._running):
            t = threading.Thread(target=self._work, name=f"ds4-resident-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every worker has ended (complete, failed or stopped)."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Ask the workers to end after their current piece, and wait for them."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    # -- the workers ----------------------------------------------------------------------------
    def _work(self) -> None:
        _lower_priority()
        try:
            while not self._stop.is_set():
                with self._lock:
                    if self._next >= len(self._pieces):
                        return
                    g, lo, hi = self._pieces[self._next]
                    self._next += 1
                self._read(lo, hi)
                with self._lock:
                    self._left[g] -= 1
                    finished = self._left[g] == 0
                if finished:
                    self._finish(g)
        except BaseException as e:          # the copy stops; what is ready stays, the rest stays on the map
            if isinstance(e, OSError):
                e = ModelFileError(self.path, f"cannot read: {e.strerror or e}")
            with self._lock:
                if self.error is None:
                    self.error = e
            self._stop.set()
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                os.close(self._fd)
                self._view.release()
                self._done.set()

    def _read(self, lo: int, hi: int) -> None:
        while lo < hi:
            n = os.preadv(self._fd, [self._view[lo:hi]], lo)     # (releases the GIL)
            if n <= 0:
                raise ModelFileError(self.path, f"ends at byte {lo:,}, before the {self.size:,} bytes it had "
                                                f"when opened: the file was truncated")
            lo += n

    def _finish(self, g: int) -> None:
        lo, hi, names = self._groups[g]
        self.ready.update(names)
        if self._on_ready is not None:
            self._on_ready(names)
        if self._release is not None:
            self._release(lo, hi)
        if self._drop and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self._groups_left -= 1
            if self._groups_left == 0:
                self.seconds = time.perf_counter() - self._t0


class Populate:
    """MADV_POPULATE_READ over [addr, addr + size) in CHUNK pieces from a daemon thread."""
    CHUNK = 256 << 20

    def __init__(self, addr: int, size: int):
        self.addr, self.size = addr, size
        self.error: OSError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._madvise = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self._madvise = libc.madvise
                self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                self._madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                self._madvise = None

    def start(self) -> bool:
        """Populate one page here (so a kernel without MADV_POPULATE_READ says so now), the file
        in a thread; False where it cannot (the caller falls back to WILLNEED)."""
        if self._madvise is None or not self._chunk(0, mmap.PAGESIZE):
            return False
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._work, name="ds4-prefault", daemon=True)
        self._thread.start()
        return True

    def _chunk(self, lo: int, n: int) -> bool:
        n = min(n, self.size - lo)
        if self._madvise(self.addr + lo, n, _MADV_POPULATE_READ) == 0:
            return True
        self.error = OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return False

    def _work(self) -> None:
        _lower_priority()
        for lo in range(0, self.size, self.CHUNK):
            if self._stop.is_set() or not self._chunk(lo, self.CHUNK):
                return

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
