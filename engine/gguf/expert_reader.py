"""Reading routed experts from the GGUF into cache slots: pread, optionally O_DIRECT, from a pool.

The expert cache (engine/gguf/expert_cache.py) never touches the routed experts through the
file's map. A map's fault on a truncated file is SIGBUS, which kills the process; a pread past the
end returns short, which becomes one ModelFileError here. And in a memory cgroup the page cache a
buffered read fills counts against the limit, while O_DIRECT reads land in the slots only.

O_DIRECT needs the file offset, the length and the buffer address aligned to the device's block:
each matrix's region in a slot is ALIGN-aligned and read from the ALIGN boundary at or below the
expert's first byte, so the expert's bytes begin `off % ALIGN` into the region (`Span.skip`).
The same layout serves buffered reads (skip 0 bytes read before it), so one slot size fits both.

Reads run in a thread pool of `depth` threads (os.preadv releases the GIL): NVMe drives reach
their rated speed only with many reads in flight (ds4 uses a queue of 16-32); a virtio disk is
content with fewer but loses nothing by more.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ModelFileError

ALIGN = 4096          # O_DIRECT alignment that every Linux block device accepts
DEPTH = 16            # reads in flight: within the queue depth NVMe drives need for full speed


def region_bytes(n: int) -> int:
    """The slot bytes one matrix of n bytes needs: its bytes at any alignment, whole ALIGN blocks."""
    return -(-(n + ALIGN - 1) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Span:
    """One read: `n` bytes of the file at `off` wanted at byte `dst + skip` of the reader's
    buffer `b` (one buffer for the host slots; the mlx slots are one array per matrix)."""
    off: int
    n: int
    dst: int
    b: int = 0

    @property
    def skip(self) -> int:
        return self.off % ALIGN


def split(s: Span, piece: int) -> list:
    """s as spans of at most `piece` bytes (a multiple of ALIGN) that lay the same bytes at the
    same slot bytes, each but the first starting on a block: more reads in flight for one
    matrix (a decode layer asks for 18 matrices of ~2.4 MB)."""
    if piece <= 0 or s.skip + s.n <= piece:
        return [s]
    lo = s.off - s.skip
    out = [Span(s.off, piece - s.skip, s.dst, s.b)]
    for p in range(lo + piece, s.off + s.n, piece):
        out.append(Span(p, min(piece, s.off + s.n - p), s.dst + (p - lo), s.b))
    return out


def _pread(fd: int, view: memoryview, off: int) -> int:
    return os.preadv(fd, [view], off)


class ExpertReader:
    """Reads Spans of one file into writable buffers (the cache's slots) from a thread pool.
    `buf`: one memoryview, or a list of them (a Span's `b` picks one). `pread(fd, view, offset)
    -> n` is the one system call, replaceable (fault-injection tests)."""

    def __init__(self, path: str, buf, *, direct: bool = False, depth: int = DEPTH, pread=None):
        self.path = str(path)
        self.bufs = list(buf) if isinstance(buf, (list, tuple)) else [buf]
        self.buf = self.bufs[0]
        self.direct = False
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:          # tmpfs and some overlays refuse O_DIRECT: buffered reads
                self.fd = -1
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:
                raise ModelFileError(self.path, f"cannot read: {e.strerror or e}") from None
        self.pread = pread or _pread
        self.size = os.fstat(self.fd).st_size
        self._pool = ThreadPoolExecutor(max_workers=max(1, depth), thread_name_prefix="ds4-expert-read")
        self._lock = threading.Lock()
        self.bytes_read = 0          # bytes the reads returned (O_DIRECT: whole blocks)
        self.read_seconds = 0.0      # summed over the reads (in flight together: not wall time)

    def submit(self, spans) -> Future:
        """A Future that is done when every span is read (its result: None), or holds the first
        error (a ModelFileError naming the file and the offset)."""
        spans = list(spans)
        outer: Future = Future()
        left = [len(spans)]
        if not spans:
            outer.set_result(None)
            return outer

        errors: list = []

        def one_done(f: Future) -> None:
            # complete only when every span has ended: a failed expert's slot is reused at once,
            # and a read still writing into it would clobber the next expert's bytes
            err = f.exception()
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
                if err is not None:
                    errors.append(err)
            if last:
                if errors:
                    outer.set_exception(errors[0])
                else:
                    outer.set_result(None)

        for s in spans:
            self._pool.submit(self.read, s).add_done_callback(one_done)
        return outer

    def read(self, s: Span) -> None:
        """One span, in the caller's thread, retrying short reads; the end of the file before its
        last byte is a ModelFileError (the file shrank under the engine)."""
        t0 = time.perf_counter()
        if self.direct:
            lo, start, want = s.off - s.skip, s.dst, s.skip + s.n
            hi = -(-want // ALIGN) * ALIGN               # whole blocks; the file may end within the last
        else:
            lo, start, want = s.off, s.dst + s.skip, s.n
            hi = want
        got = 0
        while got < want:
            try:
                n = self.pread(self.fd, self.bufs[s.b][start + got:start + hi], lo + got)
            except OSError as e:
                raise ModelFileError(self.path, f"cannot read the routed expert at byte {s.off:,}: "
                                                f"{e.strerror or e}") from None
            if n <= 0:
                raise ModelFileError(self.path, f"ends at byte {lo + got:,}, inside a routed expert "
                                                f"({s.off:,}..{s.off + s.n:,}): the file was truncated "
                                                f"or replaced while the engine ran")
            got += n
        with self._lock:
            self.bytes_read += got
            self.read_seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self.fd < 0:
            return
        self._pool.shutdown(wait=True, cancel_futures=True)
        os.close(self.fd)
        self.fd = -1


def direct_read_speed(path: str, nbytes: int = 256 << 20, block: int = 4 << 20, depth: int = DEPTH) -> float | None:
    """The disk's direct-read speed in bytes/s: `nbytes` read with O_DIRECT in `block` pieces,
    `depth` at a time, from the middle of the file (what the bench divides missed bytes by).
    None where O_DIRECT is refused (tmpfs) or the file is smaller than one block."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    import mmap
    try:
        size = os.fstat(fd).st_size
        nbytes = min(nbytes, size - size % block)
        if nbytes < block:
            return None
        lo = ((size - nbytes) // 2) // ALIGN * ALIGN
        bufs = [mmap.mmap(-1, block) for _ in range(depth)]
        offs = list(range(lo, lo + nbytes, block))

        def one(i: int) -> int:
            return os.preadv(fd, [bufs[i % depth]], offs[i])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            got = sum(pool.map(one, range(len(offs))))
        dt = time.perf_counter() - t0
        for b in bufs:
            b.close()
        return got / dt if dt > 0 else None
    except OSError:
        return None
    finally:
        os.close(fd)
