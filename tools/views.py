"""The stale-edit guard: which lines of which file the model has seen, in which version of the file.

A line-range edit names lines by number, so it is only safe on lines the model has actually been
shown (by read, search or an edit's context block) and that are still where and what they were.
One view per file, keyed by the real path (so `./a.c`, `a.c` and `/abs/a.c` are one file), holds
a digest of the whole file as it was when its lines were shown and the CRC of each shown line.
Any change to the file by someone else (the user, a formatter run through bash, git checkout)
changes the digest and drops the view: the model must look again. Our own edits carry the view
over: lines before the edit keep their state; lines after it keep it only if the line count did
not change (otherwise their numbers moved, and a model still using the old numbers would edit the
wrong lines); the lines shown in the edit's context block are added.
"""
from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .base import ToolContext, ToolError
from .fileutil import strip_eol


@dataclass
class View:
    digest: bytes
    seen: dict[int, int] = field(default_factory=dict)   # line number -> CRC32 of its text


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def line_crc(line: str) -> int:
    return zlib.crc32(strip_eol(line).encode("utf-8", "surrogateescape"))


def _views(ctx: ToolContext) -> dict[str, View]:
    return ctx.state.setdefault("file_views", {})


def get(ctx: ToolContext, path: Path) -> View | None:
    return _views(ctx).get(str(path))


def forget(ctx: ToolContext, path: Path) -> None:
    _views(ctx).pop(str(path), None)


def remember(ctx: ToolContext, path: Path, data: bytes, lines: list[str], numbers: Iterable[int]) -> None:
    """Lines `numbers` (1-based) of this version of the file were shown to the model."""
    views, d = _views(ctx), digest(data)
    v = views.get(str(path))
    if v is None or v.digest != d:
        v = views[str(path)] = View(d)
    for n in numbers:
        v.seen[n] = line_crc(lines[n - 1])


def check(ctx: ToolContext, path: Path, rel: str, data: bytes, lines: list[str], a: int, b: int) -> None:
    """Refuse a line edit of lines a..b unless each was shown and nothing changed since."""
    v = get(ctx, path)
    again = f"read lines {a}-{b} of {rel} again (or use old/new text replacement), then retry"
    if v is None or not v.seen:
        raise ToolError(f"a line edit needs lines you have been shown, and you have not read {rel}; "
                        f"read lines {a}-{b} first (or use old/new text replacement)")
    if v.digest != digest(data):
        forget(ctx, path)
        raise ToolError(f"{rel} changed on disk since you last saw it; {again}")
    for n in range(a, b + 1):
        if n not in v.seen:
            raise ToolError(f"line {n} of {rel} was not shown to you (or its number moved after an "
                            f"edit); {again}")
        if v.seen[n] != line_crc(lines[n - 1]):
            raise ToolError(f"line {n} of {rel} changed since you saw it; {again}")


def after_edit(ctx: ToolContext, path: Path, old_data: bytes, new_data: bytes, new_lines: list[str],
               a: int, b_old: int, delta: int, shown: Iterable[int]) -> None:
    """Carry the view over our own edit of old lines a..b_old (line count changed by delta)."""
    v = get(ctx, path)
    keep: dict[int, int] = {}
    if v is not None and v.digest == digest(old_data):
        for n, crc in v.seen.items():
            if n < a or (delta == 0 and n > b_old):
                # same number; keep it only if the text there is what the model saw
                if n <= len(new_lines) and line_crc(new_lines[n - 1]) == crc:
                    keep[n] = crc
    nv = _views(ctx)[str(path)] = View(digest(new_data), keep)
    for n in shown:
        nv.seen[n] = line_crc(new_lines[n - 1])
