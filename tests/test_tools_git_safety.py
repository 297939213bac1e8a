"""git safety of the agent's tools (tools.gitsafe, tools.gitrevs).

1. Nothing a repository's configuration names is executed by a tool that needs no approval (nor by
   git_commit, nor by the start-up's git summary): each case sets one such key to a script that
   creates a marker file, first proves that plain git WOULD run it (so the test can fail), then
   puts the repository through every tool and asserts that no marker appeared.
2. When the project is a subfolder of a larger repository, no git tool call returns a byte of a
   file outside it, whatever the revision argument's shape.
"""
from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest

import tools
from ds4agent.environment import git_summary, system_text
from tools import ToolContext, call, gitpy, gitsafe
from tools.gitrevs import root_path, split_object_path

HOOKS = ["post-index-change", "pre-commit", "prepare-commit-msg", "commit-msg", "post-commit",
         "reference-transaction", "post-checkout", "pre-auto-gc", "post-rewrite", "pre-push",
         "fsmonitor-watchman", "pre-merge-commit", "post-merge"]


class Repo:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.root = tmp / "repo"
        self.marks = tmp / "marks"
        self.bin = tmp / "bin"
        for d in (self.root, self.marks, self.bin):
            d.mkdir()
        self.global_cfg = tmp / "global.gitconfig"
        self.global_cfg.write_text("")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        self.env.update(GIT_CONFIG_GLOBAL=str(self.global_cfg), GIT_CONFIG_NOSYSTEM="1",
                        GIT_TERMINAL_PROMPT="0")
        for k in ("PAGER", "EDITOR", "VISUAL"):
            self.env.pop(k, None)

    def mark(self, name: str) -> str:
        """A program that leaves marks/<name> behind and ignores its arguments and input."""
        p = self.bin / name
        p.write_text(f"#!/bin/sh\ntouch '{self.marks / name}'\nexit 0\n")
        p.chmod(0o755)
        return str(p)

    def git(self, *args: str, check: bool = True, cwd: Path | None = None, **kw) -> str:
        r = subprocess.run(["git", *args], cwd=cwd or self.root, env=kw.pop("env", self.env),
                           capture_output=True, text=True, timeout=60, **kw)
        if check and r.returncode:
            raise AssertionError(f"git {args}: {r.stderr}")
        return r.stdout

    def config(self, key: str, value: str) -> None:
        self.git("config", key, value)

    def found(self) -> set[str]:
        return {p.name for p in self.marks.iterdir()}

    def clear(self) -> None:
        for p in self.marks.iterdir():
            p.unlink()

    def dirty(self) -> None:
        """An unstaged change to a tracked file, an untracked file, a stat-only change."""
        (self.root / "a.txt").write_text(f"changed {time.time()}\n")
        (self.root / "new.txt").write_text("untracked\n")
        os.utime(self.root / "sub" / "b.py", (1_600_000_000, 1_600_000_000))


def make_repo(tmp: Path) -> Repo:
    r = Repo(tmp)
    r.git("init", "-q", "-b", "main")
    r.config("user.email", "t@example.com")
    r.config("user.name", "Tester")
    (r.root / "sub").mkdir()
    (r.root / "a.txt").write_text("one\n")
    (r.root / "sub" / "b.py").write_text("def f():\n    return 1\n")
    (r.root / ".gitattributes").write_text("*.txt diff=x filter=f\n")
    r.git("add", "-A")
    r.git("commit", "-q", "-m", "c1")
    (r.root / "a.txt").write_text("two\n")
    r.git("commit", "-q", "-am", "c2")
    r.dirty()
    return r


def run_on_tty(r: Repo, *args: str) -> None:
    """git with its stdout on a terminal: the only way git starts a pager."""
    master, slave = pty.openpty()
    p = subprocess.Popen(["git", *args], cwd=r.root, env=r.env, stdin=subprocess.DEVNULL,
                         stdout=slave, stderr=slave)
    os.close(slave)
    deadline = time.time() + 30
    while p.poll() is None and time.time() < deadline:
        if select.select([master], [], [], 0.1)[0]:
            try:
                os.read(master, 65536)
            except OSError:
                break
    p.wait(timeout=30)
    os.close(master)


