"""read, write, edit, list: the file tools.

Improvements over ds4's agent (spec/agent.md §3.6-3.11, §10): every cut is marked and the edit
guard only records lines that were shown whole; binary files are detected; write and edit are
atomic, create parent folders, keep permission bits and CRLF line endings; the guard is keyed by
the real path; list is sorted, optionally recursive and says when it stops.
"""
from __future__ import annotations

import bisect
import os
import stat
from pathlib import Path

from . import gitsafe, views
from .base import MAX_RESULT_CHARS, Tool, ToolContext, ToolError, ToolResult, register
from .fileutil import (MAX_FILE_BYTES, SKIP_DIRS, atomic_write, decode, encode, human_size,
                       is_binary, line_ending, load_text, printable, split_lines, strip_eol,
                       to_ending, unified_diff)
from .safefs import open_inside, read_inside

READ_LINES = 500          # lines a read shows when no end_line is given
MAX_LINE_CHARS = 2000     # a longer line is cut (and is then not editable by line number)
EDIT_CONTEXT = 4          # lines shown before and after an edit
EDIT_SHOW = 30            # an edited span longer than this is shown as its first and last 12 lines
LIST_ENTRIES = 400


def resolve_readable(ctx: ToolContext, path: str) -> Path:
    """A path for reading: inside the project, or one of the folders the agent itself writes
    (bash job logs), which the model must be able to read even when they are elsewhere."""
    try:
        return ctx.resolve(path, must_exist=True)
    except ToolError:
        p = Path(path).expanduser()
        real = Path(os.path.realpath(p if p.is_absolute() else ctx.root / p))
        for d in ctx.state.get("readable_dirs", ()):
            d = Path(os.path.realpath(d))
            if d in real.parents and real.exists():
                return real
        raise


def _numbered(n: int, line: str) -> tuple[str, bool]:
    """`N<TAB>text` for line n, and whether the line was shown whole."""
    text = printable(strip_eol(line))
    if len(text) > MAX_LINE_CHARS:
        return (f"{n}\t{text[:MAX_LINE_CHARS]} [... line truncated: {len(text) - MAX_LINE_CHARS} "
                f"more characters ...]"), False
    return f"{n}\t{text}", True


# ---------------------------------------------------------------------------------------- read

