"""The shim's settings (the `ds4-agent --serve` flags), in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL_ID = "deepseek-v4-flash"
# Model ids that only pick the thinking default (protocol.md §4.2); listed by /v1/models too.
MODEL_ALIASES = ("deepseek-chat", "deepseek-reasoner")
# Text only (ds4's 64 MiB is sized for images, which the shim does not take): a 1M-token context
# of text is ~4 MB of UTF-8, JSON escaping (\uXXXX for non-ASCII, as Python's json writes it)
# and tool schemas can double or triple that. Bigger bodies cannot fit and only cost memory.
MAX_BODY_BYTES = 16 * 1024 * 1024
KEEPALIVE_S = 5.0                            # SSE comment while the prompt is prefilled
# the server runtime's limits (docs/serve.md, "Limits, timeouts, shutdown" says why each value)
MAX_QUEUE = 16                               # requests waiting behind the running one
MAX_CONNECTIONS = 1024                       # open client sockets (also kept below RLIMIT_NOFILE)
HEADER_TIMEOUT_S = 10.0                      # a request line + headers, from its first byte
BODY_TIMEOUT_S = 30.0                        # a request body, plus 1 s per BODY_MIN_RATE bytes
BODY_MIN_RATE = 64 * 1024                    # bytes a second a long body must keep up
IDLE_TIMEOUT_S = 5                           # keep-alive: an idle connection between requests
WRITE_TIMEOUT_S = 60.0                       # a client that reads nothing of its answer


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
    # server runtime limits (serve/server.py)
    max_queue: int = MAX_QUEUE
    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    body_min_rate: int = BODY_MIN_RATE
    idle_timeout_s: int = IDLE_TIMEOUT_S
    write_timeout_s: float = WRITE_TIMEOUT_S
    chunk: int = 2048
    # test hooks: replies forced instead of sampled (the engine still evaluates every token)
    forced_tool_calls: dict = field(default_factory=dict)   # tool name -> arguments
