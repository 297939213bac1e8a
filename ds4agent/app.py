"""The terminal UI: a Textual app over the agent, which runs on its own engine thread.

    transcript (scrolls, sticks to the bottom while you are there)
      * user message
        ▶ thinking (dimmed, collapsible; streams, folds when the answer starts)
        answer (Markdown, streamed)
        tool call: arguments, approval, result (edits as coloured diffs, bash output + exit status)
    queue preview        messages typed while the model works, sent in order
    approval bar         y / n / a(lways) for bash, write, edit, git commit
    progress bar         prefill (system prompt|message|...) ▶▶▶···  done/total  pct  t/s  ETA;
                         a compaction's summary as it is written, tokens of at most 1024
    input                multi-line: Enter sends, Shift+Enter / Ctrl+J new line, Up/Down history
    status bar           state │ ctx used/total │ gen t/s │ prefill t/s │ think │ session │ model · backend
                         (this turn's speeds, live; fields fitted to the width by priority)

The engine never runs on the UI thread. AgentWorker owns the Agent (and so the Session); this app
sends it lines and reads its events (ds4agent/events.py). Events arrive on the worker thread and go
into an inbox; the UI drains it at most ~30 times a second, merging consecutive text deltas, so a
fast model costs one Markdown append per frame, not one per token, and the worker never waits for
the screen. The app keeps its own queue of typed messages and hands the worker one item at a time,
so a queued message is echoed where it really starts and can be taken back (Ctrl+X) before it runs.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Static

from engine.atomic import atomic_write

from . import events as E
from .tui_widgets import (HISTORY_MAX, Answer, ApprovalBar, InputArea, NoticeLine, StatusBar, SummaryView, Thinking,
                          ToolView, UserMessage, fmt_secs, fmt_tokens, one_line, prefill_bar, replay_widgets,
                          status_fields)
from .worker import AgentWorker

FLUSH_S = 1 / 30            # how often streamed events reach the screen at most
REPLAY_MESSAGES = 60        # how much of a switched-to session is drawn
QUEUE_PREVIEW_CHARS = 120
# typed while the model works, these stop the turn (as Esc does) and run next, ahead of queued
# messages: a turn may run for minutes, and none of them is of use after it (/quit: leaves at once)
STOP_FIRST = ("/new", "/switch", "/resume", "/think")
KEYS_HINT = ("Enter sends · Shift+Enter/Ctrl+J new line · ↑↓ history · Esc interrupts · "
             "Ctrl+X edits the queued message · Ctrl+O folds thinking · Ctrl+C quits · /help")


# -- markers the app adds to the agent's event stream (emitted on the worker thread) ----------------
@dataclass
class Ready:                 # the agent started: the system prefix is live
    pass


@dataclass
class Begin:                 # the worker took an item (a user message or a slash command)
    kind: str
    text: str


@dataclass
class End:                   # ... and finished it; for a command the worker's reply Notice follows
    kind: str
    error: bool = False


@dataclass
class Timeline:              # after /switch or /new: the messages of the timeline now live
    messages: list = field(default_factory=list)


def instrument(make_agent: Callable) -> Callable:
    """Wrap a make_agent(emit) factory so the agent tells the UI when it starts and finishes each item.

    AgentWorker runs items one after another and emits nothing of its own around them; the UI needs
    to know when the worker is idle (to send the next queued message) and which Notice is a
    command's reply. The wrappers run on the worker thread, in order with the agent's own events.
    """
    def make(emit):
        agent = make_agent(emit)
        orig_start, orig_submit, orig_command = agent.start, agent.submit, agent.command

        def start():
            del agent.start              # /new calls start() again: that one is the agent's own
            orig_start()                 # a failure here is the worker's "could not start"
            emit(Ready())

        def submit(text):
            emit(Begin("user", text))
            try:
                return orig_submit(text)
            except Exception as e:       # reported here so that it lands before End
                import traceback
                emit(E.Notice(f"internal error: {e}\n{traceback.format_exc(limit=3)}", "error"))
                return None
            finally:
                emit(End("user"))

        nested = [0]

        def command(line):
            if nested[0]:                # a command that runs another (/resume runs /switch): one item
                return orig_command(line)
            emit(Begin("command", line))
            before = agent.transcript
            error = False
            nested[0] += 1
            try:
                out = orig_command(line)
            except Exception as e:
                out, error = f"internal error: {e}", True
            finally:
                nested[0] -= 1
            if agent.transcript is not before and line.split()[0].lower() in ("/switch", "/new", "/resume"):
                emit(Timeline(list(agent.transcript)))
            emit(End("command", error))
            return out                   # the worker emits it as a Notice right after End

        agent.start, agent.submit, agent.command = start, submit, command
        return agent
    return make


class _Wake(Message):
    """Posted (thread-safely) when the inbox goes from empty to non-empty."""


# -- the app ----------------------------------------------------------------------------------------
CSS = """
Screen { layout: vertical; }
#transcript { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
#transcript > * { margin-bottom: 1; }
.user { color: $text; margin-top: 1; }
.notice { color: $text-muted; }
.notice.error { color: $error; }
.notice.warning { color: $warning; }
.notice.reply { color: $text; }
.notice.command { color: $accent; margin-top: 1; }
.thinking { background: $background; border-top: none; padding: 0 0 0 0; margin-bottom: 0; }
.thinking CollapsibleTitle { color: $text-muted; padding: 0; }
.thinking Contents { padding: 0 0 0 2; }
.thinking .para { color: $text-muted; text-style: italic; margin-bottom: 1; }
.thinking .para:last-child { margin-bottom: 0; }
#transcript > .answer { margin: 0; padding: 0; background: $background; }
.answer MarkdownFence { margin: 0 0 1 0; }
.answer MarkdownFence > Label { padding: 0 1; }
.tool { height: auto; border-left: thick $warning 60%; padding: 0 1; background: $boost; }
.tool-body { padding: 0 0 0 2; }
.tool-state { padding: 0 0 0 2; }
.result-box { background: $boost; border-top: none; padding: 0; }
.result-box Contents { padding: 0 0 0 2; }
.summary { margin-bottom: 1; }
.turn-end { color: $text-muted; text-style: italic; }
.turn-end.bad { color: $warning; }
#queue { height: auto; max-height: 4; color: $accent; padding: 0 1; display: none; }
#approval { height: auto; background: $warning 25%; padding: 0 1; }
#approval:focus { background: $warning 40%; }
#prefill { height: 1; padding: 0 1; display: none; }
#input { height: auto; min-height: 3; max-height: 12; border: round $primary 50%; padding: 0 1; }
#input:focus { border: round $primary; }
#status { height: 1; background: $panel; color: $text; padding: 0 1; }
#warning { height: auto; background: $warning 30%; padding: 0 1; display: none; }
"""


class AgentApp(App):
    """ds4-agent's TUI. make_agent(emit) -> Agent runs on the engine thread (see AgentWorker)."""

    CSS = CSS
    TITLE = "ds4-agent"
    BINDINGS = [
        Binding("escape", "interrupt", "interrupt", show=False),
        Binding("ctrl+c", "leave", "quit", show=False, priority=True),
        Binding("ctrl+q", "leave", "quit", show=False, priority=True),
        Binding("ctrl+o", "toggle_thinking", "thinking", show=False),
        Binding("ctrl+l", "clear_screen", "clear", show=False),
    ]

    def __init__(self, make_agent: Callable, *, history_path: str | os.PathLike | None = None,
                 banner: str | None = None, worker_factory=AgentWorker, initial: list[str] | None = None,
                 **kw):
        super().__init__(**kw)
        self._make_agent = make_agent
        self._worker_factory = worker_factory
        self.worker: AgentWorker | None = None
        self.history_path = Path(history_path) if history_path else None
        self.banner = banner
        # inbox: events from the worker thread, drained on the UI loop
        self._lock = threading.Lock()
        self._inbox: list = []
        self._wake_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # state of the conversation as the UI sees it
        self.ready = False
        self.busy = True               # an item is with the worker (or the model is still loading)
        self.queue: list[str] = []     # typed while busy, sent in order
        self.queue.extend(initial or [])   # e.g. /resume: sent once the model is ready
        self.status: E.Status | None = None
        self.approval: ApprovalBar | None = None
        self._await_reply: str | None = None   # a command ended: its reply Notice comes next
        self._leaving = False
        self._gone = False             # exit() called: nothing more is drawn
        self._think: Thinking | None = None
        self._answer: Answer | None = None
        self._tools: dict[int, ToolView] = {}
        self._summary: SummaryView | None = None   # a compaction's summary while it is written
        self._turn_t0 = 0.0
        self.turns_finished = 0        # tests and the screenshot wait on these
        self.events_seen: deque = deque(maxlen=10_000)

    # -- layout ------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="transcript")
        yield Static(id="queue")
        yield Static(id="prefill")
        yield InputArea(self._load_history(), id="input")
        yield Static(id="warning")
        yield StatusBar(Text("loading the model…", style="dim"), id="status")

    async def on_mount(self):
        self._loop = asyncio.get_running_loop()
        self.transcript = self.query_one("#transcript", VerticalScroll)
        self.transcript.anchor()
        self.input = self.query_one("#input", InputArea)
        self.input.focus()
        await self._add_header()
        self.worker = self._worker_factory(instrument(self._make_agent), self._emit)

    # -- events from the worker thread ---------------------------------------------------------------
    def _emit(self, ev):
        """Called on the worker thread: queue the event, wake the UI once per batch."""
        with self._lock:
            self._inbox.append(ev)
            if self._wake_pending:
                return
            self._wake_pending = True
        loop = self._loop
        try:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.post_message, _Wake())
        except RuntimeError:     # the UI has already gone (the loop closed under us)
            pass

    def on__wake(self, _msg: _Wake):
        # let a frame's worth of events pile up, then apply them in one go
        self.set_timer(FLUSH_S, self._drain)

    async def _drain(self):
        with self._lock:
            evs, self._inbox = self._inbox, []
            self._wake_pending = False
        if self._gone:         # the worker's last events (the stopped turn's end) outlive the screen
            return
        with self.batch_update():
            for ev in coalesce(evs):
                if self._gone:
                    return
                try:
                    await self._apply(ev)
                except Exception as e:   # a display bug must not take the UI down
                    if self._gone:
                        return
                    self.log.error(f"could not show {type(ev).__name__}: {e!r}")
                    await self._add(NoticeLine(f"ui error showing {type(ev).__name__}: {e}", "error"))

    async def _apply(self, ev):
        self.events_seen.append(ev)
        if isinstance(ev, E.TextDelta):
            await self._close_thinking(collapse=True)
            if self._answer is None:
                self._answer = Answer()
                await self._add(self._answer)
            await self._answer.add(ev.text)
        elif isinstance(ev, E.ReasoningDelta):
            if self._think is None:
                await self._close_answer()
                self._think = Thinking()
                await self._add(self._think)
            await self._think.add(ev.text)
        elif isinstance(ev, E.Prefill):
            bar = self.query_one("#prefill", Static)
            bar.update(prefill_bar(ev.done, ev.total, ev.tokens_per_s, ev.eta_s, what=ev.what,
                                   hint="Esc stops it" if ev.stoppable else "",
                                   width=bar.content_size.width or self.size.width - 2))
            bar.display = ev.done < ev.total
        elif isinstance(ev, E.SummaryDelta):
            await self._summary_delta(ev)
        elif isinstance(ev, E.Status):
            self._show_status(ev)
        elif isinstance(ev, E.ToolStarted):
            await self._close_stream()
            view = ToolView(ev.name, ev.arguments)
            self._tools[ev.index] = view
            await self._add(view)
        elif isinstance(ev, E.ApprovalNeeded):
            await self._ask(ev)
        elif isinstance(ev, E.ToolFinished):
            view = self._tools.get(ev.index)
            if view is None:
                view = ToolView(ev.name, ev.arguments)
                await self._add(view)
            await view.finish(ev)
            self._tools.pop(ev.index, None)
            await self._drop_approval()
        elif isinstance(ev, E.TurnFinished):
            await self._turn_finished(ev)
        elif isinstance(ev, E.Compacted):
            await self._compacted(ev)
        elif isinstance(ev, E.Notice):
            await self._notice(ev)
        elif isinstance(ev, Ready):
            self.ready = True
            await self._idle()
        elif isinstance(ev, Begin):
            pass
        elif isinstance(ev, End):
            await self._close_stream()
            self._close_summary(None)
            await self._drop_approval()
            self.query_one("#prefill", Static).display = False
            if ev.kind == "command":
                self._await_reply = "error" if ev.error else "info"
            else:
                await self._idle()
        elif isinstance(ev, Timeline):
            await self._replay(ev.messages)

    async def _notice(self, ev: E.Notice):
        if self._await_reply is not None:      # a command's reply: the worker is free again
            level = "error" if self._await_reply == "error" else "reply"
            self._await_reply = None
            if ev.text == "quit":
                await self._stop_and_exit()
                return
            if ev.text:
                await self._add(NoticeLine(ev.text, level))
            await self._idle()
            return
        if ev.text == "stopped":
            return
        if ev.level == "error" and not self.ready and self.worker is not None and self.worker.failed:
            self._set_status(Text(f"could not start: {self.worker.failed}", style="bold red"))
        if ev.text.startswith(("compaction failed", "compaction interrupted")):
            self._close_summary(None)
        await self._add(NoticeLine(ev.text, ev.level))

    # -- compaction: the summary streams into its own block, the bar counts its tokens -----------------
    async def _summary_delta(self, ev: E.SummaryDelta):
        if self._summary is None:
            await self._close_stream()
            self._summary = SummaryView()
            await self._add(self._summary)
        self._summary.add(ev.text)
        bar = self.query_one("#prefill", Static)
        bar.update(prefill_bar(ev.tokens, ev.max_tokens, ev.tokens_per_s, 0.0, label="summary", cap=True,
                               width=bar.content_size.width or self.size.width - 2))
        bar.display = True

    async def _compacted(self, ev: E.Compacted):
        if self._summary is None and ev.summary:       # nothing was streamed: show the kept summary
            self._summary = SummaryView()
            await self._add(self._summary)
        self._close_summary(ev.summary)
        await self._add(NoticeLine(f"context compacted: {fmt_tokens(ev.before_tokens)} → "
                                   f"{fmt_tokens(ev.after_tokens)} tokens", "warning"))

    def _close_summary(self, kept: str | None):
        if self._summary is not None:
            self._summary.done(kept)
            self._summary = None
            self.query_one("#prefill", Static).display = False

    # -- transcript helpers ------------------------------------------------------------------------
    async def _add(self, widget: Widget):
        await self.transcript.mount(widget)

    async def _add_header(self):
        """The banner and the keys: at the top of every view (a /new, a /switch, Ctrl+L keep them)."""
        if self.banner:
            await self._add(Static(Text(self.banner, style="bold"), classes="banner header"))
        await self._add(NoticeLine(KEYS_HINT, "info"))
        self.transcript.children[-1].add_class("header")

    async def _clear_transcript(self):
        await self.transcript.remove_children()
        await self._add_header()
        self._think = self._answer = self._summary = None
        self._tools = {}

    async def _close_thinking(self, collapse: bool):
        if self._think is not None:
            self._think.done(collapse)
            self._think = None

    async def _close_answer(self):
        if self._answer is not None:
            await self._answer.close()
            self._answer = None

    async def _close_stream(self):
        await self._close_thinking(collapse=True)
        await self._close_answer()

    async def _turn_finished(self, ev: E.TurnFinished):
        await self._close_stream()
        self.turns_finished += 1
        dt = time.perf_counter() - self._turn_t0 if self._turn_t0 else 0.0
        parts = [fmt_secs(dt)]
        if ev.tool_calls:
            parts.append(f"{ev.tool_calls} tool call{'s' if ev.tool_calls != 1 else ''}")
        if self.status is not None and self.status.gen_tps:
            parts.append(f"{self.status.gen_tps:.1f} t/s")
        bad = ev.interrupted or ev.finish_reason not in ("stop", "tool_calls")
        head = {"interrupted": "⏹ interrupted", "length": "⚠ stopped at the token limit",
                "error": "✗ error"}.get(ev.finish_reason, "✓")
        await self._add(Static(Text(f"{head} · " + " · ".join(parts)),
                               classes="turn-end bad" if bad else "turn-end"))

    async def _replay(self, messages: list):
        """Draw a switched-to (or new) timeline as it looked live: reasoning folded, tool calls as
        tool blocks with their results (tui_widgets.replay_widgets); nothing streamed."""
        await self._clear_transcript()
        widgets = replay_widgets(messages, REPLAY_MESSAGES)
        if widgets:
            await self.transcript.mount_all(widgets)
        self.transcript.anchor()

    # -- approvals ---------------------------------------------------------------------------------
    async def _ask(self, ev: E.ApprovalNeeded):
        await self._drop_approval()
        view = next(iter(reversed(list(self._tools.values()))), None) if self._tools else None
        if view is not None:
            view.set_state(Text("waiting for your approval…", style="yellow"))
        self.approval = ApprovalBar(ev)
        await self.mount(self.approval, before=self.query_one("#prefill"))
        self.approval.focus()
        self.transcript.scroll_end(animate=False)
        if self.status is not None:
            self._show_status(self.status)

    async def on_approval_bar_answered(self, msg: ApprovalBar.Answered):
        if self.worker is not None:
            self.worker.answer(msg.answer)
        view = next(iter(reversed(list(self._tools.values()))), None) if self._tools else None
        if view is not None:
            view.answer = msg.answer
            view.set_state(Text({"y": "approved", "always": "approved (always, this session)"}.get(
                msg.answer, "refused"), style="dim"))
        await self._drop_approval()

    async def _drop_approval(self):
        if self.approval is not None:
            bar, self.approval = self.approval, None
            await bar.remove()
            self.input.focus()
            if self.status is not None:
                self._show_status(self.status)

    # -- input, queue, dispatch --------------------------------------------------------------------
    async def on_input_area_submitted(self, msg: InputArea.Submitted):
        text = msg.text.strip("\n")
        line = text.strip()
        self.input.remember(text)
        self._save_history(text)
        word = line.split()[0].lower() if line else ""
        if word in ("/quit", "/exit") and (self.busy or not self.ready):
            await self.action_leave()
            return
        if self.busy and self.ready and word in STOP_FIRST:
            self.queue.insert(0, text)
            self._show_queue()
            await self.action_interrupt()
            return
        if self.busy:
            self.queue.append(text)
            self._show_queue()
            return
        await self._dispatch(text)

    async def _dispatch(self, text: str):
        """Hand one item to the (idle) worker; it is echoed here, where it really starts."""
        line = text.strip()
        self.busy = True
        if self.status is not None:
            self._show_status(self.status)
        self._turn_t0 = time.perf_counter()
        self._tools = {}
        if line.startswith("/"):
            await self._add(NoticeLine("› " + line, "command"))
            self.worker.send_command(line)
        else:
            await self._add(UserMessage(text))
            self.worker.send_user(text)

    async def _idle(self):
        self.busy = False
        await self._send_next()
        if self.status is not None:
            self._show_status(self.status)

    async def _send_next(self):
        if self.busy or self._leaving or not self.queue:
            self._show_queue()
            return
        text = self.queue.pop(0)
        self._show_queue()
        await self._dispatch(text)

    def _show_queue(self):
        box = self.query_one("#queue", Static)
        if not self.queue:
            box.display = False
            return
        first = one_line(self.queue[0], QUEUE_PREVIEW_CHARS)
        t = Text(f"queued ({len(self.queue)}): ", style="bold")
        t.append(first)
        t.append("   Ctrl+X edits it · Esc interrupts so it runs now", style="dim")
        box.update(t)
        box.display = True

    def recall_queued(self, area: InputArea) -> bool:
        if not self.queue:
            return False
        text = self.queue.pop(0)
        area.load_text(text)
        area.move_cursor(area.document.end)
        self._show_queue()
        return True

    # -- status bar ----------------------------------------------------------------------------------
    def _show_status(self, st: E.Status):
        self.status = st
        busy = "waiting for your approval" if self.approval is not None else \
            st.busy or ("working" if self.busy and self.ready else "idle")
        self.query_one("#status", StatusBar).show_fields(status_fields(st, busy))
        warn = self.query_one("#warning", Static)
        warn.update(Text("⚠ " + st.warning) if st.warning else "")
        warn.display = bool(st.warning)
        if st.busy != "prefill" and self._summary is None:   # (a summary's bar stays while it is written)
            self.query_one("#prefill", Static).display = False

    def _set_status(self, t: Text):
        self.query_one("#status", StatusBar).show_text(t)

    # -- actions -----------------------------------------------------------------------------------
    async def action_interrupt(self):
        """Esc: stop generation or prefill (between chunks); a pending approval counts as 'no'."""
        if self.worker is None or not self.busy:
            return
        self.worker.interrupt()
        if self.approval is not None:
            await self._drop_approval()

    async def action_leave(self):
        """Ctrl+C, Ctrl+Q, Ctrl+D on an empty prompt, /quit: stop what runs, save, leave."""
        if self._leaving:
            return
        self._leaving = True
        self.queue.clear()
        self._show_queue()
        if self.worker is not None:
            self.worker.interrupt()
        await self._stop_and_exit()

    async def _stop_and_exit(self):
        self._leaving = True
        self._set_status(Text("saving and leaving…", style="bold"))
        worker = self.worker
        if worker is not None:
            # stop() joins the engine thread (which saves first): never on the UI loop
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        self._gone = True
        self.exit()

    def action_toggle_thinking(self):
        blocks = list(self.query(Thinking))
        if blocks:
            collapse = not all(b.collapsed for b in blocks)
            for b in blocks:
                b.collapsed = collapse

    async def action_clear_screen(self):
        await self._clear_transcript()

    # -- history file ------------------------------------------------------------------------------
    def _load_history(self) -> list[str]:
        if self.history_path is None or not self.history_path.exists():
            return []
        out = []
        try:
            for line in self.history_path.read_text(encoding="utf-8").splitlines():
                try:
                    s = json.loads(line)
                except ValueError:
                    continue
                if isinstance(s, str):
                    out.append(s)
        except OSError:
            return []
        return out[-HISTORY_MAX:]

    def _save_history(self, text: str):
        if self.history_path is None:
            return
        try:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            entries = self.input.past[-HISTORY_MAX:]
            atomic_write(self.history_path,   # a private 0600 file, replaced whole
                         ["".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode("utf-8")])
        except OSError:
            pass