def _read(args: dict, ctx: ToolContext) -> ToolResult:
    path = resolve_readable(ctx, args["path"])
    rel = ctx.rel(path)
    start = args.get("start_line", 1)
    end = args.get("end_line")
    if end is not None and end < start:
        raise ToolError(f"end_line {end} is before start_line {start}")
    # Opened once and checked where the descriptor really is: a symlink swapped in after
    # resolve_readable cannot make this read an outside file.
    fd = open_inside(ctx, path, extra_roots=ctx.state.get("readable_dirs", ()), shown=rel)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ToolError(f"{rel} is a directory (use list)" if stat.S_ISDIR(st.st_mode) else
                        f"{rel} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_FILE_BYTES:
            return _read_large(f, st.st_size, rel, start, end)
        data = f.read()
    if is_binary(data):
        raise ToolError(f"{rel} is a binary file ({len(data)} bytes); read shows text files only")
    text, utf8 = decode(data)
    lines = split_lines(text)
    total = len(lines)
    if total == 0:
        views.remember(ctx, path, data, lines, ())
        return ToolResult(f"{rel}: empty file (0 lines)")
    if start > total:
        raise ToolError(f"start_line {start} is past the end of {rel} ({total} lines)")
    last = min(end if end is not None else start + READ_LINES - 1, total)

    budget = MAX_RESULT_CHARS - 300
    body, shown, used, stop = [], [], 0, last
    for n in range(start, last + 1):
        entry, whole = _numbered(n, lines[n - 1])
        if body and used + len(entry) + 1 > budget:
            stop = n - 1
            break
        body.append(entry)
        used += len(entry) + 1
        if whole:
            shown.append(n)
    views.remember(ctx, path, data, lines, shown)

    head = f"{rel}: lines {start}-{stop} of {total}"
    if not utf8:
        head += " (not valid UTF-8: undecodable bytes shown as \ufffd)"
    out = [head] + body
    truncated = True
    if stop < last:
        out.append(f"[... truncated at the size limit: lines {stop + 1}-{last} not shown; "
                   f"continue with start_line={stop + 1} ...]")
    elif stop < total and end is None:
        out.append(f"[... truncated: lines {stop + 1}-{total} not shown; continue with "
                   f"start_line={stop + 1} ...]")
    else:
        truncated = False
    return ToolResult("\n".join(out), truncated=truncated)


def _read_large(f, size: int, rel: str, start: int, end: int | None) -> ToolResult:
    """Files over MAX_FILE_BYTES (long logs): streamed, LF lines, not registered for line edits."""
    last = end if end is not None else start + READ_LINES - 1
    body: list[str] = []
    used, size_stop = 0, False
    if is_binary(f.read(8192)):
        raise ToolError(f"{rel} is a binary file; read shows text files only")
    f.seek(0)
    for n, raw in enumerate(f, 1):
        if n < start:
            continue
        if n > last:
            break
        entry, _ = _numbered(n, raw.decode("utf-8", "replace"))
        if body and used + len(entry) + 1 > MAX_RESULT_CHARS - 300:
            size_stop = True
            break
        body.append(entry)
        used += len(entry) + 1
    f.seek(0)
    total, tail = 0, b""
    while chunk := f.read(1 << 20):
        total += chunk.count(b"\n")
        tail = chunk[-1:]
    if tail and tail != b"\n":
        total += 1
    if not body:
        raise ToolError(f"start_line {start} is past the end of {rel} ({total} lines)")
    stop = start + len(body) - 1
    out = [f"{rel}: lines {start}-{stop} of {total} (large file, {size} bytes: "
           f"not editable by line number)"] + body
    truncated = size_stop or (stop < total and end is None)
    if truncated:
        out.append(f"[... truncated: lines {stop + 1}-{min(last, total) if size_stop else total} not "
                   f"shown; continue with start_line={stop + 1} ...]")
    return ToolResult("\n".join(out), truncated=truncated)


register(Tool(
    name="read",
    description=(
        "Read a text file with numbered lines: each output line is `N<TAB>text`, where N is the "
        "line number (not part of the file). Without start_line/end_line it shows the first "
        f"{READ_LINES} lines; the header says `PATH: lines A-B of TOTAL`, and a "
        "`[... truncated ...]` line tells you the start_line to continue with. Output is capped at "
        f"about {MAX_RESULT_CHARS // 1000}k characters and lines over {MAX_LINE_CHARS} characters "
        "are cut, always with a marker. Read only the range you need (use search or outline to "
        "find it). Lines shown here may then be changed by line number with edit. Binary files "
        "are refused. Paths are relative to the project directory; bash job logs can be read too."),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file to read, relative to the project directory"},
            "start_line": {"type": "integer", "minimum": 1,
                           "description": "first line to show (1-based, default 1)"},
            "end_line": {"type": "integer", "minimum": 1,
                         "description": f"last line to show, inclusive (default start_line+{READ_LINES - 1})"},
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    run=_read,
))


# ---------------------------------------------------------------------------------------- write

def _write(args: dict, ctx: ToolContext) -> ToolResult:
    path = ctx.resolve(args["path"])
    rel = ctx.rel(path)
    content = args["content"]
    try:     # the old content, from a descriptor checked to be inside (it goes into the diff)
        st, old = read_inside(ctx, path, MAX_FILE_BYTES, shown=rel)
        existed = True
    except FileNotFoundError:
        existed = False
    if existed and stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{rel} is a directory")
    if existed and not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{rel} is not a regular file")
    old_text: str | None = None
    old_lines = 0
    if existed:
        if old is not None and not is_binary(old):
            old_text = decode(old)[0]
            old_lines = len(split_lines(old_text))
            if old_text == content:
                views.remember(ctx, path, old, split_lines(old_text), range(1, old_lines + 1))
                return ToolResult(f"{rel} already has exactly this content; nothing written")
        else:
            old_text = "[binary or very large file]\n"
    data = encode(content)
    atomic_write(ctx, path, data)
    lines = split_lines(content)
    # The model wrote every line itself: all of them may be edited by number right away.
    views.remember(ctx, path, data, lines, range(1, len(lines) + 1))
    what = (f"Overwrote {rel} ({len(lines)} lines, {len(data)} bytes; it had {old_lines} lines)"
            if existed else f"Created {rel} ({len(lines)} lines, {len(data)} bytes)")
    return ToolResult(what, diff=unified_diff(old_text, content, rel))


register(Tool(
    name="write",
    description=(
        "Create a file, or replace a whole file, with `content` (written exactly as given; missing "
        "parent folders are created; the write is atomic). Use it for new files and complete "
        "rewrites; to change part of an existing file use edit, which is cheaper and safer. The "
        "user may be asked to approve the change. Returns a one-line summary; afterwards every "
        "line of the file counts as seen for line-number edits."),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file to write, relative to the project directory"},
            "content": {"type": "string", "description": "the complete new file content"},
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    },
    run=_write,
    needs_approval=True,
))


