"""The TUI's pieces below the app: the formatting of counts, bars, diffs and tool calls, the status
bar (its fields fitted to the terminal's width by priority), the transcript widgets (user message,
notice, thinking, answer, tool call, compaction summary, approval bar) and the input area with its
history. ds4agent/app.py lays them out and feeds them the agent's events.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

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
_EXIT = re.compile(r"finished after [0-9.]+ s: (?:.*?)exit (?:status |code )?(-?[0-9]+)")


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


def prefill_bar(done: int, total: int, tps: float, eta: float, cells: int = 24, *, label: str = "prefill",
                what: str = "", width: int = 0, hint: str = "Esc stops it", cap: bool = False) -> Text:
    """One line: `label (what) ▶▶▶··· done/total pct  t/s  ETA  hint`; with cap (a generation that
    may end before its cap: a compaction's summary) `done tokens (at most total)`, no percentage
    or ETA. Within `width` (0: any) the hint goes first, then the bar narrows, then `what`."""
    def line(cells: int, what: str, hint: str) -> Text:
        frac = min(done / total, 1.0) if total else 1.0
        filled = max(1 if done < total else cells, int(frac * cells)) if total else cells
        t = Text(label + (f" ({what})" if what else "") + " ", style="bold")
        t.append("▶" * filled, style="bold magenta")
        t.append("·" * (cells - filled), style="dim")
        t.append(f" {done} token{'s' if done != 1 else ''} (at most {total})" if cap
                 else f" {done}/{total} {100 * frac:.0f}%")
        if tps:
            t.append(f"  {tps:,.0f} t/s" if tps >= 100 else f"  {tps:.1f} t/s", style="cyan")
        if done < total and tps and not cap:
            t.append(f"  ETA {fmt_secs(eta)}", style="yellow")
        if hint:
            t.append("   " + hint, style="dim")
        return t
    for c, w, h in ((cells, what, hint), (cells, what, ""), (12, what, ""), (6, what, ""), (6, "", "")):
        t = line(c, w, h)
        if not width or t.cell_len <= width:
            return t
    return t


# -- the status bar ---------------------------------------------------------------------------------
@dataclass
class Field:
    """One field of the status bar. forms[i] is shown from narrowing step steps[i] on (steps[0] is
    0: the full form); from step `drop` on it is left out (None: never). sep goes before it."""
    forms: list[str]
    steps: list[int]
    drop: int | None = None
    style: str = ""
    sep: str = " │ "

    def at(self, step: int) -> str | None:
        if self.drop is not None and step >= self.drop:
            return None
        return self.forms[max(i for i, s in enumerate(self.steps) if s <= step)]


STATE_SHORT = {"waiting for your approval": "approval", "generating": "gen", "compacting": "compact"}
NARROWEST = 15


def short_model(name: str, n: int) -> str:
    """A model file name in n cells: whole if it fits, else without .gguf and cut in the middle
    (ds4's names end with the recipe)."""
    if len(name) <= n:
        return name
    name = name[:-5] if name.endswith(".gguf") else name
    if len(name) <= n:
        return name
    head = (n - 1) * 2 // 3
    return name[:head] + "…" + name[len(name) - (n - 1 - head):]


def status_fields(st: E.Status, state: str) -> list[Field]:
    """The status bar's fields in the order shown. As the terminal narrows, step by step (the
    numbers below): the prefill speed is shortened (1), then left out (2); the session likewise
    (3, 4); the model name is shortened (5), the context (6) and the generation speed (7); the
    backend goes (8); the state (9) and the thinking mode (10) are shortened; the model (11), the
    generation speed (12), the thinking mode (13) and the context (14) go. The state always stays."""
    pct = 100 * st.ctx_used / st.ctx_total if st.ctx_total else 0
    gen = f"{st.gen_tps:.1f} t/s" if st.gen_tps else "–"
    pre = f"{st.prefill_tps:,.0f} t/s" if st.prefill_tps else "–"
    # --expert-cache: its hit rate, reads and stall, beside the speeds; left out where narrow
    experts = [Field([st.experts, st.experts.split(",")[0]], [0, 1], 2)] if st.experts else []
    experts += [Field([st.mtp], [0], 2)] if st.mtp else []      # --mtp: the acceptance, left out where narrow
    return [
        Field(["● " + state, "● " + STATE_SHORT.get(state, state)], [0, 9],
              style="bold magenta" if state != "idle" else "green", sep=""),
        Field([f"ctx {fmt_tokens(st.ctx_used)}/{fmt_tokens(st.ctx_total)} {pct:.0f}%", f"ctx {pct:.0f}%"], [0, 6], 14,
              style="bold yellow" if st.warning else ""),
        Field([f"gen {gen}", gen], [0, 7], 12),
        Field([f"prefill {pre}", f"pp {pre}"], [0, 1], 2),
        *experts,
        Field([f"think {st.think_mode}", st.think_mode], [0, 10], 13),
        Field([f"session {st.session}", f"session {st.session[:8]}"], [0, 3], 4),
        Field([short_model(st.model, 32), short_model(st.model, 16)], [0, 5], 11, style="bold"),
        Field([st.backend], [0], 8, sep=" · "),
    ]


def fit_status(fields: list[Field], width: int) -> Text:
    """The fields in `width` cells: the first narrowing step at which they fit (see status_fields);
    what still does not fit is cut at the end."""
    def text(step: int) -> Text:
        t = Text()
        for f in fields:
            form = f.at(step)
            if form is not None:
                if len(t):
                    t.append(f.sep, style="dim")
                t.append(form, style=f.style)
        return t
    for step in range(NARROWEST + 1):
        t = text(step)
        if t.cell_len <= width:
            return t
    t.truncate(max(width, 1), overflow="ellipsis")
    return t


class StatusBar(Static):
    """The status bar: a line of text (loading, errors) or the agent's Status fitted to the width,
    fitted again whenever the terminal is resized."""

    def __init__(self, text: Text | str = "", **kw):
        super().__init__(text, **kw)
        self.fields: list[Field] | None = None

    def show_fields(self, fields: list[Field]):
        self.fields = fields
        self.update(fit_status(fields, self._width()))

    def show_text(self, text: Text | str):
        self.fields = None
        self.update(text)

    def _width(self) -> int:
        w = self.content_size.width
        return w if w > 0 else max(self.app.size.width - 2, 1)   # not laid out yet: the screen's

    def on_resize(self):
        if self.fields is not None:
            self.update(fit_status(self.fields, self._width()))


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
    paragraph, not the whole block). Given `text` (a restored turn), it is drawn folded, as a
    finished block is live (without the time: a saved session does not keep it)."""

    def __init__(self, text: str = "", collapsed: bool = False):
        super().__init__(title=f"thought ({len(text)} chars)" if text else "thinking…",
                         collapsed=collapsed, classes="thinking")
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
    """One tool call: its arguments, then the approval state, then its result. `restored`: the
    result of a call in a saved session, shown once mounted (see restored_result)."""

    def __init__(self, name: str, args: dict, restored: E.ToolFinished | None = None):
        super().__init__(classes="tool")
        self.tool_name, self.args = name, args
        self.finished: E.ToolFinished | None = None
        self.answer = ""           # what the user said when asked: "y", "always", "n" ("" not asked)
        self._restored = restored

    def compose(self) -> ComposeResult:
        yield Static(call_header(self.tool_name, self.args), classes="tool-head")
        prev = call_preview(self.tool_name, self.args)
        yield Static(prev if prev is not None else "", classes="tool-body")
        yield Static("", classes="tool-state")

    async def on_mount(self):
        body = self.query_one(".tool-body", Static)
        body.display = bool(str(body.content))
        self.query_one(".tool-state", Static).display = False
        if self._restored is not None:
            await self.finish(self._restored)

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


def restored_result(index: int, name: str, args: dict, text: str) -> E.ToolFinished:
    """A saved session keeps what the model read of a result, not its diff or exit status: they
    are read back where the text says them (a refusal, an error, a bash job's exit); an edit's
    change is drawn from its arguments (old lines red, new green)."""
    refused = text.startswith("error: the user did not approve")
    ok = not text.startswith("error:")
    exit_status = None
    if name == "bash":
        m = _EXIT.search(text.split("\n", 1)[0])
        if m:
            exit_status = int(m.group(1))
    diff = None
    if name == "edit" and ok and not refused and ("old" in args or "new" in args):   # its change, as asked
        diff = "".join(f"-{line}\n" for line in str(args.get("old", "")).splitlines()) + \
            "".join(f"+{line}\n" for line in str(args.get("new", "")).splitlines())
    return E.ToolFinished(index, name, args, ok, text, diff or None, exit_status, not refused)


def replay_widgets(messages: list, limit: int) -> list:
    """The widgets of a restored timeline (after /switch, --resume), the last `limit` messages:
    each turn as it was drawn live: the user's message, its reasoning folded, the answer, each
    tool call as a tool block with its result."""
    body = [m for m in messages if m.role != "system"]
    out: list = []
    if len(body) > limit:
        out.append(NoticeLine(f"... {len(body) - limit} earlier messages", "info"))
        body = body[-limit:]
    calls: list[tuple[str, dict]] = []       # the last assistant turn's calls, answered in order below
    for m in body:
        if m.role != "tool":                  # calls asked for and never answered (the turn stopped)
            out.extend(ToolView(name, args) for name, args in calls)
            calls = []
        if m.role == "user":
            out.append(UserMessage(m.content))
        elif m.role == "assistant":
            if m.reasoning:
                out.append(Thinking(m.reasoning, collapsed=True))
            if m.content:
                out.append(Answer(m.content))
            for c in m.tool_calls:
                try:
                    args = json.loads(c.arguments_json) if c.arguments_json else {}
                except (ValueError, TypeError):
                    args = {"arguments": c.arguments_json}
                calls.append((c.name, args if isinstance(args, dict) else {"arguments": args}))
        elif m.role == "tool":
            if calls:
                name, args = calls.pop(0)
                out.append(ToolView(name, args, restored_result(len(out), name, args, m.content)))
            else:                             # a result whose call is out of view (or was not parsed)
                first = one_line(m.content.splitlines()[0] if m.content.strip() else "(empty)", 100)
                out.append(Collapsible(Static(Text(m.content, style="dim")), title=Content(f"result: {first}"),
                                       collapsed=True, classes="result-box"))
    out.extend(ToolView(name, args) for name, args in calls)
    return out


class SummaryView(Collapsible):
    """A compaction's summary: open and streamed while it is written, folded once kept."""

    def __init__(self):
        body = Static("", classes="summary-body")
        super().__init__(body, title="summary (being written…)", collapsed=False, classes="result-box summary")
        self.text = ""
        self._body = body

    def add(self, text: str):
        self.text += text
        self._body.update(Text(self.text.lstrip("\n"), style="dim"))

    def done(self, kept: str | None):
        """kept: the summary the agent kept (None: the compaction failed or was interrupted, what was written is not used)."""
        if kept is not None:
            self.text = kept
            self._body.update(Text(kept, style="dim"))
            self.title = Content(f"summary kept ({len(kept)} chars)")
        else:
            self.title = Content("summary not used (the compaction stopped)")
        self.collapsed = True


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
