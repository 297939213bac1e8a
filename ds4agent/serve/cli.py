"""`ds4-agent --serve ...`: flags -> ServeConfig, open the model, run uvicorn until SIGINT/SIGTERM,
then drain the queue and save the live session to the disk cache (the shutdown moment)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .config import ServeConfig


def add_flags(p: argparse.ArgumentParser):
    g = p.add_argument_group("HTTP shim (--serve)")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--kv-disk-dir", help="folder for the disk prefix cache (off without it)")
    g.add_argument("--kv-disk-space-mb", type=float, default=4096)
    g.add_argument("--kv-cache-min-tokens", type=int, default=512)
    g.add_argument("--kv-cache-cold-max-tokens", type=int, default=30000)
    g.add_argument("--kv-cache-continued-interval-tokens", type=int, default=10000)
    g.add_argument("--kv-cache-boundary-trim-tokens", type=int, default=32)
    g.add_argument("--kv-cache-boundary-align-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-reject-different-quant", action="store_true")
    g.add_argument("--cors", action="store_true", help="answer browsers (Access-Control-Allow-Origin: *)")
    g.add_argument("--api-key", help="require this key (Authorization: Bearer KEY or x-api-key: KEY)")
    g.add_argument("--tool-memory-max-ids", type=int, default=100_000)
    g.add_argument("--disable-exact-dsml-tool-replay", action="store_true",
                   help="render earlier tool calls canonically instead of replaying the sampled bytes")
    g.add_argument("--max-tokens", type=int, help="cap on generated tokens per request, whatever the client asks")
    g.add_argument("--trace", help="append one JSON line per request (prompt, reuse, output) to this file")
    # test hook: answer fresh prompts that offer one of these tools with a call of it, e.g.
    # '{"Bash": {"command": "echo pong"}, "exec_command": {"cmd": "echo pong"}}'
    g.add_argument("--test-forced-tool-call", help=argparse.SUPPRESS)


def config_from(a, ctx: int) -> ServeConfig:
    forced = {}
    if a.test_forced_tool_call:
        forced = json.loads(a.test_forced_tool_call)
        if not isinstance(forced, dict):
            raise ValueError("--test-forced-tool-call takes a JSON object: tool name -> arguments")
    for name in ("port", "tool_memory_max_ids", "kv_cache_min_tokens"):
        if getattr(a, name) is not None and getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must not be negative")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if a.tool_memory_max_ids < 1:
        raise ValueError("--tool-memory-max-ids must be at least 1")
    return ServeConfig(
        host=a.host, port=a.port, ctx=ctx, max_tokens=a.max_tokens, api_key=a.api_key, cors=a.cors,
        trace=os.path.expanduser(a.trace) if a.trace else None, exact_replay=not a.disable_exact_dsml_tool_replay,
        tool_memory_max_ids=a.tool_memory_max_ids,
        kv_disk_dir=os.path.expanduser(a.kv_disk_dir) if a.kv_disk_dir else None,
        kv_disk_space_mb=a.kv_disk_space_mb, kv_cache_min_tokens=a.kv_cache_min_tokens,
        kv_cache_cold_max_tokens=a.kv_cache_cold_max_tokens,
        kv_cache_continued_interval_tokens=a.kv_cache_continued_interval_tokens,
        kv_cache_boundary_trim_tokens=a.kv_cache_boundary_trim_tokens,
        kv_cache_boundary_align_tokens=a.kv_cache_boundary_align_tokens,
        kv_cache_reject_different_quant=a.kv_cache_reject_different_quant,
        forced_tool_calls=forced)


def serve_main(a, model: str, ctx: int) -> int:
    import uvicorn

    from engine import Engine, ModelFileError

    from .app import create_app
    from .shim import Shim
    try:
        cfg = config_from(a, ctx)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        engine = Engine.open(model, backend=a.backend, numerics=a.numerics)
    except ModelFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        shim = Shim(engine, cfg)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    shim.start()
    url = f"http://{cfg.host}:{cfg.port}"
    print(f"ds4-agent: serving {model} (context {ctx}) on {url}\n"
          f"  OpenAI:    {url}/v1  (chat/completions, completions, responses)\n"
          f"  Anthropic: {url}      (messages)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(shim), host=cfg.host, port=cfg.port, log_level="warning",
                    lifespan="off", timeout_graceful_shutdown=10)
    except (OSError, SystemExit) as e:
        print(f"error: cannot serve on {url}: {e}", file=sys.stderr)
        shim.stop()
        return 1
    shim.stop()
    return 0
