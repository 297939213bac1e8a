"""MCP tools: stdio servers started with the official `mcp` SDK, their tools offered to the model.

The SDK is asyncio; the agent runs on its engine worker thread and calls synchronously. So every
server's client session lives on ONE background event-loop thread ("ds4-mcp"), each in a task
that owns its `stdio_client` and `ClientSession` contexts from start to stop (anyio wants a scope
left by the task that entered it); the agent's calls are coroutines sent to that loop with
run_coroutine_threadsafe and waited on with a timeout, polling the user's Esc.

Tools are named `mcp__<server>__<tool>` (Claude Code's names, cut to [A-Za-z0-9_-]), and their
schemas are the servers' inputSchema in the OpenAI function form tools.schemas() gives, after the
built-in tools, by server then tool name, so the system prompt (and its cache file) is the same on
every start. A server that fails to start is one notice and left out. One that dies mid-session:
its calls return "mcp server X is not running" (one notice the first time) and its tools stay in
the system prompt, which is already prefilled (taking them out would re-prefill it all).

The SDK is imported only when a server starts: `--serve` and a project without MCP servers never
load it. Its log records go to agent_home()/logs/mcp.log, each server's stderr to
logs/mcp-<name>.log, never to the terminal the TUI draws on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import fnmatch
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tools
from tools.base import truncate
from tools.joblog import CappedLog, open_fresh
from tools.proctree import MARKER_VAR, kill_marked, marked_env, new_marker

from . import events as E
from .home import agent_home
from .mcp_config import McpConfig, ServerConfig

# seconds a server has to start and list its tools (all start in parallel; one that exits fails at
# once): npx/uvx servers install themselves on a first run, and a trivial Python server took 2.6-6 s
# on a loaded 2-core machine
START_TIMEOUT = 30.0
CLOSE_TIMEOUT = 8.0         # the SDK's shutdown: stdin closed, 2 s, SIGTERM, 2 s, SIGKILL
MAX_DESCRIPTION = 2000      # a tool's description in the system prompt (some servers write essays)
POLL_S = 0.1                # how often a waiting call looks at Esc
LOG_HEAD = 16 << 20         # a server's stderr log keeps its first 16 MiB and its last 1 MiB, as
LOG_TAIL = 1 << 20          # a bash job's log does (one wrote 6.1 GB in 20 s)
MAX_JUNK = 200              # lines on stdout that are not JSON-RPC before the server is stopped


def tool_name(server: str, tool: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"mcp__{server}__{tool}")


@dataclass
class McpTool:
    name: str                  # mcp__server__tool, what the model calls
    server: str
    remote: str                # the server's own name for it
    description: str
    schema: dict               # inputSchema
    read_only: bool = False    # annotations.readOnlyHint: no checkpoint before it (it changes no file)

    def schema_json(self) -> str:
        fn = {"name": self.name, "description": self.description[:MAX_DESCRIPTION], "parameters": self.schema}
        return json.dumps({"type": "function", "function": fn}, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Server:
    cfg: ServerConfig
    status: str = "new"        # new, starting, running, failed, stopped
    error: str = ""
    tools: list[McpTool] = field(default_factory=list)
    session: object = None
    task: object = None
    stop: object = None        # asyncio.Event, made on the loop
    ready: object = None
    log: object = None         # its stderr's CappedLog (None: no log could be made)
    marker: str = ""           # in its environment: finds its whole process tree (tools.proctree)
    junk: int = 0              # lines on its stdout that were not JSON-RPC
    said: bool = False         # its death was told (once)


class McpManager:
    def __init__(self, config: McpConfig, *, log_dir: Path | None = None, start_timeout: float = START_TIMEOUT,
                 project_dir: Path | None = None, home: Path | None = None):
        self.config = config
        self.project_dir, self.home = project_dir, home     # for /mcp trust
        self.servers = {n: Server(c) for n, c in sorted(config.servers.items())}
        self.start_timeout = start_timeout
        self.log_dir = log_dir if log_dir is not None else agent_home() / "logs"
        self._tools: dict[str, McpTool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- life cycle -------------------------------------------------------------------------------
    def start(self, names=None) -> list[str]:
        """Start the servers not started yet (all, or those named), in parallel, each within
        start_timeout. Returns one notice line per server that failed."""
        todo = [s for s in self.servers.values() if s.status == "new" and (names is None or s.cfg.name in names)]
        if not todo:
            return []
        self._ensure_loop()
        fut = asyncio.run_coroutine_threadsafe(self._start_all(todo), self._loop)
        fut.result()             # bounded: _start_all gives each server start_timeout
        lines = []
        for s in todo:
            if s.status == "running":
                self._add_tools(s, lines)
            else:
                log = self.log_dir / f"mcp-{s.cfg.name}.log"
                if s.log is not None:
                    s.log.settle(0.5)
                seen = s.log is not None and (s.log.stored or s.log.dropped) > 0  # it said something: where
                lines.append(f"mcp: server {s.cfg.name} failed to start: {s.error}" + (f" (its stderr: {log})" if seen else ""))
        return lines

    def _add_tools(self, s: Server, lines: list[str]):
        for t in s.tools:
            if t.name in self._tools or t.name in tools.REGISTRY:
                lines.append(f"mcp: server {s.cfg.name}: tool {t.remote} is named {t.name} like another tool (left out)")
                continue
            self._tools[t.name] = t

    def _ensure_loop(self):
        if self._loop is not None:
            return
        self._setup_logging()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ds4-mcp", daemon=True)
        self._thread.start()

    def _setup_logging(self):
        # the SDK logs a dying server's broken pipe at ERROR: Python's last-resort handler would
        # print it over the TUI; it goes to a file (or nowhere) instead
        # (capped: a server writing junk on stdout made the SDK log a traceback per line)
        log = logging.getLogger("mcp")
        log.propagate = False
        if not log.handlers:
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log.addHandler(_CappedHandler(self.log_dir / "mcp.log", LOG_HEAD))
            except OSError:
                log.addHandler(logging.NullHandler())

    def _errlog(self, name: str) -> CappedLog | None:
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            return CappedLog(self.log_dir / f"mcp-{name}.log", LOG_HEAD, LOG_TAIL)
        except OSError:
            return None

    async def _start_all(self, todo: list[Server]):
        for s in todo:
            s.status, s.stop, s.ready = "starting", asyncio.Event(), asyncio.Event()
            s.task = asyncio.get_running_loop().create_task(self._serve(s))
        await asyncio.wait([asyncio.ensure_future(s.ready.wait()) for s in todo], timeout=self.start_timeout)
        late = [s for s in todo if s.status == "starting"]
        for s in late:
            s.status, s.error = "failed", f"no answer within {self.start_timeout:g} s"
            s.task.cancel()
        if late:
            await asyncio.wait([s.task for s in late], timeout=CLOSE_TIMEOUT)

    async def _serve(self, s: Server):
        """One server's whole life, in one task: start, list tools, wait for stop, shut down."""
        s.log = self._errlog(s.cfg.name)
        # stderr goes into the log's pipe; our copy of its write end closes once the server has
        # its own (log.start), so the log ends with the server's last process
        errlog = (os.fdopen(s.log.write_fd, "w", closefd=False) if s.log is not None
                  else open(os.devnull, "w", encoding="utf-8"))
        s.marker = new_marker()
        inherited = {MARKER_VAR: os.environ[MARKER_VAR]} if MARKER_VAR in os.environ else {}
        started = False
        try:
            from mcp import ClientSession, StdioServerParameters, stdio_client
            params = StdioServerParameters(command=s.cfg.command, args=s.cfg.args, cwd=s.cfg.cwd,
                                           env=marked_env({**inherited, **s.cfg.env}, s.marker))
            async with stdio_client(params, errlog=errlog) as (read, write):
                if s.log is not None:
                    s.log.start()
                started = True
                async with ClientSession(read, write, message_handler=self._junk_counter(s)) as session:
                    await session.initialize()
                    s.tools = [_tool(s.cfg.name, t) for t in await _list_tools(session)]
                    s.session, s.status = session, "running"
                    s.ready.set()
                    await s.stop.wait()
        except BaseException as e:   # ExceptionGroups and cancellation included: noted, not raised
            if s.status == "starting":
                s.status, s.error = "failed", _reason(e)
            elif s.status == "running":
                s.status, s.error = "stopped", f"died ({_reason(e)})"
        finally:
            if s.status == "running":
                s.status, s.error = "stopped", s.error or "closed"
            s.session = None
            s.ready.set()
            errlog.close()
            kill_marked(s.marker)      # what left the server's process group (setsid, double forks)
            if s.log is not None and not started:
                s.log.abandon()

    def _junk_counter(self, s: Server):
        """The session's message handler: a server that keeps writing lines that are not
        JSON-RPC on stdout (each one parsed, logged and reported) is stopped past MAX_JUNK."""
        async def handle(message):
            if isinstance(message, Exception):
                s.junk += 1
                if s.junk == MAX_JUNK and s.stop is not None:
                    s.error = f"wrote {MAX_JUNK} lines on stdout that are not JSON-RPC; stopped"
                    s.stop.set()
        return handle

    def close(self):
        """Stop every server (the SDK closes its stdin, then terminates its process tree) and the
        loop thread. Safe to call twice."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        live = [s for s in self.servers.values() if s.task is not None]

        async def stop_all():
            for s in live:
                s.stop.set()
            tasks = [s.task for s in live if not s.task.done()]
            if tasks:
                done, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=2)
        try:
            asyncio.run_coroutine_threadsafe(stop_all(), loop).result(CLOSE_TIMEOUT + 4)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        kill_marked([s.marker for s in live if s.marker])     # a task that could not finish
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        if not loop.is_running():
            loop.close()

    # -- tools ------------------------------------------------------------------------------------
    def owns(self, name: str) -> bool:
        return name in self._tools

    def schemas(self) -> list[str]:
        """The started servers' tools as function schemas: by server, then tool name."""
        return [t.schema_json() for t in sorted(self._tools.values(), key=lambda t: (t.server, t.name))]

    def changes_files(self, name: str) -> bool:
        """Whether a call may change files (a checkpoint goes first): any tool not annotated readOnlyHint."""
        t = self._tools.get(name)
        return t is not None and not t.read_only

    def needs_approval(self, name: str) -> bool:
        t = self._tools[name]
        if any(fnmatch.fnmatchcase(name, p) for p in self.config.allow):
            return False
        allowed = self.servers[t.server].cfg.always_allow
        return not ("*" in allowed or t.remote in allowed or name in allowed)

    def call(self, name: str, args, *, emit=None, should_stop=None) -> tools.ToolResult:
        """Run an MCP tool. Every failure (bad arguments, a dead server, a timeout, Esc) is an
        error result; a server found dead is also one notice through emit."""
        t = self._tools.get(name)
        if t is None:
            return tools.ToolResult.error(f"unknown tool '{name}'")
        s = self.servers[t.server]
        if s.status != "running" or self._loop is None:
            return self._gone(s, emit)
        try:
            args = check_arguments(t.schema, args)
        except tools.ToolError as e:
            return tools.ToolResult.error(str(e))
        session, timeout = s.session, s.cfg.timeout
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(session.call_tool(t.remote, args), timeout), self._loop)
        deadline = time.monotonic() + timeout + 5
        while not fut.done():      # (TimeoutError is both the poll's and wait_for's: done() tells)
            concurrent.futures.wait([fut], timeout=POLL_S)
            stopped = should_stop is not None and should_stop()
            if not fut.done() and (stopped or time.monotonic() > deadline):
                fut.cancel()
                return tools.ToolResult.error(f"{name} was interrupted" if stopped else f"{name} timed out after {timeout:g} s")
        try:
            raw = fut.result()
        except TimeoutError:
            return tools.ToolResult.error(f"{name} timed out after {timeout:g} s (the server is still running)")
        except Exception as e:
            return self._failed(s, name, e, emit)
        return result_of(raw)

    def _failed(self, s: Server, name: str, e: Exception, emit) -> tools.ToolResult:
        """A call raised: a protocol error from a live server, or the server is gone (a ping
        tells which)."""
        if self._alive(s):
            return tools.ToolResult.error(f"{name}: {_reason(e)}")
        if s.status == "running":
            s.status, s.error = "stopped", f"died ({_reason(e)})"
        if s.stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(s.stop.set)   # its task reaps the process
        return self._gone(s, emit)

    def _gone(self, s: Server, emit) -> tools.ToolResult:
        """A call to a server that is not running; the first one after it died also says so in
        the transcript (its own task may have seen the death before any call did)."""
        if not s.said and s.status == "stopped" and self._loop is not None and emit is not None:
            s.said = True
            emit(E.Notice(f"mcp: server {s.cfg.name} {s.error}; its tools return errors now", "warning"))
        return tools.ToolResult.error(f"mcp server {s.cfg.name} is not running")

    def _alive(self, s: Server) -> bool:
        if s.session is None or s.task is None or s.task.done():
            return False
        try:
            asyncio.run_coroutine_threadsafe(asyncio.wait_for(s.session.send_ping(), 2.0), self._loop).result(3.0)
            return True
        except Exception:
            return False

    # -- /mcp -------------------------------------------------------------------------------------
    def trust(self, which: str) -> str:
        """The user trusts a project server (or all): recorded, started now; its tools join the
        system prompt on the next /new (this conversation's prompt is already prefilled)."""
        from . import mcp_config
        pick = sorted(self.config.untrusted) if which == "all" else [which]
        unknown = [n for n in pick if n not in self.config.untrusted]
        if unknown or not pick:
            known = ", ".join(sorted(self.config.untrusted)) or "none"
            return f"no untrusted project server {unknown[0] if unknown else ''} (untrusted: {known})".replace("server  (", "server (")
        chosen = [self.config.untrusted.pop(n) for n in pick]
        try:
            mcp_config.trust(self.project_dir, chosen, self.home)
        except OSError as e:
            self.config.untrusted.update({c.name: c for c in chosen})
            return f"could not record the trust: {e.strerror or e}"
        for c in chosen:
            self.config.servers[c.name] = c
            self.servers[c.name] = Server(c)
        self.servers = dict(sorted(self.servers.items()))
        out = [f"trusted {c.name}: {' '.join([c.command] + c.args)}" for c in chosen]
        out += self.start([c.name for c in chosen])
        out.append("its tools join the system prompt with the next /new (this one is already prefilled)")
        return "\n".join(out)

    def status_text(self) -> str:
        lines = []
        for s in self.servers.values():
            state = {"new": "not started", "starting": "starting"}.get(s.status, s.status)
            why = f": {s.error}" if s.error and s.status in ("failed", "stopped") else ""
            lines.append(f"  {s.cfg.name} ({s.cfg.source}): {state}{why}")
            for t in sorted(s.tools, key=lambda t: t.name):
                if t.name in self._tools:
                    ask = "" if not self.needs_approval(t.name) else " [asks]"
                    lines.append(f"    {t.name}{ask}  {_first_line(t.description)}")
        for name, c in sorted(self.config.untrusted.items()):
            lines.append(f"  {name} ({c.source}): not trusted, not started (/mcp trust {name})")
        return "mcp servers:\n" + "\n".join(lines) if lines else "no MCP servers configured"


