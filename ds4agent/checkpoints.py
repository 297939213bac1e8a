"""Checkpoints before every tool call that can change files, and /undo, /redo, /checkpoints.

Before an approved `write`, `edit`, `bash` or `git_commit` runs (or an MCP tool not annotated
read-only), the work tree is checkpointed
(tools/checkpoints.py: a commit on refs/ds4-agent/<branch>/<n>, nothing of the user's touched); after
it, the tree it left is recorded too (`<n>-after`), with the files the step changed. A checkpoint's
message (JSON) records its turn, time, the step before it, and where its turn started on the KV
timeline: the position, the pending-EOS flag, the transcript length, a hash of the tokens and the
saved session that was the timeline then. A conversation can only resume at a turn boundary (half a
turn cannot be continued), so /undo takes the files back to a step and the conversation back to the
start of that step's turn: in place (Session.rewind) when the state can be cut there, else by
loading the session saved at turn start. Nothing is ever re-prefilled: when neither works only the
files go back, after asking.

Before it restores, /undo snapshots the files as they are and saves the session, so /redo can put
both back (the session by loading it: no prefill) while nothing new has happened. Files whose
content differs from what the agent last left (someone else changed them) are listed and asked
about before being overwritten; `n` keeps them.

Everything runs on the agent's worker thread. A checkpoint that fails (no git, a time limit) is one
warning and the tool runs anyway.
"""
from __future__ import annotations

import hashlib
import os
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from sessions import KVFileError, SessionStoreError, read_header
from tools.checkpoints import MAX_FILE, CheckpointError, CheckpointRepo, CheckpointTimeout, Ref

from . import events as E
from .home import agent_home

CHANGING = frozenset({"write", "edit", "bash", "git_commit"})
KEEP_STEPS = 200          # checkpoints kept per branch (older refs deleted; git's objects dedupe)
LIST_ROWS = 30
# Turn-start sessions kept as hard links beside the shadow repositories: the store prunes a save
# once the next save continues it (sessions/store.py), which is at the end of the very turn /undo
# goes back to; a link keeps the file (no copy, no disk until the store's name is gone).
KEEP_KV = 4


@dataclass
class Step:
    n: int
    ref: Ref
    after: Ref | None = None

    @property
    def meta(self) -> dict:
        return self.ref.meta

    @property
    def turn_key(self):      # the steps of one turn share their turn's start
        s = self.meta.get("start") or {}
        return (self.meta.get("turn"), s.get("pos"), s.get("tok"))

    @property
    def files(self) -> list[str]:
        return list((self.after.meta if self.after else {}).get("files") or [])


@dataclass
class Redo:
    branch: str
    tree: str                # the files before the undo
    sha: str | None          # the session saved before the undo
    head: int
    left: str | None
    transcript: list
    eos: bool
    tok_after: str = ""      # the timeline right after the undo: redo only while it is unchanged


def tokens_hash(tokens) -> str:
    return hashlib.sha1(array("i", tokens).tobytes()).hexdigest()


