"""The TUI's pieces below the app: the formatting of counts, bars, diffs and tool calls, and the
transcript widgets (user message, notice, thinking, answer, tool call, approval bar) and the
input area with its history. ds4agent/app.py lays them out and feeds them the agent's events.
"""
from __future__ import annotations

import json
import time

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.content import Content  # titles are plain text: a "[" in a tool result is not markup
from textual.widgets import Collapsible, Markdown, Static, TextArea

from . import events as E

HISTORY_MAX = 512
SHOW_DIFF_LINES = 400       # longer diffs and outputs are cut on screen (the model got its own copy)
SHOW_OUTPUT_LINES = 200


# -- formatting -------------------------------------------------------------------------------------
def fmt_tokens(n: int) -> str:
    """ds4's footer counts: 950, 12k, 12.3k."""
    if n < 1000:
        return str(n)
    if n % 1000 == 0:
        return f"{n // 1000}k"
    return f"{n / 1000:.1f}k"


def fmt_secs(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def prefill_bar(done: int, total: int, tps: float, eta: float, cells: int = 24) -> Text:
    frac = done / total if total else 1.0
    filled = max(1 if done < total else cells, int(frac * cells)) if total else cells
    t = Text("prefill ", style="bold")
    t.append("▶" * filled, style="bold magenta")
    t.append("·" * (cells - filled), style="dim")
    t.append(f" {done}/{total} {100 * frac:.0f}%")
    if tps:
        t.append(f"  {tps:,.0f} t/s", style="cyan")
    if done < total and tps:
        t.append(f"  ETA {fmt_secs(eta)}", style="yellow")
    t.append("   Esc stops it", style="dim")
    return t


def diff_text(diff: str, limit: int = SHOW_DIFF_LINES) -> Text:
    """A unified diff coloured line by line (headers bold, hunks cyan, - red, + green)."""
    lines = diff.splitlines()
    t = Text()
    for line in lines[:limit]:
        if line.startswith(("+++", "---")):
            style = "bold"
        elif line.startswith("@@"):
            style = "cyan"
        elif line.startswith("+"):
            style = "green"
        elif line.startswith("-"):
            style = "red"
        else:
            style = "dim"
        t.append(line + "\n", style=style)
    if len(lines) > limit:
        t.append(f"... {len(lines) - limit} more diff lines\n", style="dim italic")
    t.rstrip()
    return t


def clip_lines(text: str, limit: int) -> tuple[str, int]:
    lines = text.splitlines()
    if len(lines) <= limit:
        return text.rstrip("\n"), 0
    return "\n".join(lines[:limit]), len(lines) - limit


def one_line(s: str, n: int = 100) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 1] + "…"


def call_header(name: str, args: dict) -> Text:
    """What a tool call does, in one line (arguments as the model gave them)."""
    t = Text("⚒ ", style="bold yellow")
    if name == "bash":
        t.append("$ ", style="bold cyan")
        t.append(str(args.get("command", "")), style="bold cyan")
        return t
    t.append(name, style="bold")
    path = args.get("path")
    if path is not None:
        t.append(" " + str(path), style="green")
    for k, v in args.items():
        if k in ("path", "content", "old", "new", "command"):
            continue
        t.append(f" {k}=", style="dim")
        t.append(one_line(json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v, 60),
                 style="yellow" if isinstance(v, (int, float)) else "")
    if "content" in args:
        n = str(args["content"]).count("\n") + (0 if str(args["content"]).endswith("\n") else 1)
        t.append(f" ({n} lines)", style="dim")
    return t


def call_preview(name: str, args: dict) -> Text | None:
    """What the user approves before it happens: old/new text of an edit, the start of a write."""
    t = Text()
    if "old" in args or "new" in args:
        for line in str(args.get("old", "")).splitlines()[:40]:
            t.append("- " + line + "\n", style="red")
        for line in str(args.get("new", "")).splitlines()[:40]:
            t.append("+ " + line + "\n", style="green")
    elif "content" in args:
        body, more = clip_lines(str(args["content"]), 20)
        for line in body.splitlines():
            t.append("+ " + line + "\n", style="blue")
        if more:
            t.append(f"... {more} more lines\n", style="dim italic")
    else:
        return None
    t.rstrip()
    return t


