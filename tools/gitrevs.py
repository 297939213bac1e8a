"""Revision arguments of the git tool, confined to the project like every other path.

When the project is a subfolder of a larger repository (a monorepo, a home directory kept in git),
a revision can name a file outside it: `HEAD:secret.txt` (paths after the colon start at the
repository's root), `HEAD:../secret.txt` and `:./x` (relative to the project), `:0:path` (the
index), `HEAD:` or `HEAD^{tree}` (a tree listing), a bare blob or tree id. So each argument is
either a commit-ish (checked with git: it must peel to a commit; a tree or blob id is refused), or
`REV:path` / `:path` / `:N:path` whose path is resolved against the repository's root and must lie
inside the project; it is passed on rewritten to the root-relative path that was checked.
Commands that show many files get a pathspec for the project from the caller.
"""
from __future__ import annotations

import posixpath
import re

from .base import ToolError
from .gitsafe import Git

_STAGE = re.compile(r":([0-3]):(.*)\Z", re.S)
_RANGE = re.compile(r"\.\.\.?")
_SUFFIX = re.compile(r"\^(@|!|-\d*)\Z")          # A^@, A^!, A^-N: still about commit A


def split_object_path(part: str) -> tuple[str, str] | None:
    """(`REV`, path) for `REV:path`, (`:` or `:N:`, path) for the index forms, None for a plain
    revision (`:/text` searches commit messages). The first colon outside `{...}` splits, as in git."""
    if part.startswith(":"):
        if part.startswith(":/"):
            return None
        m = _STAGE.match(part)
        return (f":{m[1]}:", m[2]) if m else (":", part[1:])
    depth = 0
    for i, c in enumerate(part):
        if c == "{":
            depth += 1
        elif c == "}" and depth:
            depth -= 1
        elif c == ":" and not depth:
            return part[:i] + ":", part[i + 1:]
    return None


def root_path(prefix: str, path: str) -> str:
    """A path after `REV:` as a path from the repository's root: `./` and `../` start at the
    project (git's rule), anything else at the root. '' is the root itself."""
    if path.startswith(("./", "../")):
        path = posixpath.join(prefix, path)
    if path.startswith("/"):
        raise ToolError(f"{path!r}: give a path inside the project, not an absolute one")
    norm = posixpath.normpath(path) if path else ""
    return "" if norm == "." else norm


def inside(prefix: str, path: str) -> bool:
    if path == ".." or path.startswith("../"):
        return False
    return not prefix or path == prefix or path.startswith(prefix + "/")


def _endpoints(part: str) -> list[str]:
    """The commits a revision expression names: `^A`, `A..B`, `A...B`, `A^!` ..."""
    part = part[1:] if part.startswith("^") else part
    ends = _RANGE.split(part) if not part.startswith(":/") else [part]
    return [_SUFFIX.sub("", e) for e in ends if e]


def _check_commits(g: Git, names: list[str], sub: str) -> None:
    if not names:
        return
    if any("\n" in n for n in names):
        raise ToolError(f"git {sub} failed: a revision cannot contain a line break")

    def kinds(asks: list[str]) -> list[str]:
        r = g.run("cat-file", "--batch-check=%(objecttype)",
                  input="".join(a + "\n" for a in asks).encode())
        got = r.stdout.decode("utf-8", "replace").splitlines()
        return [(k.split()[-1] if k.strip() else "") for k in got] + [""] * len(asks)

    # `:/text` cannot take a ^{commit} suffix (it would join the search text); it only ever
    # finds commits
    peeled = kinds([n if n.startswith(":/") else n + "^{commit}" for n in names])
    for name, kind in zip(names, peeled):
        if kind == "commit":
            continue
        what = kinds([name])[0]
        if what in ("", "missing", "ambiguous"):
            raise ToolError(f"git {sub} failed: unknown revision {name!r}")
        raise ToolError(f"git {sub} failed: {name!r} is a {what}, not a commit (refused: give a "
                        "commit, branch or tag; for a file as of a revision give REV:path with a "
                        "path inside the project)")


def _past_leading_dots(path: str) -> str:
    """The path after its leading ./ and ../ segments: the only place '..' can stand without git
    splitting the argument into a range (what follows a leading '..' starts with '/', never a
    revision)."""
    while True:
        if path.startswith("./"):
            path = path[2:]
        elif path.startswith("../"):
            path = path[3:]
        elif path in (".", ".."):
            return ""
        else:
            return path


def confine(g: Git, parts: list[str], sub: str, *, allow_outside: bool) -> tuple[list[str], int]:
    """`parts` with every path confined to the project and rewritten from the root; and how many
    of them were `REV:path` forms. Raises ToolError for anything naming content outside."""
    out: list[str] = []
    commits: list[str] = []
    objects = 0
    for part in parts:
        split = split_object_path(part)
        if split is None:
            commits += _endpoints(part)
            out.append(part)
            continue
        rev, path = split
        if not allow_outside and (".." in rev or ".." in _past_leading_dots(path)):
            raise ToolError(f"git {sub}: {part!r}: git reads '..' inside a REV:path as a revision range "
                            "(each side a different object); name one object, with ./ or ../ only "
                            "at the start of its path (refused)")
        full = root_path(g.prefix, path)
        if not allow_outside and not inside(g.prefix, full):
            where = g.prefix or "the repository's root"
            raise ToolError(f"git {sub}: {part!r}: {full or 'the root tree'} is outside the project ({where}); "
                            "paths after REV: start at the repository's root, ./ and ../ at the "
                            "project (refused)")
        if not rev.startswith(":"):              # REV:path, not the index's :path or :N:path
            commits.append(rev[:-1])
        out.append(rev + full)
        objects += 1
    _check_commits(g, commits, sub)
    return out, objects
