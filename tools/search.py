"""search: regex or literal text search over the project's files, grep-style output.

Better than ds4's (spec/agent.md §3.10, §10 item 8): .gitignore is honoured (plus dependency and
cache folders), results are in path order, symlinked files inside the project are searched, and
hitting max_matches or the size limit is said explicitly. Lines shown are registered with the
edit guard, so they can be edited by number straight away.

Patterns run on the `regex` package (Python `re` syntax in its compatible mode) because it can
stop a match after a time: a backtracking pattern such as `(a|aa)+b` on a line of a's would
otherwise hold the process (and the GIL) for minutes, and no thread can interrupt `re`. A
linear-time engine (RE2) would drop backreferences and lookarounds, which users of a grep-like
tool expect. The whole search gets TIME_LIMIT seconds; past it the matches found so far are
returned with a note saying where it stopped.
"""
from __future__ import annotations

import stat
import time

import regex

from . import rxlimit, views
from .base import MAX_RESULT_CHARS, Tool, ToolContext, ToolError, ToolResult, register
from .fileutil import (MAX_FILE_BYTES, decode, glob_matcher, is_binary, printable, project_files,
                       split_lines, strip_eol)
from .safefs import read_inside

MAX_LINE_CHARS = 300     # a longer matching line is cut around the match
TIME_LIMIT = 10.0        # seconds one search may take, all files together


class _Deadline:
    """Matching with the time left; `rx.search` raises TimeoutError once it is spent."""

    def __init__(self, rx: regex.Pattern, seconds: float):
        self.rx, self.end = rx, time.monotonic() + seconds

    def search(self, text: str):
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return self.rx.search(text, timeout=left)


