"""What every tool shares: the call context, the result, the registry and argument checking.

A tool is a plain function with a JSON schema. It returns text for the model (never raises for a
user or model mistake: bad arguments, a missing file, a path outside the project all become an
error result), plus optional extras for the UI (a diff, an exit status). It knows nothing of the UI;
approval is asked by the caller before `run` for tools marked `needs_approval`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MAX_RESULT_CHARS = 24_000   # what one result may put in the context; longer output is cut and marked


class ToolError(Exception):
    """A problem the model should read about (bad argument, file not found, path refused)."""


@dataclass
class ToolContext:
    root: Path                        # the project directory; paths resolve inside it
    allow_outside: bool = False       # the user allowed paths outside the project
    state: dict = field(default_factory=dict)   # per-session tool state (file views, bash jobs)
    scratch: Path | None = None       # where full outputs are kept (bash logs)
    should_stop: Callable[[], bool] | None = None   # the user interrupted: a tool's waits end early

    def resolve(self, path: str, *, must_exist: bool = False) -> Path:
        """A path argument as an absolute path inside the project (symlinks resolved)."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path must be a non-empty string")
        p = Path(path).expanduser()
        if not p.is_absolute():
            p = self.root / p
        real = Path(os.path.realpath(p))
        root = Path(os.path.realpath(self.root))
        if not self.allow_outside and real != root and root not in real.parents:
            raise ToolError(f"{path}: outside the project directory {root} (refused)")
        if must_exist and not real.exists():
            raise ToolError(f"{path}: no such file or directory")
        return real

    def rel(self, p: Path) -> str:
        try:
            return str(Path(p).relative_to(os.path.realpath(self.root)))
        except ValueError:
            return str(p)


@dataclass
class ToolResult:
    text: str                          # what the model reads
    ok: bool = True
    diff: str | None = None            # unified diff of a file change (UI shows it coloured)
    exit_status: int | None = None     # bash
    truncated: bool = False

    @classmethod
    def error(cls, msg: str) -> "ToolResult":
        return cls(f"error: {msg}", ok=False)


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict                   # JSON schema of the arguments object
    run: Callable[[dict, ToolContext], ToolResult]
    needs_approval: bool = False

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def schema_json(self) -> str:
        return json.dumps(self.schema(), ensure_ascii=False, separators=(",", ":"))


REGISTRY: dict[str, Tool] = {}


def register(tool: Tool) -> Tool:
    REGISTRY[tool.name] = tool
    return tool


def truncate(text: str, limit: int = MAX_RESULT_CHARS, *, where: str = "") -> tuple[str, bool]:
    """Head and tail of a long text with an explicit marker of what was cut (cuts fall on line
    boundaries when there are any nearby)."""
    if len(text) <= limit:
        return text, False
    h, t = limit * 2 // 3, limit // 3
    nl = text.rfind("\n", h // 2, h)
    head = text[: nl + 1] if nl >= 0 else text[:h]
    nl = text.find("\n", len(text) - t, len(text) - t // 2)
    tail = text[nl + 1:] if nl >= 0 else text[-t:]
    cut = text[len(head): len(text) - len(tail)]
    note = (f"[... truncated: {len(cut)} characters ({cut.count(chr(10))} lines) cut"
            f"{'; ' + where if where else ''} ...]\n")
    if not head.endswith("\n"):
        note = "\n" + note
    return head + note + tail, True


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def check_args(tool: Tool, args: Any) -> dict:
    """Arguments against the tool's schema (required keys, types of the declared properties)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolError(f"arguments are not valid JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    props = tool.parameters.get("properties", {})
    required = tool.parameters.get("required", [])
    # An optional argument sent as null means "not given" (some clients send every key).
    args = {k: v for k, v in args.items() if v is not None or k in required}
    for k in required:
        if k not in args:
            raise ToolError(f"missing required argument '{k}'")
    unknown = [k for k in args if k not in props]
    if unknown:
        raise ToolError(f"unknown argument '{unknown[0]}' (expected: {', '.join(props)})")
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
             "array": list, "object": dict}
    for k, v in args.items():
        want = props[k].get("type")
        py = types.get(want) if isinstance(want, str) else None
        if py is None:
            continue
        if want in ("integer", "number") and isinstance(v, bool):
            raise ToolError(f"argument '{k}' must be {want}, got boolean")
        if want == "integer" and isinstance(v, float) and v.is_integer():
            args[k] = v = int(v)
        if not isinstance(v, py):
            raise ToolError(f"argument '{k}' must be {want}, got {_json_type(v)} {json.dumps(v, default=str)[:40]}")
        if "enum" in props[k] and v not in props[k]["enum"]:
            raise ToolError(f"argument '{k}' must be one of {props[k]['enum']}")
        if want in ("integer", "number"):
            lo, hi = props[k].get("minimum"), props[k].get("maximum")
            if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
                rng = f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"
                raise ToolError(f"argument '{k}' must be in {rng}, got {v}")
        if want == "array" and props[k].get("items", {}).get("type") == "string":
            if not all(isinstance(x, str) for x in v):
                raise ToolError(f"argument '{k}' must be an array of strings")
    return args


def call(name: str, args: Any, ctx: ToolContext) -> ToolResult:
    """Run a tool by name. Every failure the model can cause becomes an error result."""
    tool = REGISTRY.get(name)
    if tool is None:
        return ToolResult.error(f"unknown tool '{name}' (available: {', '.join(sorted(REGISTRY))})")
    try:
        return tool.run(check_args(tool, args), ctx)
    except ToolError as e:
        return ToolResult.error(str(e))
    except OSError as e:
        return ToolResult.error(f"{e.filename or name}: {e.strerror or e}")
    except Exception as e:  # a bug in a tool must not take the agent loop down
        return ToolResult.error(f"{name} failed: {type(e).__name__}: {e}")
