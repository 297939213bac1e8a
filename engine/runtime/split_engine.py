"""Rank 0 of a split run: the Engine the command asked for, with its layers cut across ranks.

`open_split` is what `Engine.open` does when `--layers` is given (EngineOptions.layers). Alone
(no mlx.launch) it opens the usual Engine. Under mlx.launch every rank above 0 becomes a worker
(engine/runtime/split_worker.py) and never returns; rank 0 checks that every rank has the same
file (a hash of its header and tensor directory), plans the ranges, and returns an Engine whose
model runs the embedding and its own layers, hands the HC state on, and gets the logits back
from the last rank. Sessions need no change: their state is a `SplitState` (this rank's layers,
and an id the workers keep theirs under), and Session's snapshot/restore/fork hand over to
`SplitModel` (a snapshot is the single-process file, byte for byte).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np

from ..errors import ModelFileError
from ..model import snapshot as snap
from ..model.layer_split import Keep, LayerRunner, PartialKVState, SplitError, parse_ranges, plan
from . import distributed as D
from .split_worker import PROTOCOL, bind_engine, file_identity, free_memory, pack_json, unpack_json


# session ids are unique in the process: a second engine opened after a first (ds4-bench) never
# names a state the workers still hold under the first's ids
_SIDS = itertools.count(1)


class Coordinator:
    """Rank 0's rounds of the ring, one at a time, each with its timeout."""

    def __init__(self, link: D.Link):
        self.link = link
        self._sids = _SIDS
        self._freed: list[int] = []
        self._free_lock = threading.Lock()
        self.inflight = 0         # tokens posted (D.POST) since the last round came back

    def new_sid(self) -> int:
        return next(self._sids)

    def round(self, op, sid=0, args=(), parts=(), tokens=0, timeout=None):
        """Send one message round the ring; returns (args, parts) of what comes back."""
        link = self.link
        with link.lock:
            if link.broken is not None:
                raise link.broken
            with self._free_lock:
                sids, self._freed = self._freed, []
            if sids:
                self._exchange(D.FREE, 0, (), [np.array(sids, np.int64)], D.round_timeout())
            # (the answer comes after every chunk posted before it: those count in its wait)
            t = timeout if timeout is not None else D.round_timeout(tokens + self.inflight)
            h, back = self._exchange(op, sid, args, parts, t)
            self.inflight = 0
            return [int(x) for x in h[2:6]], back

    def post(self, op, sid, args, parts, tokens: int):
        """Send one message round the ring that nothing answers (D.POST). The send returns once
        rank 1 has taken it, which it does when it has finished the chunk before: that wait, and
        the ranks behind it, are within the round timeout of the tokens still in flight."""
        link = self.link
        with link.lock:
            if link.broken is not None:
                raise link.broken
            t = D.round_timeout(tokens + self.inflight)
            try:
                err = link.post(op, sid, args, parts, timeout=t)
            except TimeoutError as e:
                raise self._fail(D.lost(e, link.next if link.size == 2 else f"1..{link.size - 1}", t)) from None
            if err is not None:
                raise self._fail(D.lost(err, link.next, t)) from None
            self.inflight += tokens

    def _exchange(self, op, sid, args, parts, t):
        link = self.link
        try:
            how, got = link.exchange(op, sid, args, parts, timeout=t)
        except TimeoutError as e:
            who = link.prev if link.size == 2 else f"1..{link.size - 1}"
            raise self._fail(D.lost(e, who, t)) from None
        if how != "ok":
            raise self._fail(D.lost(got, link.next if how == "send" else link.prev, t)) from None
        h, back = got
        if int(h[0]) == D.ERR:
            raise self._fail(D.HopError(unpack_json(back[0])))
        return h, back

    def _fail(self, err: D.HopError) -> D.HopError:
        self.link.broken = err
        return err

    def free(self, sid: int):
        """A session went away: its workers' state goes with the next round (a finalizer may run
        on any thread, even inside a round)."""
        with self._free_lock:
            self._freed.append(sid)

    def close(self):
        if self.link.broken is None:
            self.round(D.CLOSE)


class SplitState:
    """A Session's state on rank 0: this rank's layers (`local`, the backend's own state) and the
    id under which every worker keeps the state of its layers."""

    def __init__(self, local, sid: int, coord: Coordinator):
        self.local, self.sid, self.coord = local, sid, coord
        self.config, self.ctx, self.rewind_cap = local.config, local.ctx, local.rewind_cap
        import weakref
        weakref.finalize(self, coord.free, sid)

    @property
    def layers(self):
        return self.local.layers

    def can_truncate(self, n_tokens: int, new_len: int) -> bool:
        if not self.local.can_truncate(n_tokens, new_len):
            return False
        back, _ = self.coord.round(D.CANTRUNC, self.sid, (n_tokens, new_len, 1))
        return bool(back[2])

    def truncate(self, n_tokens: int, new_len: int):
        self.local.truncate(n_tokens, new_len)
        self.coord.round(D.TRUNC, self.sid, (n_tokens, new_len))

    def reset(self):
        self.local.reset()
        self.coord.round(D.RESET, self.sid)

    def nbytes(self) -> int:
        """Rank 0's part (each rank holds its own layers' state)."""
        return self.local.nbytes()