def hooks_into(r: Repo, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for h in HOOKS:
        (folder / h).write_text(f"#!/bin/sh\ntouch '{r.marks / ('hook-' + h)}'\nexit 0\n")
        (folder / h).chmod(0o755)


def hook_triggers(r: Repo) -> None:
    r.git("status")                                   # refreshes b.py's stat: post-index-change
    r.git("commit", "-q", "-am", "hooked", check=False)
    r.git("checkout", "-q", "-b", "other")
    r.git("checkout", "-q", "main")


HOOK_PROOF = {"hook-post-index-change", "hook-pre-commit", "hook-prepare-commit-msg",
              "hook-commit-msg", "hook-post-commit", "hook-reference-transaction",
              "hook-post-checkout"}


def lazy_fetch_repo(r: Repo, url: str) -> None:
    """A partial clone missing one blob: showing it makes git fetch it from the promisor remote."""
    (r.root / "gone.txt").write_text("fetched lazily\n")
    r.git("add", "gone.txt")
    r.git("commit", "-q", "-m", "gone")
    oid = r.git("rev-parse", "HEAD:gone.txt").strip()
    (r.root / ".git" / "objects" / oid[:2] / oid[2:]).unlink()
    r.config("core.repositoryformatversion", "1")
    r.config("extensions.partialClone", "origin")
    r.config("remote.origin.url", url)
    r.config("remote.origin.promisor", "true")


def signed_head(r: Repo) -> None:
    """HEAD becomes a commit carrying a (fake) signature: log.showSignature makes git verify it."""
    tree = r.git("rev-parse", "HEAD^{tree}").strip()
    parent = r.git("rev-parse", "HEAD").strip()
    body = (f"tree {tree}\nparent {parent}\nauthor T <t@example.com> 1700000000 +0000\n"
            "committer T <t@example.com> 1700000000 +0000\ngpgsig -----BEGIN PGP SIGNATURE-----\n"
            " \n iQEzBAABCAAdFiEE\n -----END PGP SIGNATURE-----\n\nsigned\n")
    oid = r.git("hash-object", "-t", "commit", "-w", "--stdin", input=body).strip()
    r.git("update-ref", "refs/heads/main", oid)


def alternates(r: Repo) -> None:
    other = r.tmp / "other"
    r.git("init", "-q", "-b", "main", str(other))
    (other / "o.txt").write_text("o\n")
    r.git("add", "o.txt", cwd=other)
    r.git("-c", "user.name=o", "-c", "user.email=o@example.com", "commit", "-q", "-m", "o", cwd=other)
    (r.root / ".git" / "objects" / "info" / "alternates").write_text(str(other / ".git" / "objects") + "\n")


# name: (set the repository up, run plain git that must leave the marks, the marks it must leave)
CASES = {
    "core.fsmonitor": (lambda r: r.config("core.fsmonitor", r.mark("fsmonitor")),
                       lambda r: r.git("status"), {"fsmonitor"}),
    "fsmonitor-watchman hook": (
        lambda r: (hooks_into(r, r.root / ".git" / "hooks"),
                   r.config("core.fsmonitor", ".git/hooks/fsmonitor-watchman")),
        lambda r: r.git("status"), {"hook-fsmonitor-watchman"}),
    "GIT_CONFIG_PARAMETERS": (
        lambda r: r.env.update(GIT_CONFIG_PARAMETERS=f"'core.fsmonitor'='{r.mark('envconfig')}'"),
        lambda r: r.git("status"), {"envconfig"}),
    "diff.x.textconv": (lambda r: r.config("diff.x.textconv", r.mark("textconv")),
                        lambda r: (r.git("diff"), r.git("show", "HEAD")), {"textconv"}),
    "diff.x.command": (lambda r: r.config("diff.x.command", r.mark("diffcommand")),
                       lambda r: r.git("diff"), {"diffcommand"}),
    "diff.external": (lambda r: r.config("diff.external", r.mark("external")),
                      lambda r: r.git("diff"), {"external"}),
    "GIT_EXTERNAL_DIFF": (lambda r: r.env.update(GIT_EXTERNAL_DIFF=r.mark("envdiff")),
                          lambda r: r.git("diff"), {"envdiff"}),
    "filter clean/smudge": (
        lambda r: (r.config("filter.f.clean", r.mark("clean")),
                   r.config("filter.f.smudge", r.mark("smudge")),
                   r.config("filter.f.required", "true")),
        lambda r: (r.git("diff", check=False), r.git("cat-file", "--filters", "HEAD:a.txt", check=False)),
        {"clean", "smudge"}),
    "filter process": (lambda r: r.config("filter.f.process", r.mark("process")),
                       lambda r: r.git("diff", check=False), {"process"}),
    "hooks": (lambda r: hooks_into(r, r.root / ".git" / "hooks"), hook_triggers, HOOK_PROOF),
    "core.hooksPath": (lambda r: (hooks_into(r, r.tmp / "hookdir"),
                                  r.config("core.hooksPath", str(r.tmp / "hookdir"))),
                       hook_triggers, HOOK_PROOF),
    "core.pager": (lambda r: r.config("core.pager", r.mark("pager")),
                   lambda r: run_on_tty(r, "log"), {"pager"}),
    "pager.<command>": (lambda r: (r.config("pager.log", r.mark("pagerlog")),
                                   r.config("pager.status", r.mark("pagerstatus"))),
                        lambda r: (run_on_tty(r, "log"), run_on_tty(r, "status")),
                        {"pagerlog", "pagerstatus"}),
    "core.sshCommand": (lambda r: r.config("core.sshCommand", r.mark("ssh")),
                        lambda r: r.git("ls-remote", "ssh://example.invalid/x", check=False), {"ssh"}),
    "lazy fetch over ssh": (
        lambda r: (lazy_fetch_repo(r, "ssh://example.invalid/x"), r.config("core.sshCommand", r.mark("lazyssh"))),
        lambda r: r.git("show", "HEAD:gone.txt", check=False), {"lazyssh"}),
    "lazy fetch through ext::": (
        lambda r: (lazy_fetch_repo(r, "ext::" + r.mark("lazyext")), r.config("protocol.ext.allow", "always")),
        lambda r: r.git("show", "HEAD:gone.txt", check=False), {"lazyext"}),
    "core.gitProxy": (
        lambda r: (lazy_fetch_repo(r, "git://example.invalid/x"), r.config("core.gitProxy", r.mark("proxy"))),
        lambda r: r.git("show", "HEAD:gone.txt", check=False), {"proxy"}),
    "credential.helper": (
        lambda r: (r.config("credential.helper", r.mark("credential")),
                   r.config("credential.https://example.invalid.helper", r.mark("credential-url"))),
        lambda r: r.git("credential", "fill", input="protocol=https\nhost=example.invalid\n\n", check=False),
        {"credential", "credential-url"}),
    "include.path": (
        lambda r: ((r.tmp / "inc.gitconfig").write_text(
            f"[core]\n\tfsmonitor = {r.mark('inc-fsmonitor')}\n"
            f"[filter \"f\"]\n\tclean = {r.mark('inc-clean')}\n"
            f"[diff \"x\"]\n\ttextconv = {r.mark('inc-textconv')}\n"),
            r.config("include.path", str(r.tmp / "inc.gitconfig"))),
        lambda r: (r.git("status"), r.git("diff", check=False)),
        {"inc-fsmonitor", "inc-clean", "inc-textconv"}),
    "uploadpack.packObjectsHook (global)": (
        lambda r: r.global_cfg.write_text(f"[uploadpack]\n\tpackObjectsHook = {r.mark('packhook')}\n"),
        lambda r: r.git("clone", "-q", "--no-local", str(r.root), str(r.tmp / "clone"), check=False),
        {"packhook"}),
    "core.editor": (lambda r: r.config("core.editor", r.mark("editor")),
                    lambda r: r.git("commit", "--allow-empty", check=False), {"editor"}),
    "sequence.editor": (lambda r: r.config("sequence.editor", r.mark("seqeditor")),
                        lambda r: r.git("rebase", "-i", "--autostash", "HEAD~1", check=False),
                        {"seqeditor"}),
    "gpg.program + log.showSignature": (
        lambda r: (signed_head(r), r.config("log.showSignature", "true"),
                   r.config("gpg.program", r.mark("gpgverify"))),
        lambda r: r.git("log", "-1"), {"gpgverify"}),
    "gpg.program + commit.gpgSign": (
        lambda r: (r.config("commit.gpgSign", "true"), r.config("gpg.program", r.mark("gpgsign"))),
        lambda r: r.git("commit", "-q", "-am", "signed?", check=False), {"gpgsign"}),
    "core.alternateRefsCommand": (
        lambda r: (alternates(r), r.config("core.alternateRefsCommand", r.mark("altrefs"))),
        lambda r: r.git("fetch", "-q", str(r.tmp / "other"), "main", check=False), {"altrefs"}),
}


def every_tool(r: Repo, ctx: ToolContext) -> dict[str, tools.ToolResult]:
    """Each tool that needs no approval, each git subcommand and argument shape, the start-up's
    git summary, and a commit."""
    calls = {
        "status": ("git", {"subcommand": "status"}),
        "status path": ("git", {"subcommand": "status", "path": "a.txt"}),
        "diff": ("git", {"subcommand": "diff"}),
        "diff stat": ("git", {"subcommand": "diff", "stat": True}),
        "diff staged": ("git", {"subcommand": "diff", "staged": True}),
        "diff HEAD~1": ("git", {"subcommand": "diff", "ref": "HEAD~1"}),
        "diff range": ("git", {"subcommand": "diff", "ref": "HEAD~1 HEAD"}),
        "diff pair": ("git", {"subcommand": "diff", "ref": "HEAD~1:a.txt HEAD:a.txt"}),
        "log": ("git", {"subcommand": "log"}),
        "log stat": ("git", {"subcommand": "log", "stat": True}),
        "log path": ("git", {"subcommand": "log", "path": "a.txt"}),
        "show": ("git", {"subcommand": "show"}),
        "show stat": ("git", {"subcommand": "show", "stat": True, "ref": "HEAD~1"}),
        "show file": ("git", {"subcommand": "show", "ref": "HEAD:a.txt"}),
        "show missing": ("git", {"subcommand": "show", "ref": "HEAD:gone.txt"}),
        "search": ("search", {"pattern": "e"}),
        "list": ("list", {"path": ".", "depth": 3}),
        "outline": ("outline", {"path": "."}),
        "read": ("read", {"path": "a.txt"}),
    }
    out = {k: call(name, args, ctx) for k, (name, args) in calls.items()}
    out["environment"] = tools.ToolResult(system_text(r.root))
    out["commit"] = call("git_commit", {"message": "by the tool", "all": True}, ctx)
    must = {"status", "diff", "log", "search", "list", "commit"}
    if (r.root / "gone.txt").exists():   # a partial clone cannot commit without fetching
        must.discard("commit")
    for k, res in out.items():   # a failing tool proves nothing: these must have run git
        if k in must:
            assert res.ok, (k, res.text)
        assert "Traceback" not in res.text and "Error:" not in res.text, (k, res.text)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_no_repository_program_runs(tmp_path, monkeypatch, case):
    setup, trigger, proof = CASES[case]
    r = make_repo(tmp_path)
    setup(r)
    trigger(r)
    assert proof <= r.found(), f"plain git did not run {proof - r.found()}: the case proves nothing"
    r.clear()
    r.dirty()
    for k in [k for k in os.environ if k.startswith("GIT_")]:
        monkeypatch.delenv(k)
    for k, v in r.env.items():
        if k.startswith("GIT_"):
            monkeypatch.setenv(k, v)        # GIT_EXTERNAL_DIFF too: the tools must drop it
    ctx = ToolContext(root=r.root, scratch=tmp_path / "scratch")
    through_gitpython = gitpy.calls[0]
    try:
        results = every_tool(r, ctx)
    finally:
        tools.close(ctx)
    assert r.found() == set(), f"{case}: a tool ran {r.found()}"
    # the git tool and the summary went through GitPython (tools.gitpy), except where a GIT_*
    # variable it cannot unset is set: then through gitsafe's subprocess
    stray = gitpy.stray_variables(gitsafe.base_env(r.root))
    assert (gitpy.calls[0] > through_gitpython) == (not stray), stray
    assert results["commit"].ok == ("by the tool" in r.git("log", "-1", "--format=%s"))
    assert "changed" in results["diff"].text


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_read_only_tools_write_nothing(tmp_path):
    """Porcelain `git diff` and `git status` rewrite .git/index when a file's stat changed."""
    r = make_repo(tmp_path)
    (r.root / "c.txt").write_text("same\n")
    r.git("add", "c.txt")
    os.utime(r.root / "c.txt", (1_500_000_000, 1_500_000_000))   # stat-dirty, content clean
    before = snapshot(r.root)
    ctx = ToolContext(root=r.root)
    for args in ({"subcommand": "status"}, {"subcommand": "diff"}, {"subcommand": "diff", "ref": "HEAD"},
                 {"subcommand": "diff", "stat": True}, {"subcommand": "diff", "staged": True},
                 {"subcommand": "log"}, {"subcommand": "show"}):
        assert call("git", args, ctx).ok
        assert snapshot(r.root) == before, args
    for name, args in (("search", {"pattern": "e"}), ("list", {"path": ".", "depth": 3}),
                       ("outline", {"path": "."})):
        assert call(name, args, ctx).ok
    git_summary(r.root)
    assert snapshot(r.root) == before


def test_the_users_own_filter_still_applies(tmp_path, monkeypatch):
    """A filter defined in the user's global config (git-lfs) is theirs, not the repository's:
    without it every such file would read as modified."""
    r = make_repo(tmp_path)
    r.global_cfg.write_text("[filter \"f\"]\n\tclean = tr a-z A-Z\n\tsmudge = cat\n")
    (r.root / "a.txt").write_text("hello\n")
    r.git("add", "a.txt")
    r.git("commit", "-q", "-m", "filtered")
    assert r.git("show", "HEAD:a.txt") == "HELLO\n"
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(r.global_cfg))
    ctx = ToolContext(root=r.root)
    os.utime(r.root / "a.txt", (1_500_000_000, 1_500_000_000))   # git must compare the content
    assert " a.txt" not in call("git", {"subcommand": "status"}, ctx).text
    r.global_cfg.write_text("")                 # the same driver from the repository: disabled
    r.config("filter.f.clean", "tr a-z A-Z")
    assert " M a.txt" in call("git", {"subcommand": "status"}, ctx).text


