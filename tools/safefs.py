"""Opening files so that a symlink swapped in by another process cannot lead outside the project.

Checking a path and then opening it is a race: between `realpath` (inside) and `open` a folder or
the file itself can become a symlink to anything. So the check is made on what was opened: a file
is opened first and the real path of the open descriptor (/proc/self/fd/N on Linux, F_GETPATH on
macOS) must lie inside one of the allowed folders; otherwise nothing is read. Writes open the
target's folder the same way and then create, rename and make folders relative to that
descriptor (never by path), so a swap after the check can only redirect them inside the project.
Symlinks inside the project that point inside keep working: they are followed, and where they
end up is what gets checked.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
from pathlib import Path

from .base import ToolContext, ToolError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def fd_path(fd: int) -> str | None:
    """Where an open descriptor really is, or None where the system cannot say."""
    if sys.platform.startswith("linux"):
        try:
            p = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        if p.endswith(" (deleted)") and os.fstat(fd).st_nlink == 0:
            p = p[: -len(" (deleted)")]
        return p
    try:
        import fcntl
        buf = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024))    # macOS, BSD
        return os.fsdecode(buf.split(b"\0", 1)[0])
    except (ImportError, AttributeError, OSError):
        return None


def allowed_roots(ctx: ToolContext, extra=()) -> list[Path] | None:
    """The folders a file may really lie in (None: anywhere, the user allowed outside paths)."""
    if ctx.allow_outside:
        return None
    return [Path(os.path.realpath(ctx.root))] + [Path(os.path.realpath(d)) for d in extra]


def _check(fd: int, path: Path, roots: list[Path] | None, shown: str) -> None:
    if roots is None:
        return
    real = fd_path(fd)
    if real is None:
        # No way to ask the descriptor: compare it with what the path resolves to now (a race
        # remains only where neither /proc nor F_GETPATH exists).
        resolved = os.path.realpath(path)
        try:
            st, now = os.fstat(fd), os.stat(resolved)
        except OSError:
            st = now = None
        same = st is not None and (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
        real = resolved if same else None
    if real is not None:
        rp = Path(real)
        if any(rp == r or r in rp.parents for r in roots):
            return
    os.close(fd)
    raise ToolError(f"{shown}: it now leads outside the project directory (a symlink changed "
                    "while it was opened; refused)")


def open_inside(ctx: ToolContext, path: Path, *, extra_roots=(), shown: str | None = None) -> int:
    """A read-only descriptor for path, checked to be inside the project (or extra_roots).
    O_NONBLOCK: opening a FIFO must not wait for a writer (the caller refuses non-regular files)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC | _NOCTTY)
    _check(fd, path, allowed_roots(ctx, extra_roots), shown or ctx.rel(path))
    return fd


def read_inside(ctx: ToolContext, path: Path, limit: int | None = None, *, extra_roots=(),
                shown: str | None = None) -> tuple[os.stat_result, bytes | None]:
    """(stat, bytes) of a file checked to be inside; bytes is None when it is not a regular file
    or is larger than limit."""
    fd = open_inside(ctx, path, extra_roots=extra_roots, shown=shown)
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode) or (limit is not None and st.st_size > limit):
        os.close(fd)
        return st, None
    with os.fdopen(fd, "rb") as f:     # fdopen refuses a folder: only regular files get here
        return st, f.read()


def _open_dir(ctx: ToolContext, d: Path, shown: str) -> int:
    """A descriptor of folder d, checked to be inside; missing folders are made one by one
    relative to their checked parent (never following a symlink that appears meanwhile)."""
    missing: list[str] = []
    cur = d
    while True:
        try:
            fd = os.open(cur, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
            break
        except FileNotFoundError:
            if cur.parent == cur:
                raise
            missing.append(cur.name)
            cur = cur.parent
    _check(fd, cur, allowed_roots(ctx), shown)
    for name in reversed(missing):
        try:
            os.mkdir(name, 0o777, dir_fd=fd)
        except FileExistsError:
            pass
        try:
            nfd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nfd
    return fd


def write_inside(ctx: ToolContext, path: Path, data: bytes, default_mode: int) -> None:
    """Atomic replace of path (temp file beside it, then rename), both done relative to the
    checked folder descriptor. The file keeps its permission bits; a new one gets default_mode."""
    dfd = _open_dir(ctx, path.parent, ctx.rel(path))
    try:
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            mode = stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else default_mode
        except FileNotFoundError:
            mode = default_mode
        tmp = f".{path.name}.{secrets.token_hex(4)}.tmp"
        tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600,
                      dir_fd=dfd)
        try:
            with os.fdopen(tfd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), mode)
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)


class UnsafeFile(OSError):
    """A file that is not read: not a regular file, a symlink where none may be, or too large."""


def read_regular(path: Path, limit: int, *, nofollow: bool) -> bytes:
    """The bytes of a small regular file, for config files (`.mcp.json`, config.toml).
    A project can commit one as a symlink to /dev/zero (read until memory runs out) or a FIFO
    (hangs on open): the open is non-blocking, the opened descriptor must be a regular file of at
    most `limit` bytes, and with nofollow (a path inside a project) a symlink at the path is not
    followed. FileNotFoundError passes through; any other refusal is an UnsafeFile whose
    strerror says why in a few words."""
    flags = os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC | _NOCTTY | (_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if nofollow and e.errno == errno.ELOOP:
            raise UnsafeFile(e.errno, "is a symlink (not followed here)", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, "not a regular file", str(path))
        if st.st_size > limit:
            raise UnsafeFile(errno.EFBIG, f"larger than {limit} bytes", str(path))
        data = os.read(fd, limit + 1)
        while len(data) <= limit and (more := os.read(fd, limit + 1 - len(data))):
            data += more
        if len(data) > limit:        # it grew while read
            raise UnsafeFile(errno.EFBIG, f"larger than {limit} bytes", str(path))
        return data
    finally:
        os.close(fd)
