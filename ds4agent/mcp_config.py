"""MCP server configuration: which servers to start, how, and which of their tools run unasked.

Two files in Claude Code's shape, `{"mcpServers": {NAME: {"command", "args", "env"}}}`: the user's
`~/.ds4-agent/mcp.json` (agent_home(), so $DS4_AGENT_HOME moves it) and the project's `.mcp.json`;
a project entry replaces the user's entry of the same name. Extra keys, all optional:
  "allow": ["mcp__srv__tool", "mcp__srv__*"]  (top level) tools that run without asking
  "alwaysAllow": ["tool", "*"]                 (per server) the same, by the server's tool names
  "timeout": 120                               (per server) seconds one call may take
  "cwd": "path"                                (per server) where it runs (default: the project)
`${VAR}` and `${VAR:-default}` expand in command, args, env and cwd, as in Claude Code.

A project's `.mcp.json` comes with the repository, so it may name any program: its servers start
only once the user trusted them (`/mcp trust`), recorded per project in
`~/.ds4-agent/mcp-trust.json` with a hash of the entry, so an entry the repository later changes
must be trusted again. The user's own file is trusted as it is.

A file that cannot be used is one warning line naming the file and the problem, never a
traceback; a bad entry is one line and the others still load.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from tools.safefs import read_regular

from .home import agent_home

PROJECT_FILE = ".mcp.json"
HOME_FILE = "mcp.json"
TRUST_FILE = "mcp-trust.json"
DEFAULT_CALL_TIMEOUT = 120.0
MAX_FILE = 1 << 20          # a config file larger than this is not read
MAX_HASHED = 64 << 20       # bytes of a server's program file hashed for its trust
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass
class ServerConfig:
    name: str
    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    always_allow: list[str] = field(default_factory=list)
    timeout: float = DEFAULT_CALL_TIMEOUT
    source: str = ""              # the file it came from (for /mcp and the warnings)
    project: bool = False         # from the project's .mcp.json (needs the user's trust)
    digest: str = ""              # hash of the raw entry: what the trust is given to


@dataclass
class McpConfig:
    servers: dict[str, ServerConfig] = field(default_factory=dict)
    allow: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    untrusted: dict[str, ServerConfig] = field(default_factory=dict)   # project servers not (yet) trusted


def _expand(value: str, where: str) -> str:
    def sub(m):
        v = os.environ.get(m.group(1))
        if v is None:
            if m.group(2) is None:
                raise ValueError(f"{where}: ${{{m.group(1)}}} is not set (write ${{{m.group(1)}:-default}})")
            return m.group(2)
        return v
    return _VAR.sub(sub, value)


def _strings(v, what: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{what} must be a list of strings")
    return list(v)


def _server(name: str, raw, source: str, project_dir: Path) -> ServerConfig:
    """One mcpServers entry, checked and expanded. ValueError names the problem in one line."""
    if not isinstance(raw, dict):
        raise ValueError("must be an object with a command")
    kind = raw.get("type", "stdio")
    if kind != "stdio":
        raise ValueError(f"type {kind!r} is not supported (stdio servers only)")
    cmd = raw.get("command")
    if not isinstance(cmd, str) or not cmd.strip():
        raise ValueError("command must be a non-empty string")
    env = raw.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must be an object of strings")
    timeout = raw.get("timeout", DEFAULT_CALL_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    cwd = raw.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError("cwd must be a string")
    cwd = _expand(cwd, "cwd") if cwd else None
    return ServerConfig(
        name=name, command=_expand(cmd, "command"),
        args=[_expand(a, "args") for a in _strings(raw.get("args", []), "args")],
        env={k: _expand(v, f"env {k}") for k, v in env.items()},
        cwd=str((project_dir / os.path.expanduser(cwd)).resolve()) if cwd else str(project_dir),
        always_allow=_strings(raw.get("alwaysAllow", []), "alwaysAllow"),
        timeout=float(timeout), source=source, digest=entry_digest(raw))


def entry_digest(raw, files: dict[str, str] | None = None) -> str:
    """What the trust is given to: the entry, and the program files of the project it runs
    (so a changed ./srv.sh needs new trust; an entry naming no project file hashes as before)."""
    text = json.dumps(raw, sort_keys=True, ensure_ascii=False)
    if files:
        text += json.dumps(files, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def program_files(s: ServerConfig, project_dir: Path) -> dict[str, str]:
    """{path: sha256} of the files inside the project that the entry runs: its command when it
    is a path (`./srv.sh`), and any argument that names a file there (`python srv.py`)."""
    out = {}
    names = ([s.command] if "/" in s.command else []) + [a for a in s.args if a and not a.startswith("-")]
    for n in names:
        p = Path(os.path.realpath(Path(s.cwd or project_dir) / os.path.expanduser(n)))
        if p == project_dir or project_dir not in p.parents:
            continue
        out[str(p)] = _file_sha(p)
    return {k: v for k, v in out.items() if v is not None}


def _file_sha(p: Path) -> str | None:
    """sha256 of a regular file (None: none there); a FIFO or device is named as such, unread."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None if stat.S_ISDIR(st.st_mode) else f"not a regular file ({st.st_mode:o})"
        h, left = hashlib.sha256(), MAX_HASHED
        while left > 0 and (block := os.read(fd, min(left, 1 << 20))):
            h.update(block)
            left -= len(block)
        # past MAX_HASHED (a model file given as an argument), its size and time stand for the rest
        return h.hexdigest() if st.st_size <= MAX_HASHED else f"{h.hexdigest()}:{st.st_size}:{st.st_mtime_ns}"
    finally:
        os.close(fd)


