"""GGUF container reading: header, metadata and tensor directory, with bounds checks everywhere.

Why not `gguf.GGUFReader`: it builds one NumPy view per array element, so the real DeepSeek V4
vocabulary (129,280 tokens + 127,741 merges) takes about 6.6 s to open, and it reads past the end of
short files with bare IndexErrors or loops on absurd counts. This reader walks the same format with
`struct` over an mmap, checks every length against the bytes that remain before using it, and never
touches tensor data: opening costs O(metadata). Tensor bytes are handed out as zero-copy NumPy views
of the map, only after the directory has proved that each tensor lies inside the file (a view past
EOF would SIGBUS on first touch). `tests/test_gguf_file.py` checks it against `gguf.GGUFReader`.
"""
from __future__ import annotations

import codecs
import mmap
import os
import stat
import struct
import time
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelFileError
from . import paging, prefetch

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (3,)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_U64 = struct.Struct("<Q")
# A string array longer than this is read one string at a time: the bulk read makes a few copies
# of the whole run (the real vocabulary's two arrays: 2.3 and 2.9 MB), and a corrupt count could
# make it the file.
_BULK_BYTES = 16 << 20
_GUESS_BYTES = 32   # a vocabulary string's bytes with its length, at most, for the first guess (18, 23)

# GGUF metadata value types (gguf spec numbering).
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)
VALUE_TYPE_NAMES = {
    T_UINT8: "u8", T_INT8: "i8", T_UINT16: "u16", T_INT16: "i16", T_UINT32: "u32", T_INT32: "i32",
    T_FLOAT32: "f32", T_BOOL: "bool", T_STRING: "string", T_ARRAY: "array", T_UINT64: "u64",
    T_INT64: "i64", T_FLOAT64: "f64",
}
# struct format and NumPy dtype of each fixed-size scalar type
_SCALAR = {
    T_UINT8: ("<B", "<u1"), T_INT8: ("<b", "<i1"), T_UINT16: ("<H", "<u2"), T_INT16: ("<h", "<i2"),
    T_UINT32: ("<I", "<u4"), T_INT32: ("<i", "<i4"), T_FLOAT32: ("<f", "<f4"), T_BOOL: ("<?", "<u1"),
    T_UINT64: ("<Q", "<u8"), T_INT64: ("<q", "<i8"), T_FLOAT64: ("<d", "<f8"),
}


@dataclass(frozen=True)
class Field:
    """One metadata entry. For arrays `value` is a list (strings) or a NumPy array (numbers)."""
    key: str
    type: int
    value: Any
    elem_type: int | None = None  # element type of an array

    @property
    def type_name(self) -> str:
        if self.type == T_ARRAY:
            return f"array of {VALUE_TYPE_NAMES.get(self.elem_type, '?')}"
        return VALUE_TYPE_NAMES.get(self.type, f"type {self.type}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    dims: tuple[int, ...]   # ggml order: dims[0] is the contiguous (input) dimension
    offset: int             # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


class _Cursor:
    """Sequential little-endian reads from a buffer; every read is checked against the end."""

    def __init__(self, path, buf, size):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def need(self, n, what):
        if n < 0 or self.pos + n > self.size:
            raise ModelFileError(self.path, f"truncated {what}: needs {n} bytes at offset {self.pos}, "
                                            f"file has {self.size} bytes")

    def unpack(self, fmt, what):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what):
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, f"{what} is not valid UTF-8") from None

    def remaining(self):
        return self.size - self.pos


