"""ds4's KV cache file (`<sha1>.kv`), byte-compatible (spec/kvcache.md §2-3).

    48-byte KVC header | u32 text_bytes | cache text | DSV4 session payload | optional KTM trailer

The payload is the engine's `Session.snapshot()`; the text is the rendered text of the stored
prefix (its SHA-1 names the file); the KTM trailer maps tool ids to the exact DSML blocks the model
sampled. Writes go to a temporary name in the same folder, are fsynced and renamed over the final
name, so a reader (or a crash) only ever sees the old file or the new one. Reads validate the whole
file against the live session's model and context before the session is touched, never follow a
symlink and never open anything but a regular file (sessions/safeio.py).

ds4's format has no checksum, so a payload swapped in from another file with the same token count
would restore silently. `read_kv` therefore checks the payload's token ids against the text: for a
token-text key the text must be exactly the concatenated token texts of the payload's tokens (one
table lookup per token; this holds for both writers, the shim's cache and the agent's store, since
both write the token text of the live timeline, whatever tokenization the model sampled, where a
re-tokenization of the text could legitimately differ). A visible-transcript key (flag bit 1 or 2)
is the client-visible text, i.e. the token text with hidden reasoning left out (and a sampled but
not yet evaluated end-of-sentence added), so there the text must be a byte subsequence of it.
"""
from __future__ import annotations

import hashlib
import os
import struct
import time
from dataclasses import dataclass, field

from engine import Session, SnapshotError

from . import safeio
from .safeio import UnsafeFile

MAGIC = b"KVC"
VERSION = 1
HEADER = struct.Struct("<3sBBBBBIII4sQQQ")   # 48 bytes
assert HEADER.size == 48
TEXT_LEN = struct.Struct("<I")
PREFIX_BYTES = HEADER.size + TEXT_LEN.size  # 52

# save reasons (header byte 5)
REASONS = {"unknown": 0, "cold": 1, "continued": 2, "evict": 3, "shutdown": 4, "agent-system": 5,
           "agent-session": 6}
REASON_NAMES = {v: k for k, v in REASONS.items()}
# extension flags (header byte 6)
FLAG_TOOL_MAP, FLAG_RESPONSES_KEY, FLAG_THINKING_KEY = 0x01, 0x02, 0x04

EOS_TEXT = "<｜end▁of▁sentence｜>".encode()
KTM_MAGIC = b"KTM"
KTM_VERSION = 1
KTM_MAX_ID = 256
KTM_MAX_DSML = 512 << 20
KTM_MAX_ENTRIES = 4 * 100_000   # ds4: 4 x the tool-memory size


class KVFileError(Exception):
    """A KV file that cannot be used; the message names the file and the fault. `corrupt` marks a
    file that contradicts itself (as opposed to one that is merely for another model/context)."""

    def __init__(self, path, problem, *, corrupt: bool = False):
        self.path, self.problem, self.corrupt = str(path), problem, corrupt
        super().__init__(f"{self.path}: {problem}")


@dataclass
class KVHeader:
    version: int
    quant_bits: int
    reason: int
    flags: int
    tokens: int
    hits: int
    ctx: int
    created_at: int
    last_used: int
    payload_bytes: int
    text_bytes: int

    @property
    def reason_name(self) -> str:
        return REASON_NAMES.get(self.reason, "unknown")

    @property
    def key_kind(self) -> str:
        if self.flags & FLAG_RESPONSES_KEY:
            return "responses-visible"
        if self.flags & FLAG_THINKING_KEY:
            return "thinking-visible"
        return "token-text"


@dataclass
class KVFileInfo:
    path: str
    header: KVHeader
    text: bytes
    size: int
    tool_map: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.header.tokens


