"""Sessions on disk: ds4's KV file format, the agent's named-session store, the shim's prefix cache.

Layering: sessions/ uses engine/ (Session.snapshot/restore) and nothing above it.
"""
from .kvfile import (FLAG_RESPONSES_KEY, FLAG_THINKING_KEY, FLAG_TOOL_MAP, KVFileError, KVFileInfo,
                     KVHeader, read_header, read_info, read_kv, replace_tool_map, sha1_name, touch,
                     write_kv)

__all__ = ["FLAG_RESPONSES_KEY", "FLAG_THINKING_KEY", "FLAG_TOOL_MAP", "KVFileError", "KVFileInfo",
           "KVHeader", "read_header", "read_info", "read_kv", "replace_tool_map", "sha1_name", "touch",
           "write_kv"]