# ---------------------------------------------------------------------------------------- edit

def _positions(text: str, s: str) -> list[int]:
    out, i = [], text.find(s)
    while i >= 0:
        out.append(i)
        if len(out) > 20:
            break
        i = text.find(s, i + 1)
    return out


def _near_match(lines: list[str], old: str) -> str | None:
    """Where `old` would match if whitespace did not count (a hint for a failed replacement)."""
    norm = lambda s: " ".join(s.split())
    want = [norm(strip_eol(l)) for l in split_lines(old)]
    while want and not want[0]:
        want.pop(0)
    while want and not want[-1]:
        want.pop()
    if not want:
        return None
    have = [norm(strip_eol(l)) for l in lines]
    k = len(want)
    for i in range(len(have) - k + 1):
        if k == 1:
            if want[0] in have[i]:
                return f"line {i + 1}"
        elif have[i].endswith(want[0]) and have[i + k - 1].startswith(want[-1]) \
                and have[i + 1:i + k - 1] == want[1:-1]:
            return f"lines {i + 1}-{i + k}"
    return None


def _context_block(rel: str, lines: list[str], a: int, n_new: int) -> tuple[str, list[int]]:
    """The file around an edit, numbered, and the line numbers shown whole."""
    total = len(lines)
    if total == 0:
        return f"{rel} is now empty.", []
    lo = max(1, a - EDIT_CONTEXT)
    hi = min(total, a + max(n_new, 1) - 1 + EDIT_CONTEXT)
    nums: list[int | None] = list(range(lo, hi + 1))
    if n_new > EDIT_SHOW:
        cut_from, cut_to = a + 12, a + n_new - 1 - 12
        nums = [n for n in nums if n < cut_from] + [None] + [n for n in nums if n > cut_to]
    out, shown = [f"{rel} now, lines {lo}-{hi} of {total}:"], []
    for n in nums:
        if n is None:
            out.append(f"[... {cut_to - cut_from + 1} edited lines not shown ...]")
            continue
        entry, whole = _numbered(n, lines[n - 1])
        out.append(entry)
        if whole:
            shown.append(n)
    return "\n".join(out), shown