def coalesce(evs: list) -> list:
    """Merge runs of text (reasoning, answer, summary) deltas of the same kind; keep only the last of
    a run of Prefill/Status."""
    out: list = []
    for ev in evs:
        prev = out[-1] if out else None
        if isinstance(ev, (E.TextDelta, E.ReasoningDelta)) and type(prev) is type(ev):
            out[-1] = type(ev)(prev.text + ev.text)
        elif isinstance(ev, E.SummaryDelta) and type(prev) is type(ev):
            out[-1] = E.SummaryDelta(prev.text + ev.text, ev.tokens, ev.max_tokens, ev.tokens_per_s)
        elif isinstance(ev, (E.Prefill, E.Status)) and type(prev) is type(ev):
            out[-1] = ev
        else:
            out.append(ev)
    return out


def default_history_path() -> Path:
    home = os.environ.get("DS4_AGENT_HOME") or os.path.join(os.path.expanduser("~"), ".ds4-agent")
    return Path(home) / "history"


def run_app(make_agent: Callable, **opts) -> int:
    """Run the TUI until the user leaves. make_agent(emit) -> Agent is called on the engine thread.
    opts: history_path (default ~/.ds4-agent/history; None keeps none), banner, resume (once the
    model is ready, continue: True the last session of the directory, a sha that session). After
    the UI closes it prints where the session was saved and how to continue it."""
    opts.setdefault("history_path", default_history_path())
    resume = opts.pop("resume", False)
    if resume:
        # True: the last session of the directory; else the sha `--resume NAME|ID|pick` chose
        opts["initial"] = ["/resume" if resume is True else f"/switch {resume}"]
    app = AgentApp(make_agent, **opts)
    try:
        app.run()
    finally:
        # the normal ways out stop the worker (which saves); after a crash of the UI, do it here
        if app.worker is not None:
            app.worker.interrupt()
            app.worker.stop()            # returns at once when the engine thread is already done
    # the terminal is the shell's again: where the session went and how to come back to it
    agent = app.worker.agent if app.worker is not None else None
    note = agent.farewell() if agent is not None else ""
    if note:
        print(note)
    return app.return_code or 0
