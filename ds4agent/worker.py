"""The engine worker: one thread owns the Agent (and so the Session); the UI sends it messages.

Requests queue up (messages typed while the model works wait their turn); interrupt and approval
answers bypass the queue, since the worker is busy when they matter.

MLX threads. A thread that ran MLX work must neither end nor be cut off at interpreter exit while
it is inside MLX: Python 3.11-3.13 ends a daemon thread that wakes up during finalization with
pthread_exit, whose forced unwind through MLX's C++ frames calls std::terminate ("terminate called
without an active exception", exit 134), and MLX 0.32 can abort as such a thread's per-thread
stream is torn down. So on a backend whose ops say `keep_threads`, the worker parks when it is done
instead of returning, `stop` waits for `done` rather than joining, and `busy_mlx()` tells the
command line (ds4agent/cli.py) that it must leave through engine.console.exit_now.
"""
from __future__ import annotations

import queue
import threading
import traceback
import weakref

from . import events as E
from .agent import Agent


_WORKERS: "weakref.WeakSet[AgentWorker]" = weakref.WeakSet()


def busy_mlx() -> bool:
    """Whether a worker on a backend that keeps its threads (MLX) is still at work: the process
    must then end without finalizing the interpreter (engine.console.exit_now)."""
    return any(w.keeps_threads and not w.done.is_set() for w in list(_WORKERS))


class AgentWorker:
    def __init__(self, make_agent, emit):
        """make_agent(emit) -> Agent, called on the worker thread (loading the model happens there)."""
        self._emit = emit
        self._q: "queue.Queue[tuple[str, str]]" = queue.Queue()
        self.agent: Agent | None = None
        self._thread = threading.Thread(target=self._run, args=(make_agent,), name="ds4-engine", daemon=True)
        self.ready = threading.Event()
        self.done = threading.Event()      # the worker has saved and stopped (it may park, not end)
        self.keeps_threads = False          # its backend's threads must live as long as the process
        self.failed: str | None = None
        _WORKERS.add(self)
        self._thread.start()

    def send_user(self, text: str):
        self._q.put(("user", text))

    def send_command(self, line: str):
        self._q.put(("command", line))

    def pending(self) -> int:
        return self._q.qsize()

    def interrupt(self):
        if self.agent is not None:
            self.agent.interrupt()

    def answer(self, ans: str):
        if self.agent is not None:
            self.agent.answer_approval(ans)

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Ask the worker to save and stop; wait up to `timeout` s. True when it has."""
        self._q.put(("stop", ""))
        return self.done.wait(timeout)

    def _run(self, make_agent):
        try:
            self._work(make_agent)
        finally:
            self.done.set()
        if self.keeps_threads:
            threading.Event().wait()     # parked for good (module docstring); a daemon, left at exit

    def _work(self, make_agent):
        try:
            self.agent = make_agent(self._emit)
            ops = getattr(getattr(getattr(self.agent, "engine", None), "model", None), "ops", None)
            self.keeps_threads = bool(getattr(ops, "keep_threads", False))
            self.agent.start()
        except Exception as e:   # a model that fails to load is reported, not raised into the UI
            self.failed = str(e)
            self._emit(E.Notice(f"could not start: {e}", "error"))
            self.ready.set()
            return
        self.ready.set()
        while True:
            kind, text = self._q.get()
            if kind == "stop":
                self.agent.save_on_exit()
                self._emit(E.Notice("stopped"))
                return
            try:
                if kind == "user":
                    self.agent.submit(text)
                else:
                    out = self.agent.command(text)
                    self._emit(E.Notice(out) if out != "quit" else E.Notice("quit"))
            except ConnectionError as e:     # a split run's rank gone or silent (engine HopError): one line
                self._emit(E.Notice(str(e), "error"))
            except Exception as e:   # a bug must not kill the worker silently
                self._emit(E.Notice(f"internal error: {e}\n{traceback.format_exc(limit=3)}", "error"))
