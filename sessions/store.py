"""The agent's named sessions (/save /list /switch /rename /delete; spec/agent.md §6).

A session is a ds4 KV file `<root>/<sha1>.kv` (save reason "agent-session"; sha1 of the rendered
token text, so the file stays byte-compatible with ds4) plus a metadata record `<sha1>.json`
beside it: title, project directory, think mode, created/updated times, token count, an optional
user-given name, the lineage (which saved sessions this one was continued from), model file name
and routed-expert quant width. Both are written to a temporary name and renamed. A KV file with no
metadata (ds4 wrote it, or a crash came between the two writes) is still a session: its title is
derived from its text and it has no project, so it shows in the global view only.

Loading restores the KV tensors, the token list and the last logits: the session is ready to
sample, nothing is prefilled. Every check runs before the live session is touched, so a failed
load leaves it as it was.

Lineage. The store remembers, per live Session object, which saved session it was last loaded
from or saved as (its sha, text length and own lineage). When that session is saved again and its
text still extends the remembered one (checked by hashing the new text's prefix), the new record
gets `parent` = that sha and `ancestors` = the parent's ancestors + the parent. A timeline that
was reset, compacted or rebuilt does not extend it, so it starts a fresh lineage (the agent can
still say which session it continues, `continues=`, after a compaction: only the name follows).

Names follow the conversation. A name belongs to the newest save of its lineage: saving a
continuation of the session that holds a name moves the name onto the new record (written first,
then taken off the old one; a crash between the two leaves two holders, and `resolve` picks the
one that descends from the other). So `/switch work`, a turn, and `--resume work` continue that
turn. The record the user named (`/save NAME`, `rename`) is `pinned` (it keeps the name it was
given there) and is never pruned: the snapshot stays, reachable by its id and listed as an
earlier save of NAME. Deleting the holder hands the name back to its newest pinned ancestor that
was saved under that name.

Prefix pruning (after every save). ds4 deletes every saved session whose text is a strict prefix
of the new one; here a stored session P is removed only when ALL of these hold:
  1. P is one of the new session's own ancestors (recorded lineage, not mere text overlap: a
     session saved independently that happens to share a prefix is not ours to delete) and of
     its branch (a fork's save never removes the save its parent branch goes on from);
  2. P's text is a strict byte prefix of the new text (the new file contains P's whole history);
  3. P holds no name and is not pinned (naming a session is how the user keeps a branch point);
  4. no other saved session descends from P, by recorded lineage or by text prefix (P is then a
     branch point that another timeline still starts from);
  5. P's KV header and metadata are readable (an unreadable file is never guessed about).
So a linear save-continue-save chain keeps only its newest save (and the snapshots the user
named), and saving can never remove a session that another saved timeline still depends on.

Branches and forks (sessions/records.py). A record says which branch (the agent's timeline id)
saved it; a name moves along its own branch only (a save of another branch that continues a named
record does not take its name: it is a fork). A pending fork (`/fork`, not continued yet) is an
entry on its parent's record: its name resolves to the parent's file with the fork's branch, the
parent is not pruned while it has one (rule 3), and the fork's first longer save takes the name.
A save prunes only its own branch's ancestors (rule 1).

System prefixes are cached beside the sessions, one file per model and prefix text
(sessions/sysprompt_cache.py).

The root defaults to `$DS4_AGENT_HOME/sessions` or `~/.ds4-agent/sessions` (mode 0700). Sessions
are global on disk; `list()` shows the current project directory's by default, `list("all")`
every one.

Damage. Nothing in the folder is trusted: symlinks are never followed and only regular files are
opened (a FIFO named like a session would block a reader forever; sessions/safeio.py), a KV file
whose payload tokens do not spell its text is refused on load (kvfile.check_payload_text), and a
`.json` record is read with a size cap and checked against its schema (`check_meta`: field types,
finite ranges, 40-hex lineage ids), so deep nesting, `"tokens": "many"` or `Infinity` make the
session show as damaged, never an exception.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from engine import Session

from . import safeio
from .kvfile import (PREFIX_BYTES, KVFileError, KVFileInfo, atomic_write, read_header, read_info, read_kv,
                     remove_stale_temps, routed_quant_bits, write_kv)
from .prefix_cache import token_text
from .records import (MAX_ANCESTORS, MAX_FORKS, META_VERSION, NAME_MAX, SHA_RE as _SHA, Fork, check_meta,  # noqa: F401
                      TITLE_MAX_BYTES, clip_title, fork_entry, forks_of, is_branch, pinned_of, title_from_text)
from .sysprompt_cache import SYSPROMPT_BUDGET_MB, SYSPROMPT_KEEP, SystemPrefixCache, SystemPrefixCacheError

_SHA_KV = re.compile(r"([0-9a-f]{40})\.kv")
_HEX = re.compile(r"[0-9a-fA-F]+")
META_MAX_BYTES = 1 << 20        # a record is ~1 KB (+ 256 ancestors of 43 bytes); more is not ours


class SessionStoreError(Exception):
    """A session that cannot be found, read, loaded, renamed or saved; the message says why."""


class SessionNotFound(SessionStoreError):
    pass


class AmbiguousSession(SessionStoreError):
    def __init__(self, ref: str, candidates: list["SessionInfo"]):
        self.ref, self.candidates = ref, candidates
        lines = "\n".join(f"  {c.id}  {c.label}" for c in candidates)
        super().__init__(f"{ref!r} matches {len(candidates)} sessions:\n{lines}")


@dataclass
class SessionInfo:
    sha: str
    path: str
    title: str
    tokens: int = 0
    created: float = 0.0
    updated: float = 0.0
    project_dir: str | None = None
    think_mode: str | None = None
    name: str | None = None
    pinned: str | None = None         # the name the user saved it under (kept; never pruned)
    branch: str | None = None         # the timeline that saved it (None: written before branches)
    forks: tuple[Fork, ...] = ()      # forks that start here and have no save of their own yet
    fork_pending: bool = False        # this is such a fork (name, branch: the fork's; file: the parent's)
    tip: bool = True                  # no later save of its branch continues it (resolve says)
    parent: str | None = None
    ancestors: tuple[str, ...] = ()
    model: str | None = None
    quant_bits: int | None = None
    ctx: int | None = None
    size: int = 0
    error: str | None = None          # why the session is unreadable (None: it is fine)
    origin: str | None = None         # "headless": saved by `ds4-agent -p` (sessions/retention.py)
    has_meta: bool = True
    text: bytes | None = field(default=None, repr=False)   # filled by load()

    @property
    def id(self) -> str:
        return self.sha[:8]

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def label(self) -> str:
        return self.name or self.title

    @property
    def earlier_of(self) -> str | None:
        """The name this snapshot was saved under when the name has since moved on (None when it
        holds its name, or was never named)."""
        return self.pinned if self.pinned and self.pinned != self.name else None


def fork_view(e: SessionInfo, f: Fork) -> SessionInfo:
    """Record `e` seen as its pending fork `f`: the parent's file and text, the fork's name and branch."""
    return dataclasses.replace(e, name=f.name, pinned=None, branch=f.branch, forks=(), fork_pending=True,
                               tip=True, created=f.created or e.created)


def _fork_uses(e: SessionInfo, name: str):
    for f in e.forks:
        if f.name == name:
            raise SessionStoreError(f"the name {name!r} is already used by a fork of session {e.id}")


@dataclass
class _Origin:
    sha: str
    text_bytes: int
    ancestors: tuple[str, ...]


def default_root() -> str:
    home = os.environ.get("DS4_AGENT_HOME")
    base = home if home else os.path.join(os.path.expanduser("~"), ".ds4-agent")
    return os.path.join(base, "sessions")


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise SessionStoreError("a session name must be text")
    name = name.strip()
    if not name:
        raise SessionStoreError("a session name cannot be empty")
    if len(name) > NAME_MAX:
        raise SessionStoreError(f"a session name has at most {NAME_MAX} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise SessionStoreError("a session name cannot contain control characters")
    return name


class SessionStore:
    def __init__(self, root=None, project_dir=None, *, now: Callable[[], float] = time.time,
                 sysprompt_keep: int = SYSPROMPT_KEEP, sysprompt_budget_mb: float = SYSPROMPT_BUDGET_MB):
        self.root = os.path.abspath(os.fspath(root) if root is not None else default_root())
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except OSError as e:
            raise SessionStoreError(f"cannot create the session folder {self.root}: {e.strerror or e}") from None
        self.project_dir = os.path.realpath(os.fspath(project_dir) if project_dir is not None else os.getcwd())
        self._now = now
        self.origin: str | None = None     # written into each record this store saves
        self.sysprompts = SystemPrefixCache(self.root, now=now, keep=sysprompt_keep, budget_mb=sysprompt_budget_mb)
        remove_stale_temps(self.root)     # real time: the temp files' mtimes are real
        self._origins: "weakref.WeakKeyDictionary[Session, _Origin]" = weakref.WeakKeyDictionary()

    # -- paths -----------------------------------------------------------------------------------
    def kv_path(self, sha: str) -> str:
        return os.path.join(self.root, sha + ".kv")

    def meta_path(self, sha: str) -> str:
        return os.path.join(self.root, sha + ".json")

    # -- reading ---------------------------------------------------------------------------------
    def _shas(self) -> list[str]:
        """Every `<sha>.kv` name of the folder, whatever it is (a FIFO or a symlink is listed, as
        damaged: the user sees it and can /delete it)."""
        try:
            names = [n for n, _ in safeio.scan(self.root)]
        except OSError as e:
            raise SessionStoreError(f"cannot list {self.root}: {e.strerror or e}") from None
        return sorted(m.group(1) for m in map(_SHA_KV.fullmatch, names) if m)

    def _read_meta(self, sha: str) -> dict | None:
        """The metadata record, None when there is none; SessionStoreError when it is damaged
        (not a regular file, too big, not JSON, not this session's, or failing `check_meta`)."""
        p = self.meta_path(sha)
        try:
            raw = safeio.read_regular(p, META_MAX_BYTES)
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise SessionStoreError(f"metadata {p}: too big ({e})") from None
        except OSError as e:
            raise SessionStoreError(f"metadata {p}: cannot read: {e.strerror or e}") from None
        try:
            meta = json.loads(raw)
        except RecursionError:
            raise SessionStoreError(f"metadata {p}: not valid JSON (nested too deeply)") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise SessionStoreError(f"metadata {p}: not valid JSON ({e})") from None
        if not isinstance(meta, dict) or meta.get("sha") != sha:
            raise SessionStoreError(f"metadata {p}: not a session record for {sha[:8]}")
        problem = check_meta(meta)
        if problem:
            raise SessionStoreError(f"metadata {p}: bad field {problem}")
        return meta

    def _entry(self, sha: str) -> SessionInfo:
        """One session as list() shows it; a damaged file gives an entry with `error` set."""
        path = self.kv_path(sha)
        e = SessionInfo(sha=sha, path=path, title="(unreadable session)")
        problems = []
        hdr = None
        try:
            hdr, e.size = read_header(path)
            e.tokens, e.ctx, e.quant_bits = hdr.tokens, hdr.ctx, hdr.quant_bits
            e.created, e.updated = float(hdr.created_at), float(hdr.last_used)
        except KVFileError as x:
            problems.append(x.problem)
        try:
            meta = self._read_meta(sha)
        except SessionStoreError as x:
            problems.append(str(x))
            meta = None
        else:
            if meta is None:
                e.has_meta = False
                if hdr is not None:
                    try:
                        e.title = title_from_text(read_info(path, with_tool_map=False).text)
                    except KVFileError as x:
                        problems.append(x.problem)
            else:
                e.title = meta.get("title") or e.title
                e.name = meta.get("name") or None
                e.pinned = pinned_of(meta) or None
                e.project_dir = meta.get("project_dir")
                e.think_mode = meta.get("think_mode")
                e.parent = meta.get("parent")
                e.branch, e.forks = meta.get("branch"), forks_of(meta)
                e.ancestors = tuple(meta.get("ancestors", ()))
                e.model = meta.get("model")
                e.origin = meta.get("origin") if meta.get("origin") == "headless" else None
                e.created = float(meta.get("created", e.created))
                e.updated = float(meta.get("updated", e.updated))
                if hdr is None:
                    e.tokens = meta.get("tokens") or 0
        if problems:
            e.error = "; ".join(problems)
        return e

    def _all(self) -> list[SessionInfo]:
        return [self._entry(s) for s in self._shas()]

    def list(self, scope: str = "project") -> list[SessionInfo]:
        """Sessions, most recently updated first: this project's ("project") or every one ("all").
        Damaged ones are listed with `error` set (a session without readable metadata has no
        project, so it appears in the "all" view only)."""
        if scope not in ("project", "all"):
            raise ValueError(f"scope must be 'project' or 'all', not {scope!r}")
        out = self._all()
        if scope == "project":
            out = [e for e in out if e.project_dir is not None
                   and os.path.realpath(e.project_dir) == self.project_dir]
        out.sort(key=lambda e: (e.updated, e.created, e.sha), reverse=True)
        return out

    def resolve(self, ref: str) -> SessionInfo:
        """A session by user-given name (exact; a name wins over an id prefix that spells the
        same) or by a unique prefix of its sha (AmbiguousSession lists the candidates)."""
        if not isinstance(ref, str) or not ref.strip():
            raise SessionNotFound("no session given")
        ref = ref.strip()
        entries = self._all()
        named = [e for e in entries if e.name == ref]
        if len(named) > 1:
            # a save that crashed while moving the name: the holder is the one that continues
            # every other (save writes the new holder before it clears the old)
            tip = [e for e in named if all(o is e or o.sha in e.ancestors for o in named)]
            if len(tip) == 1:
                return tip[0]
            raise AmbiguousSession(ref, named)
        if named:
            return self._tip(named[0], entries)
        forked = [fork_view(e, f) for e in entries for f in e.forks if f.name == ref]
        if len(forked) == 1:
            return forked[0]
        if _HEX.fullmatch(ref):
            hits = [e for e in entries if e.sha.startswith(ref.lower())]
            if len(hits) == 1:
                return self._tip(hits[0], entries)
            if hits:
                hits.sort(key=lambda e: (e.updated, e.sha), reverse=True)
                raise AmbiguousSession(ref, hits)
        raise SessionNotFound(f"no session {ref!r} (give a name or the start of an id from /list)")

    @staticmethod
    def _tip(e: SessionInfo, entries) -> SessionInfo:
        """`e` with `tip` set: False when a later save of its branch continues it (a timeline that
        goes on from it is then a new branch, not that one)."""
        e.tip = not (e.branch and any(o.branch == e.branch and e.sha in o.ancestors for o in entries))
        return e

    def info(self, ref: str) -> SessionInfo:
        return self.resolve(ref)

    # -- load ------------------------------------------------------------------------------------
    def load(self, ref: str, session: Session, *, allow_other_quant: bool = False) -> SessionInfo:
        """Restore a saved session into `session`: tokens, KV state and the last logits, so the
        next token can be sampled at once (no prefill). On any failure SessionStoreError is raised
        and `session` is exactly as it was."""
        e = self.resolve(ref)
        if e.error:
            raise SessionStoreError(f"session {e.id} is unreadable: {e.error}")
        if e.ctx and (e.ctx > session.ctx or e.tokens >= session.ctx):
            # said here in plain words (the payload's own check names its fields), with the fix
            raise SessionStoreError(
                f"session {e.id} was saved with a {e.ctx}-token context, more than this run's {session.ctx}: "
                f"continue it with `ds4-agent --resume {e.id}` (which takes its context) or --ctx {e.ctx}")
        try:
            info = read_kv(e.path, session, check_name=True, allow_other_quant=allow_other_quant)
        except KVFileError as x:
            raise SessionStoreError(f"cannot load session {e.id}: {x.problem}") from None
        except OSError as x:
            raise SessionStoreError(f"cannot load session {e.id}: {x.strerror or x}") from None
        e.text = info.text
        e.tokens = info.header.tokens
        self._origins[session] = _Origin(e.sha, len(info.text), e.ancestors)
        return e

    # -- save ------------------------------------------------------------------------------------
    def save(self, session: Session, rendered_text: bytes | str | None = None, *, think_mode: str,
             title: str | None = None, name: str | None = None, continues: str | None = None,
             branch: str | None = None) -> SessionInfo:
        """Save the live timeline of `session` (its whole KV state and logits) and its metadata;
        move the name of the session it continues onto it; then prune the ancestors it supersedes
        (module docstring). `rendered_text`, when given, must be the token text of the timeline
        (it is what names the file). `name` names (and pins) this save. `continues`: the sha of the
        saved session this timeline continues when its text does not show it (a compaction).
        `branch`: the timeline's branch id (a record keeps the branch that first saved its text;
        saving a pending fork's unchanged text returns the fork's view of its parent)."""
        if branch is not None and not is_branch(branch):
            raise SessionStoreError(f"bad branch id {branch!r} (12 lowercase hex digits)")
        if session.pos == 0:
            raise SessionStoreError("nothing to save: the session holds no tokens")
        text = token_text(session)
        if rendered_text is not None:
            rt = rendered_text.encode("utf-8", "surrogateescape") if isinstance(rendered_text, str) \
                else bytes(rendered_text)
            if rt != text:
                raise SessionStoreError("the transcript does not match the live session's tokens; "
                                        "sync the session to the transcript before saving")
        sha = hashlib.sha1(text).hexdigest()
        try:
            old = self._read_meta(sha)
        except SessionStoreError:
            old = None                     # a corrupt record of the same text is replaced
        ancestors = self._lineage(session, sha, text, old)
        name, pinned, holder, fork_src = self._naming(session, sha, old, ancestors, name, continues, branch)
        now = float(self._now())
        path = self.kv_path(sha)
        existed = os.path.exists(path)
        try:
            write_kv(path, session, text, reason="agent-session", now=int(now))
        except OSError as x:
            raise SessionStoreError(f"cannot save session {sha[:8]}: {x.strerror or x}") from None
        eng = session.engine
        meta = {
            "version": META_VERSION,
            "sha": sha,
            "title": clip_title(" ".join(title.split())) if title else title_from_text(text),
            "name": name or None,
            "pinned": pinned or None,
            "project_dir": self.project_dir,
            "think_mode": think_mode,
            "created": float((old or {}).get("created", now)),
            "updated": now,
            "tokens": session.pos,
            "ctx": session.ctx,
            "parent": ancestors[-1] if ancestors else None,
            "ancestors": list(ancestors),
            "model": os.path.basename(str(getattr(eng.file, "path", "")) or "") or None,
            "quant_bits": routed_quant_bits(session),
            "branch": (old or {}).get("branch") or branch,
            "forks": (old or {}).get("forks", []),
            "origin": self.origin,
        }
        try:
            self._write_meta(sha, meta)
        except OSError as x:
            if not existed:            # no half-saved session: drop the KV file we just wrote
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise SessionStoreError(f"cannot save session {sha[:8]} metadata: {x.strerror or x}") from None
        if holder is not None:
            self._take_name(holder)    # after the new holder is written (resolve copes with a crash here)
        if fork_src is not None:
            self._drop_fork(fork_src, branch)    # the fork has its own record now
        self._origins[session] = _Origin(sha, len(text), tuple(ancestors))
        self._prune(sha, text, ancestors, (old or {}).get("branch") or branch)
        e = self._entry(sha)
        e.text = text
        pending = [f for f in e.forks if f.branch == branch and e.branch != branch]
        return fork_view(e, pending[0]) if pending else e

    def _naming(self, session: Session, sha: str, old: dict | None, ancestors, name: str | None,
                continues: str | None, branch: str | None = None):
        """(name, pinned, holder, fork_src) of a save: the name given (it pins), else the record's
        own, else the name of this branch's pending fork on the saved session it continues (fork_src),
        else that session's name when it is of this branch; holder: the record it moves from."""
        o = self._origins.get(session)
        src = o.sha if (o is not None and o.sha != sha and ancestors and ancestors[-1] == o.sha) else \
            (continues if continues and _SHA.fullmatch(continues) and continues != sha else None)
        if name is not None:
            name = _check_name(name)
            return name, name, self._name_holder(name, sha, movable=set(ancestors) | ({src} if src else set())), None
        if old and old.get("name"):
            return old["name"], pinned_of(old), None, None
        pinned = pinned_of(old) if old else None
        if src is not None:
            try:
                src_meta = self._read_meta(src)
            except SessionStoreError:
                src_meta = None            # a damaged record keeps its name; this save has none
            fork = [f for f in forks_of(src_meta) if f.branch == branch]
            if fork:
                return fork[0].name, pinned, None, src
            # a name moves along its own branch: another branch continuing it is a fork
            if src_meta and src_meta.get("name") and (branch is None or src_meta.get("branch") in (None, branch)):
                return src_meta["name"], pinned, src, None
        return None, pinned, None, None

    def _name_holder(self, name: str, sha: str, movable: set[str]) -> str | None:
        """The session that holds `name` now, when the name may move from it to `sha` (it is this
        timeline's own ancestor); None when no other session holds it; an error when an unrelated
        session does."""
        for e in self._all():
            if e.name == name and e.sha != sha:
                if e.sha in movable:
                    return e.sha
                raise SessionStoreError(f"the name {name!r} is already used by session {e.id}")
            _fork_uses(e, name)
        return None

    def _take_name(self, sha: str):
        """Clear the name of `sha`'s record (keeping what pins it); a failure leaves two holders,
        which resolve() tells apart by lineage."""
        try:
            meta = self._read_meta(sha)
            if meta is None:
                return
            meta["pinned"], meta["name"] = pinned_of(meta), None
            self._write_meta(sha, meta)
        except (SessionStoreError, OSError):
            pass

    def _lineage(self, session: Session, sha: str, text: bytes, old: dict | None) -> tuple[str, ...]:
        o = self._origins.get(session)
        if o is not None and o.sha == sha:           # the same text saved again
            return tuple(old.get("ancestors", ())) if old else o.ancestors
        if (o is not None and o.text_bytes < len(text)
                and hashlib.sha1(text[:o.text_bytes]).hexdigest() == o.sha):
            anc = [a for a in o.ancestors if a != sha] + [o.sha]
            return tuple(anc[-MAX_ANCESTORS:])
        return tuple(old.get("ancestors", ())) if old else ()

    def _write_meta(self, sha: str, meta: dict):
        data = json.dumps(meta, indent=1, ensure_ascii=False).encode("utf-8") + b"\n"
        atomic_write(self.meta_path(sha), [data])

    def _check_name_free(self, name: str, sha: str | None):
        for e in self._all():
            if e.name == name and e.sha != sha:
                raise SessionStoreError(f"the name {name!r} is already used by session {e.id}")
            _fork_uses(e, name)

    # -- forks (sessions/records.py) ---------------------------------------------------------------
    def add_fork(self, sha: str, branch: str, name: str) -> SessionInfo:
        """Record a pending fork of saved session `sha`: branch `branch`, named `name` (unique among
        names and forks). Returns the fork's view of the record."""
        name = _check_name(name)
        if not is_branch(branch):
            raise SessionStoreError(f"bad branch id {branch!r} (12 lowercase hex digits)")
        self._check_name_free(name, None)
        meta = self._read_meta(sha)
        if meta is None:
            raise SessionStoreError(f"session {sha[:8]} has no record to fork from")
        forks = [f for f in meta.get("forks", []) if f["branch"] != branch]
        if len(forks) >= MAX_FORKS:
            raise SessionStoreError(f"session {sha[:8]} already has {MAX_FORKS} forks that were never continued")
        fork = Fork(branch, name, float(self._now()))
        meta["forks"] = forks + [fork_entry(fork)]
        try:
            self._write_meta(sha, meta)
        except OSError as x:
            raise SessionStoreError(f"cannot record the fork on session {sha[:8]}: {x.strerror or x}") from None
        return fork_view(self._entry(sha), fork)

    def _drop_fork(self, sha: str, branch: str, strict: bool = False):
        """Take the pending fork `branch` off `sha`'s record (its first save has a record of its own,
        or it was deleted). Not strict: a failure leaves the entry (the record that took its name
        wins in resolve)."""
        try:
            meta = self._read_meta(sha)
            if meta is None:
                return
            meta["forks"] = [f for f in meta.get("forks", []) if f["branch"] != branch]
            self._write_meta(sha, meta)
        except (SessionStoreError, OSError) as x:
            if strict:
                raise SessionStoreError(f"cannot delete the fork: {x}") from None

    def copied(self, src: Session, dst: Session):
        """`dst` now holds a copy of `src`'s timeline (a fork): it continues the same saved session."""
        o = self._origins.get(src)
        if o is not None:
            self._origins[dst] = o

    def _prune(self, sha: str, text: bytes, ancestors, branch: str | None = None) -> list[str]:
        removed = []
        if not ancestors:
            return removed
        others = None
        for p in reversed(ancestors):
            if p == sha or not os.path.exists(self.kv_path(p)):
                continue
            try:
                hdr, _ = read_header(self.kv_path(p))
                meta = self._read_meta(p)
            except (KVFileError, SessionStoreError):
                continue                                  # rule 5
            if meta is None or meta.get("name") or pinned_of(meta) or meta.get("forks"):   # rules 5 and 3
                continue
            if branch and meta.get("branch") not in (None, branch):
                continue                                  # rule 1: another branch's save (its tip)
            n = hdr.text_bytes
            if not (n < len(text) and hashlib.sha1(text[:n]).hexdigest() == p):
                continue                                  # rule 2
            if others is None:
                others = [e for e in self._all() if e.sha != sha]
            if any(self._descends(e, p, n) for e in others if e.sha != p and e.sha not in removed):
                continue                                  # rule 4
            try:
                self._remove_files(p)
            except OSError:
                continue                                  # the save stands; the old one stays
            removed.append(p)
        return removed

    def _descends(self, e: SessionInfo, p: str, n: int) -> bool:
        """Whether saved session `e` continues from `p` (whose text is n bytes long)."""
        if p in e.ancestors:
            return True
        if e.error:
            return False                # its text cannot be read; only its record could say
        try:
            hdr, _ = read_header(e.path)
            if hdr.text_bytes <= n:
                return False
            with safeio.open_regular(e.path) as f:
                f.seek(PREFIX_BYTES)
                head = f.read(n)
        except (KVFileError, OSError):
            return False
        return hashlib.sha1(head).hexdigest() == p

    def _remove_files(self, sha: str):
        for p in (self.kv_path(sha), self.meta_path(sha)):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    # -- rename / delete -------------------------------------------------------------------------
    def rename(self, ref: str, name: str | None) -> SessionInfo:
        """Give a session a name (unique in the store; it pins the session), or clear its name and
        pin with None/''."""
        e = self.resolve(ref)
        if e.fork_pending:
            raise SessionStoreError(f"the fork {e.name!r} has no save of its own yet: continue it, then rename it")
        new = _check_name(name) if name is not None and str(name).strip() else None
        if new is not None:
            self._check_name_free(new, e.sha)
        try:
            meta = self._read_meta(e.sha)
        except SessionStoreError as x:
            raise SessionStoreError(f"cannot rename session {e.id}: {x}") from None
        if meta is None:
            if e.error:
                raise SessionStoreError(f"cannot rename session {e.id}: {e.error}")
            # a KV file without metadata (ds4's, or a crash between the writes): adopt it here
            meta = {"version": META_VERSION, "sha": e.sha, "title": e.title, "project_dir": self.project_dir,
                    "think_mode": None, "created": e.created, "updated": e.updated, "tokens": e.tokens,
                    "ctx": e.ctx, "parent": None, "ancestors": [], "model": None, "quant_bits": e.quant_bits}
        meta["name"] = meta["pinned"] = new
        try:
            self._write_meta(e.sha, meta)
        except OSError as x:
            raise SessionStoreError(f"cannot rename session {e.id}: {x.strerror or x}") from None
        return self._entry(e.sha)

    def delete(self, ref: str) -> SessionInfo:
        """Remove a session's KV file and metadata (works on damaged sessions too). A name it held
        goes back to its newest ancestor that the user saved under that name, if one is left."""
        e = self.resolve(ref)
        if e.fork_pending:                 # only the fork goes: its text is its parent's
            self._drop_fork(e.sha, e.branch, strict=True)
            return e
        try:
            self._remove_files(e.sha)
        except OSError as x:
            raise SessionStoreError(f"cannot delete session {e.id}: {x.strerror or x}") from None
        if e.name:
            for a in reversed(e.ancestors):
                try:
                    meta = self._read_meta(a)
                except SessionStoreError:
                    continue
                if meta is not None and pinned_of(meta) == e.name and not meta.get("name") \
                        and os.path.exists(self.kv_path(a)):
                    meta["pinned"], meta["name"] = e.name, e.name
                    try:
                        self._write_meta(a, meta)
                    except OSError:
                        pass
                    break
        return e

    def forget(self, session: Session):
        """Drop the remembered origin of a live session (after /new), so its next save starts a
        new lineage. Saving checks the text anyway; this only makes it explicit."""
        self._origins.pop(session, None)

    # -- cached system prefixes (sessions/sysprompt_cache.py) ----------------------------------------
    def sysprompt_path(self, session: Session, text: bytes | str) -> str:
        return self.sysprompts.path(session, text)

    def load_system_prefix(self, session: Session, text: bytes | str) -> bool:
        """Restore the cached prefill of exactly `text` on this model into `session`; False, with
        the session untouched, when there is none or it cannot be used."""
        if not self.sysprompts.load(session, text):
            return False
        self._origins.pop(session, None)
        return True

    def save_system_prefix(self, session: Session, text: bytes | str) -> KVFileInfo:
        """Cache the session (exactly the prefilled system prefix `text`)."""
        try:
            info = self.sysprompts.save(session, text)
        except SystemPrefixCacheError as x:
            raise SessionStoreError(str(x)) from None
        self._origins.pop(session, None)
        return info
