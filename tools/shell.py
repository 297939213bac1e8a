"""bash, bash_status, bash_stop: shell commands as background jobs.

Every command is a job: `bash -c COMMAND` in its own process group (session), cwd the project
directory, stdin from /dev/null, stdout and stderr going through a pipe into a capped log file
(joblog: the first LOG_HEAD_BYTES, then the last LOG_TAIL_BYTES when the output ends). The tool waits
up to `timeout` seconds; a job still running then keeps running in the background and the model
can poll it (bash_status, optionally waiting) or stop it (bash_stop kills the whole group).

Better than ds4's (spec/agent.md §3.5, §10 items 6-7): the output goes to the file directly, so a
chatty job never stalls on a full pipe while nobody polls; the first observation of a long output
is its head AND tail (a failing build's errors are at the end) with line numbers to read the rest
from the log; bash_status can wait; the child never reads the terminal; logs live under the
session's scratch folder (or one temp folder per session) and running jobs are killed when the
agent exits. Stopping a job also kills what left its process group (setsid, nohup, double
forks): every process carrying the job's environment marker (proctree).
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import proctree
from .base import Tool, ToolContext, ToolError, ToolResult, register
from .joblog import CappedLog

DEFAULT_TIMEOUT = 30
MAX_TIMEOUT = 600
FULL_LINES, FULL_CHARS = 150, 12_000    # output up to this size is shown whole
HEAD_LINES, HEAD_CHARS = 40, 4_000      # otherwise its head ...
TAIL_LINES, TAIL_CHARS = 80, 8_000      # ... and its tail
STOP_GRACE = 2.0                        # seconds between SIGTERM and SIGKILL
# A log keeps the first 16 MiB (what read shows whole, by line number) and, once the output
# ends, its last 1 MiB: bounded disk per job, and both ends of a long build's output.
LOG_HEAD_BYTES = 16 << 20
LOG_TAIL_BYTES = 1 << 20

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_LIVE: dict[str, subprocess.Popen] = {}    # marker -> leader, of jobs not yet stopped


@dataclass
class Job:
    id: int
    command: str
    proc: subprocess.Popen
    log: Path
    started: float
    sink: CappedLog
    marker: str                # in the environment of every process the job starts
    ended: float | None = None
    seen: int = 0              # bytes of the log already shown to the model
    seen_lines: int = 0        # lines in those bytes (to number what comes next)
    stopped: bool = False      # bash_stop killed it

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
            self.sink.settle()       # what it wrote before it ended is in the log
        return rc

    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started


def _kill_all_at_exit() -> None:
    for p in list(_LIVE.values()):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
    proctree.kill_marked(list(_LIVE))     # one /proc scan for all jobs


atexit.register(_kill_all_at_exit)


def _jobs(ctx: ToolContext) -> dict[int, Job]:
    return ctx.state.setdefault("bash_jobs", {})


def _log_dir(ctx: ToolContext) -> Path:
    d = ctx.state.get("bash_log_dir")
    if d is None:
        if ctx.scratch is not None:
            d = Path(ctx.scratch) / "bash"
            d.mkdir(parents=True, exist_ok=True)
        else:
            d = Path(tempfile.mkdtemp(prefix="ds4-agent-bash-"))
            ctx.state["bash_log_dir_owned"] = True
        ctx.state["bash_log_dir"] = d
        # the model must be able to read a log with the read tool even outside the project
        ctx.state.setdefault("readable_dirs", []).append(str(d))
    return Path(d)


def _status_text(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name} (exit status {128 - rc})"
    return f"exit status {rc}"


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _clean(b: bytes) -> str:
    """Log bytes as text for the model: no colour codes, progress-bar rewrites collapsed."""
    s = _ANSI.sub("", b.decode("utf-8", "replace"))
    if "\r" in s:
        s = "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in s.split("\n"))
    return s


def _lines(s: str) -> list[str]:
    ls = s.split("\n")
    if ls and ls[-1] == "":
        ls.pop()
    return ls


def _cap_head(ls: list[str], n: int, chars: int) -> list[str]:
    out, used = [], 0
    for l in ls[:n]:
        if used + len(l) + 1 > chars:
            out.append(l[:max(0, chars - used)] + " [... line cut ...]")
            break
        out.append(l)
        used += len(l) + 1
    return out


def _cap_tail(ls: list[str], n: int, chars: int) -> list[str]:
    out, used = [], 0
    for l in reversed(ls[-n:] if n else []):
        if used + len(l) + 1 > chars:
            out.append("[... line cut ...] " + l[-max(0, chars - used):] if chars > used else "[... line cut ...]")
            break
        out.append(l)
        used += len(l) + 1
    return out[::-1]


def _count_lines(f, start: int, end: int) -> int:
    f.seek(start)
    n, left = 0, end - start
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        n += chunk.count(b"\n")
        left -= len(chunk)
    return n


def _output(job: Job) -> tuple[str, bool]:
    """The log from what the model has seen to now: whole if short, else head + tail with the
    line numbers of the cut, which the model can read from the log."""
    try:
        size = job.log.stat().st_size
    except OSError:
        return "(the output log is gone)", False
    start, first_line = job.seen, job.seen_lines + 1
    new = size - start
    where = str(job.log)
    if new <= 0:
        return ("no new output" if start else "no output"), False
    with open(job.log, "rb") as f:
        if new <= FULL_CHARS * 2:
            f.seek(start)
            raw = f.read(new)
            text = _clean(raw)
            ls = _lines(text)
            nlines = raw.count(b"\n") + (0 if raw.endswith(b"\n") else 1)
            if len(ls) <= FULL_LINES and len(text) <= FULL_CHARS:
                job.seen, job.seen_lines = size, job.seen_lines + raw.count(b"\n")
                label = "output" if start == 0 else f"new output (log lines {first_line}-{first_line + nlines - 1})"
                return f"{label}:\n" + "\n".join(ls), False
        f.seek(start)
        head_raw = f.read(min(new, 64 * 1024))
        f.seek(max(start, size - 64 * 1024))
        tail_raw = f.read()
        total_nl = _count_lines(f, start, size)
    nlines = total_nl + (0 if tail_raw.endswith(b"\n") else 1)
    head = _cap_head(_lines(_clean(head_raw)), HEAD_LINES, HEAD_CHARS)
    tail = _cap_tail(_lines(_clean(tail_raw)), TAIL_LINES, TAIL_CHARS)
    # log line numbers, for "read path=LOG start_line=..."
    h_last = first_line + len(head) - 1
    t_first = first_line + nlines - len(tail)
    if t_first <= h_last:     # few but very long lines: the cut is inside lines
        t_first = h_last + 1
    job.seen, job.seen_lines = size, job.seen_lines + total_nl
    label = "output" if start == 0 else "new output"
    return (f"{label} ({nlines} lines, {new} bytes; full log: {where}):\n" + "\n".join(head) +
            f"\n[... truncated: log lines {h_last + 1}-{t_first - 1} not shown; read them with "
            f"read path={where} start_line={h_last + 1} ...]\n" + "\n".join(tail)), True


def _observe(job: Job) -> ToolResult:
    rc = job.poll()
    short = job.command if len(job.command) <= 120 else job.command[:117] + "..."
    if rc is None:
        head = (f"[job {job.id}] `{short}` is still running as job {job.id} after "
                f"{job.elapsed():.1f} s (pid {job.proc.pid}). Check it with bash_status job={job.id} "
                f"(add wait=SECONDS to wait for it to finish); stop it with bash_stop job={job.id}.")
    else:
        how = "stopped by bash_stop: " if job.stopped else ""
        head = f"[job {job.id}] `{short}` finished after {job.elapsed():.1f} s: {how}{_status_text(rc)}."
    out, truncated = _output(job)
    if job.sink.dropped and not job.sink.done.is_set():
        out += _live_tail(job)
        truncated = True
    return ToolResult(head + "\n" + out, exit_status=None if rc is None else _exit_status(rc),
                      truncated=truncated)


def _live_tail(job: Job) -> str:
    """Output past the log's cap is not in the file until the output ends: its latest lines."""
    tail = _cap_tail(_lines(_clean(job.sink.last())), TAIL_LINES // 4, TAIL_CHARS // 4)
    return (f"\n[... log capped at {job.sink.head_bytes} bytes; {job.sink.dropped} bytes since not "
            f"stored (the last {job.sink.tail_bytes} bytes are added to the log when the output "
            "ends); the latest output: ...]\n" + "\n".join(tail))


def _get_job(ctx: ToolContext, jid: int) -> Job:
    jobs = _jobs(ctx)
    if jid not in jobs:
        have = ", ".join(str(j) for j in jobs) or "none"
        raise ToolError(f"no bash job {jid} (jobs: {have})")
    return jobs[jid]


def _wait(job: Job, seconds: float, should_stop=None) -> None:
    """Up to `seconds` for the job to end; a user's interrupt (`should_stop`) ends the wait early,
    as the timeout does (the job runs on in the background): Esc and /quit must not sit out a
    600-second wait."""
    if seconds > 0 and job.poll() is None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                job.proc.wait(timeout=min(left, 0.1) if should_stop is not None else left)
                break
            except subprocess.TimeoutExpired:
                if should_stop is not None and should_stop():
                    break
        job.poll()


# ---------------------------------------------------------------------------------------- bash

def _bash(args: dict, ctx: ToolContext) -> ToolResult:
    command = args["command"]
    if not command.strip():
        raise ToolError("command is empty")
    timeout = args.get("timeout", DEFAULT_TIMEOUT)
    jid = ctx.state.get("bash_next_job", 1)
    ctx.state["bash_next_job"] = jid + 1
    log = _log_dir(ctx) / f"job-{jid}.log"
    shell = shutil.which("bash") or "/bin/sh"
    marker = proctree.new_marker()
    env = proctree.marked_env(dict(os.environ, PAGER="cat", GIT_PAGER="cat", GIT_TERMINAL_PROMPT="0",
                                   TERM="dumb", NO_COLOR="1", PYTHONUNBUFFERED="1"), marker)
    sink = CappedLog(log, LOG_HEAD_BYTES, LOG_TAIL_BYTES)
    try:
        proc = subprocess.Popen([shell, "-c", command], cwd=ctx.root, stdin=subprocess.DEVNULL,
                                stdout=sink.write_fd, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    except OSError as e:
        sink.abandon()
        raise ToolError(f"could not start the command: {e.strerror or e}") from None
    sink.start()
    _LIVE[marker] = proc
    job = Job(jid, command, proc, log, time.monotonic(), sink, marker)
    _jobs(ctx)[jid] = job
    _wait(job, timeout, ctx.should_stop)
    return _observe(job)


register(Tool(
    name="bash",
    description=(
        "Run a shell command with bash in the project directory (stdin is empty; stdout and "
        "stderr are merged into one log file). It waits up to `timeout` seconds (default "
        f"{DEFAULT_TIMEOUT}, max {MAX_TIMEOUT}): if the command finished you get its exit status "
        "and output; if not it keeps running in the background as a job and you get its output "
        "so far plus the job number, to check later with bash_status or end with bash_stop. Long "
        "output is shown as its first and last lines with a `[... truncated ...]` marker giving "
        "the log path and line numbers, which you can read with the read tool. Use it to build, "
        "run tests, and run programs; prefer read/search/list/edit for files. Interactive "
        "programs cannot be used. The user may be asked to approve the command."),
    parameters={
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "the shell command (bash syntax)"},
            "timeout": {"type": "number", "minimum": 0, "maximum": MAX_TIMEOUT,
                        "description": f"seconds to wait before returning (default {DEFAULT_TIMEOUT}); "
                                       "the command keeps running afterwards"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
    run=_bash,
    needs_approval=True,
))


# ---------------------------------------------------------------------------------------- status

def _bash_status(args: dict, ctx: ToolContext) -> ToolResult:
    jid = args.get("job")
    if jid is None:
        jobs = _jobs(ctx)
        if not jobs:
            return ToolResult("no bash jobs")
        rows = []
        for j in jobs.values():
            rc = j.poll()
            state = "running" if rc is None else _status_text(rc)
            rows.append(f"job {j.id}: {state}, {j.elapsed():.1f} s, `{j.command[:80]}`")
        return ToolResult("\n".join(rows))
    job = _get_job(ctx, jid)
    _wait(job, args.get("wait", 0), ctx.should_stop)
    return _observe(job)


register(Tool(
    name="bash_status",
    description=(
        "Check a bash job: whether it is still running or its exit status, and the output it "
        "produced since you last looked (head and tail if long, with the log path). With wait=N "
        "it first waits up to N seconds for the job to finish. Without job it lists all jobs."),
    parameters={
        "type": "object",
        "properties": {
            "job": {"type": "integer", "minimum": 1, "description": "the job number bash gave"},
            "wait": {"type": "number", "minimum": 0, "maximum": MAX_TIMEOUT,
                     "description": "seconds to wait for the job to finish first (default 0)"},
        },
        "additionalProperties": False,
    },
    run=_bash_status,
))


# ---------------------------------------------------------------------------------------- stop

def stop_job(job: Job) -> None:
    """SIGTERM to the job's whole process group and to every process carrying its marker (also
    those that left the group), SIGKILL after a grace period."""
    if job.poll() is None:
        job.stopped = True
        try:
            os.killpg(job.proc.pid, signal.SIGTERM)
        except OSError:
            pass
        proctree.signal_marked(job.marker, signal.SIGTERM)
        _wait(job, STOP_GRACE)
    # the leader may be gone while children it started in the background still run
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proctree.kill_marked(job.marker)
    _wait(job, STOP_GRACE)
    _LIVE.pop(job.marker, None)
    job.sink.done.wait(STOP_GRACE)   # the pipe ends with its last writer: the log is final


def _bash_stop(args: dict, ctx: ToolContext) -> ToolResult:
    job = _get_job(ctx, args["job"])
    stop_job(job)
    return _observe(job)


register(Tool(
    name="bash_stop",
    description=(
        "Stop a bash job: its whole process group gets SIGTERM, then SIGKILL if it has not "
        "exited within 2 seconds. Returns its final status and the output not yet shown."),
    parameters={
        "type": "object",
        "properties": {
            "job": {"type": "integer", "minimum": 1, "description": "the job number bash gave"},
        },
        "required": ["job"],
        "additionalProperties": False,
    },
    run=_bash_stop,
))


def close(ctx: ToolContext) -> None:
    """End of a session: stop its running jobs and delete the log folder if it was a temp one."""
    for job in list(_jobs(ctx).values()):
        stop_job(job)
    d = ctx.state.get("bash_log_dir")
    if d is not None and ctx.state.get("bash_log_dir_owned"):
        shutil.rmtree(d, ignore_errors=True)
        ctx.state.pop("bash_log_dir", None)
        ctx.state.pop("bash_log_dir_owned", None)
        dirs = ctx.state.get("readable_dirs", [])
        if str(d) in dirs:
            dirs.remove(str(d))
