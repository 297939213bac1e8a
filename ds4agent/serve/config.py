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
# live KV slots (--slots): at most this many, whatever the memory. Each slot is one more thread
# asking the engine for forward passes; a batched decode step over B slots reads the weights once
# but runs B attentions and B expert sets, so past ~8 the step is no longer weight-bound and every
# stream slows (issue 23's bar: each of 4 streams <= 1.5x slower than alone). Agent clients rarely
# have more than a handful of conversations alive at once (main, title, a few subagents).
MAX_SLOTS = 8
KEEPALIVE_S = 5.0                            # SSE comment while the prompt is prefilled
# the server runtime's limits (docs/serve.md, "Limits, timeouts, shutdown" says why each value)
MAX_QUEUE = 16                               # requests waiting behind the running one
MAX_CONNECTIONS = 1024                       # open client sockets (also kept below RLIMIT_NOFILE)
HEADER_TIMEOUT_S = 10.0                      # a request line + headers, from its first byte
BODY_TIMEOUT_S = 30.0                        # a request body, plus 1 s per BODY_MIN_RATE bytes
BODY_MIN_RATE = 64 * 1024                    # bytes a second a long body must keep up
IDLE_TIMEOUT_S = 5                           # keep-alive: an idle connection between requests
WRITE_TIMEOUT_S = 60.0                       # a client that reads nothing of its answer


def _env_slots() -> int:
    import os
    try:
        return max(1, min(MAX_SLOTS, int(os.environ.get("DS4_SERVE_SLOTS", "1"))))
    except ValueError:
        return 1


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
    # live KV timelines (--slots; the CLI sizes its default from memory, sizing.py). The
    # DS4_SERVE_SLOTS test hook sets it for configs built in tests (runs the serve suites at N)
    slots: int = field(default_factory=lambda: _env_slots())
    # test hooks: replies forced instead of sampled (the engine still evaluates every token)
    forced_tool_calls: dict = field(default_factory=dict)   # tool name -> arguments
