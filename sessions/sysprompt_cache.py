"""The agent's cache of prefilled system prefixes, beside its sessions (issue 24 item 7).

A system prefix names the project directory (its working directory, git status, AGENTS.md), so
each project has its own; one cache slot re-prefilled it every time the user moved between two
projects (seconds on the tiny model, minutes on the real one). So each prefix has its own file,
`sysprompt-<sha1>.kv` (reason "agent-system"), the sha1 of the model file's name, its
routed-expert width and the rendered prefix text: the same text on another recipe of the same
shape (q2 and q2-imatrix) is another file, never a wrong KV state. A file is used only when its
text equals the requested prefix byte for byte and its width matches (kvfile.read_kv checks
both, and the payload against the model).

Loading one counts as a use (header last_used, kvfile.touch). After each write the least recently
used files go beyond `keep` files or `budget_mb` of disk together; the file just written always
stays. The single `sysprompt.kv` of earlier versions is removed at the first write. The names
never match a session's `<sha1>.kv`, so they are not listed as sessions.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Callable

from engine import Session

from . import safeio
from .kvfile import KVFileError, KVFileInfo, read_header, read_kv, routed_quant_bits, touch, write_kv
from .prefix_cache import token_text

LEGACY_SYSPROMPT = "sysprompt.kv"   # the single slot of earlier versions
PREFIX = "sysprompt-"
SYSPROMPT_KEEP = 8                  # cached prefixes: one per project directory (and model) used lately
SYSPROMPT_BUDGET_MB = 4096          # ... and the disk they may take together
_NAME = re.compile(r"sysprompt-([0-9a-f]{40})\.kv")


class SystemPrefixCacheError(Exception):
    pass


def _bytes(text: bytes | str) -> bytes:
    return text.encode("utf-8", "surrogateescape") if isinstance(text, str) else bytes(text)


class SystemPrefixCache:
    def __init__(self, root: str, *, now: Callable[[], float] = time.time, keep: int = SYSPROMPT_KEEP,
                 budget_mb: float = SYSPROMPT_BUDGET_MB):
        self.root = root
        self._now = now
        self.keep = max(1, int(keep))
        self.budget = int(budget_mb * 2**20)

    def path(self, session: Session, text: bytes | str) -> str:
        """Where the prefilled prefix `text` of this session's model is cached."""
        model = os.path.basename(str(getattr(session.engine.file, "path", "")) or "")
        key = hashlib.sha1(model.encode("utf-8", "surrogateescape") + b"\0" +
                           str(routed_quant_bits(session)).encode() + b"\0" + _bytes(text)).hexdigest()
        return os.path.join(self.root, PREFIX + key + ".kv")

    def load(self, session: Session, text: bytes | str) -> bool:
        """Restore the cached prefill of exactly `text` into `session` and count the use; False,
        with the session untouched, when there is none or it cannot be used."""
        want = _bytes(text)
        path = self.path(session, want)
        if not os.path.lexists(path):
            return False
        try:
            read_kv(path, session, expect_text=want)
        except (KVFileError, OSError):
            return False
        try:
            touch(path, int(self._now()))       # the least recently used go first
        except (KVFileError, OSError):
            pass
        return True

    def save(self, session: Session, text: bytes | str) -> KVFileInfo:
        """Cache the session, which holds exactly the prefilled prefix `text`; then evict."""
        want = _bytes(text)
        if token_text(session) != want:
            raise SystemPrefixCacheError("the session does not hold exactly the system prefix")
        path = self.path(session, want)
        try:
            info = write_kv(path, session, want, reason="agent-system", now=int(self._now()))
        except (OSError, ValueError) as x:
            raise SystemPrefixCacheError(f"cannot save {path}: {x}") from None
        self.evict(keep=path)
        return info

    def entries(self) -> list[tuple[str, int, int]]:
        """(path, bytes, last used) of every cached prefix, most recently used first (an unreadable
        file counts as never used: it goes first)."""
        out = []
        try:
            names = [n for n, _ in safeio.scan(self.root) if _NAME.fullmatch(n)]
        except OSError:
            return out
        for n in names:
            p = os.path.join(self.root, n)
            try:
                hdr, size = read_header(p)
                out.append((p, size, hdr.last_used))
            except KVFileError:
                out.append((p, 0, 0))
        out.sort(key=lambda x: (x[2], x[0]), reverse=True)
        return out

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove the least recently used prefixes beyond the count and the disk budget (never
        `keep`, the file just written) and the legacy single slot. Returns the removed paths."""
        removed = []
        legacy = os.path.join(self.root, LEGACY_SYSPROMPT)
        if os.path.lexists(legacy):
            try:
                os.unlink(legacy)
                removed.append(legacy)
            except OSError:
                pass
        total, n = 0, 0
        for p, size, _ in sorted(self.entries(), key=lambda x: x[0] != keep):   # stable: keep first
            n += 1
            total += size
            if p != keep and (n > self.keep or total > self.budget):
                try:
                    os.unlink(p)
                    removed.append(p)
                except OSError:
                    pass
                total -= size
                n -= 1
        return removed