class SplitOps:
    """The backend's ops, with a session's state made across the ranks."""

    def __init__(self, ops, model: "SplitModel"):
        self._ops, self._model = ops, model

    def __getattr__(self, k):
        return getattr(self._ops, k)

    def new_state(self, config, ctx: int, rewind_cap: int) -> SplitState:
        return self._model.new_state(ctx, rewind_cap)


class SplitModel:
    """Rank 0's model: the embedding and its layers here, the rest on the ring; otherwise the
    wrapped Model (attributes read through)."""

    def __init__(self, inner, keep: Keep, coord: Coordinator, ranges):
        self.inner, self.keep, self.coord, self.ranges = inner, keep, coord, ranges
        self.runner = LayerRunner(inner, keep)
        self.ops = SplitOps(inner.ops, self)
        self.split = self               # Session's hook (snapshot, restore, fork)

    def __getattr__(self, k):
        return getattr(self.inner, k)

    def new_state(self, ctx: int, rewind_cap: int) -> SplitState:
        ops = self.inner.ops
        local = ops.state_from_host(PartialKVState(self.inner.c, ctx, rewind_cap, self.keep.layers))
        sid = self.coord.new_sid()
        self.coord.round(D.NEW, sid, (ctx, rewind_cap))
        return SplitState(local, sid, self.coord)

    def forward(self, tokens, pos0: int, state: SplitState, all_logits: bool = False):
        tokens = np.asarray(tokens, dtype=np.int64)
        r = self.runner
        X = r.layers(r.embed(tokens), tokens, pos0, state)
        X = self.inner.ops.logits_to_host(X)        # (the backend's token boundary, then the hop)
        _, back = self.coord.round(D.FWD, state.sid, (pos0, len(tokens), int(all_logits)), [tokens, X],
                                   tokens=len(tokens))
        logits = np.array(back[0], copy=False).reshape(-1, self.inner.c.n_vocab)
        return logits if all_logits else logits[0]

    def post(self, tokens, pos0: int, state: SplitState):
        """A prefill chunk that is not its prefill's last (Session.sync): its logits are never read,
        so it goes on to rank 1 without waiting for an answer, and this rank goes on to the next
        chunk while the workers compute this one. The workers' state stays in order: every later
        message round the ring comes after it."""
        tokens = np.asarray(tokens, dtype=np.int64)
        r = self.runner
        X = r.layers(r.embed(tokens), tokens, pos0, state)
        X = self.inner.ops.logits_to_host(X)
        self.coord.post(D.POST, state.sid, (pos0, len(tokens), 0), [tokens, X], tokens=len(tokens))

    def settle(self, state: SplitState):
        """The logits after the last chunk posted for `state` (a prefill that stopped before its
        last chunk); None once the ring has failed (the failure is already on its way up)."""
        if self.coord.link.broken is not None:
            return None
        _, back = self.coord.round(D.TAIL, state.sid)
        return np.array(back[0], copy=True).reshape(-1)

    def forward_batch(self, tokens, positions, states):
        """One pass per session (each a trip round the ring): the rows a batched pass gives."""
        rows = [self.forward([t], p, s, all_logits=True)[0] for t, p, s in zip(tokens, positions, states)]
        return np.stack(rows)

    # -- Session's hooks -------------------------------------------------------------------------
    def snapshot(self, session) -> bytes:
        """The single-process payload: rank 0's blocks, then every worker's, in layer order."""
        st, T = session.state, len(session._tokens)
        c = self.inner.c
        host = self.inner.ops.state_to_host(st.local)
        R = min(snap.raw_window(c, st.ctx), T)
        blocks, rows = [], []
        for il in range(*self.keep.layers):
            ls = host.layers[il]
            b = snap.layer_block(ls, T, R)
            blocks.append(np.frombuffer(b, np.uint8))
            rows.append(np.array([il, ls.n_comp, ls.n_index, len(b)], np.int64))
        _, back = self.coord.round(D.SAVE, st.sid, (T,), [np.zeros(0, np.uint8), np.zeros(0, np.int64)])
        data = np.array(back[0], copy=False)
        table = np.array(back[1], copy=False).reshape(-1, 4)
        at = 0
        for il, n_comp, n_index, n in table.tolist():
            blocks.append(data[at:at + n])
            rows.append(np.array([il, n_comp, n_index, n], np.int64))
            at += n
        table = np.stack(rows)
        if table[:, 0].tolist() != list(range(c.n_layer)):
            raise D.HopError(f"the ranks sent layers {table[:, 0].tolist()}, not 0..{c.n_layer - 1}")
        logits = session._logits if session._logits is not None else np.zeros(c.n_vocab, np.float32)
        return snap.pack(c, st.ctx, session.chunk, session._tokens, logits, table[:, 1], table[:, 2],
                         [b.tobytes() for b in blocks])

    def restore(self, session, data: bytes):
        """(state, tokens, logits) of a payload: checked whole here (a bad one changes nothing),
        then each worker loads its layers under a new id."""
        c = self.inner.c
        host = PartialKVState(c, session.ctx, session.rewind_cap, self.keep.layers)
        tokens, logits = snap.load(c, host, data)
        sid = self.coord.new_sid()
        self.coord.round(D.LOAD, sid, (session.ctx, session.rewind_cap),
                         [np.frombuffer(bytes(data), np.uint8)], tokens=len(tokens) // 64)
        return SplitState(self.inner.ops.state_from_host(host), sid, self.coord), tokens, logits

    def fork_state(self, state: SplitState) -> SplitState:
        ops = self.inner.ops
        host = ops.state_to_host(state.local)
        host = host.copy_to(np, np.array) if host is state.local else host
        sid = self.coord.new_sid()
        self.coord.round(D.COPY, sid, (state.sid,))
        return SplitState(ops.state_from_host(host), sid, self.coord)

    def close(self):
        self.coord.close()


def _layer_bytes(m) -> tuple[list[int], tuple[int, int]]:
    c = m.config
    per = [0] * c.n_layer
    embed = head = 0
    for name, ti in m.layout.present.items():
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if il < c.n_layer:
                per[il] += ti.nbytes
        elif name.startswith("token_embd"):
            embed += ti.nbytes
        else:
            head += ti.nbytes
    return per, (embed, head)


def _hello(coord: Coordinator, m, o) -> list[dict]:
    me = {"rank": 0, "free": free_memory(), "protocol": PROTOCOL, "hash": file_identity(m)}
    _, back = coord.round(D.HELLO, 0, (), [pack_json([me])], timeout=D.OPEN_TIMEOUT_S)
    infos = unpack_json(back[0])
    for info in infos:
        if "error" in info:
            raise ModelFileError(m.path, f"{info['error']} (every rank opens the same path on its own machine)")
        if info.get("protocol") != PROTOCOL:
            raise ModelFileError(m.path, f"rank {info['rank']} runs split protocol {info.get('protocol')}, "
                                         f"rank 0 runs {PROTOCOL}: install the same ds4-agent version on every machine")
        if info["hash"] != me["hash"]:
            raise ModelFileError(m.path, f"rank {info['rank']} has a different model file (header and tensor "
                                         f"directory sha256 {info['hash'][:12]}, rank 0's {me['hash'][:12]}): "
                                         f"every rank needs the same file")
    return infos


def open_split(cls, path, o):
    """Engine.open with `o.layers` set (module docstring)."""
    from ..backends import registry
    from ..gguf.model_file import ModelFile
    g = D.group()
    n = 1 if g is None else g.size()
    if n == 1:
        ranges = parse_ranges(o.layers)
        if ranges is not None and len(ranges) > 1:
            raise SplitError(f"--layers names {len(ranges)} ranges but this process runs alone: start every "
                             f"rank with mlx.launch (docs/distributed.md)")
        return cls.open(path, dataclasses.replace(o, layers=None))
    link = D.shared_link(g)
    if link.rank > 0:
        from .split_worker import worker_main
        worker_main(path, o, link, cls)     # never returns
    D.filter_ring_noise()
    entry = registry.pick(o.backend)
    ops = registry.make_ops(entry, o.numerics)
    entry.setup(o.threads)
    m = ModelFile.open(path, check_merges=False)
    try:
        coord = Coordinator(link)
        infos = _hello(coord, m, o)
        per, edge = _layer_bytes(m)
        ranges = plan(o.layers, m.config.n_layer, n, [i["free"] for i in infos], per, edge)
        coord.round(D.PLAN, 0, (), [pack_json({"ranges": ranges, "status": []})], timeout=D.OPEN_TIMEOUT_S)
        keep = Keep(ranges[0], embed=True, head=False)
        eng = bind_engine(cls, m, keep, entry.name, o, ops)
        # each rank reads only its own layers' pages: no whole-file copy or prefault
        eng.paging = _advise(m, "lowmem" if o.paging == "lowmem" else "none")
        eng.model = SplitModel(eng.model, keep, coord, ranges)
        return eng
    except BaseException:
        m.close()
        raise


def serve_if_worker(path, o, engine_cls) -> None:
    """For commands that start a UI before they open the model (ds4-agent): under mlx.launch a
    rank above 0 opens it now (engine_cls.open), which serves the ring and never returns; rank 0
    and a process alone return at once."""
    if o.layers is not None and D.launched() and D.this_rank() > 0:
        engine_cls.open(path, o)


def _advise(m, mode: str) -> str:
    """Engine.open's advice on the map (session._advise; not imported: session imports this)."""
    if mode == "none":
        return "none"
    try:
        return m.gguf.advise(mode)
    except OSError:
        return "none"