def _edit(args: dict, ctx: ToolContext) -> ToolResult:
    path = ctx.resolve(args["path"])
    rel = ctx.rel(path)
    if not path.exists():
        raise ToolError(f"{rel}: no such file (use write to create a file)")
    data, text, _ = load_text(ctx, path)
    lines = split_lines(text)
    new = args["new"]
    old = args.get("old")
    start, end = args.get("start_line"), args.get("end_line")
    eol = line_ending(text)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    if old is not None:
        if start is not None or end is not None:
            raise ToolError("give either old (text to replace) or start_line/end_line (a line "
                            "range), not both")
        if old == "":
            raise ToolError("old must not be empty (to rewrite a whole file use write)")
        pos = _positions(text, old)
        if not pos and eol != "\n" and "\n" in old:
            # the model typed LF; the file has CRLF
            old, new = to_ending(old, eol), to_ending(new, eol)
            pos = _positions(text, old)
        if not pos:
            hint = _near_match(lines, old)
            raise ToolError(f"old text not found in {rel}" + (
                f"; {hint} would match if whitespace were ignored: copy the exact text (indentation "
                f"matters) from a fresh read" if hint else "; read the file again and copy the "
                "exact text"))
        if len(pos) > 1:
            where = ", ".join(str(bisect.bisect_right(starts, p)) for p in pos[:10])
            more = "+" if len(pos) > 20 else ""
            raise ToolError(f"old text occurs {len(pos)}{more} times in {rel} (at lines {where}); "
                            "include more surrounding text so it matches exactly once, or edit by "
                            "line range")
        p = pos[0]
        if old == new:
            raise ToolError("old and new are the same: nothing to change")
        new_text = text[:p] + new + text[p + len(old):]
        a = bisect.bisect_right(starts, p)
        b_old = bisect.bisect_right(starts, p + len(old) - 1)
        what = "replaced the old text"
    elif start is not None or end is not None:
        if start is None:
            raise ToolError("end_line needs start_line")
        end = start if end is None else end
        if end < start:
            raise ToolError(f"end_line {end} is before start_line {start}")
        if end > len(lines):
            raise ToolError(f"lines {start}-{end} are outside {rel}, which has {len(lines)} lines")
        views.check(ctx, path, rel, data, lines, start, end)
        repl = to_ending(new, eol)
        if repl and not repl.endswith(("\n", "\r")) and lines[end - 1].endswith(("\n", "\r")):
            repl += eol
        new_text = "".join(lines[:start - 1]) + repl + "".join(lines[end:])
        if new_text == text:
            raise ToolError(f"lines {start}-{end} already have this text: nothing to change")
        a, b_old = start, end
        what = f"replaced lines {start}-{end}" if new else f"deleted lines {start}-{end}"
    else:
        raise ToolError("edit needs old (exact text to replace, with new) or start_line[/end_line] "
                        "(a range of lines you have read, with new)")

    new_data = encode(new_text)
    atomic_write(ctx, path, new_data)
    new_lines = split_lines(new_text)
    delta = len(new_lines) - len(lines)
    n_new = max(0, b_old - a + 1 + delta)
    block, shown = _context_block(rel, new_lines, a, n_new)
    views.after_edit(ctx, path, data, new_data, new_lines, a, b_old, delta, shown)

    head = f"Edited {rel}: {what} (old lines {a}-{b_old}, now {n_new} line{'s' if n_new != 1 else ''})"
    if delta and b_old < len(lines):
        head += (f". Lines after old line {b_old} moved by {delta:+d} (old line {b_old + 1} is now "
                 f"line {b_old + 1 + delta}); read them again before editing them by number")
    return ToolResult(head + ".\n" + block, diff=unified_diff(text, new_text, rel))


register(Tool(
    name="edit",
    description=(
        "Change part of an existing text file; `new` is the replacement text. Two ways: (1) `old` + "
        "`new`: `old` must match the current file exactly (whitespace and indentation included) "
        "and exactly once, else nothing is changed and you are told why (not found / how many "
        "matches); include a few surrounding lines to make it unique. (2) `start_line` [+ "
        "`end_line`, inclusive] + `new`: replace those whole lines (new=\"\" deletes them); allowed "
        "only on lines you were shown by read, search or a previous edit and that have not "
        "changed since, otherwise re-read them. Do not put line-number prefixes in `new`. The "
        "file's line endings are kept. The result shows the changed region with its new line "
        "numbers and says when later lines moved. The user may be asked to approve the change."),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file to edit, relative to the project directory"},
            "new": {"type": "string", "description": "replacement text (\"\" deletes)"},
            "old": {"type": "string",
                    "description": "exact current text to replace; must occur exactly once"},
            "start_line": {"type": "integer", "minimum": 1,
                           "description": "first line to replace (line-range mode)"},
            "end_line": {"type": "integer", "minimum": 1,
                         "description": "last line to replace, inclusive (default start_line)"},
        },
        "required": ["path", "new"],
        "additionalProperties": False,
    },
    run=_edit,
    needs_approval=True,
))


