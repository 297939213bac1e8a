#!/usr/bin/env python3
"""Size limits of the project's Python code (DEVELOPERS.md): no file outside tests/ over 700 lines,
no function or method over 80 lines. A file or function that was over when the limit came in is
named in ALLOWED (with its size then) and may not grow; anything new over the limit fails.

    python scripts/check_sizes.py          # prints each offence, exit 1 if any
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ds4agent", "engine", "prompts", "sessions", "tools", "scripts")
FILE_MAX = 700
FUNC_MAX = 80

# offenders allowed at their size: "path" for a file, "path::qualified.name" for a function ->
# lines then. None today; an entry may only shrink or go, never grow.
ALLOWED: dict[str, int] = {}


def python_files(root: Path = ROOT) -> list[Path]:
    files = []
    for pkg in PACKAGES:
        files += [p for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts]
    files += [p for p in root.glob("*.py")]
    return sorted(files)


def _functions(tree: ast.AST):
    """(qualified name, node) of every function and method, nested ones included."""
    stack = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                stack.append((name + ".", child))
            else:
                stack.append((prefix, child))


def sizes(path: Path, root: Path = ROOT) -> dict[str, int]:
    """{key: lines} of the file and of each of its functions (decorators and docstring included)."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root).as_posix()
    out = {rel: len(text.splitlines())}
    for name, node in _functions(ast.parse(text, filename=rel)):
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        out[f"{rel}::{name}"] = node.end_lineno - start + 1
    return out


def offences(root: Path = ROOT, allowed: dict[str, int] = ALLOWED) -> list[str]:
    found = []
    for path in python_files(root):
        for key, n in sizes(path, root).items():
            limit = FUNC_MAX if "::" in key else FILE_MAX
            if n <= limit:
                continue
            was = allowed.get(key)
            if was is None:
                found.append(f"{key}: {n} lines (limit {limit})")
            elif n > was:
                found.append(f"{key}: {n} lines, grew from {was} (limit {limit}; split it instead)")
    return found


def stale(root: Path = ROOT, allowed: dict[str, int] = ALLOWED) -> list[str]:
    """Allow-list entries that are now within the limit or gone: drop them, so the list only shrinks."""
    now = {}
    for path in python_files(root):
        now.update(sizes(path, root))
    out = []
    for key in sorted(allowed):
        limit = FUNC_MAX if "::" in key else FILE_MAX
        if now.get(key, 0) <= limit:
            out.append(f"{key}: now {now.get(key, 'gone')}, within the limit {limit}: drop it from ALLOWED")
    return out


def main() -> int:
    found = offences() + stale()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