# -- helpers ---------------------------------------------------------------------------------------
async def _list_tools(session) -> list[dict]:
    """Every page of tools/list as wire dicts (by_alias: the same keys in SDK 1.x and 2.x)."""
    out, cursor = [], None
    for _ in range(50):
        if cursor is None:
            res = await session.list_tools()
        else:
            from mcp import types
            res = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        d = res.model_dump(by_alias=True, exclude_none=True)
        out.extend(d.get("tools", []))
        cursor = d.get("nextCursor")
        if not cursor:
            break
    return out


def _tool(server: str, d: dict) -> McpTool:
    schema = d.get("inputSchema") if isinstance(d.get("inputSchema"), dict) else {"type": "object", "properties": {}}
    return McpTool(tool_name(server, d.get("name", "")), server, d.get("name", ""),
                   " ".join(str(d.get("description") or d.get("title") or "").split()), schema,
                   read_only=isinstance(d.get("annotations"), dict) and d["annotations"].get("readOnlyHint") is True)


def check_arguments(schema: dict, args) -> dict:
    """Loosely, against the tool's inputSchema: an object, its required keys, the top-level types
    (the server checks the rest); model mistakes become a clear error before the call."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise tools.ToolError(f"arguments are not valid JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise tools.ToolError("arguments must be a JSON object")
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in args]
    if missing:
        raise tools.ToolError(f"missing required argument '{missing[0]}'")
    if schema.get("additionalProperties") is False:
        unknown = [k for k in args if k not in props]
        if unknown:
            raise tools.ToolError(f"unknown argument '{unknown[0]}' (expected: {', '.join(props)})")
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
             "object": dict, "null": type(None)}
    for k, v in args.items():
        want = (props.get(k) or {}).get("type") if isinstance(props.get(k), dict) else None
        wants = [want] if isinstance(want, str) else want if isinstance(want, list) else []
        py = tuple(x for w in wants for x in _as_tuple(types.get(w)))
        if not py:
            continue
        bad_bool = isinstance(v, bool) and bool not in py
        if bad_bool or not isinstance(v, py):
            raise tools.ToolError(f"argument '{k}' must be {' or '.join(wants)}, got {json.dumps(v, default=str)[:40]}")
    return args


def _as_tuple(t):
    return () if t is None else t if isinstance(t, tuple) else (t,)


def result_of(raw) -> tools.ToolResult:
    """A CallToolResult as text for the model: text parts joined, other parts summarized."""
    d = raw.model_dump(by_alias=True, exclude_none=True) if hasattr(raw, "model_dump") else dict(raw)
    parts = []
    for c in d.get("content") or []:
        kind = c.get("type")
        if kind == "text":
            parts.append(c.get("text", ""))
        elif kind in ("image", "audio"):
            size = len(c.get("data", "")) * 3 // 4
            parts.append(f"[{kind}: {size} bytes{', ' + c['mimeType'] if c.get('mimeType') else ''}]")
        elif kind == "resource":
            r = c.get("resource") or {}
            parts.append(r["text"] if "text" in r else f"[resource: {r.get('uri', '?')}]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {c.get('uri', '?')}]")
        else:
            parts.append(f"[{kind} content]")
    if not parts and d.get("structuredContent") is not None:
        parts.append(json.dumps(d["structuredContent"], ensure_ascii=False))
    text, cut = truncate("\n".join(parts))
    if d.get("isError"):
        return tools.ToolResult(f"error: {text}", ok=False, truncated=cut)
    return tools.ToolResult(text, truncated=cut)


def _reason(e: BaseException) -> str:
    """One line for an exception, the first leaf of an ExceptionGroup (anyio wraps them)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, asyncio.CancelledError):
        return "cancelled"
    msg = " ".join(str(e).split())
    if isinstance(e, FileNotFoundError):
        return f"command not found: {e.filename or msg}"
    return (msg or type(e).__name__)[:300]


