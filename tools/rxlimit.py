"""A size check on a regular expression before `regex.compile` sees it.

The `regex` package's compiler (its C part) lays out every fixed repetition count: `a{1000000}`
takes 274 MB to compile, `((((a{100}){100}){100}){100})` past 14 GB, and all of it happens before
the search's time limit starts, in a tool that needs no approval. The cost follows the repeats'
minimum counts, multiplied through their nesting (`{0,1000}`, `*` and `?` cost nothing; `{1000,}`
costs as much as `{1000}`), so the pattern is parsed first (by the package's own parser, cheap and
exact, so that comments, classes and verbose mode cannot hide a count) and its expanded size, the
sum over its nodes of the product of the minimum counts around each, is bounded.

Where the package's parser cannot be reached (its private module changed), the pattern is compiled
instead in a child Python under a memory cap: slower (about 40 ms) but still bounded.
"""
from __future__ import annotations

import subprocess
import sys

import regex

MAX_EXPANDED = 100_000   # nodes after repetition; measured 270-790 bytes each to compile
CHILD_MEMORY = 1 << 30   # address-space cap of the fallback compile
CHILD_SECONDS = 10.0

try:  # the parser regex.compile itself runs (regex/_main.py _compile)
    from regex import _regex_core as _core
    _REPEATS = (_core.GreedyRepeat, _core.LazyRepeat, _core.PossessiveRepeat)
    _BASE = _core.RegexBase
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed regex
    _core = None


class TooLarge(ValueError):
    """The pattern would expand past MAX_EXPANDED nodes when compiled."""


def _parse(pattern: str, flags: int):
    global_flags = flags
    while True:
        source = _core.Source(pattern)
        info = _core.Info(global_flags, source.char_type, {})
        source.ignore_space = bool(info.flags & regex.VERBOSE)
        source.use_unicode_space(bool(info.flags & regex.VERSION1))
        try:
            return _core._parse_pattern(source, info)
        except _core._UnscopedFlagSet:  # a (?x) in the middle: parse again with it global
            global_flags = info.global_flags


def _children(node):
    for v in vars(node).values():
        if isinstance(v, _BASE):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (c for c in v if isinstance(c, _BASE))


def expanded_size(tree, limit: int = MAX_EXPANDED) -> int:
    """Sum over the nodes of the product of the enclosing minimum repeat counts; stops past limit.

    Iterative, so a deeply nested pattern cannot exhaust the stack here."""
    total, stack = 0, [(tree, 1)]
    while stack:
        node, mult = stack.pop()
        total += mult
        if total > limit:
            break
        if isinstance(node, _REPEATS):
            mult *= max(node.min_count, 1)
        stack.extend((c, mult) for c in _children(node))
    return total


_CHILD = ("import resource,sys\n"
          "resource.setrlimit(resource.RLIMIT_AS,({cap},{cap}))\n"
          "import regex\n"
          "regex.compile(sys.stdin.read(),{flags})\n")


def _child_check(pattern: str, flags: int) -> None:
    code = _CHILD.format(cap=CHILD_MEMORY, flags=flags)
    try:
        r = subprocess.run([sys.executable, "-c", code], input=pattern.encode("utf-8", "replace"),
                           capture_output=True, timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        raise TooLarge("compiling it took too long") from None
    if r.returncode != 0 and b"MemoryError" in r.stderr:
        raise TooLarge("compiling it needs too much memory")
    # any other failure is a syntax error the parent's compile reports in its own words


def check(pattern: str, flags: int) -> None:
    """Raise TooLarge when compiling pattern would take unbounded memory, regex.error when it is
    not a regular expression; return when regex.compile may be called safely."""
    if "{" not in pattern:
        return  # no counted repeat: the compiled size is linear in the pattern's length
    if _core is None:  # pragma: no cover - depends on the installed regex
        _child_check(pattern, flags)
        return
    n = expanded_size(_parse(pattern, flags))
    if n > MAX_EXPANDED:
        raise TooLarge(f"its repeats expand to over {MAX_EXPANDED:,} elements")