def sha1_name(text: bytes | str) -> str:
    """The file name of a cache text: lowercase hex SHA-1 + '.kv'."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return hashlib.sha1(text).hexdigest() + ".kv"


def routed_quant_bits(session_or_engine) -> int:
    """Header byte 4: 2 for the IQ2_XXS/Q2_K expert files, 4 for Q4_K and MXFP4 ones."""
    eng = getattr(session_or_engine, "engine", session_or_engine)
    t = eng.file.tensor("blk.0.ffn_down_exps.weight").type_name
    return 2 if t in ("IQ2_XXS", "Q2_K") else 4


# -- writing -------------------------------------------------------------------------------------
def encode_tool_map(tool_map: dict[str, str] | None) -> bytes:
    if not tool_map:
        return b""
    parts = [KTM_MAGIC, bytes([KTM_VERSION]), struct.pack("<I", len(tool_map))]
    for tid, dsml in tool_map.items():
        i, d = tid.encode("utf-8"), dsml.encode("utf-8")
        if not 1 <= len(i) <= KTM_MAX_ID or not 1 <= len(d) <= KTM_MAX_DSML:
            raise ValueError(f"tool map entry {tid[:40]!r}: id must be 1..{KTM_MAX_ID} bytes and DSML "
                             f"1..{KTM_MAX_DSML} bytes")
        parts += [struct.pack("<II", len(i), len(d)), i, d]
    return b"".join(parts)


def kv_file_bytes(text: bytes, payload: bytes, trailer: bytes = b"") -> int:
    return PREFIX_BYTES + len(text) + len(payload) + len(trailer)


def write_kv(path, session: Session, rendered_text: bytes | str, *, reason: str = "cold",
             tool_map: dict[str, str] | None = None, key_kind: str = "token-text",
             now: int | None = None, payload: bytes | None = None) -> KVFileInfo:
    """Write `session` (its whole timeline) as a KV file at `path`, atomically. `payload` is the
    session's snapshot when the caller already took it (a second one would double peak memory)."""
    if session.pos == 0:
        raise ValueError("nothing to save: the session holds no tokens")
    text = rendered_text.encode("utf-8", "surrogateescape") if isinstance(rendered_text, str) else bytes(rendered_text)
    if payload is None:
        payload = session.snapshot()
    trailer = encode_tool_map(tool_map)
    flags = (FLAG_TOOL_MAP if trailer else 0) | {"token-text": 0, "responses-visible": FLAG_RESPONSES_KEY,
                                                 "thinking-visible": FLAG_THINKING_KEY}[key_kind]
    now = int(time.time()) if now is None else now
    hdr = KVHeader(VERSION, routed_quant_bits(session), REASONS[reason], flags, session.pos, 0,
                   session.ctx, now, now, len(payload), len(text))
    data = [pack_header(hdr), TEXT_LEN.pack(len(text)), text, payload, trailer]
    atomic_write(path, data)
    return KVFileInfo(os.fspath(path), hdr, text, kv_file_bytes(text, payload, trailer), dict(tool_map or {}))


def pack_header(h: KVHeader) -> bytes:
    return HEADER.pack(MAGIC, h.version, h.quant_bits, h.reason, h.flags, 0, h.tokens, h.hits, h.ctx,
                       b"\0" * 4, h.created_at, h.last_used, h.payload_bytes)


def atomic_write(path, chunks):
    """Write chunks to a temp file beside `path`, fsync it, rename it over `path`, fsync the folder
    (a symlink at `path` is replaced, its target never written)."""
    safeio.write_atomic(path, chunks, durable=True)


# -- reading -------------------------------------------------------------------------------------
def _as_kv_error(path, op, *args):
    """op(*args), its refusals (missing, not a regular file, unreadable) as KVFileError."""
    try:
        return op(*args)
    except FileNotFoundError:
        raise KVFileError(path, "no such file") from None
    except UnsafeFile as e:
        raise KVFileError(path, e.strerror) from None
    except OSError as e:
        raise KVFileError(path, f"cannot read: {e.strerror or e}") from None


def _open(path, mode: str = "rb"):
    """Open a KV file. Every reader takes all it reads (header, size, text, payload, trailer) from
    this one descriptor, so a concurrent atomic replace can never mix two versions."""
    return _as_kv_error(path, safeio.open_regular, path, mode)


def read_header(path) -> tuple[KVHeader, int]:
    """The header and the file size; KVFileError if the file cannot be a KV file."""
    path = os.fspath(path)
    with _open(path) as f:
        return _read_header(f, path)


def _read_header(f, path) -> tuple[KVHeader, int]:
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        head = f.read(PREFIX_BYTES)
    except OSError as e:
        raise KVFileError(path, f"cannot read: {e.strerror or e}") from None
    return parse_header(path, head, size)


def header_of(path, st) -> tuple[KVHeader, int]:
    """read_header for a folder scan that already holds the name's lstat result `st`: one open
    and one pread, no file object (a folder of 10,000 files is read in well under a second)."""
    head = _as_kv_error(path, safeio.read_head, path, st, PREFIX_BYTES)
    return parse_header(path, head, st.st_size)


def parse_header(path, head: bytes, size: int) -> tuple[KVHeader, int]:
    """The header from the file's first PREFIX_BYTES bytes and its size; KVFileError if invalid."""
    if len(head) < PREFIX_BYTES:
        raise KVFileError(path, f"truncated header: {size} bytes, a KV file has at least {PREFIX_BYTES}")
    (magic, version, quant, reason, flags, _r, tokens, hits, ctx, _r2, created, last_used,
     payload_bytes) = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise KVFileError(path, f"not a KV cache file (magic {magic!r}, expected b'KVC')")
    if version != VERSION:
        raise KVFileError(path, f"unsupported KV file version {version}")
    if quant not in (2, 4):
        raise KVFileError(path, f"routed-expert quant bits {quant} (only 2 or 4 are valid)")
    if tokens == 0:
        raise KVFileError(path, "holds no tokens")
    (text_bytes,) = TEXT_LEN.unpack_from(head, HEADER.size)
    need = PREFIX_BYTES + text_bytes + payload_bytes
    if need > size:
        raise KVFileError(path, f"truncated: header promises {text_bytes} text + {payload_bytes} payload bytes "
                                f"({need} in all), the file has {size}")
    return KVHeader(version, quant, reason if reason <= 6 else 0, flags, tokens, hits, ctx, created,
                    last_used, payload_bytes, text_bytes), size