def _show(n: int, sep: str, line: str, m: regex.Match | None) -> tuple[str, bool]:
    text = printable(strip_eol(line))
    if len(text) <= MAX_LINE_CHARS:
        return f"{n}{sep}{text}", True
    lo = max(0, (m.start() if m else 0) - MAX_LINE_CHARS // 3)
    piece = text[lo:lo + MAX_LINE_CHARS]
    pre = f"[... {lo} characters ...]" if lo else ""
    post = f"[... {len(text) - lo - len(piece)} characters ...]" if lo + len(piece) < len(text) else ""
    return f"{n}{sep}{pre}{piece}{post}", False


def _compile(args: dict) -> regex.Pattern:
    pattern = args["pattern"]
    if pattern == "":
        raise ToolError("pattern must not be empty")
    flags = regex.IGNORECASE if args.get("ignore_case") else 0
    source = regex.escape(pattern) if args.get("literal") else pattern
    try:
        # the compile itself is bounded first: fixed repeat counts can make it take gigabytes
        rxlimit.check(source, flags | regex.VERSION0)
        # VERSION0: the `re`-compatible dialect (the model writes Python regular expressions)
        return regex.compile(source, flags | regex.VERSION0)
    except rxlimit.TooLarge as e:
        raise ToolError(f"pattern too large to compile: {e}; use smaller repeat counts (such as "
                        "{2,1000} or + instead of {1000}), or literal=true") from None
    except (regex.error, OverflowError, RecursionError) as e:
        raise ToolError(f"invalid regular expression: {e} (set literal=true to search for the "
                        "text as it is)") from None


def _file_hits(dl: _Deadline, text: str, prefilter: bool, room: int):
    """(matching lines of one file, at most room of them; whether more exist; its lines)."""
    if prefilter and not dl.search(text):
        return [], False, []  # quick reject: no match anywhere in the file, so none in a line
    lines = split_lines(text)
    hits: list[tuple[int, regex.Match]] = []
    for i, line in enumerate(lines, 1):
        m = dl.search(strip_eol(line))
        if m:
            if len(hits) >= room:
                return hits, True, lines
            hits.append((i, m))
    return hits, False, lines


def _block(ctx: ToolContext, f, data: bytes, lines: list[str], hits, context: int) -> str:
    """A file's matches with their context lines; the lines shown whole join the edit guard."""
    hit_at = dict(hits)
    want: list[int] = sorted({j for i, _ in hits
                              for j in range(max(1, i - context), min(len(lines), i + context) + 1)})
    out, shown, prev = [ctx.rel(f)], [], None
    for j in want:
        if prev is not None and j != prev + 1:
            out.append("--")
        entry, whole = _show(j, ":" if j in hit_at else "-", lines[j - 1], hit_at.get(j))
        out.append(entry)
        if whole:
            shown.append(j)
        prev = j
    views.remember(ctx, f, data, lines, shown)
    return "\n".join(out)


def _search(args: dict, ctx: ToolContext) -> ToolResult:
    rx = _compile(args)
    base = ctx.resolve(args.get("path", "."), must_exist=True)
    context = args.get("context", 0)
    max_matches = args.get("max_matches", 100)
    match_glob = glob_matcher(args.get("glob"))
    dl = _Deadline(rx, TIME_LIMIT)
    files, hit_file_limit = project_files(ctx, base)
    # A whole-file search can only stand in for the per-line one when nothing in the pattern
    # depends on where a line starts or ends.
    prefilter = not any(t in rx.pattern for t in ("^", "$", "\\A", "\\Z", "(?"))
    root_is_file = base.is_file()

    blocks: list[str] = []
    matches = nfiles = skipped_binary = skipped_large = 0
    more, timed_out = False, None
    for f in files:
        if not root_is_file and not match_glob(f.relative_to(base).as_posix()):
            continue
        try:
            # read through a descriptor checked to be inside: a file swapped for a symlink
            # after the listing must not show an outside file
            st, data = read_inside(ctx, f, MAX_FILE_BYTES)
        except (OSError, ToolError):
            continue
        if data is None:
            skipped_large += stat.S_ISREG(st.st_mode)
            continue
        if is_binary(data):
            skipped_binary += 1
            continue
        text, _ = decode(data)
        try:
            hits, more, lines = _file_hits(dl, text, prefilter, max_matches - matches)
        except TimeoutError:
            timed_out = f
            break
        if hits:
            nfiles += 1
            matches += len(hits)
            blocks.append(_block(ctx, f, data, lines, hits, context))
        if more:
            break
    counts = (matches, nfiles, len(files), skipped_binary, skipped_large)
    return _result(ctx, args, base, counts, blocks, more, hit_file_limit, timed_out)


def _result(ctx: ToolContext, args: dict, base, counts, blocks: list[str], more: bool,
            hit_file_limit: bool, timed_out) -> ToolResult:
    matches, nfiles, nsearched, skipped_binary, skipped_large = counts
    pattern, max_matches = args["pattern"], args.get("max_matches", 100)
    what = f"/{pattern}/" if not args.get("literal") else repr(pattern)
    where = ctx.rel(base)
    if matches == 0:
        text = (f"No matches {'before the time limit ' if timed_out else ''}for {what} in {where}"
                + (f" (glob {args['glob']})" if args.get("glob") else ""))
        text += f"; {nsearched} files searched" if timed_out is None else ""
    else:
        text = (f"{matches} matching line{'s' if matches != 1 else ''} in {nfiles} "
                f"file{'s' if nfiles != 1 else ''} for {what} in {where}")
    notes = []
    if skipped_binary:
        notes.append(f"{skipped_binary} binary files skipped")
    if skipped_large:
        notes.append(f"{skipped_large} files over {MAX_FILE_BYTES >> 20} MiB skipped")
    if notes:
        text += " (" + "; ".join(notes) + ")"
    body = "\n\n".join(blocks)
    full = text + ("\n\n" + body if body else "")
    truncated = False
    if len(full) > MAX_RESULT_CHARS:
        cut = full.rfind("\n", 0, MAX_RESULT_CHARS - 200)
        full = full[:cut] + ("\n[... truncated at the size limit; narrow the search with path, "
                             "glob or a more specific pattern ...]")
        truncated = True
    if timed_out is not None:
        hint = ("narrow the search with path or glob" if args.get("literal") else "the pattern may "
                "backtrack heavily (nested repeats like (a+)+): simplify it, or narrow path/glob")
        full += (f"\n[... search timed out after {TIME_LIMIT:g} s while matching in "
                 f"{ctx.rel(timed_out)}; the results above are partial: {hint} ...]")
        truncated = True
    if more:
        full += (f"\n[... truncated: stopped at max_matches={max_matches}; more matches exist. "
                 "Narrow the search or raise max_matches ...]")
        truncated = True
    if hit_file_limit:
        full += "\n[... truncated: too many files; only the first 100000 were searched ...]"
        truncated = True
    return ToolResult(full, truncated=truncated)


register(Tool(
    name="search",
    description=(
        "Search file contents under a folder (or in one file) for a regular expression (Python "
        "`re` syntax, matched per line) or, with literal=true, for exact text. Files ignored by "
        ".gitignore, .git, dependency/cache folders (node_modules, .venv, __pycache__, ...) and "
        "binary files are skipped. `glob` limits the files: `*.py`, `*.{ts,tsx}`, `src/**/*.c` "
        "(a pattern without `/` matches file names at any depth; several patterns separated by "
        "spaces). Output groups matches by file in path order: `N:text` is a matching line, "
        "`N-text` a context line, `--` separates distant groups. Lines shown can be edited by "
        "number afterwards. The result says when it stopped at max_matches or the size limit. "
        f"A search stops after {TIME_LIMIT:g} s and returns what it found so far, marked as partial."),
    parameters={
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "regular expression (or exact text with literal=true)"},
            "path": {"type": "string", "description": "folder or file to search (default: the project directory)"},
            "literal": {"type": "boolean", "description": "treat pattern as exact text, not a regex (default false)"},
            "ignore_case": {"type": "boolean", "description": "case-insensitive matching (default false)"},
            "glob": {"type": "string", "description": "only files matching this glob, e.g. *.py or src/**/*.{c,h}"},
            "context": {"type": "integer", "minimum": 0, "maximum": 10,
                        "description": "lines of context before and after each match (default 0)"},
            "max_matches": {"type": "integer", "minimum": 1, "maximum": 1000,
                            "description": "stop after this many matching lines (default 100)"},
        },
        "required": ["pattern"],
        "additionalProperties": False,
    },
    run=_search,
))