# -- transcript widgets -----------------------------------------------------------------------------
class UserMessage(Static):
    def __init__(self, text: str):
        t = Text("❯ ", style="bold red")
        t.append(text, style="bold")
        super().__init__(t, classes="user")


class NoticeLine(Static):
    def __init__(self, text: str, level: str = "info"):
        style = {"error": "bold red", "warning": "yellow"}.get(level, "")
        super().__init__(Text(text, style=style), classes=f"notice {level}")
        self.level = level


class Thinking(Collapsible):
    """Reasoning: dimmed, collapsible, streamed a paragraph per Static (so an update re-renders one
    paragraph, not the whole block)."""

    def __init__(self, text: str = "", collapsed: bool = False):
        super().__init__(title="thinking…", collapsed=collapsed, classes="thinking")
        self.t0 = time.perf_counter()
        self.chars = 0
        self._cur: Static | None = None
        self._cur_text = ""
        self._initial = text

    async def on_mount(self):
        if self._initial:
            await self.add(self._initial)

    async def add(self, text: str):
        self.chars += len(text)
        if self._cur is None:
            text = text.lstrip("\n")
            if not text:
                return
            pieces = text.split("\n\n")
            new = pieces
        else:
            pieces = (self._cur_text + text).split("\n\n")
            self._cur.update(Text(pieces[0]))
            new = pieces[1:]
        contents = self.query_one(Collapsible.Contents)
        for p in new:
            self._cur = Static(Text(p), classes="para")
            await contents.mount(self._cur)
        self._cur_text = pieces[-1]

    def done(self, collapse: bool):
        dt = time.perf_counter() - self.t0
        self.title = Content(f"thought for {fmt_secs(dt)} ({self.chars} chars)" if self.chars else "thinking")
        if collapse:
            self.collapsed = True


class Answer(Markdown):
    """The answer as Markdown; streamed through Textual's MarkdownStream (which merges appends when
    the screen is slower than the model)."""

    def __init__(self, text: str = ""):
        super().__init__(text, classes="answer")
        self.stream = None
        self.chars = len(text)

    async def add(self, text: str):
        if self.stream is None:
            text = text.lstrip("\n") if self.chars == 0 else text
            if not text:
                return
            self.stream = Markdown.get_stream(self)
        self.chars += len(text)
        await self.stream.write(text)

    async def close(self):
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None


class ToolView(Vertical):
    """One tool call: its arguments, then the approval state, then its result."""

    def __init__(self, name: str, args: dict):
        super().__init__(classes="tool")
        self.tool_name, self.args = name, args
        self.finished: E.ToolFinished | None = None
        self.answer = ""           # what the user said when asked: "y", "always", "n" ("" not asked)

    def compose(self) -> ComposeResult:
        yield Static(call_header(self.tool_name, self.args), classes="tool-head")
        prev = call_preview(self.tool_name, self.args)
        yield Static(prev if prev is not None else "", classes="tool-body")
        yield Static("", classes="tool-state")

    def on_mount(self):
        body = self.query_one(".tool-body", Static)
        body.display = bool(str(body.content))
        self.query_one(".tool-state", Static).display = False

    def set_state(self, text: Text | str):
        st = self.query_one(".tool-state", Static)
        st.update(text)
        st.display = bool(str(text))

    async def finish(self, ev: E.ToolFinished):
        self.finished = ev
        body = self.query_one(".tool-body", Static)
        if not ev.approved:
            self.set_state(Text("✗ not approved: the model was told so", style="yellow"))
            return
        if ev.diff:
            body.update(diff_text(ev.diff))
            body.display = True
            body.add_class("diff")
        if ev.exit_status is not None:
            out, more = clip_lines(ev.text, SHOW_OUTPUT_LINES)
            t = Text(out, style="" if ev.exit_status == 0 else "dark_orange")
            if more:
                t.append(f"\n... {more} more lines (the model read them)", style="dim italic")
            body.update(t)
            body.display = True
            body.add_class("output")
            st = Text(f"exit {ev.exit_status}", style="bold green" if ev.exit_status == 0 else "bold red")
            if self.answer:
                st.append("  (approved)", style="dim")
            self.set_state(st)
            return
        if not ev.ok:
            self.set_state(Text(one_line(ev.text, 300), style="bold red"))
            return
        first = one_line(ev.text.splitlines()[0] if ev.text.strip() else "(empty result)", 100)
        n = ev.text.count("\n") + 1
        if ev.diff or n <= 1:
            t = Text("✓ ", style="green")
            if self.answer:
                t.append("approved" + (" (always)" if self.answer == "always" else "") + " · ", style="dim")
            t.append(first, style="green")
            self.set_state(t)
        else:
            out, more = clip_lines(ev.text, SHOW_OUTPUT_LINES)
            if more:
                out += f"\n... {more} more lines"
            self.set_state("")
            await self.mount(Collapsible(Static(Text(out, style="dim"), classes="result"),
                                         title=Content(f"✓ {first} ({n} lines)"), collapsed=True, classes="result-box"))