def decode_tool_map(path, buf: bytes) -> dict[str, str]:
    if len(buf) < 8 or buf[:3] != KTM_MAGIC or buf[3] != KTM_VERSION:
        raise KVFileError(path, "tool-id map section is missing or has a bad magic/version")
    (n,) = struct.unpack_from("<I", buf, 4)
    if n > KTM_MAX_ENTRIES:
        raise KVFileError(path, f"tool-id map claims {n} entries (at most {KTM_MAX_ENTRIES})")
    out, p = {}, 8
    for k in range(n):
        if p + 8 > len(buf):
            raise KVFileError(path, f"tool-id map entry {k} runs past the end of the file")
        il, dl = struct.unpack_from("<II", buf, p)
        p += 8
        if not 1 <= il <= KTM_MAX_ID or not 1 <= dl <= KTM_MAX_DSML:
            raise KVFileError(path, f"tool-id map entry {k} has bad lengths (id {il}, DSML {dl} bytes)")
        if p + il + dl > len(buf):
            raise KVFileError(path, f"tool-id map entry {k} runs past the end of the file (id {il}, DSML {dl} "
                                    f"bytes, {len(buf) - p} left)")
        out[buf[p:p + il].decode("utf-8", "replace")] = buf[p + il:p + il + dl].decode("utf-8", "replace")
        p += il + dl
    return out


def read_info(path, *, with_tool_map: bool = True) -> KVFileInfo:
    """Header, text and tool map of a KV file, without its payload."""
    with _open(os.fspath(path)) as f:
        return _read_info(f, os.fspath(path), with_tool_map)


def _read_info(f, path, with_tool_map: bool = True) -> KVFileInfo:
    h, size = _read_header(f, path)
    f.seek(PREFIX_BYTES)
    text = f.read(h.text_bytes)
    tool_map = {}
    if with_tool_map and h.flags & FLAG_TOOL_MAP:
        f.seek(PREFIX_BYTES + h.text_bytes + h.payload_bytes)
        tool_map = decode_tool_map(path, f.read())
    if len(text) != h.text_bytes:
        raise KVFileError(path, "truncated cached text")
    return KVFileInfo(os.fspath(path), h, text, size, tool_map)


def read_kv(path, session: Session, *, expect_text: bytes | None = None, check_name: bool = False,
            allow_other_quant: bool = False) -> KVFileInfo:
    """Restore `session` from a KV file. Everything is validated first (header, sizes, tool map,
    name vs text, quant width, and the payload against the model and the session's context); on
    any fault KVFileError is raised and `session` is exactly as it was."""
    path = os.fspath(path)
    with _open(path) as f:
        info = _read_info(f, path)
        h = info.header
        f.seek(PREFIX_BYTES + h.text_bytes)
        payload = f.read(h.payload_bytes)
    if check_name and os.path.basename(path) != sha1_name(info.text):
        raise KVFileError(path, "cached text hash does not match file name")
    if expect_text is not None and info.text != expect_text:
        raise KVFileError(path, "cached text differs from the expected text")
    if not allow_other_quant and h.quant_bits != routed_quant_bits(session):
        raise KVFileError(path, f"KV checkpoint was written for a different quantization "
                                f"({h.quant_bits}-bit experts, this model has {routed_quant_bits(session)}-bit)")
    if not (h.flags & FLAG_TOOL_MAP) and info.size != PREFIX_BYTES + h.text_bytes + h.payload_bytes:
        raise KVFileError(path, f"{info.size - PREFIX_BYTES - h.text_bytes - h.payload_bytes} trailing bytes "
                                f"after the payload and no tool-id map flag")
    if len(payload) != h.payload_bytes:
        raise KVFileError(path, "truncated payload")
    if len(payload) >= 52 and struct.unpack_from("<13I", payload)[7] != h.tokens:
        raise KVFileError(path, corrupt=True, problem=f"KV payload token count mismatch (header {h.tokens}, "
                                f"payload {struct.unpack_from('<13I', payload)[7]})")
    if _payload_fits(payload, session):   # else restore names the model/context mismatch
        check_payload_text(path, info, payload, session.engine.tokenizer.token_bytes)
    try:
        session.restore(payload)   # validates fully before replacing the session's state
    except SnapshotError as e:
        raise KVFileError(path, f"payload: {e}") from None
    return info