def test_the_users_lfs_filter_is_off_where_the_repository_names_lfs_programs():
    """git-lfs's own config can name programs (lfs.extension.<x>.clean, custom transfer agents);
    where the repository sets one, the user's filters are disabled like the repository's."""
    from tools.gitsafe import driver_overrides
    user = [("global", "filter.lfs.clean"), ("global", "filter.lfs.process")]
    assert not [k for k, _ in driver_overrides(user) if k.startswith("filter.lfs.")]
    for key in ("lfs.extension.x.clean", "lfs.customtransfer.y.path", "lfs.standalonetransferagent"):
        got = dict(driver_overrides(user + [("local", key)]))
        assert got["filter.lfs.clean"] == "" and got["filter.lfs.process"] == "", key
    assert not [k for k, _ in driver_overrides(user + [("global", "lfs.extension.x.clean")])
                if k.startswith("filter.lfs.")]                 # the user's own lfs settings


def test_status_is_not_hidden_by_the_repository(tmp_path):
    r = make_repo(tmp_path)
    r.config("status.showUntrackedFiles", "no")
    ctx = ToolContext(root=r.root)
    assert "?? new.txt" in call("git", {"subcommand": "status"}, ctx).text
    assert "1 staged" not in git_summary(r.root) and "2 modified or untracked" in git_summary(r.root)


