"""git (status, diff, log, show: read-only, no approval) and git_commit (asks approval).

Two tools rather than one with a `commit` subcommand, so that approval is a property of the tool:
the caller asks before git_commit and never before reading history. Commands run through
GitPython's git wrapper in the project directory, without colour, pager or external diff tools.
"""
from __future__ import annotations

import os

from .base import MAX_RESULT_CHARS, Tool, ToolContext, ToolError, ToolResult, register, truncate

try:
    import git as _gitpython
except ImportError:       # pragma: no cover - gitpython is a dependency; say so if it is missing
    _gitpython = None

GIT_TIMEOUT = 60


def _git_cmd(ctx: ToolContext):
    if _gitpython is None:
        raise ToolError("the git tool needs the gitpython package, which is not installed")
    try:
        _gitpython.Repo(ctx.root, search_parent_directories=True)
    except (_gitpython.InvalidGitRepositoryError, _gitpython.NoSuchPathError):
        raise ToolError("the project directory is not inside a git repository") from None
    except _gitpython.GitCommandNotFound:
        raise ToolError("git is not installed") from None
    return _gitpython.Git(str(ctx.root))


def _run(g, *args: str, ok=(0,)) -> tuple[int, str]:
    cmd = ["git", "-c", "color.ui=false", "-c", "core.quotepath=false", *args]
    try:
        status, out, err = g.execute(cmd, with_extended_output=True, with_exceptions=False,
                                     kill_after_timeout=GIT_TIMEOUT, stdout_as_string=True,
                                     env={"GIT_PAGER": "cat", "GIT_TERMINAL_PROMPT": "0",
                                          "GIT_EDITOR": "true"})
    except _gitpython.GitCommandNotFound:
        raise ToolError("git is not installed") from None
    if status not in ok:
        msg = (err or out or "").strip() or f"exit status {status}"
        raise ToolError(f"git {args[0]} failed: {msg}")
    return status, out


def _refs(ref: str | None) -> list[str]:
    if not ref:
        return []
    parts = ref.split()
    for p in parts:
        if p.startswith("-"):
            raise ToolError(f"ref {p!r} looks like an option; give a revision such as HEAD~1, "
                            "main..feature or a commit id")
    return parts


def _paths(ctx: ToolContext, paths: list[str]) -> list[str]:
    root = os.path.realpath(ctx.root)
    return [os.path.relpath(ctx.resolve(p), root) for p in paths]


def _clip(text: str, hint: str) -> tuple[str, bool]:
    return truncate(text, MAX_RESULT_CHARS, where=hint)


# ---------------------------------------------------------------------------------------- git

def _git(args: dict, ctx: ToolContext) -> ToolResult:
    g = _git_cmd(ctx)
    sub = args["subcommand"]
    refs = _refs(args.get("ref"))
    paths = ["--", *_paths(ctx, [args["path"]])] if args.get("path") else []
    stat = args.get("stat", False)
    if args.get("staged") and sub != "diff":
        raise ToolError("staged applies to subcommand=diff only")
    if args.get("max_count") is not None and sub != "log":
        raise ToolError("max_count applies to subcommand=log only")

    if sub == "status":
        if refs:
            raise ToolError("status takes no ref")
        _, out = _run(g, "status", "--short", "--branch", *paths)
        lines = out.splitlines()
        if len(lines) <= 1:
            out += "\n(nothing to commit: the working tree is clean)"
        else:
            out += ("\n(XY codes: X = staged, Y = not staged; M modified, A added, D deleted, "
                    "R renamed, ?? untracked)")
        text, cut = _clip(out, "give path= to narrow it")
        return ToolResult(text, truncated=cut)

    if sub == "diff":
        cmd = ["diff", "--no-ext-diff", "--no-color"]
        if args.get("staged"):
            cmd.append("--cached")
        if stat:
            cmd.append("--stat")
        _, out = _run(g, *cmd, *refs, *paths)
        if not out.strip():
            what = ("the index (staged) vs HEAD" if args.get("staged") else
                    f"the working tree vs {' '.join(refs)}" if refs else
                    "the working tree vs the index (unstaged changes; staged=true shows staged ones)")
            return ToolResult(f"no differences: {what}; untracked files are not shown by diff")
        text, cut = _clip(out, "use stat=true for a summary or path= to narrow it")
        return ToolResult(text, truncated=cut)

    if sub == "log":
        n = args.get("max_count", 20)
        # \x1e starts each commit, so commits can be counted with or without --stat; one more
        # than asked for is fetched to know whether there are more
        cmd = ["log", f"--max-count={n + 1}", "--date=short", "--format=%x1e%h %ad %an%d: %s"]
        if stat:
            cmd.append("--stat")
        _, out = _run(g, *cmd, *refs, *paths)
        entries = [e.strip("\n") for e in out.split("\x1e") if e.strip()]
        if not entries:
            return ToolResult("no commits" + (" touching that path" if paths else ""))
        text, cut = _clip(("\n\n" if stat else "\n").join(entries[:n]), "lower max_count or give path=")
        if len(entries) > n:
            text += f"\n[... truncated: older commits not shown; raise max_count (now {n}) or give ref= ...]"
            cut = True
        return ToolResult(text, truncated=cut)

    # show
    cmd = ["show", "--no-ext-diff", "--no-color", "--format=fuller"]
    cmd += ["--stat"] if stat else ["--stat", "--patch"]
    _, out = _run(g, *cmd, *(refs or ["HEAD"]), *paths)
    text, cut = _clip(out, "use stat=true or path= to narrow it")
    return ToolResult(text, truncated=cut)