def payload_tokens(payload: bytes, count: int) -> memoryview:
    """The checkpoint token ids of a DSV4 payload (spec §3.2: u32[T] right after the 52-byte header)."""
    return memoryview(payload)[52:52 + 4 * count].cast("I")


def is_subsequence(small: bytes, big: bytes) -> bool:
    """Whether `small` is `big` with some bytes left out (greedy, matching equal runs at C speed)."""
    i = j = 0
    while i < len(small):
        if j >= len(big):
            return False
        if small[i] == big[j]:
            n = 1                       # the length of the equal run here, found by doubling
            while i + n < len(small) and small[i:i + 2 * n] == big[j:j + 2 * n]:
                n *= 2
            lo = min(n, len(small) - i, len(big) - j)
            hi = min(2 * n, len(small) - i, len(big) - j)
            while lo < hi:              # then bisected to the first difference
                mid = (lo + hi + 1) // 2
                if small[i:i + mid] == big[j:j + mid]:
                    lo = mid
                else:
                    hi = mid - 1
            i, j = i + lo, j + lo
        else:
            j = big.find(small[i], j + 1)
            if j < 0:
                return False
    return True


def _payload_fits(payload: bytes, session: Session) -> bool:
    """Whether the payload header is for this model and fits the session's context (the checks
    Session.restore makes first, with their own messages)."""
    if len(payload) < 52:
        return False
    (magic, version, s_ctx, _p, _rc, _rw, _cc, T, n_layer, hd, ihd, vocab, _r) = struct.unpack_from("<13I", payload)
    c = session.engine.config
    return (magic, version) == (0x34565344, 1) and (n_layer, hd, ihd, vocab) == (
        c.n_layer, c.head_dim, c.idx_head_dim, c.n_vocab) and s_ctx <= session.ctx and T < session.ctx


def check_payload_text(path, info: KVFileInfo, payload: bytes, token_bytes) -> None:
    """KVFileError unless the payload's token ids spell the file's text (module doc). Not marked
    `corrupt`: such a file is skipped, not deleted (it may be a user's, placed by hand)."""
    h = info.header
    if len(payload) < 52 + 4 * h.tokens:
        raise KVFileError(path, f"truncated payload: {len(payload)} bytes cannot hold {h.tokens} token ids")
    try:
        spelled = b"".join(token_bytes(int(t)) for t in payload_tokens(payload, h.tokens))
    except (IndexError, KeyError, ValueError):
        raise KVFileError(path, "payload holds token ids outside the vocabulary") from None
    if h.flags & (FLAG_RESPONSES_KEY | FLAG_THINKING_KEY):
        # the transcript ends with the end-of-sentence the model sampled, which is not evaluated
        # into the KV state yet (protocol.md §7.3): it need not be among the tokens
        text = info.text[:-len(EOS_TEXT)] if info.text.endswith(EOS_TEXT) else info.text
        if not is_subsequence(text, spelled):
            raise KVFileError(path, "payload tokens do not match the cached text (the "
                              "visible transcript is not the tokens' text with parts left out)")
    elif spelled != info.text:
        raise KVFileError(path, "payload tokens do not match the cached text (another "
                          "file's payload, or a damaged one)")


def touch(path, now: int | None = None):
    """Count a cache hit: hits + 1 and last_used = now, rewriting the header in place."""
    path = os.fspath(path)
    with _open(path, "r+b") as f:
        h, _ = _read_header(f, path)
        h.hits += 1
        h.last_used = int(time.time()) if now is None else now
        f.seek(0)
        f.write(pack_header(h))
        f.flush()
        os.fsync(f.fileno())


def replace_tool_map(path, tool_map: dict[str, str], now: int | None = None):
    """Rewrite only the KTM trailer of an existing file (ds4's refresh of a same-name entry)."""
    path = os.fspath(path)
    with _open(path) as f:
        h, size = _read_header(f, path)
        trailer = encode_tool_map(tool_map)
        if not trailer:
            return
        f.seek(0)
        body = f.read(PREFIX_BYTES + h.text_bytes + h.payload_bytes)
    h.flags |= FLAG_TOOL_MAP
    h.last_used = int(time.time()) if now is None else now
    atomic_write(path, [pack_header(h), body[HEADER.size:], trailer])


def remove_stale_temps(folder, older_than_s: float = safeio.STALE_AGE_S, now: float | None = None) -> int:
    """Delete temp files a killed writer left behind (`<name>.tmp.*`): those whose writer is gone
    (by the pid in the name) or that are old enough that no live writer can still own them.
    Symlinks and non-regular files are never touched. Returns how many were removed."""
    return safeio.remove_stale_temps(folder, now=now, older_than_s=older_than_s)
