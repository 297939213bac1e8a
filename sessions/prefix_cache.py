"""The HTTP shim's disk prefix cache: ds4-server's `--kv-disk-dir` (spec/kvcache.md §4-5).

A folder of ds4 KV files, each named by the SHA-1 of its cache text (the rendered token text of the
stored prefix, or a visible-transcript key). A request's rendered prompt is matched against the
folder by the longest cached text that is a byte prefix of it; the winner is restored into the live
session and only the rest of the prompt is tokenized and prefilled.

Save moments (the shim decides when; this module does the math and the store):

* cold      - a request with no reuse at all, min <= prompt <= cold_max: store at the chat anchor
              (the last <｜User｜> before the first <｜Assistant｜>, when >= min), else at
              `len - trim` rounded down to `align` (when that is >= min), else at the full prompt;
* continued - every `continued_step()` tokens (interval rounded up to align) of the live timeline;
* evict     - the whole live timeline, before a miss replaces it;
* shutdown  - the whole live timeline, on SIGINT/SIGTERM.

Disk use stays under `space_mb`: a store that could not fit (with 1% slack) is skipped, and after
every store the lowest-scoring files are unlinked, the new file protected:

    effective_hits = hits * 2^(-(now - (last_used or created)) / 6 h)      (< 0.01 counts as 0)
    score          = (effective_hits + 1) * tokens / file_size

so small, recently and often hit checkpoints survive and big stale ones go first; equal scores
evict the older last_used first. Checkpoints above cold_max tokens are single-use: loading one
deletes it (the live session is saved again at its next evict/continued/shutdown moment); smaller
ones are touched (hits + 1, last_used = now).

A file that fails validation while scanning or loading is skipped and reported as a warning, never
raised to the caller; a load that fails leaves the session exactly as it was.

The folder is indexed in memory (name -> header, by each name's lstat signature) once at start and
kept up to date by our own stores, loads and evictions; a lookup re-lists the folder only when its
mtime changed (another process added or removed a file), and then reads only headers it has not
seen. So a folder holding 10,000 foreign or broken files costs one scan at start (with ONE summary
warning) and nothing per request. Names that are not regular files (FIFOs, symlinks, devices,
directories) are never opened (sessions/safeio.py); files are only ever written to a temp name in
the folder and renamed, so a symlink planted under a cache name is replaced, never followed. Temp
files count against the disk budget; those whose writer is gone are deleted at start.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable

from engine import Session

from . import safeio
from .kvfile import (KVFileError, KVFileInfo, KVHeader, encode_tool_map, header_of, kv_file_bytes,
                     read_info, read_kv, replace_tool_map, routed_quant_bits, sha1_name, touch, write_kv)

HIT_HALF_LIFE_S = 21600          # ds4: DS4_KVSTORE_HIT_HALF_LIFE_SECONDS (6 h), compile-time
MIN_EFFECTIVE_HITS = 0.01        # ds4: decayed hit counts below this count as no hits
DEFAULT_SPACE_MB = 4096
STORE_REASONS = ("cold", "continued", "evict", "shutdown")
KEY_KINDS = ("token-text", "responses-visible", "thinking-visible")
_NAME = re.compile(r"[0-9a-f]{40}\.kv")
EXAMPLES_IN_SUMMARY = 3          # problems named in the one summary warning of a scan

log_ = logging.getLogger("ds4agent.kvcache")


def token_text(session_or_engine, tokens=None) -> bytes:
    """ds4's cache text of a token sequence (ds4_kvstore_render_tokens_text): every token's text,
    special tokens spelled literally, concatenated. `tokens` defaults to the session's timeline."""
    eng = getattr(session_or_engine, "engine", session_or_engine)
    if tokens is None:
        tokens = session_or_engine.tokens
    tb = eng.tokenizer.token_bytes
    return b"".join(tb(int(t)) for t in tokens)


