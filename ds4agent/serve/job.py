"""A request as the shim's scheduler and its slots see it (worker.py, slot.py), and the refusal of
one the queue has no room for: in their own module so a slot needs nothing of the scheduler's."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from engine import SamplingParams
from prompts import Rendered

from . import events as E


class QueueFull(Exception):
    """The request would wait behind `waiting` others, the most --max-queue allows (the app
    answers 503 with Retry-After: `retry_after` seconds, about one request's run time)."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"server busy: {waiting} requests already queued (--max-queue {waiting}); "
                         f"retry in {retry_after} s")
        self.waiting = waiting
        self.retry_after = retry_after


@dataclass
class Job:
    """One request, parsed and rendered on the client's side; the worker does the rest."""
    api: str
    rendered: Rendered
    tokens: list[int]                 # the canonical tokenization of rendered.text
    sampling: SamplingParams
    max_tokens: int
    stop: list[str]
    emit: Callable[[E.Event], None]
    seed: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    forced: str | None = None         # test hook: this text instead of sampling
    server_capped: bool = False       # max_tokens is the server's --max-tokens, below the client's ask
    trace: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.rendered.text

    @property
    def prompt_bytes(self) -> bytes:
        return self.rendered.encode()
