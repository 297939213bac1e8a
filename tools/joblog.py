"""A bash job's output log with a size cap: the head goes to the file, the tail is kept in memory.

The job writes into a pipe that a thread drains at once, so the job never waits on a full pipe
whoever polls it. The first `head_bytes` go to the log file as they come; past that nothing more
is stored (a job printing in a loop filled the disk at 255 MiB/s while it ran in the background),
only counted, and the last `tail_bytes` are kept in memory: they are shown while the job runs and
added to the file when the output ends, where a build's errors usually are.
"""
from __future__ import annotations

import fcntl
import os
import selectors
import struct
import termios
import threading
import time
from pathlib import Path

CHUNK = 1 << 20


def open_fresh(path: Path) -> int:
    """A new, empty log file at path for writing. Whatever was there goes first (unlinking a
    symlink removes the link, not its target) and the file is made with O_EXCL, which never
    follows a symlink: a link planted at a log's path cannot lead the writes elsewhere."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                   | getattr(os, "O_NOFOLLOW", 0), 0o600)


class CappedLog:
    def __init__(self, path: Path, head_bytes: int, tail_bytes: int):
        self.path, self.head_bytes, self.tail_bytes = path, head_bytes, tail_bytes
        self.stored = 0                  # bytes in the file (output only, not our notes)
        self.dropped = 0                 # bytes past the cap
        self.tail = bytearray()          # the latest output past the cap
        self.done = threading.Event()    # every writer has closed the pipe, the file is final
        self._lock = threading.Lock()    # held while a chunk is read and stored
        self._fd = open_fresh(path)
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        try:     # a larger pipe: fewer wake-ups for the thread draining a chatty job
            fcntl.fcntl(self.read_fd, fcntl.F_SETPIPE_SZ, CHUNK)
        except (AttributeError, OSError):    # not Linux, or over the system's pipe limit
            pass

    def start(self) -> None:
        """The job has its copy of the write end: ours goes, so the pipe ends with the job's."""
        os.close(self.write_fd)
        threading.Thread(target=self._pump, name=f"bash-log {self.path.name}", daemon=True).start()

    def abandon(self) -> None:
        """The job could not be started."""
        for fd in (self.write_fd, self.read_fd, self._fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.done.set()

    def _write(self, data: bytes) -> None:
        try:
            os.write(self._fd, data)
        except OSError:        # disk full, or the log folder removed at session end
            pass

    def _store(self, chunk: bytes) -> None:
        room = self.head_bytes - self.stored
        if room > 0:
            part = chunk[:room]
            self._write(part)
            self.stored += len(part)
            chunk = chunk[room:]
            if chunk:
                self._write(f"\n[... log capped at {self.head_bytes} bytes: later output is not "
                            f"stored until the job ends, then its last {self.tail_bytes} bytes "
                            "are added here ...]\n".encode())
        if chunk:
            self.dropped += len(chunk)
            self.tail += chunk
            if len(self.tail) > 2 * self.tail_bytes:
                del self.tail[:-self.tail_bytes]

    def _pump(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.read_fd, selectors.EVENT_READ)
        try:
            while True:
                sel.select()
                with self._lock:
                    try:
                        chunk = os.read(self.read_fd, CHUNK)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        break
                    self._store(chunk)
        finally:
            sel.close()
            with self._lock:
                self._finish()

    def _finish(self) -> None:
        if self.dropped:
            tail = self.last()
            self._write(f"[... {self.dropped - len(tail)} bytes not stored; the last "
                        f"{len(tail)} bytes of the output follow ...]\n".encode() + tail)
        os.close(self.read_fd)
        os.close(self._fd)
        self.done.set()

    def last(self) -> bytes:
        """The kept tail, from a line start where one is near."""
        t = bytes(self.tail[-self.tail_bytes:])
        nl = t.find(b"\n", 0, 4096)
        return t[nl + 1:] if 0 <= nl < len(t) - 1 else t

    def _pending(self) -> int:
        try:
            return struct.unpack("i", fcntl.ioctl(self.read_fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def settle(self, timeout: float = 1.0) -> None:
        """Wait until what was written so far is stored: the pipe has ended, or it is empty (a
        background process may keep it open without writing)."""
        end = time.monotonic() + timeout
        while not self.done.is_set():
            with self._lock:
                if self.done.is_set() or self._pending() == 0:
                    return
            if time.monotonic() > end:
                return
            time.sleep(0.002)