def test_embedded_bare_repository(tmp_path):
    """A bare repository committed inside the project is found by git first when a command runs
    in it (search or list of that folder, or the agent opened there); its config is the cloner's."""
    r = make_repo(tmp_path)
    evil = r.root / "evil.git"
    r.git("init", "-q", "--bare", str(evil))
    r.git("config", "core.fsmonitor", r.mark("embedded"), cwd=evil)
    r.git("config", "core.bare", "false", cwd=evil)
    r.git("config", "core.worktree", "..", cwd=evil)
    r.git("status", cwd=evil)
    assert r.found() == {"embedded"}
    r.clear()
    ctx, inner = ToolContext(root=r.root), ToolContext(root=evil)
    call("search", {"pattern": "x", "path": "evil.git"}, ctx)
    call("list", {"path": "evil.git", "depth": 3}, ctx)
    call("outline", {"path": "evil.git"}, ctx)
    for sub in ("status", "diff", "log", "show"):
        call("git", {"subcommand": sub}, inner)
    system_text(evil)
    assert r.found() == set()


def test_a_git_too_old_for_the_overrides_is_not_run(tmp_path, monkeypatch):
    import tools.gitsafe as gitsafe
    r = make_repo(tmp_path)
    r.config("core.fsmonitor", r.mark("old"))
    monkeypatch.setattr(gitsafe, "MIN_VERSION", (99, 0))
    ctx = ToolContext(root=r.root)
    assert "too old to run safely" in call("git", {"subcommand": "status"}, ctx).text
    assert "sub/b.py" in call("search", {"pattern": "return"}, ctx).text     # a walk instead
    assert "git unavailable" in git_summary(r.root)
    assert r.found() == set()


