"""Helpers shared by the session-store tests (test_session_store, test_session_names)."""
from __future__ import annotations

from engine import Session


def prefix_snapshots(eng, ctx: int, system: str, user: str) -> tuple[bytes, bytes]:
    """(system-prefix snapshot, conversation snapshot): `system`, then `system + user`, prefilled
    once in one session (every other timeline of a module is a restore plus a few steps)."""
    s = Session(eng, ctx)
    s.sync(eng.tokenizer.encode(system))
    sys_blob = s.snapshot()
    s.sync(eng.tokenizer.encode(system + user))
    return sys_blob, s.snapshot()