# -- policy math (pure) --------------------------------------------------------------------------
def store_len(n_tokens: int, *, min_tokens: int, trim: int, align: int) -> int:
    """ds4_kvstore_store_len: cut `trim` tokens off the tail and round down to `align`, when that
    still leaves at least `min_tokens`; otherwise the full length."""
    if n_tokens > min_tokens + trim:
        s = n_tokens - trim
        if align > 0:
            s -= s % align
        if s >= min_tokens:
            return s
    return n_tokens


def chat_anchor(tokens, user_id: int, assistant_id: int, *, min_tokens: int = 0) -> int:
    """Position of the LAST <｜User｜> token before the FIRST <｜Assistant｜> token (everything before
    it is the prompt's stable cross-session prefix: BOS, tools, system, user-role scaffolding), or
    -1 when there is none or it is shorter than min_tokens."""
    last_user = -1
    for i, t in enumerate(tokens):
        if t == assistant_id:
            break
        if t == user_id:
            last_user = i
    return last_user if last_user >= min_tokens and last_user >= 0 else -1


def cold_store_len(prompt_tokens: int, anchor_pos: int, *, min_tokens: int = 512,
                   cold_max_tokens: int = 30000, trim: int = 32, align: int = 2048) -> int:
    """How many tokens of a cold prompt to store: the chat anchor when it is >= min_tokens, else
    store_len(prompt). 0 when the prompt gets no cold save (below min, above cold_max, or cold saves
    disabled with cold_max 0)."""
    if cold_max_tokens <= 0 or prompt_tokens < min_tokens or prompt_tokens > cold_max_tokens:
        return 0
    if anchor_pos is not None and anchor_pos >= min_tokens and anchor_pos <= prompt_tokens:
        return anchor_pos
    return store_len(prompt_tokens, min_tokens=min_tokens, trim=trim, align=align)