class ApprovalBar(Static, can_focus=True):
    """Asks y / n / always for one call; the worker waits until it is answered."""

    GUARD_S = 0.25

    BINDINGS = [
        Binding("y", "answer('y')", "yes"),
        Binding("n", "answer('n')", "no"),
        Binding("a", "answer('always')", "always"),
    ]

    class Answered(Message):
        def __init__(self, answer: str):
            super().__init__()
            self.answer = answer

    def __init__(self, ev: E.ApprovalNeeded):
        t = Text("Allow ", style="bold")
        t.append(ev.summary, style="bold yellow")
        t.append("?  ")
        for key, what in (("y", "yes"), ("n", "no"), ("a", f"always {ev.name} this session")):
            t.append(f"[{key}]", style="bold reverse")
            t.append(f" {what}  ")
        t.append("Esc: no, and stop", style="dim")
        super().__init__(t, id="approval")
        self.request = ev

    def on_mount(self):
        self.shown_at = time.monotonic()

    def action_answer(self, ans: str):
        # keys typed for the prompt in the instant the question appeared must not answer it
        if time.monotonic() - self.shown_at < self.GUARD_S:
            return
        self.post_message(self.Answered(ans))


class InputArea(TextArea):
    """The prompt: Enter sends, Shift+Enter / Ctrl+J / Alt+Enter insert a new line, Up on the first
    line and Down on the last walk the history, Ctrl+D on an empty prompt leaves."""

    BINDINGS = [
        Binding("ctrl+p", "history(-1)", "previous", show=False),
        Binding("ctrl+n", "history(1)", "next", show=False),
        Binding("ctrl+x", "recall_queued", "edit queued", show=False),
        Binding("ctrl+d", "delete_or_leave", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, history: list[str] | None = None, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)
        self.past: list[str] = history if history is not None else []
        self._hist_pos = len(self.past)
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(text))
            self.clear()
            self._hist_pos = len(self.past)
            return
        if event.key in ("shift+enter", "ctrl+j", "alt+enter", "newline"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.past:
            event.stop()
            event.prevent_default()
            self.action_history(-1)
            return
        if event.key == "down" and self.cursor_location[0] == self.document.line_count - 1 \
                and self._hist_pos < len(self.past):
            event.stop()
            event.prevent_default()
            self.action_history(1)
            return
        await super()._on_key(event)

    def action_history(self, step: int):
        if not self.past:
            return
        if self._hist_pos == len(self.past):
            self._draft = self.text
        pos = min(max(self._hist_pos + step, 0), len(self.past))
        if pos == self._hist_pos:
            return
        self._hist_pos = pos
        self.load_text(self.past[pos] if pos < len(self.past) else self._draft)
        self.move_cursor(self.document.end)

    def remember(self, text: str):
        if not self.past or self.past[-1] != text:
            self.past.append(text)
            del self.past[:-HISTORY_MAX]
        self._hist_pos = len(self.past)

    def action_recall_queued(self):
        if not self.app.recall_queued(self):
            self.action_cut()

    def action_delete_or_leave(self):
        if not self.text:
            self.app.action_leave()
        else:
            self.action_delete_right()
