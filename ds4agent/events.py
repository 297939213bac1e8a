"""Messages from the agent (engine worker thread) to whatever shows it (the TUI, headless mode).

The worker never touches the UI: it emits these through one callback; the TUI forwards them to
its event loop (App.call_from_thread). Everything is plain data.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Prefill:               # before the first prefill chunk (done 0), then after each one
    done: int
    total: int
    tokens_per_s: float
    eta_s: float
    what: str = ""           # "system prompt", "message", "tool results", "compaction request", "compacted context"
    stoppable: bool = True   # Esc stops it (a message's prefill; not the system prompt's or tool results')


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class TextDelta:
    text: str


@dataclass
class ToolStarted:
    index: int
    name: str
    arguments: dict


@dataclass
class ToolFinished:
    index: int
    name: str
    arguments: dict
    ok: bool
    text: str                      # the result the model reads
    diff: str | None = None
    exit_status: int | None = None
    approved: bool = True


@dataclass
class ApprovalNeeded:            # the worker blocks until Agent.answer_approval(...) is called
    name: str
    arguments: dict
    summary: str                 # one line: what would happen (command, file, ...)


@dataclass
class Status:                    # context, speeds, session, mode: for the status bar
    model: str
    backend: str
    ctx_used: int
    ctx_total: int
    prefill_tps: float           # this turn's latest prefill (0: none yet this turn)
    gen_tps: float               # this turn's generation, live (0: no token yet this turn)
    session: str
    think_mode: str
    busy: str = ""               # "", "prefill", "generating", "tool", "saving", "compacting"
    warning: str = ""            # e.g. "context 85% full: compaction soon"
    experts: str = ""            # --expert-cache: "experts 93% hit, 1.20 GB read, 3.1 s stall"
    mtp: str = ""                # --mtp: "mtp 42%", the drafts the verify accepted this session


@dataclass
class TurnFinished:
    interrupted: bool = False
    finish_reason: str = "stop"   # stop | tool_calls | length | interrupted | error
    tool_calls: int = 0
    answer: str = ""


@dataclass
class Notice:                    # a line for the transcript (command output, saves, errors)
    text: str
    level: str = "info"          # info | warning | error


@dataclass
class SummaryDelta:              # compaction: the summary as it is written (not part of any answer)
    text: str
    tokens: int                  # written so far ...
    max_tokens: int              # ... of at most this many
    tokens_per_s: float


@dataclass
class Compacted:
    before_tokens: int
    after_tokens: int
    summary: str = field(default="")