register(Tool(
    name="git",
    description=(
        "Read the git repository of the project (nothing is changed). subcommand: `status` "
        "(branch and changed/untracked files, short format), `diff` (unstaged changes; "
        "staged=true for staged ones; ref=REV compares the working tree with REV, ref=\"A B\" or "
        "\"A..B\" two revisions), `log` (recent commits, one line each: hash date author: "
        "subject; max_count, default 20), `show` (a commit's message, stats and patch; ref "
        "default HEAD; ref=REV:path shows a file as of REV). path limits any of them to a file or "
        "folder; stat=true gives per-file change counts instead of patches. Long output is cut "
        "with a `[... truncated ...]` marker. To commit use git_commit."),
    parameters={
        "type": "object",
        "properties": {
            "subcommand": {"type": "string", "enum": ["status", "diff", "log", "show"],
                           "description": "what to run"},
            "ref": {"type": "string", "description": "revision(s): HEAD~2, main..feature, a commit id"},
            "path": {"type": "string", "description": "limit to this file or folder"},
            "staged": {"type": "boolean", "description": "diff: staged changes instead of unstaged"},
            "stat": {"type": "boolean", "description": "diff/log/show: per-file summary instead of patches"},
            "max_count": {"type": "integer", "minimum": 1, "maximum": 500,
                          "description": "log: how many commits (default 20)"},
        },
        "required": ["subcommand"],
        "additionalProperties": False,
    },
    run=_git,
))


# ---------------------------------------------------------------------------------------- commit

def _git_commit(args: dict, ctx: ToolContext) -> ToolResult:
    g = _git_cmd(ctx)
    message = args["message"].strip()
    if not message:
        raise ToolError("message must not be empty")
    paths = args.get("paths") or []
    if paths:
        _run(g, "add", "--all", "--", *_paths(ctx, paths))
    if args.get("all"):
        _run(g, "add", "--update")          # every change to tracked files, no untracked ones
    status, _ = _run(g, "diff", "--cached", "--quiet", ok=(0, 1))
    if status == 0:
        raise ToolError("nothing is staged to commit; pass paths=[...] (files to add) or all=true "
                        "(all changes to tracked files)")
    _run(g, "commit", f"--message={message}")
    _, head = _run(g, "log", "-1", "--format=%h %D: %s")
    _, summary = _run(g, "show", "--stat", "--format=", "HEAD")
    _, patch = _run(g, "show", "--no-ext-diff", "--no-color", "--format=", "HEAD")
    text, cut = _clip(f"Committed {head.strip()}\n{summary.strip()}", "")
    return ToolResult(text, truncated=cut, diff=truncate(patch, 200_000)[0] or None)


register(Tool(
    name="git_commit",
    description=(
        "Commit to the project's git repository. paths=[...] stages those files or folders first "
        "(new, changed and deleted files under them); all=true stages every change to files git "
        "already tracks (untracked files are not added); with neither, what is already staged is "
        "committed. Fails if nothing is staged. Write a concise message: a summary line, then a "
        "blank line and details if useful. The user is asked to approve the commit. Returns the "
        "new commit's id and changed files."),
    parameters={
        "type": "object",
        "properties": {
            "message": {"type": "string", "description": "the commit message"},
            "paths": {"type": "array", "items": {"type": "string"},
                      "description": "files or folders to stage before committing"},
            "all": {"type": "boolean", "description": "stage all changes to tracked files first"},
        },
        "required": ["message"],
        "additionalProperties": False,
    },
    run=_git_commit,
    needs_approval=True,
))
