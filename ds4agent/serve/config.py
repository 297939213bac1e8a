"""The shim's settings (the `ds4-agent --serve` flags), in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL_ID = "deepseek-v4-flash"
# Model ids that only pick the thinking default (protocol.md §4.2); listed by /v1/models too.
MODEL_ALIASES = ("deepseek-chat", "deepseek-reasoner")
MAX_BODY_BYTES = 64 * 1024 * 1024          # ds4 reads at most 64 MiB of request body
KEEPALIVE_S = 5.0                            # SSE comment while the prompt is prefilled


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    ctx: int = 32768
    max_tokens: int | None = None            # per-request cap on generated tokens, whatever asked
    api_key: str | None = None
    cors: bool = False
    trace: str | None = None
    # tool memory (exact DSML replay by tool id)
    exact_replay: bool = True
    tool_memory_max_ids: int = 100_000
    # disk prefix cache (kvcache.md §4-5); off without a folder
    kv_disk_dir: str | None = None
    kv_disk_space_mb: float = 4096
    kv_cache_min_tokens: int = 512
    kv_cache_cold_max_tokens: int = 30000
    kv_cache_continued_interval_tokens: int = 10000
    kv_cache_boundary_trim_tokens: int = 32
    kv_cache_boundary_align_tokens: int = 2048
    kv_cache_reject_different_quant: bool = False
    keepalive_s: float = KEEPALIVE_S
    chunk: int = 2048
    # test hooks: replies forced instead of sampled (the engine still evaluates every token)
    forced_tool_calls: dict = field(default_factory=dict)   # tool name -> arguments
