"""A bounded cache of routed experts: slots filled by pread from the GGUF, what the kernels read.

Every weight but the routed experts stays where paging puts it (resident, or the page cache under
`lowmem`). Each layer's gate/up/down expert tensors are replaced by `SlotExperts`, whose
`expert_data(e)` is expert e's bytes in a cache slot -- the GGUF's own bytes, so the kernels
compute the same products as from the map. The forward pass asks the cache for a layer's experts
(`ExpertCache.moe`) as soon as routing has picked them, and for every hash layer's at the step's
start (a hash layer routes by token id: known before any layer runs); the reads run in a thread
pool (expert_reader.py) while the layers before them compute, and a routed layer's while its
shared expert computes (the host backends' moe is routed + shared_expert: apart, the same bits).

A slot holds one expert of one layer: its gate, up and down matrices. The cache holds
`n_slots`, at least `n_expert_used` (one token's experts of one layer: the working set of a
decode step). A prefill chunk that routes to more experts than the cache holds runs its rows in
groups that fit (each row's result does not depend on the other rows').

Eviction: `LRU` or `SLRU` (segmented LRU: an expert used twice moves to a protected segment that
one-off uses cannot flush). `replay(trace, n_slots, policy)` measures a policy's hit rate on a
recorded routing trace; docs/performance.md ("The expert cache") has the comparison and the
choice.
"""
from __future__ import annotations

import mmap
import time
from collections import OrderedDict

import numpy as np

from .paging import MAP_NORESERVE
from .expert_reader import ALIGN, DEPTH, ExpertReader, Span, region_bytes
from .model_file import QTensor

MATRICES = ("gate_exps", "up_exps", "down_exps")