def check_model_path(path) -> int:
    """Return the file size, or raise a ModelFileError that says why it cannot be a model."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelFileError(path, "no such file") from None
    except OSError as e:
        raise ModelFileError(path, f"cannot open: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFileError(path, "is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(path, "is not a regular file")
    if st.st_size == 0:
        raise ModelFileError(path, "is empty (0 bytes), not a GGUF file")
    return st.st_size


class GGUFFile:
    """A GGUF file mapped read-only. `fields` and `tensors` are parsed at open; data stays in the map."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.size = check_model_path(self.path)
        self._base = None     # address of the map (willneed), taken on first use
        self._copy = None      # the resident copy (paging.ResidentCopy), filled or filling
        self._populate = None  # the background prefault (paging.Populate)
        self._prefetch = None  # lowmem's read-ahead thread (prefetch.Prefetcher)
        self._experts = None   # the routed experts' page ranges, and their advice now (lowmem)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(self.path, f"cannot map: {e.strerror or e}") from None
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- paging ---------------------------------------------------------------------------------
    def advise(self, mode: str) -> str:
        """How the kernel should page the map in; returns what was done.

        "prefault": populate every page (MADV_POPULATE_READ, Linux 5.14+; else WILLNEED,
        which reads ahead asynchronously), in a background thread (paging.Populate: seconds for a
        9.5 GB file, which open does not wait for; until a page is in, the forward pass faults it
        in itself, as with "none"). Decode touches a different handful of experts every
        token; a first touch of an unmapped page costs a fault each, which made decode many
        times slower until every expert had been used once.
        "lowmem": the file is larger than the memory it may use: no prefault, the kernel's normal
        readahead (MADV_NORMAL), and willneed() hints from the forward pass for what it is about
        to read (a layer's dense matrices one layer ahead, the experts routing picked), so pages
        come in as large asynchronous reads and RSS stays bounded by what the page cache may
        keep. The hints go to a background thread (prefetch.Prefetcher); begin_step() sets the
        routed experts' advice per step (prefetch.expert_advice).
        """
        if mode == "prefault":
            if self._populate is None:
                pop = paging.Populate(self._map_address(), self.size)
                if not pop.start():
                    self._mm.madvise(mmap.MADV_WILLNEED)
                    return "willneed"
                self._populate = pop
            return "prefault"
        if mode == "lowmem":
            self._mm.madvise(mmap.MADV_NORMAL)
            if self._prefetch is None:
                try:
                    self._prefetch = prefetch.Prefetcher(self.path)
                except OSError:
                    pass            # no thread: willneed() advises the map in the caller's thread
            return "lowmem"
        raise ValueError(f"paging mode must be 'prefault' or 'lowmem', not {mode!r}")

    def start_resident(self, threads: int = 1, drop_cache: bool = False, on_ready=None, skip=frozenset()) -> None:
        """Copy the whole file into anonymous memory backed by transparent huge pages, in
        `threads` background threads, and hand out each tensor's later views from the copy once
        its bytes are all there (`paging.ResidentCopy`); returns at once. A file under
        `paging.SYNC_BYTES` is copied before this returns. The bytes and their layout are the
        file's (offsets unchanged), so results are bit-identical; what changes is where they live.
        On Linux the page cache holds a file in folios of mixed sizes, often not 2 MiB, scattered
        in physical memory; a 2 MiB anonymous huge page is physically contiguous, and the same
        matrices stream faster from it (fewer TLB misses and page walks while a decode step reads
        every matrix cold).

        on_ready(names) runs in a copy thread when those tensors are ready, so views handed out
        before can be switched (ModelFile does); then the map's pages of that range are dropped
        from this process (they stay in the page cache), so RSS does not count the bytes twice.
        Costs: RSS of the file's size, and the page cache may hold a second copy until the kernel
        reclaims it; `drop_cache` drops each piece from the page cache once copied
        (POSIX_FADV_DONTNEED), for a file whose two copies would not fit. A read that fails (a
        file cut short since open: no SIGBUS, a ModelFileError in `resident_error`) ends the copy:
        what is ready stays there, every other tensor stays on the map. `skip`: tensors left
        out of the copy (paging.plan_groups), which stay on the map."""
        if self._copy is not None:
            return
        if self.size < paging.SYNC_BYTES:
            self.load_resident(threads, drop_cache, skip)
            if on_ready is not None:
                on_ready([n for n in self.tensors if n not in skip])
            self._release_map(0, self.size)
            return
        copy = paging.ResidentCopy(self.path, self.size, paging.plan_groups(self.tensors.values(), self.size, skip))
        self._copy = copy           # (before the threads: a switch asks tensor_bytes for the copy's view)
        try:
            copy.start(threads, drop_cache, on_ready, self._release_map)
        except BaseException:
            self._copy = None
            raise

    def load_resident(self, threads: int = 2, drop_cache: bool = False, skip=frozenset()) -> float:
        """The resident copy (start_resident), made before this returns; its seconds. A failed
        read raises ModelFileError and leaves no copy."""
        t0 = time.perf_counter()
        if self._copy is None:
            copy = paging.ResidentCopy(self.path, self.size, paging.plan_groups(self.tensors.values(), self.size, skip))
            copy.start(threads, drop_cache, None, None)
            copy.wait()
            if copy.error is not None:
                raise copy.error
            self._copy = copy
        self._copy.wait()
        if self._copy.error is not None:
            raise self._copy.error
        return time.perf_counter() - t0

    def wait_resident(self, timeout: float | None = None) -> bool:
        """Wait for the background copy to end; True when it is complete (every view from it)."""
        if self._copy is None:
            return False
        self._copy.wait(timeout)
        return self.resident

    @property
    def resident_error(self) -> BaseException | None:
        """Why the background copy stopped short (the views not yet switched stay on the map)."""
        return None if self._copy is None else self._copy.error

    @property
    def resident_seconds(self) -> float | None:
        """How long the copy took, once complete."""
        return None if self._copy is None else self._copy.seconds

    def _release_map(self, lo: int, hi: int) -> None:
        """Drop the map's pages of [lo, hi) from this process, the copy now serving them: a view
        still pointing there (a C call in flight, a small table kept as a view) faults them back
        from the page cache."""
        mm = self._mm
        if mm is None:
            return
        lo -= lo % mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass

    @property
    def resident(self) -> bool:
        """Every tensor view comes from the resident copy (complete)."""
        return self._copy is not None and self._copy.complete

    def willneed(self, arrays, now: bool = False) -> None:
        """Ask the kernel to read these views of the map ahead, asynchronously, in large reads
        (lowmem paging: the pages a step is about to touch, instead of faults met one readahead
        window at a time). Views not backed by this map are ignored; so are madvise failures.
        With lowmem's thread the ranges are merged, sorted into file order and issued there, or
        (`now`) in this thread before this returns."""
        if self._prefetch is not None and self._resident is None and self._mm is not None:
            ranges = prefetch.page_ranges(self._spans(arrays))
            (self._prefetch.issue if now else self._prefetch.submit)(ranges)
            return
        self._advise_views(arrays, mmap.MADV_WILLNEED)

    def begin_step(self, n_tokens: int) -> None:
        """A forward step of n_tokens rows starts (lowmem): hints still queued from the last step
        are dropped, and the routed experts get the advice prefetch.expert_advice gives."""
        if self._prefetch is None or self._mm is None:
            return
        self._prefetch.begin_step()
        advice = prefetch.expert_advice(n_tokens)
        if self._experts is None:
            spans = [(t.offset, t.nbytes) for t in self.tensors.values() if t.name.endswith("_exps.weight")]
            self._experts = [prefetch.page_ranges(spans), mmap.MADV_NORMAL]
        if advice != self._experts[1]:
            try:
                for lo, hi in self._experts[0]:
                    self._mm.madvise(advice, lo, min(hi, self.size) - lo)
            except (OSError, ValueError):
                return
            self._experts[1] = advice

    @property
    def prefetcher(self):
        """lowmem's prefetch.Prefetcher (None in other modes): tests and benchmarks wait on it."""
        return self._prefetch

    def _spans(self, arrays):
        """(file offset, nbytes) of each array that is a view of this map."""
        base = self._map_address()
        for a in arrays:
            start = a.ctypes.data - base
            if 0 <= start and start + a.nbytes <= self.size and a.nbytes:
                yield start, a.nbytes

    def dontneed(self, arrays) -> None:
        """Drop these views' pages from this process's mapping (they stay in the page cache, and
        a later read faults them back): a backend that copied the weights into its own memory
        does not keep the file's pages counted against it as well."""
        self._advise_views(arrays, mmap.MADV_DONTNEED)

    def _map_address(self) -> int:
        if self._base is None:
            self._base = np.frombuffer(self._mm, dtype=np.uint8).ctypes.data
        return self._base

    @property
    def _resident(self) -> np.ndarray | None:
        """The complete copy as one read-only uint8 array [size], else None."""
        return self._copy.array if self.resident else None

    def _advise_views(self, arrays, advice: int) -> None:
        if self._mm is None or self._resident is not None:
            return
        self._map_address()
        page = mmap.PAGESIZE
        for a in arrays:
            start = a.ctypes.data - self._base
            if start < 0 or start + a.nbytes > self.size or a.nbytes == 0:
                continue
            lo = start - start % page
            try:
                self._mm.madvise(advice, lo, start + a.nbytes - lo)
            except (OSError, ValueError):
                return

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self):
        c = _Cursor(self.path, self._mm, self.size)
        c.need(4, "header")
        magic = bytes(self._mm[0:4])
        if magic != GGUF_MAGIC:
            raise ModelFileError(self.path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        c.pos = 4
        self.version = c.unpack("<I", "header (version)")
        if self.version not in SUPPORTED_VERSIONS:
            raise ModelFileError(self.path, f"unsupported GGUF version {self.version} "
                                            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = c.unpack("<Q", "header (tensor count)")
        n_kv = c.unpack("<Q", "header (metadata count)")
        # Each KV entry needs >= 13 bytes (key length, type, 1-byte value) and each tensor info
        # >= 24 (name length, n_dims, type, offset): absurd counts fail before any loop runs.
        if n_kv * 13 > c.remaining():
            raise ModelFileError(self.path, f"header claims {n_kv} metadata entries, more than the "
                                            f"{c.remaining()} remaining bytes can hold (corrupt or truncated)")
        self.fields: dict[str, Field] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.unpack("<I", f"metadata {key!r} type")
            if key in self.fields:
                raise ModelFileError(self.path, f"duplicate metadata key {key!r}")
            self.fields[key] = self._read_value(c, key, vtype)
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            fa = self.fields["general.alignment"]
            if fa.type != T_UINT32 or fa.value <= 0 or fa.value & (fa.value - 1):
                raise ModelFileError(self.path, "general.alignment must be a u32 power of two, "
                                                f"got {fa.type_name} {fa.value!r}")
            alignment = fa.value
        self.alignment = alignment
        if n_tensors * 24 > c.remaining():
            raise ModelFileError(self.path, f"header claims {n_tensors} tensors, more than the "
                                            f"{c.remaining()} bytes after the metadata can describe "
                                            f"(corrupt or truncated)")
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor info #{i} (name)")
            n_dims = c.unpack("<I", f"tensor {name!r} dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFileError(self.path, f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            c.need(8 * n_dims, f"tensor {name!r} dims")
            dims = struct.unpack_from(f"<{n_dims}Q", self._mm, c.pos)
            c.pos += 8 * n_dims
            type_id = c.unpack("<I", f"tensor {name!r} type")
            offset = c.unpack("<Q", f"tensor {name!r} offset")
            infos.append((name, dims, type_id, offset))
        self.data_offset = -(-c.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise ModelFileError(self.path, f"duplicate tensor {name!r}")
            self.tensors[name] = self._tensor_info(name, dims, type_id, offset)
        self._check_packing()

    def _check_packing(self):
        """Tensor data must tile the data section: each tensor starts where the one before it ends
        (rounded up to the alignment), as every GGUF writer lays them out. Two tensors sharing
        bytes, or a gap, mean a directory entry does not describe the bytes written for it: an F16
        tensor re-typed as F32 in the directory overlaps its neighbour, re-typed as Q8_0 it leaves a
        gap, and either way the weights would be read as the wrong numbers."""
        order = sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes))
        expect, prev = self.data_offset, None
        for t in order:
            if t.offset < expect and prev is not None:
                raise ModelFileError(self.path, f"tensor {t.name!r} data [{t.offset}, {t.offset + t.nbytes}) overlaps "
                                                f"tensor {prev.name!r} [{prev.offset}, {prev.offset + prev.nbytes})")
            if t.offset > expect:
                after = f"the end of tensor {prev.name!r}" if prev else "the start of the data section"
                raise ModelFileError(self.path, f"{t.offset - expect} unused bytes between {after} and tensor "
                                                f"{t.name!r}: a tensor's type or shape does not match its data")
            expect = -(-(t.offset + t.nbytes) // self.alignment) * self.alignment
            prev = t
        if prev is not None and self.size > expect:
            raise ModelFileError(self.path, f"{self.size - expect} bytes after the last tensor {prev.name!r}: "
                                            f"a tensor's type or shape does not match its data")

    def _read_value(self, c: _Cursor, key: str, vtype: int) -> Field:
        if vtype in _SCALAR:
            v = c.unpack(_SCALAR[vtype][0], f"metadata {key!r} value")
            return Field(key, vtype, bool(v) if vtype == T_BOOL else v)
        if vtype == T_STRING:
            return Field(key, vtype, c.string(f"metadata {key!r} value"))
        if vtype != T_ARRAY:
            raise ModelFileError(self.path, f"metadata {key!r} has unknown value type {vtype}")
        etype = c.unpack("<I", f"metadata {key!r} array type")
        count = c.unpack("<Q", f"metadata {key!r} array length")
        if etype in _SCALAR:
            fmt, dt = _SCALAR[etype]
            nb = count * struct.calcsize(fmt)
            if nb > c.remaining():
                raise ModelFileError(self.path, f"truncated metadata {key!r}: {count} elements need "
                                                f"{nb} bytes, {c.remaining()} are left in the file")
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=c.pos).copy()
            c.pos += nb
            if etype == T_BOOL:
                arr = arr.astype(bool)
            return Field(key, T_ARRAY, arr, etype)
        if etype == T_STRING:
            if count * 8 > c.remaining():
                raise ModelFileError(self.path, f"truncated metadata {key!r}: {count} strings need at "
                                                f"least {count * 8} bytes, {c.remaining()} are left in the file")
            return Field(key, T_ARRAY, self._read_strings(c, key, count), etype)
        raise ModelFileError(self.path, f"metadata {key!r} is an array of unsupported type {etype}")

    def _read_strings(self, c: _Cursor, key: str, count: int) -> list[str]:
        """`count` length-prefixed strings from c.pos. The vocabulary is 257k of them, read on
        every open, so the common case runs in bulk: where each string starts comes from the
        lengths' zero bytes (`_starts_by_zeros`), else from one Python pass (an int per string, no
        object made); then each 8-byte length becomes one NUL byte, the whole run is decoded as
        UTF-8 once, and split at the NULs. Anything the bulk read cannot vouch for (a length past
        the end, bad UTF-8, a NUL inside a string, a run over _BULK_BYTES) goes to
        `_read_strings_each`, which finds and names the string as it always did."""
        mm, start, size = self._mm, c.pos, self.size
        if count == 0:
            return []
        found = self._starts_by_zeros(start, count)
        if found is not None:
            at, pos = found
        else:
            starts = array("q")
            append, unpack, pos = starts.append, _U64.unpack_from, start
            try:
                for _ in range(count):
                    append(pos)
                    pos += 8 + unpack(mm, pos)[0]
            except (struct.error, OverflowError, ValueError):
                pos = size + 1              # a length read past the end: the slow pass names it
            if pos > size or pos - start > _BULK_BYTES:
                return self._read_strings_each(c, key, count)
            at = np.frombuffer(starts, np.int64) - start
        # each length becomes one NUL: its other 7 bytes dropped (a one-character separator
        # splits faster than a longer one), its first zeroed
        keep = np.ones(pos - start, bool)
        for k in range(1, 8):
            keep[at + k] = False
        run = np.frombuffer(mm, np.uint8, count=pos - start, offset=start)[keep]
        run[at - 7 * np.arange(count)] = 0
        # a NUL inside a string would be taken for a separator: only the lengths may hold them
        if count != len(run) - np.count_nonzero(run):
            return self._read_strings_each(c, key, count)
        try:
            out = codecs.utf_8_decode(run, "strict", True)[0].split("\x00")
        except UnicodeDecodeError:
            return self._read_strings_each(c, key, count)
        del out[0]                          # (the text before the first separator: none)
        c.pos = pos
        return out

    def _starts_by_zeros(self, start: int, count: int):
        """Where each of `count` strings from `start` begins (offsets from start) and where the
        last ends (absolute), found without a Python loop, or None (the caller walks them). Each
        length under 65536 has zero bytes 2..7, and its string's first byte is not zero, so it
        ends a run of offsets whose next 6 bytes are zero. The run ends are only candidates (a
        string may hold NULs or be empty, a long one has a longer length, text may follow the
        array): the answer stands only if, from `start`, each candidate plus 8 plus its length is
        the next one, the walk's own recurrence, so it is the walk's answer or None."""
        w = min(self.size - start, _GUESS_BYTES * count + 64)
        if _GUESS_BYTES * count > _BULK_BYTES or w < 16:
            return None
        a = np.frombuffer(self._mm, np.uint8, count=w, offset=start)
        zero = a == 0
        run = zero[2:w - 5].copy()          # run[p]: bytes p+2 .. p+7 all zero
        for k in range(3, 8):
            run &= zero[k:w - 7 + k]
        at = np.flatnonzero(run[:-1] & ~run[1:])[:count]
        if len(at) < count or at[0] != 0:
            return None
        nxt = at + 8 + (a[at].astype(np.int64) | a[at + 1].astype(np.int64) << 8)
        if not np.array_equal(nxt[:-1], at[1:]) or nxt[-1] > w:
            return None
        return at, start + int(nxt[-1])

    def _read_strings_each(self, c: _Cursor, key: str, count: int) -> list[str]:
        """_read_strings one string at a time: the reference, and what names a bad string."""
        mm, pos, size = self._mm, c.pos, self.size
        unpack = _U64.unpack_from
        out = []
        append = out.append
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise IndexError
                (n,) = unpack(mm, pos)
                pos += 8
                end = pos + n
                if end > size:
                    raise IndexError
                append(mm[pos:end].decode("utf-8"))
                pos = end
        except IndexError:
            raise ModelFileError(self.path, f"truncated metadata {key!r}: string #{len(out)} of "
                                            f"{count} runs past the end of the file") from None
        except UnicodeDecodeError:
            raise ModelFileError(self.path, f"metadata {key!r}: string #{len(out)} is not valid UTF-8") from None
        c.pos = pos
        return out

    def _tensor_info(self, name, dims, type_id, offset) -> TensorInfo:
        try:
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise ModelFileError(self.path, f"tensor {name!r} has unknown ggml type {type_id}") from None
        n = 1
        for d in dims:
            if d == 0 or d > 1 << 40:
                raise ModelFileError(self.path, f"tensor {name!r} has an invalid dimension {d} in {list(dims)}")
            n *= d
        if dims[0] % block_elems:
            raise ModelFileError(self.path, f"tensor {name!r}: row length {dims[0]} is not a multiple of "
                                            f"the {block_elems}-value blocks of its type")
        nbytes = n // block_elems * block_bytes
        if offset % self.alignment:
            raise ModelFileError(self.path, f"tensor {name!r} data offset {offset} is not aligned to {self.alignment}")
        start = self.data_offset + offset
        if start + nbytes > self.size:
            raise ModelFileError(self.path, f"tensor {name!r} data [{start}, {start + nbytes}) runs past the end "
                                            f"of the file ({self.size} bytes): the file is truncated")
        return TensorInfo(name, type_id, tuple(int(d) for d in dims), start, nbytes)

    # -- access --------------------------------------------------------------------------------
    def get(self, key, default=None):
        f = self.fields.get(key)
        return default if f is None else f.value

    def tensor_ready(self, name: str) -> bool:
        """tensor_bytes(name) comes from the resident copy."""
        copy = self._copy
        return copy is not None and name in copy.ready

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of one tensor's bytes in the map, or in the resident copy once
        the tensor is ready there (range already checked at open)."""
        t = self.tensors[name]
        copy = self._copy
        if copy is not None and name in copy.ready:
            return copy.array[t.offset:t.offset + t.nbytes]
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def close(self):
        # the background work ends first (after its current piece): it reads and advises the map
        for w in (getattr(self, "_copy", None), getattr(self, "_populate", None)):
            if w is not None:
                w.stop()
        if getattr(self, "_prefetch", None) is not None:
            self._prefetch.close()
        # the resident copy is freed when the last view of it goes (NumPy holds the buffer)
        self._copy = self._populate = self._prefetch = None
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # NumPy views still point into the map; it is unmapped when the last one goes.
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
