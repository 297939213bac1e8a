"""How every console command (ds4-agent, ds4, ds4-gguf, ds4-kv, ds4-bench) ends.

Broken pipes. `ds4-agent sessions list | head -3` closes the pipe after three lines; the next write
raises BrokenPipeError. A command then stops quietly, as `git log | head` does: no traceback, no
`error:` line, exit status 141 (128 + SIGPIPE, what a shell reports for a tool the signal ended,
so `set -o pipefail` scripts still see that the output was cut short). stdout is pointed at
/dev/null first, so the interpreter's own last flush at exit cannot complain again.

Leaving while a thread is inside MLX. See ds4agent/worker.py: such a process must not finalize the
interpreter, so `exit_now` runs the exit handlers (the bash tool's kill of its jobs' process trees,
the engine's page-ins), flushes, and ends the process with os._exit. Even a quiet MLX process
aborted now and then at exit (`ds4-agent --serve --backend mlx` on SIGTERM, after every slot was
saved: MLX's thread teardown), so a console script run (main called without arguments) that
opened an MLX backend (`threads_kept`) always ends that way once its main has returned.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys

PIPE_EXIT = 141
_KEPT = [False]       # an MLX backend was opened in this process


def threads_kept():
    """Called by a backend whose threads must live as long as the process (MLX)."""
    _KEPT[0] = True


def _silence_stdout():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        # no real file descriptor (a test's captured stdout): replace the object instead
        sys.stdout = open(os.devnull, "w")


def console_main(main):
    """Wrap a console script's main(argv=None) -> int: a reader that went away ends it quietly."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            rc = main(*args, **kwargs)
            if sys.stdout is not None:
                sys.stdout.flush()     # what is still buffered meets the closed pipe here, not at exit
        except BrokenPipeError:
            _silence_stdout()
            rc = PIPE_EXIT
        if _KEPT[0] and not args and not kwargs:
            exit_now(rc if isinstance(rc, int) else 1)     # the console script itself (module docstring)
        return rc
    return wrapper


def is_broken_pipe(e: BaseException) -> bool:
    """For commands that turn OSError into one `error:` line: a closed reader is not an error."""
    return isinstance(e, BrokenPipeError)


def exit_now(rc: int):
    """End the process with status `rc` without finalizing the interpreter (module docstring)."""
    try:
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(rc)
