"""How many live KV slots `--serve` keeps when `--slots` is not given: one slot's KV bytes at
`--ctx` against the memory available, at least 1 and at most MAX_SLOTS (config.py says why).

One slot's bytes are counted without allocating them: a KVState is built over a namespace whose
arrays are only shapes (its rings and row tables are all the state there is), so the figure is
exactly what a Session at this context would allocate.
"""
from __future__ import annotations

from engine import Engine
from engine.runtime.session import mem_available

from .config import MAX_SLOTS

# the share of the free memory the slots may take: the rest is for the process's own peaks (a
# long prompt's tokenization, prefill activations, a checkpoint's snapshot copy) and the system
SLOT_SHARE = 0.5
# Session's default rewind capacity (engine/runtime/session.py: min(ctx, DEFAULT_CHUNK))
_REWIND = 2048


class _Shape:
    def __init__(self, shape):
        n = 1
        for d in (shape if isinstance(shape, tuple) else (shape,)):
            n *= int(d)
        self.nbytes = 4 * n           # the state is float32 throughout


class _ShapesOnly:
    """The array namespace KVState asks for (full, zeros, float32), returning sizes, not memory."""
    float32 = "float32"

    @staticmethod
    def full(shape, fill=0.0, dtype=None):
        return _Shape(shape)

    @staticmethod
    def zeros(shape, dtype=None):
        return _Shape(shape)


def slot_kv_bytes(engine: Engine, ctx: int) -> int:
    """The KV bytes one Session of `engine` allocates at context `ctx`."""
    from engine.model.kv_state import KVState
    return KVState(engine.config, ctx, min(ctx, _REWIND), xp=_ShapesOnly).nbytes()


def default_slots(engine: Engine, ctx: int, avail: int | None = None) -> int:
    """Slots that fit SLOT_SHARE of the memory left once the weights have theirs. MemAvailable
    counts the page cache as free, and a mapped model's weights live there: that share is taken
    off (a resident copy is anonymous memory, already outside MemAvailable)."""
    per = slot_kv_bytes(engine, ctx)
    avail = mem_available() if avail is None else avail
    if avail is None or per <= 0:
        return 1
    if engine.paging != "resident":
        avail -= engine.file.gguf.size
    return max(1, min(MAX_SLOTS, int(SLOT_SHARE * max(0, avail) // per)))
