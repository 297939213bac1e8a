"""Live timelines: `/fork [NAME]` and instant `/switch` between branches (issue 25).

A timeline is a Session (the KV state) plus what the agent keeps about it: transcript, pending
EOS, name, saved id, think mode, branch id. The agent holds one live timeline; `Timelines` keeps
the ones it left most recently in memory (at most `cfg.live_timelines` in all, the live one
included), so `/switch` to one of them swaps the Session object: no disk read, no prefill. Any
other `/switch` loads from disk as before (no prefill either), into a Session taken from the
oldest left timeline (saved first if it changed) or a new one when the limit allows it and the
memory has room for another KV state.

`/fork [NAME]` saves the live timeline (the branch point, on disk), records a pending fork on
that record (sessions/records.py: the fork's text is its parent's, so it cannot be a file of its
own until it diverges; the record keeps its name, pins its branch point against pruning and makes
`/switch NAME` and `--resume NAME` find it), and the live timeline goes on as the fork under a
new branch id. The parent keeps a copy of the state (Session.snapshot/restore: a copy of the
state's used rows, no prefill) in the pool; with `live_timelines` 1 there is no copy and the
parent comes back from disk.

Nothing here imports agent.py (it imports this): the agent is passed in, and its own
`took_over(info)` turns a loaded Session into its transcript and fields.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine import Session
from engine.runtime.session import mem_available
from prompts import Message
from sessions import SessionInfo, SessionStoreError
from sessions.records import NAME_MAX

from . import events as E

FORK_SUFFIX = "-fork"


@dataclass
class Timeline:
    """What travels with a timeline when it is left and taken up again."""
    session: Session
    transcript: list[Message]
    pending_eos: bool
    session_name: str
    current_sha: str | None
    continues: str | None
    think_mode: str
    branch: str
    modified: bool


def capture(agent) -> Timeline:
    return Timeline(agent.session, agent.transcript, agent.pending_eos, agent.session_name,
                    agent.current_sha, agent._continues, agent.cfg.think_mode, agent.branch, agent.modified)


def install(agent, t: Timeline):
    agent.session, agent.transcript, agent.pending_eos = t.session, t.transcript, t.pending_eos
    agent.session_name, agent.current_sha, agent._continues = t.session_name, t.current_sha, t.continues
    agent.cfg.think_mode, agent.branch, agent.modified = t.think_mode, t.branch, t.modified


class Timelines:
    def __init__(self, agent):
        self.agent = agent
        self.left: "OrderedDict[str, Timeline]" = OrderedDict()   # branch -> timeline, oldest first

    @property
    def room(self) -> int:
        """How many left timelines may stay in memory (the live one is the rest of the limit)."""
        return max(0, int(getattr(self.agent.cfg, "live_timelines", 2)) - 1)

    def _fits(self) -> bool:
        """Whether another KV state fits in memory now (with one more to spare: the OS, the model's
        working set). A state is allocated for its whole context (Session.kv_bytes)."""
        avail = mem_available()
        return avail is None or avail > 2 * self.agent.session.kv_bytes()

    # -- /switch ----------------------------------------------------------------------------------
    def switch(self, ref: str) -> SessionInfo:
        """Make the saved session `ref` (a name, a fork's name, an id) the live timeline: from the
        pool when its branch is there, else from disk. SessionStoreError leaves everything as it was.
        The live timeline was saved by the caller when it had changed."""
        a = self.agent
        info = a.store.resolve(ref)
        branch = info.branch if info.branch and info.tip else None
        if branch in self.left and self.left[branch].current_sha != info.sha:
            self._trim_one(branch)             # its save was deleted since: that copy is not `ref`
        if branch is not None and branch in self.left and branch != a.branch:
            t = self.left.pop(branch)
            self._leave(capture(a))
            install(a, t)
            a._status()
            return info
        spare = next(iter(self.left.values()), None)      # the oldest left timeline
        if len(self.left) < self.room and self._fits():
            spare = None                                   # room for one more: a new Session
        if (branch is not None and branch == a.branch) or a.current_sha is None or self.room == 0 \
                or (spare is None and not self._fits()):
            a.store.load(info.sha, a.session)      # in place: the live timeline is not kept (as before)
            a.took_over(info)
            return info
        session = spare.session if spare is not None else self._new_session()
        if spare is not None and spare.modified:
            self._save(spare)                      # its Session is about to hold another timeline
        a.store.load(info.sha, session)            # a failure leaves `session` (and the spare) as they were
        if spare is not None:
            self.left.pop(spare.branch)
        self._leave(capture(a))
        a.session = session
        a.took_over(info)
        return info

    def _new_session(self) -> Session:
        s = self.agent.session
        return Session(self.agent.engine, s.ctx, chunk=s.chunk, rewind_cap=s.rewind_cap)

    def _leave(self, t: Timeline):
        """Keep the timeline the agent is leaving, dropping the oldest beyond the limit."""
        if self.room == 0 or t.current_sha is None:
            return             # (an unsaved timeline has no name /switch could find it by; it is fresh)
        self.left.pop(t.branch, None)
        self.left[t.branch] = t
        self._trim(self.room)

    def _trim_one(self, branch: str):
        old = self.left.pop(branch)
        if old.modified:
            self._save(old)

    def _trim(self, keep: int):
        """Drop the oldest left timelines beyond `keep` (saved first when they changed)."""
        while len(self.left) > keep:
            self._trim_one(next(iter(self.left)))

    def _save(self, t: Timeline):
        """Save a left timeline that changed since (its save on leaving failed)."""
        a = self.agent
        try:
            info = a.store.save(t.session, think_mode=t.think_mode, continues=t.continues, branch=t.branch)
            t.current_sha, t.continues, t.modified = info.sha, None, False
        except (OSError, SessionStoreError, ValueError) as e:
            a.emit(E.Notice(f"could not save {t.session_name} before dropping it from memory: {e}", "error"))

    # -- /fork ------------------------------------------------------------------------------------
    def fork(self, name: str, new_branch: str) -> str:
        """The live timeline becomes a new branch named `name` (default: this one's name + -fork);
        the one it leaves keeps its name and its state (a copy, in the pool). Returns what to show."""
        a = self.agent
        if a.store is None:
            return "fork failed: no session store"
        if not any(m.role == "user" for m in a.transcript):
            return "nothing to fork yet: the session has no turn"
        if a.modified or a.current_sha is None:
            if a.save(quiet=True) is None:
                return "fork failed: the session could not be saved (the branch point must be on disk)"
        parent = capture(a)
        try:
            info = a.store.add_fork(parent.current_sha, new_branch, name or self._default_name(parent.session_name))
        except SessionStoreError as e:
            return f"fork failed: {e}"
        self._trim(max(0, self.room - 1))          # room for the parent before its copy is made
        if self.room and self._fits():
            copy = a.session.fork()                # the state's arrays, copied: no prefill
            a.store.copied(a.session, copy)
            parent.session, parent.transcript = copy, list(parent.transcript)
            self._leave(parent)
        a.branch, a.session_name, a.modified = new_branch, info.name, False
        a.checkpoints.forked(parent.branch)       # the fork's /undo starts from the shared history
        a._status()
        return (f"forked: you are on {info.name} (a new branch of {parent.session_name} at {info.id}); "
                f"/switch {parent.session_name} goes back, /list shows the tree")

    def _default_name(self, base: str) -> str:
        every = self.agent.store.list("all")
        names = {e.name for e in every} | {f.name for e in every for f in e.forks}
        base = base[:NAME_MAX - len(FORK_SUFFIX) - 3]
        cand, n = base + FORK_SUFFIX, 2
        while cand in names:
            cand, n = f"{base}{FORK_SUFFIX}{n}", n + 1
        return cand
