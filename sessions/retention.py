"""Keeping the session store in bounds (issue 35 item 13: seven identical `hi` runs in one folder,
102 MB of KV files in an hour).

Three rules, none of which ever deletes a session the user named (a name, a pin, a pending fork):

- Headless runs (`ds4-agent -p`) are marked in their record (`origin: "headless"`). After each
  such run the project keeps its newest `keep` unnamed headless sessions (HEADLESS_KEEP, or
  `headless_keep` in the config); older ones are deleted. A TUI session is never touched by it.
- Replaced saves: a save whose branch went on from an earlier point (an /undo rewound it and the
  conversation continued elsewhere, or a /compact rebuilt it) is the conversation's old version.
  `replaced` finds them; the listings fold them into one line instead of showing them beside
  the conversation that replaced them (`/redo` or `--resume ID` still reaches them).
- A size budget (`ds4-agent sessions prune --max-size SIZE`): the store's files (sessions and the
  cached system prompts) are totalled, and unnamed sessions are deleted oldest first until the
  total fits. The command only shows the plan unless `--yes` is given.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .store import SessionStoreError

HEADLESS = "headless"
HEADLESS_KEEP = 10

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.I)


def parse_size(text: str) -> int:
    """Bytes of "500M", "2G", "1.5GB", "4096" (powers of 1024). ValueError says what is accepted."""
    m = _SIZE.fullmatch(text or "")
    if not m:
        raise ValueError(f"{text!r} is not a size: give bytes or a number with K, M, G or T (e.g. 500M, 2G)")
    return int(float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower()))


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def kept_by_user(e) -> bool:
    return bool(e.name or e.pinned or e.forks)


def replaced(entries) -> set[str]:
    """The shas of saves whose branch has a newer save that does not continue them (module
    docstring); named ones are never counted."""
    by_branch: dict[str, list] = {}
    for e in entries:
        if e.ok and e.branch:
            by_branch.setdefault(e.branch, []).append(e)
    out = set()
    for saves in by_branch.values():
        for r in saves:
            if not kept_by_user(r) and any(o.updated > r.updated and r.sha not in o.ancestors
                                           for o in saves if o is not r):
                out.add(r.sha)
    return out


def prune_headless(store, keep: int = HEADLESS_KEEP) -> list:
    """Delete this project's unnamed headless sessions beyond the newest `keep` (at least 1: the
    run's own save always stays). Returns the deleted entries; one that cannot go stays."""
    keep = max(1, int(keep))
    rows = [e for e in store.list("project") if e.ok and e.origin == HEADLESS and not kept_by_user(e)]
    gone = []
    for e in rows[keep:]:                    # list() is newest first
        try:
            store.delete(e.sha)
            gone.append(e)
        except (SessionStoreError, OSError):   # a file that will not go stays
            continue
    return gone


@dataclass
class PrunePlan:
    total: int                               # bytes of the store now
    budget: int
    doomed: list = field(default_factory=list)   # sessions to delete, oldest first
    freed: int = 0

    @property
    def after(self) -> int:
        return self.total - self.freed

    @property
    def fits(self) -> bool:
        return self.after <= self.budget


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def store_bytes(store) -> int:
    """Every file of the store folder (sessions, records, cached system prompts); links not followed."""
    try:
        names = os.listdir(store.root)
    except OSError:
        return 0
    return sum(_size(os.path.join(store.root, n)) for n in names)


def plan_prune(store, budget: int) -> PrunePlan:
    """Which unnamed sessions (every project's, oldest first) to delete so that the store fits
    `budget` bytes; named and damaged ones are never in it."""
    plan = PrunePlan(store_bytes(store), budget)
    for e in sorted(store.list("all"), key=lambda e: (e.updated, e.sha)):
        if plan.fits:
            break
        if not e.ok or kept_by_user(e):
            continue
        plan.doomed.append(e)
        plan.freed += _size(store.kv_path(e.sha)) + _size(store.meta_path(e.sha))
    return plan


def apply_prune(store, plan: PrunePlan) -> list:
    """Delete the plan's sessions; returns those deleted."""
    gone = []
    for e in plan.doomed:
        try:
            store.delete(e.sha)
            gone.append(e)
        except (SessionStoreError, OSError):
            continue
    return gone
