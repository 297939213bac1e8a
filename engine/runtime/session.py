"""`Engine` (a loaded model) and `Session` (one mutable timeline): the engine's whole boundary.

Callers speak token ids; the session owns the KV state and the logits for the next token.
`sync(tokens)` makes the timeline equal to `tokens`: it keeps the common prefix, cuts back in place
when the state still holds what the shorter timeline needs (else rebuilds), and prefills the rest
in chunks, reporting progress after each chunk and stopping between chunks when asked to.

Threads: the Sessions of one Engine may each run on their own thread (one thread at a time per
Session). Every forward pass holds `Engine.lock`; with `Engine.start_batching()` the decode steps
that several threads ask for at once run as one batched pass (engine/runtime/batcher.py).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

import numpy as np

from ..model import snapshot as snap
from ..errors import ModelFileError
from ..model.kv_state import KVState
from ..model.model import Model
from ..gguf.model_file import ModelFile
from ..gguf.prefetch import StepHints
from ..backends import registry
from ..options import PAGING, EngineOptions
from .batcher import Batcher
from .sampling import Rng, SamplingParams, logprob_of, sample, top_logprobs
from .tokenizer import Tokenizer

DEFAULT_CHUNK = 2048


class ContextFull(ValueError):
    pass


class Engine:
    """A DeepSeek V4 model mapped from a GGUF, with its tokenizer and a compute backend."""

    def __init__(self, model_file: ModelFile, backend: str, numerics: str, threads: int | None, ops=None):
        """ops: the backend's checked ops object (Engine.open makes it before the file is read)."""
        self.file = model_file
        self.config = model_file.config
        self.paging = "none"            # Engine.open sets it
        self.backend = backend
        self.numerics = numerics
        self.threads = threads
        self.tokenizer = Tokenizer.from_metadata(model_file.tokenizer)
        # every forward pass of every Session of this Engine runs under this lock: the model keeps
        # per-pass tables (RoPE angles), and a device backend evaluates every live state at each
        # token boundary, so two passes must never overlap. Sessions on several threads (one each)
        # are safe; one Session is still used by one thread at a time.
        self.lock = threading.RLock()
        self.batcher = Batcher(self)    # off until start_batching
        if ops is None:
            ops = registry.make_ops(registry.pick(backend), numerics)
        # the upload/repack hook: its time and the bytes it copied (none for the host backends)
        weights, self.bind_report = ops.bind_weights(model_file)
        self.model = Model(self.config, weights, ops)

    @classmethod
    def open(cls, path, options: EngineOptions | None = None, *, backend: str | None = None,
             numerics: str | None = None, threads: int | None = None, paging: str | None = None,
             mtp=None) -> "Engine":
        """`options` (engine.options.EngineOptions), or the same fields as keywords; not both.
        mtp: ds4's MTP file for speculative decoding (engine.runtime.speculative), checked
        against this model (one ModelFileError line when it does not fit).

        paging: "auto" (when the file fits in 80 % of the available memory: resident with the
        cpu backend where the kernel offers transparent huge pages, else prefault; else lowmem),
        "resident" (the file read once into
        anonymous huge-page memory, GGUFFile.start_resident), "prefault", "lowmem" or "none" (leave
        the kernel's defaults). Opening waits for neither the copy nor the prefault: both run in
        background threads while the weights are read from the map (`wait_resident` waits for the
        copy; `resident_seconds` is its time once complete)."""
        o = _options(options, backend=backend, numerics=numerics, threads=threads, paging=paging)
        if o.layers is not None:        # split by layers across mlx.launch's ranks (issue 38)
            from .split_engine import open_split
            return open_split(cls, path, o)
        backend, numerics, threads, paging = o.backend, o.numerics, o.threads, o.paging
        # "auto": DS4_BACKEND for every caller (benchmarks, the agent, the shim), else the best
        # available; an unknown or unavailable name, or ops that lack an operation, are one-line
        # BackendErrors here, before the file is read
        entry = registry.pick(backend)
        backend = entry.name
        ops = registry.make_ops(entry, numerics)
        entry.setup(threads)
        # (the tokenizer, built in __init__, checks the merge table: not twice)
        m = ModelFile.open(path, check_merges=False)
        try:
            avail = mem_available()
            skip = frozenset()
            if o.expert_cache is not None:      # (the routed experts left to the cache: issue 39)
                from ..gguf.expert_cache import expert_names, paging_for
                copies = hasattr(ops, "unbound")      # (mlx: binds the others into its own memory)
                paging, skip = paging_for(m, paging, avail, copies), expert_names(m)
                if copies:
                    ops.unbound = skip                 # (its slots are the experts' arrays)
            else:
                paging = _paging_mode(m, paging, backend, avail)
            eng = cls(m, backend, numerics, threads, ops)
            if o.expert_cache is not None:
                from ..gguf.expert_cache import attach
                attach(eng.model, m, o.expert_cache)
            if paging == "resident":
                # after the bind (open's own work does not share a core with the copy): the
                # weights are on the map, and each switches to the copy when its bytes are in.
                # Page cache + copy over the available memory: drop the cache as the copy grows
                drop = avail is not None and 2 * m.gguf.size > avail
                m.start_resident(RESIDENT_THREADS, drop_cache=drop, skip=skip)
            eng.paging = "resident" if paging == "resident" else _advise(m, paging)
            if eng.paging == "lowmem" and eng.model.xp is np:     # (hints for host backends that read the map)
                eng.model.pager = StepHints(m.gguf)
            if mtp is not None:
                from .mtp_drafter import attach_mtp
                attach_mtp(eng, mtp)
            return eng
        except BaseException:
            m.close()
            raise

    # -- batched decode across sessions (engine/runtime/batcher.py) ------------------------------
    def start_batching(self, window_ms: float = 4.0, prefill_chunk: int | None = 256,
                       max_batch: int | None = None, trace: int = 0) -> Batcher:
        """Route every Session of this Engine through the batcher: decode steps (Session.eval, or
        a sync that adds one token) asked for at about the same time from several threads run as
        one Model.forward_batch; a prefill runs in chunks of at most `prefill_chunk` tokens (None:
        the session's own chunk), alternating with decode batches. A step waits at most
        `window_ms` for the sessions registered with `Session.generating()` that have not asked
        yet (none registered, or all asked: it runs at once). `max_batch`: the most decode steps
        in one pass (None: all waiting). `trace`: keep the last n steps in `batcher.trace` as
        (kind, [id(session)], tokens) (tests, logs). Returns the batcher (`.stats`)."""
        self.batcher.configure(window_ms, prefill_chunk, max_batch, trace)
        self.batcher.enabled = True
        return self.batcher

    def stop_batching(self):
        """Back to direct passes (steps already queued still run through the batcher)."""
        self.batcher.enabled = False

    @property
    def batching(self) -> bool:
        return self.batcher.enabled

    @property
    def resident_seconds(self) -> float | None:
        """The resident copy's time once it is complete; None before, and without one."""
        return self.file.gguf.resident_seconds

    @property
    def expert_status(self) -> str:
        """The expert cache's hit rate, bytes read and read stall, for the agent's status bar
        ("" without --expert-cache)."""
        cache = getattr(self.model, "experts", None)
        if cache is None:
            return ""
        from ..gguf.expert_cache import status_text
        return status_text(cache)

    def wait_resident(self, timeout: float | None = None) -> bool:
        """Wait for the background resident copy (paging "resident"); True when every weight
        now reads from it, False without a copy or when it stopped short (the rest reads the map)."""
        return self.file.gguf.wait_resident(timeout)

    def close(self):
        # a device backend's copy of the weights is freed here, at a known moment, not whenever
        # the last reference goes (a host backend's weights are views of the map, closed below)
        if getattr(getattr(self, "model", None), "split", None) is not None:
            self.model.split.close()        # (the workers free their layers and wait for the next open)
        if getattr(self, "model", None) is not None and self.model.xp is not np:
            self.model.w = None
        if getattr(getattr(self, "model", None), "experts", None) is not None:
            self.model.experts.close()      # (its read threads and file descriptor)
        if getattr(self, "mtp_file", None) is not None:
            self.mtp_file.close()
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _options(options: EngineOptions | None, **fields) -> EngineOptions:
    """The options of one Engine.open call: `options`, or the keywords given (None: the default)."""
    given = {k: v for k, v in fields.items() if v is not None}
    if options is None:
        return EngineOptions(**given)
    if given:
        raise TypeError(f"Engine.open takes options or keywords, not both (got options and {', '.join(given)})")
    if not isinstance(options, EngineOptions):
        raise TypeError(f"options must be an EngineOptions, not {type(options).__name__}")
    return options


