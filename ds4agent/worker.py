"""The engine worker: one thread owns the Agent (and so the Session); the UI sends it messages.

Requests queue up (messages typed while the model works wait their turn); interrupt and approval
answers bypass the queue, since the worker is busy when they matter.
"""
from __future__ import annotations

import queue
import threading
import traceback

from . import events as E
from .agent import Agent


class AgentWorker:
    def __init__(self, make_agent, emit):
        """make_agent(emit) -> Agent, called on the worker thread (loading the model happens there)."""
        self._emit = emit
        self._q: "queue.Queue[tuple[str, str]]" = queue.Queue()
        self.agent: Agent | None = None
        self._thread = threading.Thread(target=self._run, args=(make_agent,), name="ds4-engine", daemon=True)
        self.ready = threading.Event()
        self.failed: str | None = None
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

    def stop(self, timeout: float = 30.0):
        self._q.put(("stop", ""))
        self._thread.join(timeout)

    def _run(self, make_agent):
        try:
            self.agent = make_agent(self._emit)
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
            except Exception as e:   # a bug must not kill the worker silently
                self._emit(E.Notice(f"internal error: {e}\n{traceback.format_exc(limit=3)}", "error"))