def test_core_worktree_cannot_point_outside(tmp_path):
    """A repository's core.worktree would make git compare its files with another folder's."""
    r = make_repo(tmp_path)
    elsewhere = tmp_path / "home"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "a.txt").write_text("PRIVATE-KEY-MATERIAL\n")
    r.config("core.worktree", str(elsewhere))
    assert "PRIVATE-KEY-MATERIAL" in r.git("diff", "--no-ext-diff", "--no-textconv")   # plain git
    ctx = ToolContext(root=r.root)
    for sub in ("status", "diff", "show", "log"):
        assert "PRIVATE-KEY-MATERIAL" not in call("git", {"subcommand": sub}, ctx).text
    assert "PRIVATE-KEY-MATERIAL" not in call("search", {"pattern": "PRIVATE"}, ctx).text


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "protocol.file.allow=always",
                           *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.mark.parametrize("how", ["gitdir file", "symlink", "commondir"])
def test_a_git_pointer_to_another_repository_is_not_followed(tmp_path, how):
    """A project unpacked from an archive can carry a `.git` file (`gitdir: ../victim/.git`), a
    `.git` symlink or a `commondir` file naming another repository on the disk: git would then
    show that repository's files. The tools refuse it (search and list walk the folder instead)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    _git(victim, "init", "-q")
    (victim / "key").write_text("VICTIM-SECRET-91\n")
    _git(victim, "add", "key")
    _git(victim, "commit", "-qm", "s")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "a.txt").write_text("hello\n")
    if how == "gitdir file":
        (proj / ".git").write_text("gitdir: ../victim/.git\n")
    elif how == "symlink":
        (proj / ".git").symlink_to(victim / ".git")
    else:
        for d in ("refs", "objects"):
            (proj / ".git" / d).mkdir(parents=True)
        (proj / ".git" / "HEAD").write_text((victim / ".git" / "HEAD").read_text())
        (proj / ".git" / "commondir").write_text("../../victim/.git\n")
    assert "VICTIM-SECRET-91" in _git(proj, "log", "-p")               # plain git follows it
    ctx = ToolContext(root=proj)
    for args in ({"subcommand": "log"}, {"subcommand": "show"}, {"subcommand": "status"},
                 {"subcommand": "show", "ref": "HEAD:key"}, {"subcommand": "diff", "ref": "HEAD"}):
        assert "VICTIM-SECRET-91" not in call("git", args, ctx).text, args
    assert "a.txt" in call("list", {"path": "."}, ctx).text
    assert "VICTIM-SECRET-91" not in call("search", {"pattern": "VICTIM"}, ctx).text
    assert "VICTIM-SECRET-91" not in system_text(proj)


def test_linked_work_trees_and_submodules_still_work(tmp_path):
    main = tmp_path / "main"
    main.mkdir()
    _git(main, "init", "-q")
    (main / "a.txt").write_text("in main\n")
    _git(main, "add", "a.txt")
    _git(main, "commit", "-qm", "first")
    _git(main, "worktree", "add", "-q", str(tmp_path / "wt"))
    res = call("git", {"subcommand": "log"}, ToolContext(root=tmp_path / "wt"))
    assert res.ok and "first" in res.text, res.text
    sup = tmp_path / "super"
    sup.mkdir()
    _git(sup, "init", "-q")
    _git(sup, "submodule", "add", "-q", str(main), "sub")
    assert (sup / "sub" / ".git").is_file()
    res = call("git", {"subcommand": "log"}, ToolContext(root=sup / "sub"))
    assert res.ok and "first" in res.text, res.text


# ---------------------------------------------------------------------------------------- item 9

SECRET = "TOP-SECRET-6f1d"


@pytest.fixture
def mono(tmp_path) -> Repo:
    """A repository whose root holds secret.txt; the project is its subfolder proj/."""
    r = Repo(tmp_path)
    r.git("init", "-q", "-b", "main")
    r.config("user.email", "t@example.com")
    r.config("user.name", "Tester")
    (r.root / "proj").mkdir()
    (r.root / "secret.txt").write_text(f"{SECRET} v1\n")
    (r.root / "proj" / "a.txt").write_text("project file\n")
    r.git("add", "-A")
    r.git("commit", "-q", "-m", "c1")
    (r.root / "secret.txt").write_text(f"{SECRET} v2\n")
    (r.root / "proj" / "a.txt").write_text("project file v2\n")
    r.git("commit", "-q", "-am", "c2 touches both")
    (r.root / "secret.txt").write_text(f"{SECRET} dirty\n")            # unstaged outside
    (r.root / "proj" / "a.txt").write_text("project file dirty\n")
    blob = r.git("rev-parse", "HEAD:secret.txt").strip()
    r.git("tag", "blobtag", blob)
    r.git("tag", "treetag", r.git("rev-parse", "HEAD^{tree}").strip())
    r.git("tag", "-a", "-m", "annotated", "blobtag-a", blob)
    return r


def ref_shapes(r: Repo) -> list[str]:
    blob = r.git("rev-parse", "HEAD:secret.txt").strip()
    tree = r.git("rev-parse", "HEAD^{tree}").strip()
    return ["HEAD:secret.txt", "HEAD:../secret.txt", "HEAD:./../secret.txt", "HEAD:proj/../secret.txt",
            ":secret.txt", ":0:secret.txt", ":../secret.txt", ":./../secret.txt", "HEAD^{tree}", "HEAD:",
            "HEAD~1:", "HEAD:/secret.txt", blob, blob[:8], tree, "blobtag", "blobtag-a", "treetag",
            "main:secret.txt", "HEAD@{0}:secret.txt", "HEAD^{/c1}:secret.txt", ":/c1", "HEAD~1..HEAD",
            "HEAD~1...HEAD", "HEAD", "HEAD~1", "HEAD HEAD~1", "HEAD~1:secret.txt HEAD:secret.txt",
            "HEAD:secret.txt HEAD:proj/a.txt", "HEAD:proj/a.txt HEAD:secret.txt", "HEAD~1: HEAD:",
            "HEAD:proj", "HEAD^!", "^HEAD~1 HEAD", "HEAD^{commit}^{tree}", f"{blob}:", "HEAD:.",
            "HEAD~1:./a.txt HEAD:secret.txt", "HEAD^{tree}:secret.txt", f"{tree}:secret.txt",
            # git splits at '..' before it reads REV:path: two objects, one of them outside
            "HEAD:proj/a.txt..HEAD:../secret.txt", "HEAD~1:./a.txt..HEAD:../secret.txt",
            "HEAD:proj/a.txt...HEAD:secret.txt", "HEAD:..HEAD:../secret.txt"]


def shown_outside(r: Repo, extras: list[dict]) -> int:
    """Every git subcommand with every revision shape and each of `extras`: asserts that the
    secret never appears; returns how many calls succeeded."""
    ctx = ToolContext(root=r.root / "proj")
    r.git("add", "secret.txt")          # a staged change outside too
    (r.root / "secret.txt").write_text(f"{SECRET} dirty again\n")
    seen = 0
    for sub in ("status", "diff", "log", "show"):
        for ref in [None, *ref_shapes(r)]:
            for extra in extras:
                args = {"subcommand": sub, **extra, **({"ref": ref} if ref else {})}
                res = call("git", args, ctx)
                assert SECRET not in res.text, (args, res.text)
                assert "Traceback" not in res.text
                seen += res.ok
    return seen


def test_nothing_outside_the_project_is_shown(mono):
    assert shown_outside(mono, [{}, {"stat": True}]) > 30   # most shapes inside the project work
    ctx = ToolContext(root=mono.root / "proj")
    commit = call("git_commit", {"message": "project only", "all": True}, ctx)
    assert commit.ok and SECRET not in commit.text and SECRET not in (commit.diff or "")
    assert mono.git("diff", "--name-only") == "secret.txt\n"     # all=true left the outside change alone


@pytest.mark.slow
def test_nothing_outside_the_project_is_shown_with_any_path(mono):
    extras = [{"path": "."}, {"path": "a.txt"}, {"path": "../secret.txt"}, {"staged": True},
              {"staged": True, "stat": True}, {"path": ".", "stat": True}]
    assert shown_outside(mono, extras) > 30


def test_project_files_are_shown(mono):
    ctx = ToolContext(root=mono.root / "proj")

    def ok(args):
        res = call("git", args, ctx)
        assert res.ok, (args, res.text)
        return res.text
    assert ok({"subcommand": "show", "ref": "HEAD:./a.txt"}) == "project file v2\n"
    assert ok({"subcommand": "show", "ref": "HEAD~1:proj/a.txt"}) == "project file\n"
    assert "a.txt" in ok({"subcommand": "show", "ref": "HEAD:proj"})
    assert "+project file v2" in ok({"subcommand": "diff", "ref": "HEAD~1:proj/a.txt HEAD:./a.txt"})
    assert "+project file v2" in ok({"subcommand": "show", "ref": "HEAD"})
    assert "c2 touches both" in ok({"subcommand": "log", "ref": "HEAD~1..HEAD"})
    assert "project file dirty" in ok({"subcommand": "diff"})
    for ref, why in (("HEAD:secret.txt", "outside the project"), ("blobtag", "is a blob, not a commit"),
                     ("treetag", "is a tree, not a commit"), ("nosuch", "unknown revision"),
                     ("--output=/tmp/x", "looks like an option")):
        res = call("git", {"subcommand": "show", "ref": ref}, ctx)
        assert not res.ok and why in res.text, (ref, res.text)
    assert "outside the project" in call("git", {"subcommand": "diff", "path": "../secret.txt"}, ctx).text
    # the user may allow paths outside the project: then the parent's files are theirs to see
    wide = ToolContext(root=mono.root / "proj", allow_outside=True)
    assert SECRET in call("git", {"subcommand": "show", "ref": "HEAD:secret.txt"}, wide).text


def test_pathspec_magic_in_a_path_is_literal(mono):
    ctx = ToolContext(root=mono.root / "proj")
    (mono.root / "proj" / ":(top)secret.txt").write_text("decoy\n")
    for sub in ("status", "diff", "log", "show"):
        res = call("git", {"subcommand": sub, "path": ":(top)secret.txt"}, ctx)
        assert SECRET not in res.text, res.text


def test_start_up_summary_counts_the_project_only(mono):
    assert git_summary(mono.root / "proj") == "branch main, 0 staged, 1 modified or untracked"
    assert git_summary(mono.root) == "branch main, 0 staged, 2 modified or untracked"


def test_revision_paths():
    assert split_object_path("HEAD:a/b") == ("HEAD:", "a/b")
    assert split_object_path("HEAD@{1:2}:x") == ("HEAD@{1:2}:", "x")
    assert split_object_path(":1:x") == (":1:", "x")
    assert split_object_path(":x:y") == (":", "x:y")
    assert split_object_path(":/fix: it") is None and split_object_path("main..dev") is None
    assert root_path("proj", "./a") == "proj/a" and root_path("proj", "../x") == "x"
    assert root_path("proj", "a") == "a" and root_path("", "") == "" and root_path("p", "p/./q/..") == "p"


def _many_drivers(r: Repo, n: int) -> None:
    clean, smudge = r.mark("clean"), r.mark("smudge")
    with open(r.root / ".git" / "config", "a") as f:
        f.write("".join(f'[filter "f{i}"]\n\tclean = {clean}\n\tsmudge = {smudge}\n' for i in range(n)))
    with open(r.root / ".gitattributes", "a") as f:
        f.write(f"*.py filter=f{n - 1}\n")       # the last one applies, so a missed override shows


def test_thousands_of_drivers_are_refused_in_one_line_and_fast(tmp_path, monkeypatch):
    """8,000 filter drivers took 22 s per git call (a list's `in` to dedupe) and then git could
    not even start (its environment too large): past MAX_DRIVERS the git tools refuse in one
    line naming the cap, quickly, and run nothing; under it git runs with every one off."""
    import tools.gitsafe as gitsafe
    r = make_repo(tmp_path)
    _many_drivers(r, 8000)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(r.global_cfg))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    ctx = ToolContext(root=r.root)
    t = time.monotonic()
    res = call("git", {"subcommand": "status"}, ctx)
    took = time.monotonic() - t
    assert not res.ok and f"more than {gitsafe.MAX_DRIVERS}" in res.text and "\n" not in res.text.strip()
    assert took < 5, took
    assert "more than" in git_summary(r.root)
    assert r.found() == set()


def test_driver_overrides_are_linear_and_under_the_cap_all_apply(tmp_path, monkeypatch):
    import tools.gitsafe as gitsafe
    from tools.gitsafe import driver_overrides
    entries = [("local", f"diff.d{i}.textconv") for i in range(20000)] * 2
    monkeypatch.setattr(gitsafe, "MAX_DRIVERS", 10**6)
    t = time.monotonic()
    got = driver_overrides(entries)
    assert time.monotonic() - t < 1.0 and len(got) == 20000
    monkeypatch.undo()
    r = make_repo(tmp_path)
    _many_drivers(r, 500)
    (r.root / "sub" / "b.py").write_text("changed\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(r.global_cfg))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    res = call("git", {"subcommand": "status"}, ToolContext(root=r.root))
    assert res.ok and "sub/b.py" in res.text
    assert call("git", {"subcommand": "diff"}, ToolContext(root=r.root)).ok
    assert r.found() == set()