class Checkpoints:
    def __init__(self, agent, shadow_root: Path | None = None):
        self.agent = agent
        self.enabled = bool(getattr(agent.cfg, "checkpoints", True))
        self.off_why = "checkpoints = false in the config"
        store = agent.store
        self.shadow_root = shadow_root or (Path(store.root).parent / "checkpoints" if store is not None
                                           else agent_home() / "checkpoints")
        self._repo: CheckpointRepo | None = None
        self._branch: str | None = None       # the branch whose steps are cached
        self._steps: dict[int, Step] = {}
        self._head = 0                        # the newest step whose change is in the files
        self._left: str | None = None         # the tree the agent last left the files as
        self._start: dict | None = None       # this turn's start on the timeline
        self._pending: Step | None = None
        self._note = ""                       # said to the model with the next user message ...
        self._note_tok = ""                   # ... if the timeline is still the one the undo left
        self._redo: Redo | None = None
        self._warned: set[str] = set()
        self.last_ms = 0.0                    # the last checkpoint's time (tests, benchmarks)

    # -- hooks (agent.py) -------------------------------------------------------------------------
    def turn_started(self, text: str) -> str:
        """At the start of a user turn: record where it starts; returns the message to send."""
        a = self.agent
        self._drop_redo()
        self._start = {"pos": a.session.pos, "eos": a.pending_eos, "tlen": len(a.transcript),
                       "sha": a.current_sha if not a.modified else None, "tok": tokens_hash(a.session.tokens),
                       "turn": 1 + sum(1 for m in a.transcript if m.role == "user")}
        # the note belongs to the timeline the undo left (not to one /switch or /new brought)
        note = self._note if self._note_tok == self._start["tok"] else ""
        self._note = ""
        return note + text

    def before_tool(self, name: str):
        self._pending = None
        if not self.enabled or not self._changes_files(name):
            return
        self._drop_redo()
        t0 = time.perf_counter()
        try:
            repo, branch = self._load()
            tree = repo.snapshot(branch)
            if repo.skipped:
                self._warn(f"left out of checkpoints (over {MAX_FILE >> 20} MB, /undo will not restore them): "
                           f"{', '.join(repo.skipped[:3])}{' ...' if len(repo.skipped) > 3 else ''}")
            n = max(self._steps, default=0) + 1
            prev = self._steps.get(self._head)
            start = self._start or self._start_now()
            meta = {"n": n, "turn": start["turn"], "time": round(time.time(), 3), "prev": self._head,
                    "tool": name, "start": {k: start[k] for k in ("pos", "eos", "tlen", "sha", "tok")}}
            parent = (prev.after or prev.ref).commit if prev else None
            step = Step(n, Ref(str(n), repo.commit(branch, str(n), tree, meta, parent, also=("head",)), tree, meta))
            if start["sha"] and (prev is None or prev.turn_key != step.turn_key):
                self._keep_start(start["sha"])      # the turn's first step
            self._steps[n], self._head, self._pending = step, n, step
            self._bound(repo, branch)
        except CheckpointTimeout as e:
            # every later call would wait as long again: off for this session
            self.enabled, self.off_why = False, "git took too long on this work tree"
            self._warn(f"no checkpoint before this {name} call: {e}; checkpoints are off for this session")
        except CheckpointError as e:
            self._warn(f"no checkpoint before this {name} call: {e}")
        self.last_ms = (time.perf_counter() - t0) * 1000

    def forked(self, parent: str):
        """/fork: the new branch (agent.branch now) starts with the parent's checkpoints, as copied
        refs (the same commits), so /undo on the fork goes back through the history both share and
        neither branch's undo moves the other's refs."""
        if not self.enabled:
            return
        try:
            if self._repo is None:
                self._repo = CheckpointRepo(self.agent.project_dir, self.shadow_root)
            self._repo.copy_refs(parent, self.agent.branch)
            self._branch = None         # read the new branch's steps on next use
        except CheckpointError as e:
            self.agent.emit(E.Notice(f"the fork starts with no checkpoints: {e}", "warning"))

    def _changes_files(self, name: str) -> bool:
        # an MCP server's tool (a filesystem server writes files) too, unless annotated read-only
        mcp = getattr(self.agent, "mcp", None)
        return name in CHANGING or (mcp is not None and mcp.owns(name) and mcp.changes_files(name))

    def after_tool(self, name: str):
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            repo, branch = self._load()
            tree = repo.snapshot(branch)
            files = [p for _, p in repo.changes(step.ref.tree, tree)]
            meta = {"n": step.n, "files": files[:500], "n_files": len(files)}
            step.after = Ref(f"{step.n}-after", repo.commit(branch, f"{step.n}-after", tree, meta, step.ref.commit),
                             tree, meta)
            self._left = tree
        except CheckpointError as e:
            self._warn(f"could not record the files after this {name} call: {e}")

    def command(self, cmd: str, arg: str) -> str:
        if not self.enabled:
            return f"checkpoints are off ({self.off_why})"
        try:
            if cmd == "/checkpoints":
                return self.listing()
            if cmd == "/redo":
                return self.redo()
            return self.undo(arg)
        except CheckpointError as e:
            return f"{cmd[1:]} failed: {e}"

    # -- state ------------------------------------------------------------------------------------
    def _start_now(self) -> dict:
        a = self.agent
        return {"pos": a.session.pos, "eos": a.pending_eos, "tlen": len(a.transcript), "sha": None,
                "tok": tokens_hash(a.session.tokens), "turn": sum(1 for m in a.transcript if m.role == "user")}

    def _load(self) -> tuple[CheckpointRepo, str]:
        """The repository, and this branch's steps (read from its refs when the branch changed:
        a /switch, a /fork, a restart)."""
        if self._repo is None:
            self._repo = CheckpointRepo(self.agent.project_dir, self.shadow_root)
        branch = self.agent.branch
        if branch != self._branch:
            refs = self._repo.refs(branch)
            self._steps = {int(k): Step(int(k), r, refs.get(f"{k}-after"))
                           for k, r in refs.items() if k.isdigit()}
            head = refs.get("head")
            self._head = int(head.meta.get("n", 0)) if head else max(self._steps, default=0)
            last = self._steps.get(self._head)
            self._left = last.after.tree if last and last.after else None
            self._branch = branch
        return self._repo, branch

    def _applied(self) -> list[Step]:
        """The steps whose changes are in the files, oldest first (each names the one before it)."""
        out, n, seen = [], self._head, set()
        while n and n in self._steps and n not in seen:
            seen.add(n)
            out.append(self._steps[n])
            n = int(self._steps[n].meta.get("prev") or 0)
        return out[::-1]

    def _set_head(self, repo: CheckpointRepo, branch: str, n: int):
        self._head = n
        step = self._steps.get(n)
        if step is None:
            repo.delete(branch, ["head"])
        else:
            repo.set_ref(branch, "head", step.ref.commit)

    def _bound(self, repo: CheckpointRepo, branch: str):
        old = sorted(self._steps)[:-KEEP_STEPS]
        if old:
            repo.delete(branch, [x for k in old for x in (str(k), f"{k}-after")])
            for k in old:
                del self._steps[k]

    def _keep_start(self, sha: str):
        store, d = self.agent.store, self.shadow_root / "kv"
        try:
            d.mkdir(parents=True, exist_ok=True)
            if not (d / f"{sha}.kv").exists():
                os.link(store.kv_path(sha), d / f"{sha}.kv")
            kept = sorted(d.glob("*.kv"), key=lambda p: p.stat().st_ctime, reverse=True)
            for old in kept[KEEP_KV:]:
                old.unlink()
        except OSError:
            pass          # (another file system: no link; /undo then cuts back in place or says why not)

    def _unkeep(self, sha: str) -> bool:
        """Put a kept turn-start session back in the store (linked; its KV file only: a record
        written then could name it, and the name has moved on since): whether it is there now."""
        store = self.agent.store
        try:
            if not os.path.exists(store.kv_path(sha)):
                os.link(self.shadow_root / "kv" / f"{sha}.kv", store.kv_path(sha))
            return store.info(sha).ok
        except (OSError, SessionStoreError):
            return False

    def _warn(self, msg: str):
        if msg not in self._warned:
            self._warned.add(msg)
            self.agent.emit(E.Notice(msg + " (the tool runs anyway)", "warning"))

    # -- /checkpoints -----------------------------------------------------------------------------
    def listing(self) -> str:
        self._load()
        if not self._steps:
            return "no checkpoints yet on this timeline (one is taken before each write, edit, bash, git_commit)"
        applied = {s.n for s in self._applied()}
        rows = [f"checkpoints of this timeline ({len(self._steps)}; > marks where the files are now):",
                "     n  turn  when      tool        files"]
        for n in sorted(self._steps)[-LIST_ROWS:]:
            s = self._steps[n]
            when = time.strftime("%H:%M:%S", time.localtime(float(s.meta.get("time", 0))))
            files = ", ".join(s.files[:4]) + (f" (+{len(s.files) - 4})" if len(s.files) > 4 else "")
            mark = ">" if n == self._head else " "
            undone = "" if n in applied else "  (undone)"
            rows.append(f"  {mark} {n:3d}  {s.meta.get('turn', '?'):>4}  {when}  {s.meta.get('tool', ''):<10}  "
                        f"{files or '-'}{undone}")
        if self._head == 0:
            rows.append("  > (before the first)")
        return "\n".join(rows)

    # -- /undo ------------------------------------------------------------------------------------
    def undo(self, arg: str) -> str:
        repo, branch = self._load()
        applied = self._applied()
        if not applied:
            return "nothing to undo on this timeline"
        if arg:
            if not arg.isdigit() or int(arg) < 1:
                return "usage: /undo [N]  (N: how many file-changing steps to go back; default: the last turn)"
            if int(arg) > len(applied):
                return f"there are only {len(applied)} steps to undo on this timeline"
            i = len(applied) - int(arg)
        else:                       # the last turn that changed files: back to its first step
            i = len(applied) - 1
            while i > 0 and applied[i - 1].turn_key == applied[i].turn_key:
                i -= 1
        target = applied[i]
        kept = [s for s in applied[:i] if s.turn_key == target.turn_key]   # its turn's earlier steps
        start = target.meta.get("start") or {}
        plan, why = self._kv_plan(start)
        current = repo.snapshot(branch)
        keep = self._show_and_ask(repo, current, target.ref.tree, f"/undo: the files go back to before step "
                                  f"{target.n} (turn {target.meta.get('turn', '?')})", plan, why)
        if keep is None:
            return "undo cancelled: nothing changed"
        redo = self._save_redo(repo, branch, current)
        changed, left = repo.restore(branch, target.ref.tree, current, keep)
        self._set_head(repo, branch, int(target.meta.get("prev") or 0))
        self._left = left
        conv = self._rewind(plan, why, start, redo.sha)
        redo.tok_after = tokens_hash(self.agent.session.tokens)
        old, self._redo = self._redo, redo
        if old is not None and old.sha != redo.sha:
            self._redo = old
            self._drop_redo()           # a second /undo: /redo returns to the first one's result only
            self._redo = redo
        steps = f"step {target.n}" if target is applied[-1] else f"steps {target.n}-{applied[-1].n}"
        out = [f"undid {steps}: {_files_line(changed)}", conv]
        if keep:
            out.append(f"kept as they are (changed outside the agent): {', '.join(sorted(keep))}")
        self._note = ""
        if kept:
            done = ", ".join(f"{s.meta.get('tool', '?')} ({', '.join(s.files[:3]) or 'no file'})" for s in kept)
            out.append(f"step(s) {', '.join(str(s.n) for s in kept)} of that turn stay in the files; "
                       "your next message tells the model")
            self._note_tok = redo.tok_after
            self._note = (f"[ds4-agent: the user undid a turn of this conversation, except its first "
                          f"{len(kept)} file-changing tool call(s), whose changes are still in the files: {done}]\n")
        return "\n".join(x for x in out if x)

    def _kv_plan(self, start: dict) -> tuple[str | None, str]:
        """How the conversation gets back to `start` without a prefill: "here", "rewind" (in
        place), "load" (the session saved then), or None and why not."""
        s, store = self.agent.session, self.agent.store
        pos = start.get("pos")
        if not isinstance(pos, int) or pos < 1:
            return None, "the checkpoint records no position on the timeline"
        if pos > s.pos or tokens_hash(s.tokens[:pos]) != start.get("tok"):
            return None, "the conversation changed since that turn (compacted, or another session)"
        if pos == s.pos:
            return "here", ""
        if s.state.can_truncate(s.pos, pos - 1):
            return "rewind", ""
        sha = start.get("sha")
        if sha and store is not None:
            try:
                if store.info(sha).ok:
                    return "load", ""
            except SessionStoreError:
                if (self.shadow_root / "kv" / f"{sha}.kv").exists():
                    return "load", ""
        if self._cached_system_start(start):
            return "system", ""
        return None, ("that turn is further back than the KV state can be cut in place, and the session "
                      "saved at its start is gone")

    def _cached_system_start(self, start: dict) -> bool:
        """Whether `start` is the end of the system prompt and its prefill is cached: the first turn
        of a session resumed from disk, where no session was saved at the turn's start (issue 35
        item 5)."""
        a = self.agent
        if a.store is None or start.get("tlen") != 1 or not a.transcript or a.transcript[0].role != "system":
            return False
        text = a.system_prefix()
        return (a.tok.encode(text) == a.session.tokens[:start["pos"]]
                and os.path.exists(a.store.sysprompt_path(a.session, text)))

    def _rewind(self, plan: str | None, why: str, start: dict, redo_sha: str | None) -> str:
        a = self.agent
        s = a.session
        if plan is None:
            return f"the conversation was not rewound: {why}"
        if plan == "rewind":
            s.rewind(s.pos - start["pos"])
        elif plan == "load":
            try:
                self._unkeep(start["sha"])
                a.store.load(start["sha"], s)
            except SessionStoreError as e:
                return f"the conversation was not rewound: {e}"
        elif plan == "system" and not a.store.load_system_prefix(s, a.system_prefix()):
            return "the conversation was not rewound: the cached system prompt could not be loaded"
        a.transcript = a.transcript[:int(start.get("tlen", len(a.transcript)))]
        a.pending_eos = bool(start.get("eos"))
        if plan == "load":
            a.current_sha, a.modified = start["sha"], False
        elif plan == "rewind":
            a.current_sha, a.modified = None, True
        elif plan == "system":
            a.current_sha, a.modified = None, False      # as a fresh start: nothing to save yet
        a._continues = redo_sha or a._continues     # the session's name follows it back
        a._status()
        how = {"here": "", "rewind": " (cut back in place, no prefill)", "load": " (loaded, no prefill)",
               "system": " (the cached system prompt, no prefill)"}[plan]
        return f"the conversation is back at the start of that turn: {s.pos} tokens{how}"

    def _save_redo(self, repo: CheckpointRepo, branch: str, current: str) -> Redo:
        a = self.agent
        sha = a.current_sha if not a.modified else None
        if sha is None and a.store is not None:
            info = a.save(quiet=True)
            sha = info.sha if info is not None else None
        repo.commit(branch, "redo", current, {"redo": True})     # (keeps its objects referenced)
        return Redo(branch, current, sha, self._head, self._left, list(a.transcript), a.pending_eos)

    def _show_and_ask(self, repo: CheckpointRepo, current: str, target: str, head: str,
                      plan: str | None, why: str) -> set[str] | None:
        """Show the diff from now to `target`; ask when the conversation cannot follow and when a
        file to be overwritten was changed by someone else. None: cancelled; else the files to keep."""
        a = self.agent
        touched = {p for _, p in repo.changes(current, target)}
        external = sorted({p for _, p in repo.changes(self._left, current)} & touched) if self._left else []
        diff = repo.diff_text(current, target)
        a.emit(E.Notice(head + ("\n" + diff if diff else ": no file differs")))
        if a.cfg.yolo:
            return set()
        if plan is None and not a._ask("undo", {}, f"restoring only the files ({why})"):
            return None
        if external and not a._ask("undo", {"files": external},
                                   f"overwriting {len(external)} file(s) changed outside the agent since: "
                                   f"{', '.join(external[:5])}{' ...' if len(external) > 5 else ''}"):
            return set(external)
        return set()

    def _drop_redo(self):
        """/redo is no longer possible (a new turn, a tool call, another /undo): the session saved
        for it is the undone conversation, which would stay in /list as a stray session. It is
        deleted when nothing else holds it: no name, no pin, no pending fork, saved by this branch,
        no live timeline on it, no saved session descending from it (the store's pruning rules)."""
        r, self._redo = self._redo, None
        a, store = self.agent, self.agent.store
        if r is None or not r.sha or store is None or r.sha == a.current_sha:
            return
        if any(t.current_sha == r.sha for t in a.timelines.left.values()):
            return
        try:
            e = store.info(r.sha)
            if e.name or e.pinned or e.forks or e.branch != r.branch or not e.ok:
                return
            others = [o for o in store.list("all") if o.sha != r.sha]
            n = read_header(e.path)[0].text_bytes
            if any(store._descends(o, r.sha, n) for o in others):
                return
            store.delete(r.sha)
        except (OSError, SessionStoreError, KVFileError):
            return              # it stays: a stray session, never a failed turn
        if a._continues == r.sha:
            a._continues = None

    # -- /redo ------------------------------------------------------------------------------------
    def redo(self) -> str:
        a, r = self.agent, self._redo
        if r is None or r.branch != a.branch or tokens_hash(a.session.tokens) != r.tok_after:
            return "nothing to redo (/redo works right after /undo, before a new turn or tool call)"
        repo, branch = self._load()
        current = repo.snapshot(branch)
        plan = "load" if r.sha and a.store is not None else None
        keep = self._show_and_ask(repo, current, r.tree, "/redo: the files go back to before the undo",
                                  plan, "no saved session to return to")
        if keep is None:
            return "redo cancelled: nothing changed"
        changed, left = repo.restore(branch, r.tree, current, keep)
        self._set_head(repo, branch, r.head)
        self._left, self._redo, self._note = left, None, ""
        conv = "the conversation was not restored: no saved session to return to"
        if plan == "load":
            try:
                a.store.load(r.sha, a.session)
                a.transcript, a.pending_eos = r.transcript, r.eos
                a.current_sha, a.modified, a._continues = r.sha, False, None
                conv = f"the conversation is back where it was: {a.session.pos} tokens (loaded, no prefill)"
            except SessionStoreError as e:
                conv = f"the conversation was not restored: {e}"
        a._status()
        out = [f"redone: {_files_line(changed)}", conv]
        if keep:
            out.append(f"kept as they are (changed outside the agent): {', '.join(sorted(keep))}")
        return "\n".join(out)


def _files_line(paths: list[str]) -> str:
    if not paths:
        return "no file differed"
    return f"{len(paths)} file(s) restored: " + ", ".join(paths[:8]) + (" ..." if len(paths) > 8 else "")
