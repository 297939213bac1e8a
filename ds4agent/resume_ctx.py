"""The context a `--resume` runs at (issue 35 item 1).

A saved session's KV state loads only into a context at least as large as the one it was saved
with (engine/model/snapshot.py). `ds4-agent --ctx 16384 --resume ID` of a session saved at 65536
used to fail inside the worker, unseen in headless mode, and the task ran as a new session. Now,
before the model loads: when the saved context fits this machine's memory the run adopts it and
says so in one line; when it does not, the run is refused with the flag that would continue it.
"""
from __future__ import annotations

from engine.runtime.session import DEFAULT_CHUNK, mem_available

MEMORY_SHARE = 0.5     # the grown KV state may take at most this share of the memory available now


class ResumeContextError(Exception):
    """The session cannot be continued at any context this run may use; the message says the fix."""


def _target(store, resume):
    """The saved session `--resume` continues (SessionInfo), or None when there is none to check."""
    if resume is True:
        rows = [r for r in store.list("project") if r.ok]
        return rows[0] if rows else None
    try:
        return store.resolve(resume)
    except Exception:      # the worker's /switch says why, as before
        return None


def kv_bytes(config, ctx: int) -> int:
    """Bytes of a session's KV state at `ctx` (as Session allocates it; numpy's zeros are not
    touched, so this costs no memory)."""
    from engine.model.kv_state import KVState
    return KVState(config, ctx, min(ctx, DEFAULT_CHUNK)).nbytes()


def resume_ctx(store, resume, ctx: int, config, *, avail: int | None = -1) -> tuple[int, str | None]:
    """(the context to run at, a note to print or None). ResumeContextError when the session's
    context would not fit memory. `config`: the model's ModelConfig; `avail`: the bytes of memory
    available (-1: read /proc/meminfo; None: unknown, so anything fits)."""
    if not resume:
        return ctx, None
    info = _target(store, resume)
    if info is None or not info.ok or not info.ctx:
        return ctx, None
    saved, tokens = int(info.ctx), int(info.tokens or 0)
    if saved <= ctx and tokens < ctx:
        return ctx, None
    need = max(saved, tokens + 1)
    limit = config.context_length
    gib = 1 << 30
    if limit and need > limit:
        raise ResumeContextError(f"session {info.id} was saved with a {saved}-token context, more than this "
                                 f"model's {limit}: it cannot be continued with this model")
    avail = mem_available() if avail == -1 else avail
    extra = kv_bytes(config, need) - kv_bytes(config, ctx)
    if avail is not None and extra > MEMORY_SHARE * avail:
        raise ResumeContextError(
            f"session {info.id} was saved with a {saved}-token context and --ctx is {ctx}; continuing it "
            f"needs --ctx {need}, whose KV state takes {extra / gib:.1f} GiB more than this machine has to "
            f"spare now ({avail / gib:.1f} GiB available): free memory and run with --ctx {need}")
    return need, (f"note: session {info.id} was saved with a {saved}-token context: continuing it at "
                  f"--ctx {need} (not {ctx})")