def mem_available() -> int | None:
    """MemAvailable in bytes (Linux), or None where /proc/meminfo cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _paging_mode(m: ModelFile, paging: str, backend: str, avail: int | None) -> str:
    """The mode "auto" stands for here (DS4_PAGING first, then the file's size against the
    available memory `avail`, None where unknown); other modes as given."""
    if paging == "auto":
        paging = os.environ.get("DS4_PAGING") or "auto"
        if paging not in PAGING:
            paging = "auto"
    if paging == "auto":
        if avail is None or m.gguf.size > 0.8 * avail:
            return "lowmem"
        # the backend's choice (the cpu backend's is resident: GGUFFile.load_resident); without
        # transparent huge pages a copy would cost memory and time for nothing
        mode = registry.get(backend).default_paging
        return "prefault" if mode == "resident" and not _thp_available() else mode
    if paging == "resident":
        # a copy larger than the memory left would end in the OOM killer halfway through
        if avail is not None and m.gguf.size > 0.9 * avail:
            raise ValueError(f"paging 'resident' needs {m.gguf.size:,} bytes of memory for its copy of the file, "
                             f"and {avail:,} are available; use paging 'prefault' or 'lowmem'")
    return paging


def _thp_available() -> bool:
    """Transparent huge pages for an madvise'd mapping ("always" or "madvise"; Linux only)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