def continued_step(interval: int = 10000, align: int = 2048) -> int:
    """The continued-save spacing: the interval rounded UP to a multiple of align (0: disabled)."""
    if interval <= 0:
        return 0
    if align > 0:
        return max(align, -(-interval // align) * align)
    return interval


def should_store_continued(n_tokens: int, last_continued: int, *, min_tokens: int = 512,
                           step: int = 10240) -> bool:
    """A continued save is due at live length L when L >= min, L is a multiple of the step and L
    is past the last continued (or cold) frontier."""
    return step > 0 and n_tokens >= min_tokens and n_tokens % step == 0 and n_tokens > last_continued


def effective_hits(hits: int, last_used: int, created: int, now: float) -> float:
    ts = last_used or created
    if ts == 0:
        return 0.0
    eff = float(hits)
    if now > ts:
        eff *= 2.0 ** (-(now - ts) / HIT_HALF_LIFE_S)
        if eff < MIN_EFFECTIVE_HITS:
            eff = 0.0
    return eff


def eviction_score(hits: int, last_used: int, created: int, tokens: int, size: int, now: float) -> float:
    """(effective_hits + 1) * tokens / file_size; the smallest score is evicted first."""
    if size <= 0:
        return 0.0
    return (effective_hits(hits, last_used, created, now) + 1.0) * tokens / size


def budget_required(file_bytes: int) -> int:
    """A file's size plus ds4's 1% headroom (rounded up), what must fit under the budget."""
    return file_bytes + -(-file_bytes // 100)


# -- the cache -----------------------------------------------------------------------------------
@dataclass
class CacheEntry:
    """One valid-looking file of the cache folder (its header; the text is read on load)."""
    path: str
    sha: str
    header: KVHeader
    size: int

    @property
    def tokens(self) -> int:
        return self.header.tokens

    @property
    def text_bytes(self) -> int:
        return self.header.text_bytes


class PrefixCache:
    def __init__(self, dir, *, space_mb: float = DEFAULT_SPACE_MB, min_tokens: int = 512,
                 cold_max_tokens: int = 30000, continued_interval: int = 10000, boundary_trim: int = 32,
                 boundary_align: int = 2048, reject_different_quant: bool = False,
                 now: Callable[[], float] = time.time, log: Callable[[str], object] | None = None,
                 warn: Callable[[str], object] | None = None):
        if space_mb < 0 or min_tokens < 0 or cold_max_tokens < 0 or continued_interval < 0 \
                or boundary_trim < 0 or boundary_align < 0:
            raise ValueError("prefix cache options must not be negative")
        if cold_max_tokens and cold_max_tokens < min_tokens:
            raise ValueError(f"cold_max_tokens ({cold_max_tokens}) must be 0 or at least min_tokens ({min_tokens})")
        self.dir = os.path.abspath(os.fspath(dir))
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.budget_bytes = int((space_mb or DEFAULT_SPACE_MB) * 1024 * 1024)
        self.min_tokens = min_tokens
        self.cold_max_tokens = cold_max_tokens
        self.continued_interval = continued_interval
        self.boundary_trim = boundary_trim
        self.boundary_align = boundary_align
        self.reject_different_quant = reject_different_quant
        self._now = now
        self._log = log if log is not None else log_.info
        self._warn_to = warn
        self.last_continued = 0     # the live timeline's last continued/cold frontier (§4.2)
        self._lock = threading.RLock()   # the worker stores/loads; request threads read tool maps
        self._index: dict[str, CacheEntry] = {}     # name -> entry, for the lstat signature in _sigs
        self._sigs: dict[str, tuple] = {}
        self._bad: dict[str, tuple] = {}            # name -> signature of a file found unusable
        self._temps: dict[str, int] = {}            # temp file name -> bytes (counts in the budget)
        self._dir_key: tuple | None = None
        with self._lock:
            self._refresh(force=True, clean_temps=True)
            self._evict()

    # -- policy, with this cache's knobs ---------------------------------------------------------
    def chat_anchor(self, tokens, user_id: int, assistant_id: int) -> int:
        return chat_anchor(tokens, user_id, assistant_id, min_tokens=self.min_tokens)

    def cold_store_len(self, prompt_tokens: int, anchor_pos: int = -1) -> int:
        return cold_store_len(prompt_tokens, anchor_pos, min_tokens=self.min_tokens,
                              cold_max_tokens=self.cold_max_tokens, trim=self.boundary_trim,
                              align=self.boundary_align)

    def cold_store_target(self, prompt_tokens, user_id: int, assistant_id: int) -> int:
        """The cold store length of a tokenized prompt (anchor first), 0 for no cold save."""
        tokens = list(prompt_tokens)
        return self.cold_store_len(len(tokens), self.chat_anchor(tokens, user_id, assistant_id))

    def continued_step(self) -> int:
        return continued_step(self.continued_interval, self.boundary_align)

    def should_store_continued(self, n_tokens: int, last_continued: int | None = None) -> bool:
        last = self.last_continued if last_continued is None else last_continued
        return should_store_continued(n_tokens, last, min_tokens=self.min_tokens, step=self.continued_step())

    def note_store(self, n_tokens: int):
        """Record a cold/continued save at n_tokens as the last continued frontier."""
        self.last_continued = max(self.last_continued, n_tokens)

    def reset_continued(self):
        """A live-cache miss: the next continued frontier counts from zero again."""
        self.last_continued = 0

    # -- the index -------------------------------------------------------------------------------
    def _warn(self, msg: str):
        """Problems with files: to `warn`, else to a caller's `log`, else our logger's warnings."""
        if self._warn_to is not None:
            self._warn_to(msg)
        elif self._log == log_.info:
            log_.warning("%s", msg)
        else:
            self._log(msg)

    @staticmethod
    def _sig(st) -> tuple:
        return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_mode)

    def _refresh(self, force: bool = False, clean_temps: bool = False):
        """Bring the index up to date: re-list the folder when its mtime moved (or `force`), read
        the header of every name not seen before with this signature, one summary warning for all
        the files found unusable this time. clean_temps (at start): delete the temp files whose
        writer is gone."""
        try:
            dst = os.stat(self.dir)
            key = (dst.st_ino, dst.st_mtime_ns)
            if key == self._dir_key and not force:
                return
            listing = safeio.scan(self.dir, lambda n: n.endswith(".kv") or ".tmp." in n)
        except OSError as e:
            self._warn(f"kv cache: cannot list {self.dir}: {e.strerror or e}")
            return
        seen, temps, problems = set(), {}, []
        for name, st in listing:
            if safeio.is_temp_name(name):
                if not stat.S_ISREG(st.st_mode):
                    # a symlink, FIFO or other is never ours: removed at start (the name only,
                    # nothing followed or opened), never counted
                    if clean_temps and safeio.odd_temp(st):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(self.dir, name))
                    continue
                if clean_temps and safeio.temp_is_stale(self.dir, name, st):
                    try:
                        os.unlink(os.path.join(self.dir, name))
                        continue
                    except OSError:
                        pass
                temps[name] = st.st_size
                continue
            if not _NAME.fullmatch(name):
                continue                       # not a cache name: never ours to read or evict
            seen.add(name)
            sig = self._sig(st)
            if self._sigs.get(name) == sig or self._bad.get(name) == sig:
                continue
            self._forget(name)
            problem = self._index_one(name, st, sig)
            if problem:
                problems.append(problem)
        for name in [n for n in list(self._index) + list(self._bad) if n not in seen]:
            self._forget(name)
        self._temps = temps
        self._dir_key = key
        if problems:
            self._summary(problems)

    def _index_one(self, name: str, st, sig: tuple) -> str | None:
        """Index one cache-named entry; the problem (and the name marked bad) when unusable."""
        path = os.path.join(self.dir, name)
        if not stat.S_ISREG(st.st_mode):
            self._bad[name] = sig
            return f"{name} is {safeio.kind_of(st)} (not opened)"
        try:
            h, size = header_of(path, st)
        except KVFileError as e:
            self._bad[name] = sig
            return f"{name}: {e.problem}"
        self._index[name] = CacheEntry(path, name[:40], h, size)
        self._sigs[name] = sig
        return None

    def _reindex(self, path: str):
        """Re-read one entry after we changed it (touch, trailer rewrite, new file)."""
        name = os.path.basename(path)
        with self._lock:
            self._forget(name)
            try:
                st = os.lstat(path)
            except OSError:
                return
            problem = self._index_one(name, st, self._sig(st))
            if problem:
                self._warn(f"kv cache: skipped {problem}")

    def _forget(self, name: str):
        self._index.pop(name, None)
        self._sigs.pop(name, None)
        self._bad.pop(name, None)

    def _mark_bad(self, path: str):
        """A file that failed to load: kept on disk, but not offered again until it changes."""
        name = os.path.basename(path)
        with self._lock:
            sig = self._sigs.get(name)
            self._forget(name)
            if sig is not None:
                self._bad[name] = sig

    def _summary(self, problems: list[str]):
        shown = "; ".join(problems[:EXAMPLES_IN_SUMMARY])
        more = f"; and {len(problems) - EXAMPLES_IN_SUMMARY} more" if len(problems) > EXAMPLES_IN_SUMMARY else ""
        self._warn(f"kv cache: skipped {len(problems)} unusable file{'s' * (len(problems) != 1)} in "
                   f"{self.dir} (not used, not evicted): {shown}{more}")

    # -- scanning --------------------------------------------------------------------------------
    def entries(self) -> list[CacheEntry]:
        """Every file of the folder that has a valid header and a SHA-1 name, from the index;
        others are reported once and skipped (as ds4's refresh does, neither used nor evicted)."""
        with self._lock:
            self._refresh()
            return sorted(self._index.values(), key=lambda e: e.path)

    def temp_bytes(self) -> int:
        """Bytes held by temp files (a writer's in-flight file, or one a killed writer left)."""
        with self._lock:
            self._refresh()
            return sum(self._temps.values())

    def total_bytes(self) -> int:
        """What the folder's cache files and temp files take, as the budget counts it."""
        with self._lock:
            return sum(e.size for e in self.entries()) + self.temp_bytes()

    # -- lookup and load (§5) --------------------------------------------------------------------
    def find(self, prompt_text: bytes, session: Session | None = None, *, exclude=()) -> CacheEntry | None:
        """The entry whose text is the longest byte prefix of prompt_text (tie: more tokens).
        With a session, entries made for a bigger context (and, when rejecting, for another quant
        width) are skipped."""
        prompt = bytes(prompt_text)
        ctx = session.ctx if session is not None else None
        quant = routed_quant_bits(session) if session is not None and self.reject_different_quant else None
        skip = {os.path.basename(os.fspath(p)) for p in exclude}
        cands = [e for e in self.entries()
                 if os.path.basename(e.path) not in skip
                 and e.text_bytes <= len(prompt) and e.tokens >= self.min_tokens
                 and (ctx is None or e.header.ctx <= ctx)
                 and (quant is None or e.header.quant_bits == quant)]
        cands.sort(key=lambda e: (e.text_bytes, e.tokens), reverse=True)
        for e in cands:     # one SHA-1 per candidate that could still beat the best
            if hashlib.sha1(prompt[:e.text_bytes]).hexdigest() == e.sha:
                return e
        return None

    def load(self, candidate: CacheEntry, session: Session, prompt_text: bytes) -> tuple[KVFileInfo, bytes] | None:
        """Restore `candidate` into `session`: returns (info, suffix) where info.tool_map is the
        file's tool-id map and suffix the bytes of prompt_text after the cached prefix (to be
        tokenized as rendered chat), or None (reported) when the file cannot be used, the session
        then unchanged."""
        prompt = bytes(prompt_text)
        path = candidate.path
        try:
            info = read_kv(path, session, expect_text=prompt[:candidate.text_bytes], check_name=True,
                           allow_other_quant=not self.reject_different_quant)
        except KVFileError as e:
            self._warn(f"kv cache: cannot load {e}")
            if e.corrupt:
                self._unlink(path, "corrupt")      # ds4 deletes such a file
            else:
                self._mark_bad(path)
            return None
        except OSError as e:
            self._warn(f"kv cache: cannot load {path}: {e.strerror or e}")
            self._mark_bad(path)
            return None
        n = info.header.tokens
        if self.cold_max_tokens > 0 and n > self.cold_max_tokens:
            self._unlink(path, "consumed")   # big checkpoints are single-use
        else:
            try:
                touch(path, int(self._now()))
            except (KVFileError, OSError) as e:
                self._warn(f"kv cache: cannot record the hit on {path}: {e}")
            self._reindex(path)
        self.last_continued = n
        return info, prompt[len(info.text):]

    def restore(self, session: Session, prompt_text: bytes) -> tuple[KVFileInfo, bytes] | None:
        """find + load, falling back to the next best entry when the best one fails to load."""
        failed = []
        while True:
            cand = self.find(prompt_text, session, exclude=failed)
            if cand is None:
                return None
            got = self.load(cand, session, prompt_text)
            if got is not None:
                return got
            failed.append(cand.path)

    # -- store (§4.1) ----------------------------------------------------------------------------
    def store(self, session: Session, text: bytes | None = None, reason: str = "cold",
              tool_map: dict[str, str] | None = None, key_kind: str = "token-text") -> bool:
        """Store the WHOLE live timeline of `session` (the caller brings the session exactly to
        the frontier to save). `text` is the key: the token text of the timeline (computed when
        None, checked when given) or, for the visible-transcript key kinds, that transcript.
        Returns whether the folder now holds the checkpoint; skips are reported, not raised."""
        if reason not in STORE_REASONS:
            raise ValueError(f"unknown save reason {reason!r} (one of {', '.join(STORE_REASONS)})")
        if key_kind not in KEY_KINDS:
            raise ValueError(f"unknown key kind {key_kind!r}")
        n = session.pos
        if key_kind == "token-text":
            own = token_text(session)
            if text is None:
                text = own
            elif bytes(text) != own:
                raise ValueError("the cache text is not the token text of the session's timeline")
        elif text is None:
            raise ValueError(f"a {key_kind} key needs its transcript text")
        text = bytes(text)
        if n < self.min_tokens or n == 0:
            self._log(f"kv cache: skipped tokens={n} reason={reason}: below min {self.min_tokens}")
            return False
        quant = routed_quant_bits(session)
        try:
            trailer = encode_tool_map(tool_map)
        except ValueError as e:
            self._log(f"kv cache: skipped tokens={n} reason={reason}: {e}")
            return False
        path = os.path.join(self.dir, sha1_name(text))
        now = int(self._now())
        if os.path.lexists(path):
            if self._compatible(path, text, quant, session.ctx):
                if trailer:   # same checkpoint: only the tool map is refreshed
                    try:
                        replace_tool_map(path, tool_map, now)
                    except (KVFileError, OSError) as e:
                        self._warn(f"kv cache: cannot refresh the tool map of {path}: {e}")
                    self._reindex(path)
                self._noted(reason, n)
                return True
            self._unlink(path, "incompatible, replaced")
        payload = session.snapshot()
        file_bytes = kv_file_bytes(text, payload, trailer)
        if budget_required(file_bytes) > self.budget_bytes:
            self._log(f"kv cache: skipped tokens={n} reason={reason}: {file_bytes / 2**20:.2f} MiB "
                      f"(+1%) exceeds the budget of {self.budget_bytes / 2**20:.2f} MiB")
            return False
        try:
            write_kv(path, session, text, reason=reason, tool_map=tool_map or None, key_kind=key_kind,
                     now=now, payload=payload)
            size = os.path.getsize(path)
        except OSError as e:
            self._warn(f"kv cache: cannot write {path}: {e.strerror or e}")
            return False
        self._reindex(path)
        if budget_required(size) > self.budget_bytes:   # the final size, re-checked
            self._unlink(path, "over budget")
            return False
        self._log(f"kv cache: stored tokens={n} reason={reason} size={size / 2**20:.2f} MiB file={path}")
        self.evict(protect=path)
        self._noted(reason, n)
        return True

    def _noted(self, reason: str, n: int):
        if reason in ("cold", "continued"):
            self.note_store(n)

    def _compatible(self, path: str, text: bytes, quant: int, ctx: int) -> bool:
        try:
            info = read_info(path, with_tool_map=False)
        except KVFileError:
            return False
        h = info.header
        return ((not self.reject_different_quant or h.quant_bits == quant) and h.ctx <= ctx
                and info.text == text and os.path.basename(path) == sha1_name(info.text))

    # -- eviction (§4.3) -------------------------------------------------------------------------
    def evict(self, protect=None) -> list[str]:
        """Unlink the lowest-scoring files until the folder (cache files and temp files) fits the
        budget; returns their paths. `protect` (the file just stored) is never chosen unless it
        alone exceeds the budget. Runs rarely (at start, after a store), so it re-checks every
        name's signature: hits recorded in place by another process are seen."""
        with self._lock:
            self._refresh(force=True)
            return self._evict(protect)

    def _evict(self, protect=None) -> list[str]:
        with self._lock:
            entries = sorted(self._index.values(), key=lambda e: e.path)
            total = sum(e.size for e in entries) + sum(self._temps.values())
        if total <= self.budget_bytes:
            return []
        now = int(self._now())
        keep = os.path.realpath(os.fspath(protect)) if protect is not None else None

        def score(e: CacheEntry) -> float:
            if keep is not None and os.path.realpath(e.path) == keep and e.size <= self.budget_bytes:
                return math.inf
            h = e.header
            return eviction_score(h.hits, h.last_used, h.created_at, h.tokens, e.size, now)

        scored = [(score(e), e.header.last_used, e) for e in entries]
        removed = []
        while total > self.budget_bytes and scored:
            i = min(range(len(scored)), key=lambda k: (scored[k][0], scored[k][1]))
            s, _, e = scored.pop(i)
            if s == math.inf:
                break
            if self._unlink(e.path, f"evicted (disk cache full) tokens={e.tokens} hits={e.header.hits}"):
                removed.append(e.path)
            total -= e.size
        return removed

    def _unlink(self, path: str, why: str) -> bool:
        """Remove a name of the folder (a symlink is removed itself, its target left alone)."""
        with self._lock:
            self._forget(os.path.basename(path))
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            self._warn(f"kv cache: cannot remove {path}: {e.strerror or e}")
            return False
        self._log(f"kv cache: {why}: {path}")
        return True


