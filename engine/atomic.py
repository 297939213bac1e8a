"""Writing a file so that readers (and crashes) only ever see the old one or the complete new one."""
from __future__ import annotations

import contextlib
import os
import tempfile


def _fsync_dir(d: str):
    with contextlib.suppress(OSError):
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@contextlib.contextmanager
def _temp_beside(path):
    """(fd, tmp, folder) of a fresh temp file beside `path` (`<name>.tmp.XXXX`, O_EXCL, mode 0600);
    removed on any error, and the fd closed on the way out whatever happens."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".tmp.")
    try:
        yield fd, tmp, d
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _publish(fd: int, tmp: str, path, d: str, durable: bool):
    if durable:
        os.fsync(fd)
    # the rename moves whatever the temp NAME points at: refuse if it is no longer the file this
    # process created (a name swapped in a shared folder between create and rename)
    if not os.path.samestat(os.lstat(tmp), os.fstat(fd)):
        raise OSError(f"{tmp}: the temp file was replaced while it was written")
    os.replace(tmp, path)
    if durable:
        _fsync_dir(d)


@contextlib.contextmanager
def atomic_open(path, *, durable: bool = False):
    """Yield a binary file open on a fresh temp file beside `path` (the descriptor mkstemp created,
    never reopened by name); on success rename it over `path`, on any error remove it."""
    with _temp_beside(path) as (fd, tmp, d):
        f = os.fdopen(os.dup(fd), "wb")
        with f:
            yield f
            f.flush()
        _publish(fd, tmp, path, d, durable)


@contextlib.contextmanager
def atomic_path(path, *, durable: bool = False):
    """Yield a temp path beside `path` for a writer that needs a name (a GGUF writer); on success
    rename it over `path`, on any error remove it. The file is checked to be the one created here
    before the rename. Prefer atomic_open where a file object will do."""
    with _temp_beside(path) as (fd, tmp, d):
        yield tmp
        _publish(fd, tmp, path, d, durable)


def atomic_write(path, chunks, *, durable: bool = False):
    """Write byte chunks to `path` through atomic_open."""
    with atomic_open(path, durable=durable) as f:
        for c in chunks:
            f.write(c)
