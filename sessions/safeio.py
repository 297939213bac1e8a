"""File access inside a folder we own (the KV cache folder, the session store) that an attacker or
an accident may have filled with other things: symlinks, FIFOs, devices, directories, unreadable
or half-written files.

* Never follow a symlink: every open uses O_NOFOLLOW, so a link named like a cache file fails with
  ELOOP instead of reaching (and, on a write, changing) a file outside the folder.
* Never block on a non-regular file: `lstat` first (a FIFO, socket or device is refused without
  being opened; opening a FIFO for reading waits for a writer forever), then open with O_NONBLOCK
  and re-check the descriptor with `fstat` (the name may have been swapped in between).
* Writes go to a temp file created with O_EXCL in the same folder and are renamed over the final
  name: a rename replaces a symlink itself, never its target. The temp name carries our pid
  (`<name>.tmp.<pid>-<random>`) so that a later start can tell a dead writer's leftovers from a
  live writer's file.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import threading
import time

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# `<final>.tmp.<pid>-<random>` (ours), `<final>.tmp.<pid>` (ds4's); engine.atomic's mkstemp names
# (`<final>.tmp.<random>`) have no pid and are judged by age only.
_TEMP = re.compile(r"(?P<final>.+)\.tmp\.(?:(?P<pid>\d+)(?:-[A-Za-z0-9_]+)?|[A-Za-z0-9_]+)")
STALE_AGE_S = 3600.0

_live_temps: set[str] = set()        # temp files this process is writing right now
_live_lock = threading.Lock()


class UnsafeFile(OSError):
    """A name in the folder that must not be opened as a data file (symlink, FIFO, directory...)."""


def kind_of(st) -> str:
    m = st.st_mode
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(m):
            return name
    return "not a regular file"


def open_regular(path, mode: str = "rb"):
    """Open `path` ("rb" or "r+b") only if it is a regular file, not through a symlink, without
    ever blocking. Raises FileNotFoundError, UnsafeFile (what the name is instead) or OSError."""
    path = os.fspath(path)
    for _ in range(8):      # a name replaced (atomic rename) between lstat and open: look again
        f = _open_once(path, mode)
        if f is not None:
            return f
    raise UnsafeFile(errno.EAGAIN, "keeps changing while being opened", path)


def _open_nofollow(path: str, flags: int) -> int:
    """os.open that never follows a symlink at the last component and never blocks (a FIFO
    swapped in after the lstat); a symlink there is UnsafeFile."""
    try:
        return os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, "is a symbolic link (not followed)", path) from None
        raise


def _open_once(path: str, mode: str):
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(errno.EINVAL, f"is {kind_of(st)}, not a regular file (not opened)", path)
    fd = _open_nofollow(path, os.O_RDWR if mode == "r+b" else os.O_RDONLY)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            raise UnsafeFile(errno.EINVAL, f"is {kind_of(fst)}, not a regular file", path)
        if (fst.st_ino, fst.st_dev) != (st.st_ino, st.st_dev):
            os.close(fd)
            return None
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path, limit: int) -> bytes:
    """The whole content of a regular file of at most `limit` bytes (ValueError when bigger)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValueError(f"{size} bytes, more than the {limit} allowed")
        return f.read(limit + 1)[:limit]


def scan(folder, want=None):
    """(name, lstat result) of every entry of `folder` (of those whose name `want` accepts),
    symlinks not followed; entries that vanish while scanning are left out. OSError when the
    folder cannot be listed."""
    out = []
    with os.scandir(folder) as it:
        for de in it:
            if want is not None and not want(de.name):
                continue
            try:
                out.append((de.name, de.stat(follow_symlinks=False)))
            except OSError:
                continue
    return out


def read_head(path, st, n: int) -> bytes:
    """The first n bytes of the regular file `path` whose lstat result is `st`, with one open and
    one pread (the fast path for scanning a big folder). UnsafeFile if the name is not that
    regular file any more (swapped since the lstat), OSError as raised."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(errno.EINVAL, f"is {kind_of(st)}, not a regular file (not opened)", path)
    fd = _open_nofollow(path, os.O_RDONLY)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_ino, fst.st_dev) != (st.st_ino, st.st_dev):
            raise UnsafeFile(errno.EAGAIN, "changed while being read", path)
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def is_temp_name(name: str) -> bool:
    return ".tmp." in name and _TEMP.fullmatch(name) is not None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:          # EPERM: it exists, owned by someone else
        return True
    return True


def odd_temp(st) -> bool:
    """A temp name that is neither a regular file nor a folder: no writer of ours (nor ds4's) makes
    one, they all create regular files with O_EXCL|O_NOFOLLOW, so it is junk planted or left by
    something else. Removing it unlinks the name itself (unlink never follows a symlink or opens
    a FIFO), so it is safe to do at once; a folder is left alone (never ours either, and removing
    it would mean walking into it)."""
    return not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode)


def temp_is_stale(folder, name: str, st, now: float | None = None, older_than_s: float = STALE_AGE_S) -> bool:
    """Whether temp file `name` can no longer belong to a live writer: its pid (when the name has
    one) is not running, or is ours but we are not writing it, or it is older than older_than_s.
    A pid can be reused (containers restart at the same small pids), hence the own-pid check."""
    now = time.time() if now is None else now
    if now - st.st_mtime > older_than_s:
        return True
    m = _TEMP.fullmatch(name)
    if m is None or m.group("pid") is None:
        return False
    pid = int(m.group("pid"))
    if pid == os.getpid():
        with _live_lock:
            return os.path.join(os.path.abspath(os.fspath(folder)), name) not in _live_temps
    return not _pid_alive(pid)


def remove_stale_temps(folder, now: float | None = None, older_than_s: float = STALE_AGE_S) -> int:
    """Delete the temp files a killed writer left in `folder` (regular files with a temp name that
    `temp_is_stale`), and every temp name that is a symlink, FIFO, socket or device (`odd_temp`).
    Returns how many were removed."""
    n = 0
    try:
        entries = scan(folder)
    except OSError:
        return 0
    for name, st in entries:
        if not is_temp_name(name) or stat.S_ISDIR(st.st_mode):
            continue
        if odd_temp(st) or temp_is_stale(folder, name, st, now, older_than_s):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
                n += 1
    return n


def _fsync_dir(d: str):
    with contextlib.suppress(OSError):
        dfd = os.open(d, os.O_RDONLY | _CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_atomic(path, chunks, *, durable: bool = True):
    """Write byte chunks to a new temp file beside `path` (O_EXCL|O_NOFOLLOW, mode 0600), fsync it,
    rename it over `path` (a symlink there is replaced, its target untouched), fsync the folder.
    On any error the temp file is removed and `path` is as it was."""
    path = os.path.abspath(os.fspath(path))
    d, base = os.path.split(path)
    while True:
        tmp = os.path.join(d, f"{base}.tmp.{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    with _live_lock:
        _live_temps.add(tmp)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                for c in chunks:
                    f.write(c)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    finally:
        with _live_lock:
            _live_temps.discard(tmp)
    if durable:
        _fsync_dir(d)
