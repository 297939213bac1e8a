"""The MTP file as a drafter for speculative.Speculator, and attaching one to an Engine.

`attach_mtp(engine, path)` opens and checks the MTP file against the engine's model (one
ModelFileError line when it does not fit), binds it on the engine's backend and makes the model
keep each pass's last final HC row (Model.keep_hc), which the first draft after a prefill or a
plain decode step starts from. `MTPDrafter(engine)` then drafts for one Session; it holds that
session's MTP raw rows, which are never saved with it (ds4 does not persist them either).
"""
from __future__ import annotations

import numpy as np

from ..gguf.mtp_file import MTPFile
from ..model.mtp import MTPBlock, bind_mtp
from .sampling import argmax


def attach_mtp(engine, path) -> MTPBlock:
    f = MTPFile.open(path, engine.config)
    try:
        block = MTPBlock(engine.model, bind_mtp(f, engine.model.xp))
    except BaseException:
        f.close()
        raise
    engine.mtp, engine.mtp_file = block, f
    engine.model.keep_hc = max(engine.model.keep_hc, 1)
    return block


class MTPDrafter:
    """Greedy drafts (the MTP logits' argmax: q one-hot) chained from the main model's final HC."""

    def __init__(self, engine):
        block = getattr(engine, "mtp", None)
        if block is None:
            raise ValueError("this engine was opened without an MTP file (Engine.open(..., mtp=PATH))")
        self.engine, self.block = engine, block
        self.state = block.new_state()
        self.hc = self.hc_at = None

    def _base(self, s):
        """The final HC row of the session's last token, where known (None: no draft this step)."""
        key = (id(s.state), s.pos)
        if self.hc_at == key:
            return self.hc
        m = self.engine.model
        if m.last_hc is not None and m.last_hc_at == key:
            return m.last_hc[-1]
        return None

    def propose(self, s, y: int, n: int):
        H = self._base(s)
        if H is None or s.pos == 0:
            return [], None
        drafts, tok, pos = [], int(y), s.pos - 1
        ops = self.engine.model.ops
        with self.engine.lock:
            for j in range(n):
                logits, H = self.block.step(self.state, H, tok, pos + j)
                tok = argmax(np.asarray(ops.logits_to_host(logits), np.float32))
                drafts.append(tok)
        return drafts, None

    def commit(self, s, kept: int, hc_row):
        # the MTP row at position p was made from the token at p + 1: rows from s.pos - 1 on were
        # made from drafts the main model did not keep (or from the next, still unknown, token)
        self.state.keep_upto(s.pos - 1)
        self.hc, self.hc_at = hc_row, ((id(s.state), s.pos) if hc_row is not None else None)

    def reset(self):
        self.state.reset()
        self.hc = self.hc_at = None
