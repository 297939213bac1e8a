"""Writing a file so that readers (and crashes) only ever see the old one or the complete new one."""
from __future__ import annotations

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_path(path, *, durable: bool = False):
    """Yield a temp path beside `path` (`<name>.tmp.XXXX`, mode 0600) to write; on success rename
    it over `path`, on any error remove it. durable: fsync the file and its folder as well."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".tmp.")
    os.close(fd)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        with contextlib.suppress(OSError):
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)


def atomic_write(path, chunks, *, durable: bool = False):
    """Write byte chunks to `path` through atomic_path."""
    with atomic_path(path, durable=durable) as tmp:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
