"""Sessions on disk: ds4's KV file format, the agent's named-session store, the shim's prefix cache.

Layering: sessions/ uses engine/ (Session.snapshot/restore) and nothing above it.
"""
from .kvfile import (FLAG_RESPONSES_KEY, FLAG_THINKING_KEY, FLAG_TOOL_MAP, KVFileError, KVFileInfo,
                     KVHeader, read_header, read_info, read_kv, replace_tool_map, sha1_name, touch,
                     write_kv)
from .prefix_cache import (HIT_HALF_LIFE_S, CacheEntry, PrefixCache, chat_anchor, cold_store_len,
                           continued_step, eviction_score, should_store_continued, store_len, token_text)
from .store import (AmbiguousSession, SessionInfo, SessionNotFound, SessionStore, SessionStoreError,
                    default_root, title_from_text)

__all__ = [
    "FLAG_RESPONSES_KEY", "FLAG_THINKING_KEY", "FLAG_TOOL_MAP", "HIT_HALF_LIFE_S", "AmbiguousSession",
    "CacheEntry", "KVFileError", "KVFileInfo", "KVHeader", "PrefixCache", "SessionInfo",
    "SessionNotFound", "SessionStore", "SessionStoreError", "chat_anchor", "cold_store_len",
    "continued_step", "default_root", "eviction_score", "read_header", "read_info", "read_kv",
    "replace_tool_map", "sha1_name", "should_store_continued", "store_len", "title_from_text", "touch",
    "token_text", "write_kv",
]
