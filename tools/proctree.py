"""Finding and killing every process a bash job started, also those that left its process group.

A job runs in its own process group, but `setsid cmd &`, `nohup ... &` and double forks put
processes in other groups and sessions, reparented to init, where killing the group misses them.
Each job's environment carries a marker (MARKER_VAR, a random id appended to any inherited value),
which every descendant inherits through fork, exec, setsid and daemonizing; the processes whose
/proc/PID/environ holds the marker are the job's.

Why a marker rather than a cgroup per job: cgroups need a writable cgroup v2 tree with delegation
(root in some containers, never on macOS, often not for a user session), while the marker works
for any user on Linux. Its limit: a process that empties or rewrites its environment before it
execs (`env -i cmd &`) is not found; a cgroup would catch that one.
"""
from __future__ import annotations

import os
import signal
import uuid
from typing import Iterable

MARKER_VAR = "DS4_AGENT_JOB"
_ROUNDS = 100        # stop/rescan rounds before giving up on a process that keeps forking


def new_marker() -> str:
    return uuid.uuid4().hex


def marked_env(env: dict, marker: str) -> dict:
    """env with marker added (kept beside an outer agent's marker, so both can find the job)."""
    have = env.get(MARKER_VAR)
    return dict(env, **{MARKER_VAR: f"{have}:{marker}" if have else marker})


def _has_marker(environ: bytes, want: set[bytes]) -> bool:
    key = MARKER_VAR.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(key):
            return not want.isdisjoint(entry[len(key):].split(b":"))
    return False


def _wanted(markers: str | Iterable[str]) -> set[bytes]:
    return {m.encode() for m in ([markers] if isinstance(markers, str) else markers)}


def marked_pids(markers: str | Iterable[str]) -> set[int]:
    """Live processes (not this one) carrying a marker; empty where /proc does not exist."""
    me, want, out = os.getpid(), _wanted(markers), set()
    if not want:
        return out
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:       # gone, a zombie, or another user's
            continue
        if _has_marker(environ, want):
            out.add(int(name))
    return out


def signal_marked(markers: str | Iterable[str], sig: int) -> int:
    n = 0
    for pid in marked_pids(markers):
        try:
            os.kill(pid, sig)
            n += 1
        except OSError:
            pass
    return n


def kill_marked(markers: str | Iterable[str]) -> int:
    """SIGKILL every process carrying one of markers. They are stopped first, rescanning until
    no new one appears, so that a process forking in a loop cannot outrun the kill. Returns how
    many."""
    stopped: set[int] = set()
    for _ in range(_ROUNDS):
        new = marked_pids(markers) - stopped
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        stopped |= new
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(stopped)