# the background copy's threads (at nice 19, paging.NICE): one. On the shared 2-core VM one thread
# copied at 0.66-1.66 GB/s and two at 0.71-1.88 GB/s (2 runs each, loaded): no clear gain
RESIDENT_THREADS = 1


def _advise(m: ModelFile, paging: str) -> str:
    if paging == "none":
        return "none"
    try:
        return m.gguf.advise(paging)
    except OSError:
        return "none"          # a platform without madvise: the kernel's defaults


class Session:
    def __init__(self, engine: Engine, ctx: int, *, chunk: int = DEFAULT_CHUNK, rewind_cap: int | None = None):
        if ctx < 2:
            raise ValueError("ctx must be at least 2 tokens")
        self.engine = engine
        self.ctx = ctx
        self.chunk = max(1, int(chunk))
        self.rewind_cap = min(ctx, DEFAULT_CHUNK) if rewind_cap is None else rewind_cap
        with engine.lock:       # (a device backend evaluates the new state: not inside another's pass)
            self.state = engine.model.ops.new_state(engine.config, ctx, self.rewind_cap)
        self._tokens: list[int] = []
        self._logits: np.ndarray | None = None
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0}

    # -- read-only views -----------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def pos(self) -> int:
        return len(self._tokens)

    @property
    def logits(self) -> np.ndarray:
        if self._logits is None:
            raise RuntimeError("no logits yet: the session is empty")
        return self._logits

    def kv_bytes(self) -> int:
        return self.state.nbytes()

    # -- timeline ------------------------------------------------------------------------------
    def sync(self, tokens, progress: Callable[[int, int], object] | None = None, *,
             keep_logits: bool = False):
        """Make the timeline equal to `tokens`. `progress(done, total)` is called after every chunk;
        returning False stops between chunks (the session then holds the tokens prefilled so far)
        and sync returns False. With keep_logits the logits of every newly evaluated position are
        returned as an array [n_new, vocab] instead of True."""
        tokens = self._check(tokens)
        k = 0
        n = min(len(tokens), len(self._tokens))
        while k < n and tokens[k] == self._tokens[k]:
            k += 1
        if k < len(self._tokens):
            k = self._cut(k if k < len(tokens) else k - 1)
        new = tokens[k:]
        if not new:
            return np.zeros((0, self.engine.config.n_vocab), np.float32) if keep_logits else True
        kept = []
        done = 0
        step = self.chunk
        b = self.engine.batcher
        if b.enabled and b.prefill_chunk:
            step = min(step, b.prefill_chunk)      # (the others' decode steps run between chunks)
        # a model split across ranks pipelines a prefill: each chunk but the last goes on without
        # waiting for its logits (SplitModel.post); `settle` fetches them if the prefill stops early
        split = getattr(self.engine.model, "split", None)
        pipe = split is not None and not keep_logits and not b.enabled
        try:
            for c0 in range(0, len(new), step):
                part = new[c0:c0 + step]
                out = self._forward(part, all_logits=keep_logits, post=pipe and c0 + step < len(new))
                if keep_logits:
                    kept.append(out)
                done += len(part)
                if progress is not None and progress(done, len(new)) is False and done < len(new):
                    return False
        finally:
            if pipe and self._logits is None and self._tokens:
                with self.engine.lock:
                    self._logits = split.settle(self.state)
        return np.concatenate(kept) if keep_logits else True

    def reusable(self, tokens) -> int:
        """How many leading tokens of `tokens` a sync would keep without recomputing them: the
        common prefix with the timeline when the state can be cut back to it in place, else 0
        (a cut the rings cannot make means a rebuild from scratch)."""
        tokens = [int(t) for t in tokens]
        k, n = 0, min(len(tokens), len(self._tokens))
        while k < n and tokens[k] == self._tokens[k]:
            k += 1
        if k == len(self._tokens):
            return k
        if k == len(tokens):
            k -= 1          # sync re-evaluates the last token to get its logits
        if k > 0 and self.state.can_truncate(len(self._tokens), k):
            return k
        return 0

    def eval(self, token: int) -> np.ndarray:
        """Append one token (a decode step); returns the logits for the token after it."""
        token = int(token)
        if not 0 <= token < self.engine.config.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{self.engine.config.n_vocab - 1})")
        if len(self._tokens) + 1 >= self.ctx:
            raise ContextFull(f"the context of {self.ctx} tokens is full")
        self._forward([token], all_logits=False)
        return self._logits

    def rewind(self, n: int):
        """Drop the last n tokens; the logits become those after the new last token."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot rewind {n} tokens from a timeline of {len(self._tokens)}")
        if n == 0:
            return
        target = self._tokens[:-n]
        if not target:
            self.reset()
            return
        self.sync(target)

    def reset(self):
        self.state.reset()
        self._tokens = []
        self._logits = None

    def _cut(self, new_len: int) -> int:
        """Cut the timeline to new_len tokens, in place if possible, else from scratch; returns the
        length actually kept (new_len or 0)."""
        T = len(self._tokens)
        if new_len > 0 and self.state.can_truncate(T, new_len):
            self.state.truncate(T, new_len)
            self._tokens = self._tokens[:new_len]
            self._logits = None
            return new_len
        self.reset()
        return 0

    def _check(self, tokens) -> list[int]:
        tokens = [int(t) for t in tokens]
        V = self.engine.config.n_vocab
        bad = [t for t in tokens if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if len(tokens) >= self.ctx:
            raise ContextFull(f"{len(tokens)} tokens do not fit the context of {self.ctx}")
        return tokens

    def generating(self):
        """Context manager: while inside it, this session tells the Engine's batcher (when
        batching is on) that it will ask for decode steps, so a batched step waits for it (at most
        the batcher's window) instead of leaving it for the next one. A no-op for a direct Engine."""
        return self.engine.batcher.generating(self)

    def _forward(self, part: list[int], all_logits: bool, post: bool = False):
        t0 = time.perf_counter()
        model = self.engine.model
        if self.engine.batcher.enabled:
            out = self.engine.batcher.run(self, part, all_logits)
        elif post:                  # (a split run's prefill chunk whose logits nobody reads: sync)
            with self.engine.lock:
                model.split.post(np.asarray(part), len(self._tokens), self.state)
            out = None
        else:
            with self.engine.lock:
                out = model.ops.logits_to_host(model.forward(np.asarray(part), len(self._tokens), self.state,
                                                             all_logits=all_logits))
        dt = time.perf_counter() - t0
        key = "decode" if len(part) == 1 else "prefill"
        self.stats[key + "_tokens"] += len(part)
        self.stats[key + "_s"] += dt
        self._tokens.extend(part)
        self._logits = out[-1] if all_logits else out
        return out

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, params: SamplingParams | None = None, rng: Rng | None = None) -> int:
        params = params or SamplingParams()
        return sample(self.logits, params, rng or Rng(params.seed))

    def top_logprobs(self, k: int) -> list[tuple[int, float]]:
        return top_logprobs(self.logits, k)

    def logprob(self, token: int) -> float:
        return logprob_of(self.logits, token)

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        split = getattr(self.engine.model, "split", None)
        if split is not None:        # the model split across ranks: the same payload, gathered
            with self.engine.lock:
                return split.snapshot(self)
        logits = self._logits if self._logits is not None else np.zeros(self.engine.config.n_vocab, np.float32)
        with self.engine.lock:       # (a device backend evaluates this state at others' token boundaries)
            host = self.engine.model.ops.state_to_host(self.state)
        return snap.save(self.engine.config, host, self._tokens, logits, self.chunk)

    def restore(self, data: bytes):
        # load into a fresh host state so a bad payload leaves the current timeline untouched;
        # the backend then takes it over (an upload where its state lives on a device)
        split = getattr(self.engine.model, "split", None)
        if split is not None:        # the model split across ranks: each loads its own layers
            with self.engine.lock:
                self.state, self._tokens, logits = split.restore(self, data)
            self._logits = logits if self._tokens else None
            return
        host = KVState(self.engine.config, self.ctx, self.rewind_cap)
        tokens, logits = snap.load(self.engine.config, host, data)
        with self.engine.lock:
            self.state = self.engine.model.ops.state_from_host(host)
        self._tokens = tokens
        self._logits = logits if tokens else None

    def fork(self) -> "Session":
        """A second Session holding this timeline, its state's arrays copied as they are: no
        prefill and no serialization (a snapshot/restore round trip packs and re-validates the
        used rows, which took 16-25 s at 60k tokens of a Flash-shaped state; copying the arrays
        takes a few). Both then go on independently."""
        out = Session.__new__(Session)
        out.engine, out.ctx, out.chunk, out.rewind_cap = self.engine, self.ctx, self.chunk, self.rewind_cap
        ops = self.engine.model.ops
        split = getattr(self.engine.model, "split", None)
        with self.engine.lock:
            if split is not None:    # the model split across ranks: each copies its own layers
                out.state = split.fork_state(self.state)
                host = None
            else:
                host = ops.state_to_host(self.state)
            # a host backend hands back its own state: copy it; a device backend's host copy is new
            if host is not None:
                host = host.copy_to(np, np.array) if host is self.state else host
                out.state = ops.state_from_host(host)
        out._tokens = list(self._tokens)
        out._logits = None if self._logits is None else self._logits.copy()
        out.stats = {k: 0 if isinstance(v, int) else 0.0 for k, v in self.stats.items()}
        return out


class LogitsDump:
    """Every step's logits, collected from a session and written as one .npy [steps, vocab]
    through a temp file (for `ds4 --dump-logits`)."""

    def __init__(self):
        self.rows: list[np.ndarray] = []

    def add(self, session: "Session"):
        self.rows.append(session.logits.copy())

    def save(self, path):
        from ..atomic import atomic_open
        with atomic_open(path) as f:
            np.save(f, np.array(self.rows, np.float32).reshape(len(self.rows), -1))


__all__ = ["Engine", "Session", "LogitsDump", "ContextFull", "ModelFileError", "SamplingParams", "Rng"]
