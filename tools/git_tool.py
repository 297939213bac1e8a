"""git (status, diff, log, show: read-only, no approval) and git_commit (asks approval).

Two tools rather than one with a `commit` subcommand, so that approval is a property of the tool:
the caller asks before git_commit and never before reading history. Every command goes through
tools.gitsafe (no program the repository names is ever run: fsmonitor, textconv, filters, hooks,
pagers, gpg, transports; the read commands run through GitPython, given the same environment and
command line by tools.gitpy), and every revision argument through tools.gitrevs (no file outside
the project is shown when the project is a subfolder of a larger repository).
"""
from __future__ import annotations

import os

from . import gitpy, gitrevs, gitsafe
from .base import MAX_RESULT_CHARS, Tool, ToolContext, ToolError, ToolResult, register, truncate


def _open(make, ctx: ToolContext):
    """make(root) as the tools' git, its refusals as tool errors."""
    try:
        return make(ctx.root)
    except gitsafe.NotARepository:
        raise ToolError("the project directory is not inside a git repository") from None
    except gitsafe.GitError as e:
        raise ToolError(str(e)) from None


def _git_cmd(ctx: ToolContext) -> gitsafe.Git:
    return _open(gitsafe.Git, ctx)


def _git_read(ctx: ToolContext) -> gitpy.SafeGit:
    """The read commands' git: GitPython, with gitsafe's environment and command line."""
    return _open(gitpy.safe_git, ctx)


def _run(g: gitsafe.Git | gitpy.SafeGit, *args: str, ok=(0,)) -> tuple[int, str]:
    try:
        status, out, err = g.text(*args)
    except gitsafe.GitError as e:
        raise ToolError(str(e)) from None
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


def _scope(g: gitsafe.Git | gitpy.SafeGit, ctx: ToolContext, args: dict) -> list[str]:
    """The pathspec: the path asked for, else the project when it is a subfolder of the
    repository (so diffs, logs and commits never show a file outside it)."""
    if args.get("path"):
        return ["--", *_paths(ctx, [args["path"]])]
    if g.prefix and not ctx.allow_outside:
        return ["--", "."]
    return []


def _clip(text: str, hint: str) -> tuple[str, bool]:
    return truncate(text, MAX_RESULT_CHARS, where=hint)


# ---------------------------------------------------------------------------------------- git

def _git(args: dict, ctx: ToolContext) -> ToolResult:
    g = _git_read(ctx)
    sub = args["subcommand"]
    refs, objects = gitrevs.confine(g, _refs(args.get("ref")), sub, allow_outside=ctx.allow_outside)
    scope = _scope(g, ctx, args)
    if args.get("staged") and sub != "diff":
        raise ToolError("staged applies to subcommand=diff only")
    if args.get("max_count") is not None and sub != "log":
        raise ToolError("max_count applies to subcommand=log only")
    if sub == "status":
        if refs:
            raise ToolError("status takes no ref")
        return _status(g, scope)
    if sub == "diff":
        return _diff(g, args, refs, objects, scope)
    if sub == "log":
        if objects:
            raise ToolError("log takes revisions, not REV:path (give path= to limit it to a file)")
        return _log(g, args, refs, scope)
    cmd = ["show", "--no-color", "--format=fuller"]
    cmd += ["--stat"] if args.get("stat") else ["--stat", "--patch"]
    _, out = _run(g, *cmd, *(refs or ["HEAD"]), *scope)
    text, cut = _clip(out, "use stat=true or path= to narrow it")
    return ToolResult(text, truncated=cut)


def _status(g: gitpy.SafeGit, scope: list[str]) -> ToolResult:
    # the repository's status.showUntrackedFiles cannot hide untracked files (or list every one);
    # submodules are not entered (each would be a repository with its own config)
    _, out = _run(g, "status", "--short", "--branch", "--untracked-files=normal",
                  "--ignore-submodules=dirty", *scope)
    lines = out.splitlines()
    if len(lines) <= 1:
        out += "\n(nothing to commit: the working tree is clean)"
    else:
        out += ("\n(XY codes: X = staged, Y = not staged; M modified, A added, D deleted, "
                "R renamed, ?? untracked)")
    text, cut = _clip(out, "give path= to narrow it")
    return ToolResult(text, truncated=cut)