# -- eviction policies ------------------------------------------------------------------------------
class LRU:
    """Least recently used: the victim is the key used longest ago."""
    name = "lru"

    def __init__(self, n_slots: int):
        self.order: OrderedDict = OrderedDict()

    def touch(self, key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def insert(self, key) -> None:
        """A key read in (before its first use: a prefetch is not a use)."""
        self.order[key] = None
        self.order.move_to_end(key)

    def remove(self, key) -> None:
        self.order.pop(key, None)

    def victims(self):
        """Keys in eviction order (first: evict first)."""
        return iter(self.order)


class SLRU(LRU):
    """Segmented LRU: first use lands in probation; a second use while cached moves the key to
    the protected segment (at most `protect` of the slots; its oldest drop back to probation).
    Victims come from probation first, oldest first, then from the protected segment."""
    name = "slru"

    def __init__(self, n_slots: int, protect: float = 0.8):
        super().__init__(n_slots)
        self.hot: OrderedDict = OrderedDict()
        self.cap = max(1, int(n_slots * protect))

    def touch(self, key) -> None:
        if key in self.hot:
            self.hot.move_to_end(key)
        elif key in self.order:
            del self.order[key]
            self.hot[key] = None
            while len(self.hot) > self.cap:
                old, _ = self.hot.popitem(last=False)
                self.order[old] = None
        else:
            self.order[key] = None

    def insert(self, key) -> None:
        if key not in self.hot:
            super().insert(key)

    def remove(self, key) -> None:
        self.order.pop(key, None)
        self.hot.pop(key, None)

    def victims(self):
        yield from list(self.order)
        yield from list(self.hot)


POLICIES = {"lru": LRU, "slru": SLRU}
# the kept policy: on a recorded decode trace SLRU hit 2.5-5 points more than LRU with the cache
# at 6-40 % of the experts (the 1/5 and 1/2 cgroups' share), the same at 69 %, less only at one
# token's working set (docs/performance.md, "The expert cache")
POLICY = "slru"


def replay(trace, n_slots: int, policy: str) -> float:
    """The hit rate of `policy` with `n_slots` slots on a routing trace: [(layer, experts)] in the
    order a run asked for them (ExpertCache.trace records one). Each request's experts are used
    together (none of them is evicted for another)."""
    p = POLICIES[policy](n_slots)
    held: set = set()
    hits = total = 0
    for il, experts in trace:
        keys = [(il, int(e)) for e in experts]
        want = set(keys)
        for k in keys:
            total += 1
            if k in held:
                hits += 1
                continue
            if len(held) >= n_slots:
                v = next(v for v in p.victims() if v not in want)
                p.remove(v)
                held.discard(v)
            held.add(k)
        for k in keys:
            p.touch(k)
    return hits / total if total else 0.0


# -- the weights the kernels read ------------------------------------------------------------------
class SlotExperts(QTensor):
    """A routed expert tensor whose experts live in cache slots: `expert_data(e)` is the slot's
    view (the expert must be held: ExpertCache.moe holds a layer's for its call). Nothing reads
    the tensor whole: `data` refuses, so a path that would read the map says so."""
    streamed = True

    def __init__(self, t: QTensor, cache: "ExpertCache", il: int, m: int):
        for k, v in (("name", t.name), ("type_id", t.type_id), ("dims", t.dims)):
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_shape", t.data.shape)
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_where", (il, m))

    @property
    def data(self):
        raise RuntimeError(f"{self.name}: the routed experts are in the expert cache "
                           f"(read expert_data(e), not the whole tensor)")

    @property
    def n_rows(self) -> int:
        return self._shape[0]

    def expert_data(self, e: int) -> np.ndarray:
        il, m = self._where
        return self._cache.view(il, int(e), m)


class _Layer:
    """Where one layer's experts lie in the file and in a slot."""

    def __init__(self, tensors: list, infos: list, region: list):
        self.shapes, self.spans = [], []
        dst = 0
        for t, ti, r in zip(tensors, infos, region):
            n_exp = t.dims[2]
            per = ti.nbytes // n_exp
            self.shapes.append((t.dims[1], per // t.dims[1]))
            self.spans.append((ti.offset, per, dst))
            dst += r
        self.bytes = sum(per for _, per, _ in self.spans)

    def reads(self, e: int, slot_off: int) -> list:
        return [Span(off + e * per, per, slot_off + dst) for off, per, dst in self.spans]


def _regions(tensors: list, infos: list) -> list:
    """Bytes each of a slot's three matrices takes (the largest layer's, aligned for O_DIRECT)."""
    return [max(region_bytes(ti[m].nbytes // ts[m].dims[2]) for ts, ti in zip(tensors, infos)) for m in range(3)]


class HostSlots:
    """The slots in host memory, read by the cpu and numpy kernels (ExpertCache's `store`; the mlx
    backend's is engine/backends/mlx/expert_slots.py): one anonymous map, the three matrices of a
    slot at their regions' offsets, in the file's own bytes."""
    direct = True
    host = True                               # (its kernels run at once: see ExpertCache.moe)

    def __init__(self, tensors: list, infos: list):
        self.slot_bytes = sum(_regions(tensors, infos))
        self._mem = self.buf = None

    def allocate(self, n_slots: int) -> memoryview:
        # slots are memory once read into: a cache sized beyond the memory (more than the file's
        # experts asked for) reserves nothing up front (the overcommit check would refuse it)
        self._mem = mmap.mmap(-1, n_slots * self.slot_bytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.buf = np.frombuffer(self._mem, dtype=np.uint8)
        return memoryview(self._mem)

    def reads(self, layer: _Layer, e: int, s: int) -> list:
        return layer.reads(e, s * self.slot_bytes)

    @staticmethod
    def weight(cache, il: int, m: int, t) -> "SlotExperts":
        return SlotExperts(t, cache, il, m)

    @staticmethod
    def settle(y) -> None:
        pass

    def close(self) -> None:
        pass


class ExpertCache:
    """n_slots slots of routed experts read from `path` (see the module doc). `trace`: a list to
    record [(layer, experts)] into (replay's input). `store`: where the slots are (HostSlots, or a
    backend's own memory: the mlx backend's arrays, engine/backends/mlx/expert_slots.py); it lays
    out the reads (`reads`), owns the buffers (`allocate`), makes the weights the kernels read
    (`weight`) and a layer's results final before its slots may be read into again (`settle`)."""

    def __init__(self, path: str, layers: list, infos: list, n_slots: int, n_used: int, *,
                 policy: str = POLICY, direct: bool = True, depth: int = DEPTH, pread=None, store=None,
                 ils=None):
        region = _regions(layers, infos)
        self.store = store = HostSlots(layers, infos) if store is None else store
        self.slot_bytes = store.slot_bytes
        # by layer index (`ils`: the layers' indices where they are not 0..n-1, a split rank's)
        self.layers = dict(zip(range(len(layers)) if ils is None else ils,
                               (_Layer(t, ti, region) for t, ti in zip(layers, infos))))
        self.n_used = n_used
        self.n_slots = max(int(n_slots), n_used)
        self.reader = ExpertReader(path, store.allocate(self.n_slots), direct=direct and store.direct,
                                   depth=depth, pread=pread)
        self.policy = POLICIES[policy](self.n_slots)
        self.where: dict = {}                 # (layer, expert) -> slot
        self.pending: dict = {}               # (layer, expert) -> Future of its reads
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.held: set = set()                # keys a running call reads (never evicted)
        self.fresh: set = set()               # keys read in and not used yet
        self.trace: list | None = None
        self.hits = self.misses = self.prefetched = 0
        self.ahead = 0                        # misses whose read a prefetch had started
        self.stall_s = 0.0
        self.error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes

    def stats(self) -> dict:
        n = self.hits + self.misses
        return {"slots": self.n_slots, "bytes": self.nbytes, "hits": self.hits, "misses": self.misses,
                "misses_read_ahead": self.ahead,
                "hit_rate": self.hits / n if n else 0.0, "bytes_read": self.reader.bytes_read,
                "stall_s": self.stall_s, "direct": self.reader.direct}

    # -- slots -------------------------------------------------------------------------------------
    def _slot_for(self, key, keep) -> int | None:
        """A slot for key: a free one, else the policy's victim among keys not held and not in
        `keep`; None where every slot is held."""
        if self.free:
            return self.free.pop()
        for v in self.policy.victims():
            if v in self.held or v in keep:
                continue
            s = self.where.pop(v)
            self.policy.remove(v)
            self.fresh.discard(v)
            f = self.pending.pop(v, None)
            if f is not None:             # a prefetch still writing into that slot: let it end
                t0 = time.perf_counter()
                f.exception()             # (its error is moot: nothing will read it)
                self.stall_s += time.perf_counter() - t0
            return s
        return None

    def _start(self, key, keep=()) -> bool:
        """Begin reading key into a slot unless cached; False where no slot can be had."""
        if key in self.where:
            return True
        s = self._slot_for(key, keep)
        if s is None:
            return False
        self.where[key] = s
        self.policy.insert(key)
        self.fresh.add(key)
        lay = self.layers[key[0]]
        self.pending[key] = self.reader.submit(self.store.reads(lay, key[1], s))
        return True

    def _wait(self, f, key) -> None:
        t0 = time.perf_counter()
        try:
            f.result()
        except BaseException:
            # the slot's bytes are incomplete: forget it, and end the call with the read's error
            s = self.where.pop(key, None)
            self.pending.pop(key, None)
            self.policy.remove(key)
            self.fresh.discard(key)
            if s is not None:
                self.free.append(s)
            raise
        finally:
            self.stall_s += time.perf_counter() - t0

    def _sweep(self) -> None:
        """Forget the reads that failed (their slots come free): a failed prefetch is read again
        when it is needed, so a fault that has passed leaves no stale error behind."""
        for k, f in list(self.pending.items()):
            if f.done() and f.exception() is not None:
                self.pending.pop(k)
                self.policy.remove(k)
                self.fresh.discard(k)
                self.free.append(self.where.pop(k))

    def prefetch(self, il: int, experts) -> None:
        """Start reading these experts of layer il if slots are free or hold nothing held (a
        hint: where every slot is taken the call that needs them reads them)."""
        for e in experts:
            key = (il, int(e))
            # (never in place of another prefetch not yet used: the earlier layer needs it first)
            if key not in self.where and self._start(key, self.held | self.fresh):
                self.prefetched += 1

    def hold(self, il: int, experts) -> None:
        """Make these experts of layer il readable (expert_data) until release: reads start for
        all the missing ones at once, then this waits for them."""
        self.wait_held(self.claim(il, experts))

    def claim(self, il: int, experts) -> list:
        """hold's first half: count the hits and misses, start the missing reads, mark the keys
        held (no eviction takes them); returns the keys for wait_held."""
        keys = [(il, int(e)) for e in experts]
        if self.pending:
            self._sweep()
        if self.trace is not None:
            self.trace.append((il, [k[1] for k in keys]))
        for k in keys:
            # a hit is an expert a previous use left cached; one a prefetch read for this use (a
            # hash layer's, read at the step's start) is a miss whose read started early
            if k in self.where and k not in self.fresh:
                self.hits += 1
            else:
                self.misses += 1
                self.ahead += k in self.where
            if not self._start(k, set(keys)):
                raise RuntimeError(f"expert cache: {len(keys)} experts asked at once, {self.n_slots} slots")
            self.held.add(k)
        return keys

    def wait_held(self, keys: list) -> None:
        """hold's second half: wait for the claimed keys' reads (a failed one: the keys let go,
        every read in flight ended, the error raised)."""
        try:
            for k in keys:
                f = self.pending.pop(k, None)
                if f is not None:
                    self._wait(f, k)
        except BaseException:
            self.held.difference_update(keys)
            self._wait_all()
            raise
        for k in keys:
            if k in self.fresh:               # its first use: a policy counts uses, not reads
                self.fresh.discard(k)
                self.policy.insert(k)
            else:
                self.policy.touch(k)

    def _wait_all(self) -> None:
        """After a failed read: let every read in flight end (none writes into a slot later),
        then forget the failed ones."""
        for f in list(self.pending.values()):
            f.exception()
        self._sweep()

    def release(self) -> None:
        self.held.clear()

    def empty(self) -> None:
        """Forget every cached expert (the counters stay): the bench empties the cache after its
        probe, which decodes the same tokens the measured rows will, so its reads would be hits."""
        for f in list(self.pending.values()):
            f.exception()                     # (no read may land in a slot after this)
        self.pending.clear()
        self.where.clear()
        self.fresh.clear()
        self.held.clear()
        self.policy = POLICIES[self.policy.name](self.n_slots)
        self.free = list(range(self.n_slots - 1, -1, -1))

    def view(self, il: int, e: int, m: int) -> np.ndarray:
        """Expert e of layer il, matrix m (0 gate, 1 up, 2 down): [n_out, row_bytes] uint8 in its
        slot. An expert not held is read now (a path outside ExpertCache.moe)."""
        key = (il, e)
        if key not in self.held or key in self.pending:
            self.hold(il, [e])
        lay = self.layers[il]
        off, per, dst = lay.spans[m]
        at = self.where[key] * self.slot_bytes + dst + (off + e * per) % ALIGN
        return self.store.buf[at:at + per].reshape(lay.shapes[m])

    # -- the forward pass's two calls ---------------------------------------------------------------
    def begin_step(self, layers, tokens) -> None:
        """A step starts: every hash layer's experts are known from the token ids; read them now."""
        for lw in layers:
            if lw is not None and lw.tid2eid is not None:
                self.prefetch(lw.il, np.unique(lw.tid2eid[tokens]))

    def moe(self, ops, lw, u, sel, wsel, limit):
        """ops.moe(lw, u, sel, wsel, limit) with the layer's routed experts held in slots: all the
        rows at once where their experts fit the cache, else in groups of rows that fit."""
        sel_h = np.asarray(sel)
        experts = np.unique(sel_h)
        if len(experts) <= self.n_slots:
            groups = [None]
        else:
            groups = _row_groups(sel_h, self.n_slots)
        out = []
        for rows in groups:
            s = sel_h if rows is None else sel_h[rows]
            keys = self.claim(lw.il, np.unique(s))
            try:
                sh = None
                if rows is None and getattr(self.store, "host", False) and any(k in self.pending for k in keys) \
                        and hasattr(ops, "routed") and hasattr(ops, "shared_expert"):
                    # reads in flight: the shared expert computes meanwhile. The host backends'
                    # moe is routed + shared_expert, the same bits as apart (the cpu kernels
                    # compute each product's rows whole, whatever else shares the call; each
                    # product's input is quantized by row; the sum is routed, then + shared)
                    sh = ops.shared_expert(lw, u, limit)
                self.wait_held(keys)
                if sh is not None:
                    out.append(ops.routed(lw, u, sel, wsel, limit) + sh)
                elif rows is None:
                    out.append(ops.moe(lw, u, sel, wsel, limit))
                else:
                    out.append(ops.moe(lw, u[rows], sel[rows], wsel[rows], limit))
                # a lazy backend's result is computed now, while its experts are held: a later
                # read into those slots must not land under a graph not yet run
                self.store.settle(out[-1])
            finally:
                self.release()
        return out[0] if len(out) == 1 else getattr(ops, "xp", np).concatenate(out, axis=0)

    def close(self) -> None:
        self.reader.close()
        self.store.close()


def _row_groups(sel: np.ndarray, n_slots: int) -> list:
    """Consecutive row ranges whose experts together fit n_slots (each row's alone does)."""
    groups, start, seen = [], 0, set()
    for r in range(sel.shape[0]):
        row = set(sel[r].tolist())
        if len(seen | row) > n_slots:
            groups.append(slice(start, r))
            start, seen = r, set()
        seen |= row
    groups.append(slice(start, sel.shape[0]))
    return groups


# -- sizing and attaching --------------------------------------------------------------------------
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# what `auto` leaves free beside the resident weights: the KV state of a session (the sessions are
# made after open, so their size is not known here), the activations, Python, the page cache's
# working room (a cgroup counts it)
MARGIN = 1 << 30


def parse_size(text: str) -> int | str:
    """--expert-cache's value: "auto", or bytes ("8G", "512M", "1500000000", "0"); ValueError
    (one line) for anything else."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    if t == "AUTO":
        return "auto"
    unit = t[-1:] if t[-1:] in _UNITS and not t[-1:].isdigit() else ""
    try:
        v = float(t[:len(t) - len(unit)])
    except ValueError:
        v = -1
    if not v >= 0:
        raise ValueError(f"--expert-cache takes a size (like 8G or 512M) or auto, not {text!r}")
    return int(v * _UNITS[unit])


def memory_budget() -> int | None:
    """The bytes this process may still use: MemAvailable, and within a memory cgroup what its
    limit leaves (v2 memory.max, v1 memory.limit_in_bytes); None where none can be read."""
    got = []
    try:
        with open("/proc/meminfo") as f:
            got += [int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    got += _cgroup_room()
    return min(got) if got else None


def _cgroup_room() -> list[int]:
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return []
    for ln in lines:
        hid, ctrl, rel = (ln.split(":", 2) + ["", ""])[:3]
        if ctrl == "" and hid == "0":
            base, files = f"/sys/fs/cgroup{rel}", ("memory.max", "memory.current")
        elif "memory" in ctrl.split(","):
            base, files = f"/sys/fs/cgroup/memory{rel}", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        try:
            lim = open(f"{base}/{files[0]}").read().strip()
            if lim != "max" and int(lim) < 1 << 60:        # (v1's "no limit" is a huge number)
                return [int(lim) - int(open(f"{base}/{files[1]}").read())]
        except (OSError, ValueError):
            continue
    return []


def expert_bytes(model_file) -> int:
    """The routed experts' bytes in the file (what the cache stands in for)."""
    return sum(ti.nbytes for name, ti in model_file.layout.present.items() if name.endswith("_exps.weight"))


def auto_size(model_file, budget: int | None, bound: bool = False, dense: int | None = None) -> int:
    """`auto`: the memory left after the resident (non-routed) weights and MARGIN; with no
    reading of the memory, room for every expert (nothing is evicted). `bound`: the other
    weights are in memory already (mlx copied them at bind), so `budget` has them counted.
    `dense`: the other weights' bytes this process will hold (a split rank's share), where not
    the whole file's."""
    if budget is None:
        return expert_bytes(model_file) * 2
    if dense is None:
        dense = model_file.gguf.size - expert_bytes(model_file)
    return max(0, budget - (0 if bound else dense) - MARGIN)


def attach(model, model_file, size, dense: int | None = None, **kw) -> ExpertCache:
    """Give `model` an ExpertCache of `size` bytes ("auto": auto_size) reading model_file's
    routed experts; its weights' expert tensors become SlotExperts (the cpu and numpy backends'
    kernels read host slots), or the backend's own slot weights where its ops offer
    `expert_slots` (mlx: its arrays are the slots; the experts were left unbound). Layers that
    are None (a split rank's others, --layers) are left alone; `dense`: auto_size's.
    kw: ExpertCache's (policy, direct, depth, pread)."""
    slots = getattr(model.ops, "expert_slots", None)
    if model.xp is not np and slots is None:
        raise ValueError("--expert-cache works with the cpu, numpy and mlx backends (their kernels "
                         "read the slots); this backend keeps its own copy of the experts")
    if size == "auto":
        size = auto_size(model_file, memory_budget(), bound=slots is not None, dense=dense)
    layers = [lw for lw in model.w.layers if lw is not None]
    tensors = [[getattr(lw, k) for k in MATRICES] for lw in layers]
    infos = [[model_file.layout.present[t.name] for t in ts] for ts in tensors]
    # (a backend's slots: one clear line where it cannot)
    store = slots(tensors) if slots is not None else HostSlots(tensors, infos)
    n_slots = min(int(size) // store.slot_bytes, sum(ts[0].dims[2] for ts in tensors))
    cache = ExpertCache(model_file.path, tensors, infos, n_slots, model.c.n_expert_used, store=store,
                        ils=[lw.il for lw in layers], **kw)
    for lw, ts in zip(layers, tensors):
        if lw.tid2eid is not None:
            # the hash table as a copy (3 MB a layer): a view of the map would fault (SIGBUS) if
            # the file were cut short, where the experts' preads only return short
            lw.tid2eid = np.array(lw.tid2eid)
        for m, (k, t) in enumerate(zip(MATRICES, ts)):
            setattr(lw, k, store.weight(cache, lw.il, m, t))
    model.experts = cache
    return cache


# -- what ds4-bench and the status bar print --------------------------------------------------------
def stats_delta(before: dict, after: dict) -> dict:
    """The counters' change between two stats() (hits, misses, bytes_read, stall_s)."""
    d = {k: after[k] - before[k] for k in ("hits", "misses", "bytes_read", "stall_s")}
    n = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / n if n else 0.0
    return d


def floor_line(d: dict, tokens: int, seconds: float, disk_bps: float | None) -> str:
    """One bench row's expert line: hit rate, bytes read and read stall per token, and decode
    against the disk floor: the missed experts' bytes at the disk's direct-read speed plus the
    resident compute (the step's time less its read stalls: what it takes with every expert
    in memory)."""
    t = max(tokens, 1)
    per = d["bytes_read"] / t
    text = (f"experts: hit {d['hit_rate']:.1%}, read {per / 1e6:.2f} MB/token, "
            f"stall {1e3 * d['stall_s'] / t:.1f} ms/token")
    if disk_bps:
        floor = per / disk_bps + max(0.0, seconds - d["stall_s"]) / t
        text += f"; decode = {floor / (seconds / t):.0%} of disk floor ({disk_bps / 1e9:.2f} GB/s direct reads)"
    return text


def status_text(cache: "ExpertCache") -> str:
    """The status bar's words for the cache: its hit rate, bytes read, stall so far."""
    s = cache.stats()
    return f"experts {s['hit_rate']:.0%} hit, {s['bytes_read'] / 1e9:.2f} GB read, {s['stall_s']:.1f} s stall"


def direct_read_speed(path: str) -> float | None:
    """expert_reader.direct_read_speed, here for the bench's one import."""
    from .expert_reader import direct_read_speed as speed
    return speed(path)


def expert_names(model_file) -> frozenset:
    """The routed expert tensors' names (left out of a resident copy under the cache)."""
    return frozenset(n for n in model_file.layout.present if n.endswith("_exps.weight"))


def paging_for(model_file, paging: str, avail: int | None, copies: bool = False) -> str:
    """The paging of the other weights under the expert cache: "auto" is a resident copy of
    them where they fit 80 % of the available memory (anonymous memory: a file cut short
    under the engine cannot fault them, and nothing evicts them), else lowmem; "none" for a
    backend that `copies` them into its own memory at open (mlx: a second copy would be
    waste); "prefault" would read the experts into the page cache, so it is refused."""
    if paging == "prefault":
        raise ValueError("paging 'prefault' reads the whole file, routed experts included: with "
                         "--expert-cache use auto, resident, lowmem or none")
    if paging == "auto" and copies:
        return "none"
    if paging == "auto":
        dense = model_file.gguf.size - expert_bytes(model_file)
        return "resident" if avail is None or dense <= 0.8 * avail else "lowmem"
    return paging