# ---------------------------------------------------------------------------------------- list

def _ignored_dirs(base: Path) -> set[str]:
    """Folders git ignores under base (not expanded by a deep list)."""
    rels = gitsafe.ls_files(base, "--others", "--ignored", "--exclude-standard", "--directory")
    return {os.path.normpath(base / p.rstrip("/")) for p in rels or () if p.endswith("/")}


def _list(args: dict, ctx: ToolContext) -> ToolResult:
    path = ctx.resolve(args.get("path", "."), must_exist=True)
    rel = ctx.rel(path)
    if not path.is_dir():
        st = path.stat()
        return ToolResult(f"{rel}  {human_size(st.st_size)} (a file, not a directory)")
    depth = args.get("depth", 1)
    ignored = _ignored_dirs(path) if depth > 1 else set()
    out: list[str] = []
    count = 0
    stopped = False

    def entries(d: Path) -> list[os.DirEntry]:
        with os.scandir(d) as it:
            es = list(it)
        return sorted(es, key=lambda e: (not e.is_dir(follow_symlinks=False), e.name.lower(), e.name))

    def walk(d: Path, level: int) -> None:
        nonlocal count, stopped
        try:
            es = entries(d)
        except OSError as e:
            out.append("  " * level + f"[cannot list: {e.strerror}]")
            return
        for e in es:
            if count >= LIST_ENTRIES:
                stopped = True
                return
            count += 1
            pad = "  " * level
            name = printable(e.name)
            if e.is_symlink():
                try:
                    target = os.readlink(e.path)
                except OSError:
                    target = "?"
                kind = "/" if e.is_dir() else ""
                out.append(f"{pad}{name}{kind} -> {printable(target)}")
            elif e.is_dir():
                skip = e.name in SKIP_DIRS or os.path.normpath(e.path) in ignored
                if level + 1 < depth and not skip:
                    out.append(f"{pad}{name}/")
                    walk(Path(e.path), level + 1)
                else:
                    try:
                        n = len(os.listdir(e.path))
                        note = f"{n} entr{'y' if n == 1 else 'ies'}"
                    except OSError:
                        note = "unreadable"
                    if skip and level + 1 < depth:
                        note += ", not expanded"
                    out.append(f"{pad}{name}/  ({note})")
            elif e.is_file():
                out.append(f"{pad}{name}  {human_size(e.stat().st_size)}")
            else:
                out.append(f"{pad}{name}  (special file)")
            if stopped:
                return

    walk(path, 0)
    head = f"{rel}/" if rel != "." else "./"
    if not out:
        return ToolResult(f"{head} is empty")
    if stopped:
        out.append(f"[... truncated after {LIST_ENTRIES} entries; list a subfolder or use a "
                   f"smaller depth ...]")
    return ToolResult("\n".join([head] + out), truncated=stopped)


register(Tool(
    name="list",
    description=(
        "List a directory: folders first (name ending in `/`), then files with their size, "
        "sorted by name; symlinks show their target. depth=1 (default) lists one level; a larger "
        "depth shows nested folders indented, but does not descend into .git, dependency or "
        "cache folders (node_modules, .venv, __pycache__, ...) or git-ignored folders; those show "
        f"their entry count instead. Stops after {LIST_ENTRIES} entries with a marker. Use "
        "search to find files by content and glob."),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "directory to list (default: the project directory)"},
            "depth": {"type": "integer", "minimum": 1, "maximum": 6,
                      "description": "how many levels to show (default 1)"},
        },
        "additionalProperties": False,
    },
    run=_list,
))