def _diff(g: gitpy.SafeGit, args: dict, refs: list[str], objects: int, scope: list[str]) -> ToolResult:
    if objects:
        # two files or folders as of revisions (REV:path REV:path) compare with each other only;
        # a single tree would be compared with the whole work tree, outside files included
        if objects != 2 or len(refs) != 2 or args.get("path") or args.get("staged"):
            raise ToolError("REV:path works in diff only as a pair (ref=\"HEAD~1:a.py HEAD:a.py\"), "
                            "without path= or staged; to compare a file with a revision give ref=REV "
                            "and path=FILE")
        scope = []
    # the work tree is compared by git's plumbing (diff-files, diff-index): porcelain `git diff`
    # rewrites .git/index when a file's stat changed but not its content, and a read-only tool
    # writes nothing
    worktree = not args.get("staged") and (not refs or len(refs) == 1 and ".." not in refs[0])
    if worktree and not objects:
        cmd = ["diff-index" if refs else "diff-files", "-M"]
    else:
        cmd = ["diff", "--cached"] if args.get("staged") else ["diff"]
    cmd += ["--no-color", "--ignore-submodules=dirty", "--stat" if args.get("stat") else "-p"]
    _, out = _run(g, *cmd, *refs, *scope)
    if not out.strip():
        what = ("the index (staged) vs HEAD" if args.get("staged") else
                f"the working tree vs {' '.join(refs)}" if refs else
                "the working tree vs the index (unstaged changes; staged=true shows staged ones)")
        return ToolResult(f"no differences: {what}; untracked files are not shown by diff")
    text, cut = _clip(out, "use stat=true for a summary or path= to narrow it")
    return ToolResult(text, truncated=cut)


def _log(g: gitpy.SafeGit, args: dict, refs: list[str], scope: list[str]) -> ToolResult:
    n = args.get("max_count", 20)
    stat = args.get("stat", False)
    # \x1e starts each commit, so commits can be counted with or without --stat; one more
    # than asked for is fetched to know whether there are more
    cmd = ["log", f"--max-count={n + 1}", "--date=short", "--format=%x1e%h %ad %an%d: %s"]
    if stat:
        cmd.append("--stat")
    _, out = _run(g, *cmd, *refs, *scope)
    entries = [e.strip("\n") for e in out.split("\x1e") if e.strip()]
    if not entries:
        return ToolResult("no commits" + (" touching that path" if args.get("path") else ""))
    text, cut = _clip(("\n\n" if stat else "\n").join(entries[:n]), "lower max_count or give path=")
    if len(entries) > n:
        text += f"\n[... truncated: older commits not shown; raise max_count (now {n}) or give ref= ...]"
        cut = True
    return ToolResult(text, truncated=cut)


register(Tool(
    name="git",
    description=(
        "Read the git repository of the project (nothing is changed). subcommand: `status` "
        "(branch and changed/untracked files, short format), `diff` (unstaged changes; "
        "staged=true for staged ones; ref=REV compares the working tree with REV, ref=\"A B\" or "
        "\"A..B\" two revisions), `log` (recent commits, one line each: hash date author: "
        "subject; max_count, default 20), `show` (a commit's message, stats and patch; ref "
        "default HEAD; ref=REV:path shows a file as of REV: the path starts at the repository's "
        "root, REV:./path at the project). path limits any of them to a file or "
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
    project = _scope(g, ctx, {})             # in a larger repository: only the project's files
    if args.get("all"):
        _run(g, "add", "--update", *project)   # every change to tracked files, no untracked ones
    status, _ = _run(g, "diff", "--cached", "--quiet", ok=(0, 1))
    if status == 0:
        raise ToolError("nothing is staged to commit; pass paths=[...] (files to add) or all=true "
                        "(all changes to tracked files)")
    # no hook runs (gitsafe points core.hooksPath at nothing; --no-verify says it here too) and
    # nothing is signed: the user approved a commit, not the repository's programs
    _run(g, "commit", "--no-verify", f"--message={message}")
    _, head = _run(g, "log", "-1", "--format=%h %D: %s")
    _, summary = _run(g, "show", "--stat", "--format=", "HEAD")
    _, patch = _run(g, "show", "--no-color", "--format=", "HEAD", *project)
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
