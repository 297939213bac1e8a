"""Tool-call ids and the tool memory `id -> exact sampled DSML block` (protocol.md §6.1-6.2,
kvcache.md §2.4).

The model speaks DSML; clients round-trip calls as JSON and may reorder or rebuild them. The id
is the bridge: every sampled call's id maps to the block the model actually wrote, so the next
prompt replays those bytes verbatim and the live KV state stays a prefix of it.
"""
from __future__ import annotations

import secrets
from collections import OrderedDict

from .dsml_parse import find_next_dsml_tool_block

__all__ = ["new_tool_id", "ToolMemory", "TOOL_ID_MAX_BYTES", "TOOL_MEMORY_MAX_BYTES",
           "TOOL_MEMORY_DEFAULT_MAX_IDS"]

TOOL_ID_MAX_BYTES = 256                       # KTM reader: 1 <= id_len <= 256
TOOL_MEMORY_MAX_BYTES = 512 * 1024 * 1024     # per block, and the whole memory's accounting
TOOL_MEMORY_DEFAULT_MAX_IDS = 100_000         # --tool-memory-max-ids default
# ds4 charges each entry strlen(id)+1+sizeof(entry) and each distinct block len+1+sizeof(block)
# (64 and 48 bytes on a 64-bit build); the same accounting makes the byte limit bite at the
# same point.
_ENTRY_OVERHEAD = 64
_BLOCK_OVERHEAD = 48

_PREFIXES = {"openai": "call_", "responses": "call_", "anthropic": "toolu_"}


def new_tool_id(kind: str = "openai", taken=()) -> str:
    """`call_` (OpenAI chat and Responses) or `toolu_` (Anthropic) + 32 lowercase hex digits
    from the OS CSPRNG; drawn again while it is in `taken` (ids of this turn, a ToolMemory...)."""
    try:
        prefix = _PREFIXES[kind]
    except KeyError:
        raise ValueError(f"tool id kind must be one of {sorted(_PREFIXES)}, not {kind!r}") from None
    while True:
        tid = prefix + secrets.token_hex(16)
        if tid not in taken:
            return tid


class ToolMemory:
    """Bounded `tool id -> DSML block` map with least-recently-used eviction.

    As in ds4: `remember` and `get` touch an entry (move it to the newest end); past `max_ids`
    entries or `max_bytes` of accounted memory the least recently used entries go first.
    Identical blocks are stored once (all calls of a turn share one block). Each entry remembers
    where it came from: "ram" (sampled here) or "disk" (a KV file's trailer).
    """

    def __init__(self, max_ids: int = TOOL_MEMORY_DEFAULT_MAX_IDS,
                 max_bytes: int = TOOL_MEMORY_MAX_BYTES):
        if max_ids < 1 or max_bytes < 1:
            raise ValueError("max_ids and max_bytes must be positive")
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, list] = OrderedDict()   # id -> [dsml, source, stamp]; oldest first
        self._blocks: dict[str, list] = {}                        # dsml -> [refcount, {id: stamp}, charged bytes]
        self._clock = 0
        self.bytes = 0

    # -- mapping protocol
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tool_id) -> bool:
        return tool_id in self._entries

    def ids(self) -> list[str]:
        """Ids from least to most recently used."""
        return list(self._entries)

    def get(self, tool_id: str) -> str | None:
        e = self._entries.get(tool_id)
        if e is None:
            return None
        self._touch(tool_id, e)
        return e[0]

    def source(self, tool_id: str) -> str | None:
        """"ram" or "disk" (no touch)."""
        e = self._entries.get(tool_id)
        return e[1] if e else None

    def remember(self, tool_id: str, dsml: str, source: str = "ram") -> None:
        """Map `tool_id` to the exact block `dsml`. Raises ValueError for an id outside 1..256
        UTF-8 bytes or a block outside 1 byte..512 MiB (what the KV trailer can hold)."""
        if not isinstance(tool_id, str) or not isinstance(dsml, str):
            raise ValueError("tool id and dsml must be str")
        if source not in ("ram", "disk"):
            raise ValueError(f"source must be 'ram' or 'disk', not {source!r}")
        id_len = len(tool_id.encode("utf-8"))
        if not 1 <= id_len <= TOOL_ID_MAX_BYTES:
            raise ValueError(f"tool id must be 1..{TOOL_ID_MAX_BYTES} bytes, got {id_len}")
        # 1 byte per char is a lower bound: a too-long str is refused before encoding it.
        dsml_len = len(dsml.encode("utf-8")) if 0 < len(dsml) <= TOOL_MEMORY_MAX_BYTES else 0
        if not 1 <= dsml_len <= TOOL_MEMORY_MAX_BYTES:
            raise ValueError(f"dsml block must be 1..{TOOL_MEMORY_MAX_BYTES} bytes")
        old = self._entries.get(tool_id)
        if old is not None and old[0] == dsml:
            if source == "ram":
                old[1] = "ram"           # a sampled entry outranks a disk copy
            self._touch(tool_id, old)
            self._prune()
            return
        if old is not None:
            self._remove(tool_id)
        self._clock += 1
        entry = [dsml, source, self._clock]
        self._entries[tool_id] = entry
        blk = self._blocks.get(dsml)
        if blk is None:
            blk = self._blocks[dsml] = [0, {}, dsml_len + 1 + _BLOCK_OVERHEAD]
            self.bytes += blk[2]
        blk[0] += 1
        blk[1][tool_id] = self._clock
        self.bytes += id_len + 1 + _ENTRY_OVERHEAD
        self._prune()

    def forget(self, tool_id: str) -> None:
        if tool_id in self._entries:
            self._remove(tool_id)

    def items_for_text(self, text: str) -> list[tuple[str, str]]:
        """The (id, dsml) pairs a KV file's trailer persists for `text` (kvcache.md §2.4): scan
        the text block by block (find_next_dsml_tool_block); for each block whose exact bytes
        are remembered (each distinct block once), every id mapped to it, most recently
        inserted first. Blocks come in text order. No touch."""
        out: list[tuple[str, str]] = []
        seen: set[str] = set()
        pos = 0
        while True:
            s, e = find_next_dsml_tool_block(text, pos)
            if s < 0:
                return out
            block = text[s:e]
            blk = self._blocks.get(block)
            if blk is not None and block not in seen:
                seen.add(block)
                for tid, _ in sorted(blk[1].items(), key=lambda kv: -kv[1]):
                    out.append((tid, block))
            pos = e

    # -- internals
    def _touch(self, tool_id: str, entry: list) -> None:
        self._entries.move_to_end(tool_id)

    def _remove(self, tool_id: str) -> None:
        dsml, _, _ = self._entries.pop(tool_id)
        self.bytes -= len(tool_id.encode("utf-8")) + 1 + _ENTRY_OVERHEAD
        blk = self._blocks[dsml]
        blk[0] -= 1
        blk[1].pop(tool_id, None)
        if blk[0] <= 0:
            del self._blocks[dsml]
            self.bytes -= blk[2]

    def _prune(self) -> None:
        while self._entries and (len(self._entries) > self.max_ids or self.bytes > self.max_bytes):
            self._remove(next(iter(self._entries)))
