"""A user's interrupt ends a tool's wait (issue 24 item 9): bash waits up to its timeout (at most
600 s) for a command, and Esc or /quit during that wait must not sit it out. The command runs on
as a background job, as after a timeout."""
from __future__ import annotations

import threading
import time

from tools import ToolContext, call


def test_an_interrupt_ends_the_bash_wait_and_the_job_runs_on(tmp_path):
    stop = threading.Event()
    ctx = ToolContext(root=tmp_path, should_stop=stop.is_set)
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    res = call("bash", {"command": "sleep 30", "timeout": 60}, ctx)
    assert time.monotonic() - t0 < 5
    assert res.ok and "still running as job 1" in res.text
    status = call("bash_status", {"job": 1, "wait": 60}, ctx)      # the flag is still set: no wait
    assert "still running" in status.text
    call("bash_stop", {"job": 1}, ctx)
    # without an interrupt the wait is the command's (it ends first here)
    quiet = ToolContext(root=tmp_path, should_stop=lambda: False)
    assert call("bash", {"command": "sleep 0.3; echo done", "timeout": 60}, quiet).exit_status == 0