class _CappedHandler(logging.Handler):
    """The SDK's log records into a file of at most `cap` bytes (then one note, then nothing),
    made fresh without following a symlink at its path."""

    def __init__(self, path: Path, cap: int):
        super().__init__()
        self.fd, self.left = open_fresh(path), cap

    def emit(self, record):
        if self.left <= 0:
            return
        try:
            data = (self.format(record) + "\n").encode("utf-8", "replace")[: self.left]
            self.left -= len(data)
            if self.left <= 0:
                data += b"[... mcp.log capped: later records are not stored]\n"
            os.write(self.fd, data)
        except Exception:       # a log must never fail the call that logs
            self.left = 0


def _first_line(s: str, n: int = 100) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def start_servers(project_dir, emit, *, home: Path | None = None) -> McpManager | None:
    """The CLI's entry: read the config, start the servers, say what failed (one notice each).
    None when no server is configured (the SDK is then never imported)."""
    from . import mcp_config
    cfg = mcp_config.load(project_dir, home)
    for w in cfg.warnings:
        emit(E.Notice(w, "warning"))
    for name, c in sorted(cfg.untrusted.items()):
        emit(E.Notice(f"mcp: {c.source} server {name} not started: a project's servers run once you "
                      f"trust them (/mcp trust {name})", "warning"))
    if not cfg.servers and not cfg.untrusted:
        return None
    mgr = McpManager(cfg, log_dir=(home or agent_home()) / "logs", project_dir=Path(project_dir), home=home)
    for line in mgr.start():
        emit(E.Notice(line, "warning"))
    return mgr


USAGE = "usage: /mcp (servers and tools) | /mcp trust NAME|all (start a project's .mcp.json server)"


def command(mgr: McpManager | None, arg: str) -> str:
    """The /mcp command: the servers and their tools, or `trust` for a project's servers."""
    if mgr is None:
        return ("no MCP servers configured: add them to .mcp.json in the project or to "
                f"{agent_home() / 'mcp.json'} (docs/agent.md, MCP tools)")
    words = arg.split()
    if not words:
        return mgr.status_text()
    if words[0] != "trust" or len(words) != 2:
        return USAGE
    return mgr.trust(words[1])
