"""Helpers the file tools share: text decoding that round-trips any bytes, line splitting that keeps
terminators, atomic writes, unified diffs, and the list of a project's files (.gitignore honoured).
"""
from __future__ import annotations

import difflib
import fnmatch
import os
import re
import stat
from pathlib import Path

from . import gitsafe
from .base import ToolContext, ToolError
from .safefs import read_inside, write_inside

MAX_FILE_BYTES = 16 * 1024 * 1024   # read/edit/search load at most this much of one file
SNIFF_BYTES = 8192                  # a NUL byte in the first 8 KiB marks a file as binary
MAX_FILES = 100_000                 # a walk stops after this many files
# Never descended into by search/outline/list (also when not in .gitignore): caches, environments.
SKIP_DIRS = {".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".tox",
             ".mypy_cache", ".pytest_cache", ".ruff_cache", ".cache", ".eggs"}

_UMASK = os.umask(0)
os.umask(_UMASK)

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\n|\r)|[^\r\n]+\Z")


def is_binary(data: bytes) -> bool:
    return b"\0" in data[:SNIFF_BYTES]


def decode(data: bytes) -> tuple[str, bool]:
    """Text of a file and whether it was valid UTF-8. Invalid bytes become surrogate escapes, so
    encode() gives the very same bytes back (an edit never damages what it did not touch)."""
    try:
        return data.decode("utf-8"), True
    except UnicodeDecodeError:
        return data.decode("utf-8", "surrogateescape"), False


def encode(text: str) -> bytes:
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise ToolError(f"text cannot be written as UTF-8 ({e.reason} at character {e.start})") from None


def printable(s: str) -> str:
    """The text as the model may see it: undecodable bytes shown as U+FFFD."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def split_lines(text: str) -> list[str]:
    """Lines with their terminators (LF, CRLF or a lone CR; never the other characters that
    str.splitlines treats as line breaks)."""
    return _LINE.findall(text)


def strip_eol(line: str) -> str:
    return line.rstrip("\r\n") if line.endswith(("\n", "\r")) else line


def line_ending(text: str) -> str:
    crlf = text.count("\r\n")
    return "\r\n" if crlf and crlf * 2 >= text.count("\n") else "\n"


def to_ending(s: str, eol: str) -> str:
    """Bare LFs of model-written text as the file's own line ending."""
    if eol == "\n":
        return s
    return re.sub(r"\r?\n", eol, s)


def load_text(ctx: ToolContext, path: Path) -> tuple[bytes, str, bool]:
    """A text file's bytes, text and whether it is valid UTF-8; a clear error for anything else.
    Read through a descriptor checked to be inside the project (safefs: a symlink swapped in
    after the path was checked cannot lead outside)."""
    rel = ctx.rel(path)
    try:
        st, data = read_inside(ctx, path, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise ToolError(f"{rel}: no such file") from None
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{rel} is a directory (use list)")
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{rel} is not a regular file")
    if data is None:
        raise ToolError(f"{rel} is too large ({st.st_size} bytes; the limit is {MAX_FILE_BYTES})")
    if is_binary(data):
        raise ToolError(f"{rel} is a binary file ({st.st_size} bytes); only text files are supported")
    text, utf8 = decode(data)
    return data, text, utf8


def atomic_write(ctx: ToolContext, path: Path, data: bytes) -> None:
    """Write to a temporary file beside the target, then rename: a crash never leaves half a file.
    The file keeps its permission bits; a new one gets the usual 0666 & ~umask. Missing folders
    are made; all of it relative to a folder descriptor checked to be inside the project."""
    write_inside(ctx, path, data, 0o666 & ~_UMASK)


def unified_diff(old: str | None, new: str, rel: str) -> str:
    a = split_lines(printable(old)) if old is not None else []
    b = split_lines(printable(new))
    fix = lambda ls: [l if l.endswith(("\n", "\r")) else l + "\n\\ No newline at end of file\n" for l in ls]
    lines = difflib.unified_diff(fix(a), fix(b), "/dev/null" if old is None else f"a/{rel}", f"b/{rel}")
    return "".join(lines)


def human_size(n: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def inside(ctx: ToolContext, real: Path) -> bool:
    root = Path(os.path.realpath(ctx.root))
    return ctx.allow_outside or real == root or root in real.parents


def expand_braces(pattern: str) -> list[str]:
    """`*.{ts,tsx}` -> [`*.ts`, `*.tsx`] (one level, what models write)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if not m:
        return [pattern]
    out = []
    for alt in m.group(1).split(","):
        out += expand_braces(pattern[:m.start()] + alt + pattern[m.end():])
    return out


def glob_matcher(glob: str | None):
    """A predicate on a path relative to the search base: a pattern without `/` matches the file
    name at any depth; with `/` it matches the relative path (`**/` may match no folder)."""
    if not glob:
        return lambda rel: True
    pats = [p.strip() for g in glob.split() for p in expand_braces(g) if p.strip()]

    def match(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        for p in pats:
            if "/" not in p:
                if fnmatch.fnmatchcase(name, p):
                    return True
            else:
                p = p[2:] if p.startswith("./") else p
                if fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(rel, p.replace("**/", "")):
                    return True
        return False
    return match


def _git_files(base: Path) -> list[str] | None:
    return gitsafe.ls_files(base, "--cached", "--others", "--exclude-standard")


def project_files(ctx: ToolContext, base: Path) -> tuple[list[Path], bool]:
    """Files under `base` in path order: in a git work tree those git does not ignore, otherwise a
    walk; never inside SKIP_DIRS below base; symlinks only when they resolve inside the project.
    Returns (files, hit_limit)."""
    if base.is_file():
        return [base], False
    rels = _git_files(base)
    if not rels:          # not a repository, or a folder git ignores that was asked for by name
        rels = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            here = os.path.relpath(dirpath, base)
            for f in filenames:
                rels.append(f if here == "." else f"{here}/{f}")
            if len(rels) > MAX_FILES:
                break
    out: list[Path] = []
    for rel in sorted(set(rels)):
        parts = rel.split("/")
        if any(p in SKIP_DIRS for p in parts[:-1]):
            continue
        p = base / rel
        if p.is_symlink():
            real = Path(os.path.realpath(p))
            if not inside(ctx, real):
                continue
        if not p.is_file():
            continue
        out.append(p)
        if len(out) >= MAX_FILES:
            return out, True
    return out, False
