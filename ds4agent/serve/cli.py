"""`ds4-agent --serve ...`: flags -> ServeConfig, open the model, run uvicorn until SIGINT/SIGTERM,
then drain the queue and save the live session to the disk cache (the shutdown moment)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .config import (BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_CONNECTIONS, MAX_QUEUE, MAX_SLOTS, ServeConfig)


def add_flags(p: argparse.ArgumentParser):
    g = p.add_argument_group("HTTP shim (--serve)")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port")
    g.add_argument("--kv-disk-dir", help="folder for the disk prefix cache (off without it)")
    g.add_argument("--kv-disk-space-mb", type=float, default=4096, metavar="MB",
                   help="disk budget of the --kv-disk-dir folder; the lowest-scoring files go first")
    g.add_argument("--kv-cache-min-tokens", type=int, default=512, metavar="N",
                   help="checkpoints shorter than this are neither saved nor loaded")
    g.add_argument("--kv-cache-cold-max-tokens", type=int, default=30000, metavar="N",
                   help="save prompts with no reuse only up to this length (0: never)")
    g.add_argument("--kv-cache-continued-interval-tokens", type=int, default=10000, metavar="N",
                   help="save the live timeline every N tokens as it grows (0: off)")
    g.add_argument("--kv-cache-boundary-trim-tokens", type=int, default=32, metavar="N",
                   help="a cold save without a chat anchor leaves this many tail tokens out")
    g.add_argument("--kv-cache-boundary-align-tokens", type=int, default=2048, metavar="N",
                   help="save points are rounded down to multiples of N (0: no rounding)")
    g.add_argument("--kv-cache-reject-different-quant", action="store_true",
                   help="load only checkpoints written by a model with the same expert quantisation")
    g.add_argument("--cors", action="store_true", help="answer browsers (Access-Control-Allow-Origin: *)")
    g.add_argument("--api-key", help="require this key (Authorization: Bearer KEY or x-api-key: KEY)")
    g.add_argument("--tool-memory-max-ids", type=int, default=100_000, metavar="N",
                   help="tool ids whose sampled DSML is kept for exact replay (least recently used go first)")
    g.add_argument("--disable-exact-dsml-tool-replay", action="store_true",
                   help="render earlier tool calls canonically instead of replaying the sampled bytes")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help="cap on the tokens one turn generates: per request with --serve (whatever the client "
                        "asks), per user turn in the agent and -p (also `max_tokens` in the config)")
    g.add_argument("--slots", type=int, metavar="N",
                   help=f"live KV timelines kept at once, each its own conversation (default: as many as "
                        f"fit half the free memory at --ctx, 1-{MAX_SLOTS})")
    g.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                   help=f"requests that may wait behind the running one; more get 503 (default {MAX_QUEUE})")
    g.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help=f"open client connections, kept below the open-files limit (default {MAX_CONNECTIONS})")
    g.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                   help=f"seconds for a request line and headers to arrive (default {HEADER_TIMEOUT_S:g})")
    g.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help=f"seconds for a request body, plus 1 s per 64 KiB (default {BODY_TIMEOUT_S:g})")
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
    if a.port is not None and a.port > 65535:
        raise ValueError("--port must be at most 65535")
    if a.api_key is not None and not a.api_key.strip():
        # an empty key would serve with no authentication while the command line asked for one
        raise ValueError("--api-key is empty or blank: give a key, or leave the flag out to serve "
                         "without one")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if a.tool_memory_max_ids < 1:
        raise ValueError("--tool-memory-max-ids must be at least 1")
    if a.slots is not None and not 1 <= a.slots <= MAX_SLOTS:
        raise ValueError(f"--slots must be between 1 and {MAX_SLOTS}")
    if a.max_queue < 0:
        raise ValueError("--max-queue must not be negative")
    if a.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    for flag, v in (("--header-timeout", a.header_timeout), ("--body-timeout", a.body_timeout)):
        if not 0 < v < float("inf"):
            raise ValueError(f"{flag} must be a positive number of seconds")
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
        max_queue=a.max_queue, max_connections=a.max_connections, header_timeout_s=a.header_timeout,
        body_timeout_s=a.body_timeout, forced_tool_calls=forced, slots=a.slots or 1)


def serve_main(a, model: str, ctx: int, options) -> int:
    """`options`: the EngineOptions of the command line (ds4agent.cli builds them)."""
    from .server import BindError, bind_sockets
    try:
        cfg = config_from(a, ctx)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        # bound before the model opens: a busy port is one line at once, never after a banner
        socks = bind_sockets(cfg.host, cfg.port)
    except BindError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        return _serve(a, model, ctx, options, cfg, socks)
    finally:
        for s in socks:
            s.close()


def _serve(a, model: str, ctx: int, options, cfg: ServeConfig, socks) -> int:
    from engine import Engine, ModelFileError

    from .app import create_app
    from .server import BindError, listen, make_server, quiet_signals
    from .shim import Shim
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        engine = Engine.open(model, options, mtp=getattr(a, "mtp", None))
        # (the drafts a step of slot.py's speculator: 0 without an MTP file)
        engine.mtp_draft = (getattr(a, "mtp_draft", 0) or 0) if getattr(engine, "mtp", None) else 0
    except (ModelFileError, ValueError) as e:    # ValueError: a backend that cannot serve here
        print(f"error: {e}", file=sys.stderr)
        return 1
    from .sizing import default_slots, slot_kv_bytes
    if a.slots is None:
        cfg.slots = default_slots(engine, ctx)
    print(f"slots: {cfg.slots} ({slot_kv_bytes(engine, ctx) / 2**20:.0f} MiB of KV each at ctx {ctx})",
          file=sys.stderr, flush=True)
    try:
        shim = Shim(engine, cfg)
        listen(socks)
    except (OSError, ValueError, BindError) as e:
        print(f"error: {e}", file=sys.stderr)
        engine.close()
        return 1
    shim.start()
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{host}:{socks[0].getsockname()[1]}"      # --port 0: the port the system chose
    print(f"ds4-agent: serving {model} (context {ctx}) on {url}\n"
          f"  OpenAI:    {url}/v1  (chat/completions, completions, responses)\n"
          f"  Anthropic: {url}      (messages)", file=sys.stderr, flush=True)
    server = make_server(create_app(shim), cfg)
    rc = 0
    try:
        # SIGINT and SIGTERM alike end this call (a second one skips the wait for open requests)
        server.run(sockets=socks)
    except (OSError, SystemExit) as e:
        print(f"error: serving on {url} failed: {e}", file=sys.stderr)
        rc = 1
    if server.signals:
        print("ds4-agent: stopping: saving the live sessions", file=sys.stderr, flush=True)
    with quiet_signals("ds4-agent: still saving the live sessions; stopping when done"):
        shim.stop()
    engine.close()          # a device backend's weights go now, not in the interpreter's teardown
    return rc