def read_file(path: Path, project_dir: Path, cfg: McpConfig, *, project: bool) -> None:
    """Add one file's servers and allow rules to cfg (a missing file adds nothing)."""
    try:
        # a project's file may be a symlink to /dev/zero or a FIFO: regular, small, not followed
        text = read_regular(path, MAX_FILE, nofollow=project).decode("utf-8")
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as e:
        cfg.warnings.append(f"mcp: ignoring {path}: {getattr(e, 'strerror', None) or e}")
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        cfg.warnings.append(f"mcp: ignoring {path}: not JSON (line {e.lineno} column {e.colno}: {e.msg})")
        return
    servers = data.get("mcpServers", {}) if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        cfg.warnings.append(f"mcp: ignoring {path}: expected {{\"mcpServers\": {{NAME: {{\"command\": ...}}}}}}")
        return
    allow = data.get("allow", [])
    if isinstance(allow, list) and all(isinstance(a, str) for a in allow):
        cfg.allow.extend(allow)
    else:
        cfg.warnings.append(f"mcp: {path}: allow must be a list of tool names or patterns (ignored)")
    for name, raw in servers.items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            cfg.warnings.append(f"mcp: {path}: server name {name!r} must be 1-64 letters, digits, '_', '-' or '.' (skipped)")
            continue
        try:
            s = _server(name, raw, str(path), project_dir)
        except ValueError as e:
            cfg.warnings.append(f"mcp: {path}: server {name}: {e} (skipped)")
            continue
        s.project = project
        if project:     # the trust covers the project's program files too
            s.digest = entry_digest(raw, program_files(s, project_dir))
        cfg.servers[name] = s          # the project's entry replaces the user's of the same name
        cfg.untrusted.pop(name, None)


def load(project_dir, home: Path | None = None) -> McpConfig:
    """The servers to start for this project: the user's file, then the project's over it; project
    servers the user has not trusted move to `untrusted`."""
    project_dir = Path(project_dir).resolve()
    home = home or agent_home()
    cfg = McpConfig()
    read_file(home / HOME_FILE, project_dir, cfg, project=False)
    read_file(project_dir / PROJECT_FILE, project_dir, cfg, project=True)
    trusted = _trust_table(home, cfg).get(str(project_dir), {})
    for name, s in list(cfg.servers.items()):
        if s.project and trusted.get(name) != s.digest:
            cfg.untrusted[name] = cfg.servers.pop(name)
    return cfg


def _trust_table(home: Path, cfg: McpConfig | None = None) -> dict:
    p = home / TRUST_FILE
    try:
        data = json.loads(read_regular(p, MAX_FILE, nofollow=False).decode("utf-8"))
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError("expected {project: {server: digest}}")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:     # JSONDecodeError is a ValueError
        if cfg is not None:
            cfg.warnings.append(f"mcp: ignoring {p}: {e}")
        return {}


def trust(project_dir, servers: list[ServerConfig], home: Path | None = None) -> None:
    """Record that the user trusts these project servers as they are now written (temp + rename,
    so a crash leaves the old table)."""
    home = home or agent_home()
    table = _trust_table(home)
    entry = table.setdefault(str(Path(project_dir).resolve()), {})
    for s in servers:
        entry[s.name] = s.digest
    from engine.atomic import atomic_write       # a fresh temp name (O_EXCL), never a planted link
    home.mkdir(parents=True, exist_ok=True)
    atomic_write(home / TRUST_FILE, [(json.dumps(table, indent=2, sort_keys=True) + "\n").encode("utf-8")])
