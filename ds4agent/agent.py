"""The agent loop: one live timeline, rendered once and then only appended to.

The system prefix is rendered and prefilled once (or restored from its cache file); each user turn,
each sampled token and each batch of tool results is appended to the live Session, so the KV
state is always the truth and nothing is ever re-prefilled (only compaction rebuilds, explicitly).
Sampled tokens stream through prompts.DsmlStream: reasoning and answer text go to the UI as they
come, DSML syntax is sampled greedily and payloads normally, and a finished tool block is executed
through tools/ and answered in the model's native <tool_result> form.

Everything here runs on the engine's worker thread; the UI talks to it through AgentWorker and
hears from it through the `emit` callback (ds4agent/events.py). UI-free, so headless mode and the
tests drive the same code.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import prompts
import tools
from engine import Engine, ModelFileError, Rng, SamplingParams, Session
from prompts import DsmlStream, Message, ToolCall
from prompts.render import _TOOLS_HEAD as TOOLS_HEAD
from prompts.render import _TOOLS_TAIL as TOOLS_TAIL
from prompts.render import assistant_prefix, render_messages, render_tool_results
from sessions import SessionStore, SessionStoreError

from . import events as E
from .checkpoints import Checkpoints
from .environment import system_text
from .mcp_client import command as mcp_command
from .session_views import list_text, resume_hint
from .timelines import Timelines
from .generation import GREEDY, generate
from .generation_mtp import speculator_for

EOS_TEXT = prompts.EOS
MAX_TOOL_ROUNDS = 64
COMPACT_AT = 0.85          # ds4's soft limit: compact at 85 % of the context ...
WARN_AT = 0.75             # ... and warn from 75 %
SUMMARY_MAX_TOKENS = 1024
STATUS_EVERY_S = 0.5       # how often a generation updates the status bar (speed, context)
COMPACT_REQUEST = (
    "Internal ds4-agent context compaction request. This is not a user request.\n"
    "Write a durable task-state summary of the conversation so far: the user's goals, constraints and "
    "preferences; files inspected or edited; commands run and important results; decisions, rejected "
    "approaches, known bugs and pending next steps; bulky data worth reloading with exact paths, line "
    "ranges or commands. Do not invent facts, do not narrate, do not copy file contents unless essential.\n"
    "After the summary, stop. Do not continue the user task, do not call tools, and do not output "
    "thinking tags or DSML markup.\nOutput only the compact summary.\nCompaction reason: {reason}")
SUMMARY_HEAD = "[ds4-agent compacted earlier conversation. Durable task-state summary follows.]\n"
SUMMARY_TAIL = "[End compacted summary. Recent conversation continues verbatim below.]\n\n"
HELP = """commands:
  /save [name]       save the session now (it is also saved after every turn and on exit)
  /list [all]        saved sessions of this project (all: every project); * marks this one
  /switch ID|NAME    continue a saved session (no prefill); its name follows the new turns
  /fork [NAME]       go on as a new branch of this session (no prefill); /switch moves between them
  /resume            continue the last session of this directory
  /delete ID|NAME    delete a saved session
  /new               start a fresh session
  /history [N]       the last N user turns of this session
  /think on|off|max  thinking mode for the next turns
  /ctx               context use
  /compact           summarize the conversation and keep the recent tail
  /undo [N]          files and conversation back before the last turn's changes (N: steps)
  /redo              take back the last /undo (until something new happens)
  /checkpoints       the checkpoints taken before each file-changing tool call
  /mcp [trust NAME]  MCP servers and their tools; trust: start a project's .mcp.json server
  /help              this text
  /quit              save and leave (stops a running turn first)
/new, /switch, /resume and /think typed while the model works stop the turn, then act."""


class Interrupted(Exception):
    pass


@dataclass
class AgentConfig:
    ctx: int = 65536
    think_mode: str = "high"
    yolo: bool = False
    autosave: bool = True
    max_turn_tokens: int = 16384   # one generation's safety cap (each tool round is one)
    max_tokens: int | None = None  # the user's cap on a whole turn, all its rounds (--max-tokens)
    chunk: int = 2048              # prefill chunk (progress and Esc act between chunks)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    allow_outside: bool = False
    live_timelines: int = 2        # timelines kept in memory, the live one included (/switch without a disk read)
    checkpoints: bool = True       # a git checkpoint before each write/edit/bash/git_commit (/undo)
    mtp_draft: int = 0             # --mtp: tokens the MTP drafts a step (0: off; the engine needs its file)


class Agent:
    def __init__(self, engine: Engine, project_dir, *, config: AgentConfig | None = None,
                 store: SessionStore | None = None, emit: Callable[[object], None] | None = None,
                 model_name: str = "", system: str | None = None, mcp=None):
        self.engine = engine
        self.tok = engine.tokenizer
        self.cfg = config or AgentConfig()
        self.project_dir = Path(project_dir).resolve()
        self.store = store
        self.emit = emit or (lambda ev: None)
        self.model_name = model_name or Path(engine.file.path).name
        self.session = Session(engine, self.cfg.ctx, chunk=self.cfg.chunk)
        self.rng = Rng(self.cfg.sampling.seed)
        self.tool_ctx = tools.ToolContext(root=self.project_dir, allow_outside=self.cfg.allow_outside)
        self.tool_ctx.should_stop = lambda: self._interrupt.is_set()   # Esc, /quit: a tool stops waiting
        self.always_allowed: set[str] = set()
        self._interrupt = threading.Event()
        self._approval = threading.Event()
        self._approval_answer = "n"
        self._forced: list[list[int]] = []
        self.transcript: list[Message] = []
        self.session_name = "new"
        self.branch = new_branch_id()         # this timeline's branch (checkpoints belong to it; /fork makes a new one)
        self.current_sha: str | None = None   # the saved session this timeline is (None: unsaved)
        self.timelines = Timelines(self)      # the branches left most recently, live (ds4agent/timelines.py)
        self._continues: str | None = None    # after a compaction: the save it continues
        self.exit_save = None                 # what leaving saved (for farewell)
        self.pending_eos = False   # the last assistant turn ended; its EOS goes in with the next append
        self.modified = False
        self.last_finish = E.TurnFinished()
        self.gen_tps = 0.0         # the status bar's speeds: this turn's generation (live) ...
        self.prefill_tps = 0.0     # ... and its latest prefill
        self.mtp_counts = [0, 0]   # --mtp: drafts proposed and accepted since the agent started
        self._last_gen_tokens = 0
        self._system = system      # fixed system text (tests); None: gathered from the project
        self.checkpoints = Checkpoints(self)   # /undo, /redo, /checkpoints (ds4agent/checkpoints.py)
        self.mcp = mcp             # MCP servers' tools (ds4agent/mcp_client.McpManager), or None

    # -- thread-safe controls (called from the UI thread) ---------------------------------------
    def interrupt(self):
        self._interrupt.set()
        self._approval.set()

    def answer_approval(self, answer: str):
        self._approval_answer = answer
        self._approval.set()

    def force(self, *texts: str):
        """Tests: the next generations emit exactly these texts, one per generation (a tool round
        starts a new one), each ending as if the model sampled EOS; the engine still evaluates
        every forced token, so the KV state stays real."""
        self._forced = [self.tok.encode(t) for t in texts]

    # -- timeline ---------------------------------------------------------------------------------
    @property
    def compact_reserve(self) -> int:
        return min(SUMMARY_MAX_TOKENS + 512, self.cfg.ctx // 8)

    @property
    def think_mode(self) -> str:
        return prompts.think_mode_for_context(self.cfg.think_mode, self.cfg.ctx)

    def system_prefix(self) -> str:
        return render_messages(self.transcript[:1], self.tool_schemas(), self.think_mode)

    def tool_schemas(self) -> list[str]:
        return tools.schemas() + (self.mcp.schemas() if self.mcp is not None else [])

    def start(self):
        """A fresh timeline: the system prefix, from its cache file when the text matches."""
        self.transcript = [Message("system", self._system if self._system is not None
                                   else system_text(self.project_dir))]
        self.pending_eos = False
        self.modified = False
        self.session_name = "new"
        self.branch = new_branch_id()
        self.current_sha = self._continues = None
        self.gen_tps = self.prefill_tps = 0.0      # the status bar's speeds are of this timeline's turns
        text = self.system_prefix()
        ids = self.tok.encode(text)
        self.session.reset()
        if self.store is not None and self.store.load_system_prefix(self.session, text):
            self._status()
            return
        self._prefill_to(ids, interruptible=False, what="system prompt")
        if self.store is not None:
            try:
                self.store.save_system_prefix(self.session, text)
            except (OSError, SessionStoreError) as e:
                self.emit(E.Notice(f"could not cache the system prompt: {e}", "warning"))
        self._status()

    def _append(self, text: str, *, interruptible: bool = True, what: str = ""):
        """Append rendered text to the live timeline (tokenized on its own, then prefilled). All or
        nothing: on an interrupt or an error the timeline and the pending EOS are as before."""
        prev, prev_eos = self.session.tokens, self.pending_eos
        ids = self.tok.encode((EOS_TEXT if prev_eos else "") + text)
        try:
            self._prefill_to(prev + ids, interruptible=interruptible, what=what)
        except BaseException:
            if self.session.tokens != prev:
                self.session.sync(prev)          # cut back (in place: see _prefill_to)
            self.pending_eos = prev_eos
            raise
        self.pending_eos = False

    def _prefill_to(self, target: list[int], *, interruptible: bool = True, what: str = ""):
        if len(target) >= self.cfg.ctx:
            raise ValueError(f"the conversation ({len(target)} tokens) does not fit the context of {self.cfg.ctx}")
        start = self.session.pos
        t0 = time.perf_counter()
        # Esc is honoured only while cutting back stays in place (within the session's rewind window)
        window = self.session.rewind_cap - self.session.chunk

        def progress(done, total):
            dt = max(time.perf_counter() - t0, 1e-9)
            tps = done / dt
            self.prefill_tps = tps                     # the status bar's figure is this prefill's
            self.emit(E.Prefill(done, total, tps, (total - done) / tps if tps else 0.0, what, interruptible))
            self._status("prefill")
            return not (interruptible and done <= window and self._interrupt.is_set())
        self._status("prefill")
        if len(target) > start:   # the bar shows at once: the first chunk alone can take seconds
            self.emit(E.Prefill(0, len(target) - start, 0.0, 0.0, what, interruptible))
        ok = self.session.sync(target, progress=progress if len(target) > start else None)
        if ok is False:
            raise Interrupted()

    # -- a user turn ------------------------------------------------------------------------------
    def submit(self, text: str, max_tokens: int | None = None) -> E.TurnFinished:
        """Run one user turn to completion: generation, tools, more generation. `max_tokens` (else
        cfg.max_tokens; None: no cap but max_turn_tokens per round and the context) bounds the
        tokens the turn generates over all its rounds; a turn it cuts ends "length" and says so.
        The model file failing under the engine (a read error, a file cut short: the expert
        cache's preads, issue 39) ends the turn with one error line: the timeline and transcript
        go back to the turn's start and nothing is saved, so the last save stays as it was."""
        tokens, n_msgs = self.session.tokens, len(self.transcript)
        try:
            return self._submit(text, max_tokens)
        except ModelFileError as e:
            self.emit(E.Notice(f"the turn stopped: {e}", "error"))
            del self.transcript[n_msgs:]
            try:
                self.session.sync(tokens)        # a cut back, in place (no model read)
            except (ModelFileError, ValueError):
                pass
            self.last_finish = E.TurnFinished(finish_reason="error")
            self.emit(self.last_finish)
            self._status()
            return self.last_finish

    def _submit(self, text: str, max_tokens: int | None) -> E.TurnFinished:
        cap = max_tokens if max_tokens is not None else self.cfg.max_tokens
        if cap is not None and cap < 1:
            raise ValueError(f"max_tokens must be at least 1, not {cap}")
        used = 0
        self._interrupt.clear()
        self.gen_tps = self.prefill_tps = 0.0    # the status bar speaks of this turn from here on
        self.maybe_compact("soft limit before user turn")
        text = self.checkpoints.turn_started(text)   # where the turn starts (/undo comes back here)
        try:
            self._append(prompts.USER + text + assistant_prefix(self.think_mode), what="message")
        except Interrupted:
            # cancelled during the user message's prefill: the turn never happened
            self.emit(E.Notice("interrupted before the model started; the message was not sent", "warning"))
            return self._finish(E.TurnFinished(interrupted=True, finish_reason="interrupted"))
        except ValueError as e:
            self.emit(E.Notice(str(e), "error"))
            return self._finish(E.TurnFinished(finish_reason="error"))
        self.transcript.append(Message("user", text))
        self.modified = True
        n_calls = 0
        answer = ""
        for _ in range(MAX_TOOL_ROUNDS):
            round_cap = self.cfg.max_turn_tokens if cap is None else min(cap - used, self.cfg.max_turn_tokens)
            parsed, interrupted = self._generate(max_tokens=round_cap)
            used += self._last_gen_tokens
            capped = cap is not None and used >= cap
            msg = Message("assistant", parsed.content or "", parsed.reasoning,
                          [ToolCall(prompts.new_tool_id("openai"), c.name, c.arguments_json, parsed.dsml)
                           for c in parsed.tool_calls])
            self.transcript.append(msg)
            answer = parsed.content or ""
            if interrupted:
                return self._finish(E.TurnFinished(True, "interrupted", n_calls, answer))
            if parsed.finish_reason != "tool_calls" or not parsed.tool_calls:
                if capped and parsed.finish_reason == "length":
                    self.emit(E.Notice(f"stopped at the {cap}-token limit", "warning"))
                return self._finish(E.TurnFinished(False, parsed.finish_reason, n_calls, answer))
            results = []
            for i, call in enumerate(parsed.tool_calls):
                n_calls += 1
                results.append(self._run_tool(i, call.name, call.arguments))
                if self._interrupt.is_set():
                    break
            stop = self._interrupt.is_set() or capped   # a spent cap: the results go in, no continuation
            if not stop:
                self.maybe_compact("soft limit before tool continuation")
            # The tools have run: their results go in whole (Esc does not cut them); after an Esc
            # the model is not asked to continue, and the next user turn follows the results.
            tail = render_tool_results(m.content for m in results)
            try:
                self._append(tail if stop else tail + assistant_prefix(self.think_mode), interruptible=False,
                             what="tool results")
            except ValueError as e:
                self.emit(E.Notice(str(e), "error"))
                return self._finish(E.TurnFinished(False, "error", n_calls, answer))
            self.transcript.extend(results)
            if stop and not self._interrupt.is_set():
                self.emit(E.Notice(f"stopped at the {cap}-token limit", "warning"))
                return self._finish(E.TurnFinished(False, "length", n_calls, answer))
            if stop:
                return self._finish(E.TurnFinished(True, "interrupted", n_calls, answer))
        self.emit(E.Notice(f"stopped after {MAX_TOOL_ROUNDS} tool rounds", "warning"))
        return self._finish(E.TurnFinished(False, "length", n_calls, answer))

    def _finish(self, result: E.TurnFinished) -> E.TurnFinished:
        self.last_finish = result
        if self.cfg.autosave and self.modified:
            self.save(quiet=True)
        self.emit(result)
        self._status()
        return result

    def _generate(self, *, think_mode: str | None = None, max_tokens: int | None = None,
                  greedy: bool = False, stream_events: bool | Callable = True):
        """Sample until EOS, the end of a tool block, the token cap or an interrupt. Every sampled
        token is evaluated into the timeline (ds4agent/generation.py). Returns (Parsed, interrupted);
        a turn the cap cuts parses as "length", so the UI and headless mode say so. stream_events:
        forward the stream's events as the UI's deltas (True), drop them, or hand them to a callable."""
        mode = think_mode or self.think_mode
        stream = DsmlStream(mode, has_tools=True)
        # leave room for a compaction request and its summary, so a full context can still compact
        room = self.cfg.ctx - self.session.pos - 2 - (0 if think_mode == "none" and greedy else self.compact_reserve)
        forced = self._forced.pop(0) if self._forced else None
        limit = room if forced is not None else min(max_tokens or self.cfg.max_turn_tokens, room)
        self._status("generating")
        pos0, t0, shown = self.session.pos, time.perf_counter(), [time.perf_counter()]

        def live_status():        # the status bar's speed and context while it generates, not after
            now = time.perf_counter()
            if now - shown[0] >= STATUS_EVERY_S:
                shown[0] = now
                self.gen_tps = (self.session.pos - pos0) / (now - t0)
                self._status("generating")
        sink = stream_events if callable(stream_events) else self._forward_events if stream_events else None
        res = generate(self.session, stream, sampling=GREEDY if greedy else self.cfg.sampling,
                       rng=self.rng, limit=limit, eos_id=self.tok.eos_id,
                       token_bytes=self.tok.token_bytes, forced=forced,
                       should_stop=self._interrupt.is_set, before_token=live_status, on_events=sink,
                       speculator=speculator_for(self.session, self.cfg.mtp_draft))
        self.mtp_counts = [self.mtp_counts[0] + res.drafted, self.mtp_counts[1] + res.accepted]
        self.pending_eos = True   # the assistant turn is over: EOS opens the next append
        self._last_gen_tokens = res.n_tokens     # submit counts them against the turn's cap
        if res.elapsed > 0 and res.n_tokens:
            self.gen_tps = res.n_tokens / res.elapsed
        return stream.result, res.cancelled

    def _forward_events(self, evs):
        for ev in evs:
            if isinstance(ev, prompts.ReasoningDelta):
                self.emit(E.ReasoningDelta(ev.text))
            elif isinstance(ev, prompts.TextDelta):
                self.emit(E.TextDelta(ev.text))
            elif isinstance(ev, prompts.StreamError):
                self.emit(E.Notice(f"tool call could not be parsed: {ev.message}", "warning"))

    def _run_tool(self, index: int, name: str, args: dict) -> Message:
        tool = tools.REGISTRY.get(name)
        self.emit(E.ToolStarted(index, name, args))
        approved = True
        mcp = self.mcp if self.mcp is not None and self.mcp.owns(name) else None   # an MCP server's tool
        asks = mcp.needs_approval(name) if mcp is not None else tool is not None and tool.needs_approval
        if asks and not self.cfg.yolo and name not in self.always_allowed:
            approved = self._ask(name, args)
        if not approved:
            res = tools.ToolResult.error(f"the user did not approve this {name} call")
        else:
            self._status("tool")
            self.checkpoints.before_tool(name)     # a checkpoint first, when the tool can change files
            res = (mcp.call(name, args, emit=self.emit, should_stop=self._interrupt.is_set) if mcp is not None
                   else tools.call(name, args, self.tool_ctx))
            self.checkpoints.after_tool(name)
        self.emit(E.ToolFinished(index, name, args, res.ok, res.text, res.diff, res.exit_status, approved))
        return Message("tool", res.text, name=name)

    def _ask(self, name: str, args: dict, summary: str | None = None) -> bool:
        if self._interrupt.is_set():
            return False
        self._approval.clear()
        self.emit(E.ApprovalNeeded(name, args, summary or approval_summary(name, args)))
        self._approval.wait()
        ans = self._approval_answer if not self._interrupt.is_set() else "n"
        if ans == "always":
            self.always_allowed.add(name)
            return True
        return ans == "y"

    # -- context ----------------------------------------------------------------------------------
    def ctx_used(self) -> int:
        return self.session.pos

    def maybe_compact(self, reason: str) -> bool:
        used, ctx = self.session.pos, self.cfg.ctx
        if used >= COMPACT_AT * ctx or ctx - used <= min(8192, ctx // 4):
            if len(self.transcript) > 2:
                return self.compact(reason)
        return False

    def compact(self, reason: str = "requested") -> bool:
        """Summary of the conversation + its recent tail, on a fresh timeline (explicit, shown)."""
        if len(self.transcript) < 2:
            self.emit(E.Notice("nothing to compact"))
            return False
        before = self.session.pos
        old_tokens, old_transcript, old_eos = self.session.tokens, list(self.transcript), self.pending_eos
        self._status("compacting")
        self.emit(E.Notice(f"compacting ({reason}): summarizing the conversation", "warning"))
        try:
            self._append(prompts.USER + COMPACT_REQUEST.format(reason=reason) + assistant_prefix("none"),
                         what="compaction request")
            pos0, t0 = self.session.pos, time.perf_counter()

            def show_summary(evs):   # the summary streams as it is written (its own event: not an answer)
                text = "".join(ev.text for ev in evs if isinstance(ev, (prompts.TextDelta, prompts.ReasoningDelta)))
                if text:
                    n = self.session.pos - pos0
                    self.emit(E.SummaryDelta(text, n, SUMMARY_MAX_TOKENS, n / max(time.perf_counter() - t0, 1e-9)))
            parsed, interrupted = self._generate(think_mode="none", max_tokens=SUMMARY_MAX_TOKENS,
                                                 greedy=True, stream_events=show_summary)
            summary = (parsed.content or "").split("</think>")[0].strip()
            if interrupted:
                raise Interrupted()
            if not summary:
                raise ValueError("the compaction summary was empty")
            tail = recent_tail(old_transcript[1:], keep_chars=self.cfg.ctx // 10 * 3)
            system = Message("system", old_transcript[0].content + "\n\n" + SUMMARY_HEAD + summary + "\n" + SUMMARY_TAIL)
            self.transcript = [system] + tail
            text = render_messages(self.transcript, self.tool_schemas(), self.think_mode)
            if text.endswith(assistant_prefix(self.think_mode)):
                text = text[: -len(assistant_prefix(self.think_mode))]
            self.pending_eos = False        # the rendered text already closes every assistant turn
            self.session.reset()
            self._prefill_to(self.tok.encode(text), interruptible=False, what="compacted context")
        except (ValueError, Interrupted) as e:
            self.transcript, self.pending_eos = old_transcript, old_eos
            if self.session.tokens != old_tokens:
                self.session.sync(old_tokens)
            # a stop the user asked for is not a failure: said as what it was
            self.emit(E.Notice("compaction interrupted; the conversation is unchanged", "warning")
                      if isinstance(e, Interrupted) else
                      E.Notice(f"compaction failed: {e}; the conversation is unchanged", "error"))
            self._status()
            return False
        self.modified = True
        self._continues = self.current_sha or self._continues   # the name follows the compacted timeline
        self.emit(E.Compacted(before, self.session.pos, summary))
        self._status()
        return True

    # -- sessions ---------------------------------------------------------------------------------
    def save(self, name: str | None = None, quiet: bool = False):
        if self.store is None:
            return None
        try:
            info = self.store.save(self.session, think_mode=self.cfg.think_mode, name=name,
                                   continues=self._continues, branch=self.branch)
        except (OSError, SessionStoreError, ValueError) as e:
            self.emit(E.Notice(f"save failed: {e}", "error"))
            return None
        self.current_sha, self._continues = info.sha, None
        self.session_name = info.name or info.sha[:8]
        # (self.branch stays: a record another timeline saved first keeps that one's branch, but this
        # timeline's checkpoints and pool entry are under its own; taking the other's hid them)
        self.modified = False
        if not quiet:
            self.emit(E.Notice(f"saved session {info.sha[:8]} ({info.tokens} tokens)"))
        return info

    def save_on_exit(self):
        """Leaving saves the session the user was in, changed or not, so that `--resume` brings
        back this one (not the last one written); one the user deleted and did not continue stays
        deleted. The save is remembered for `farewell`."""
        self.exit_save = None
        if any(m.role == "user" for m in self.transcript) and (self.modified or self.current_sha is not None):
            self.exit_save = self.save(quiet=True)

    def farewell(self) -> str:
        """What to print once the UI has closed: where the session was saved and how to continue
        it ("" when leaving saved nothing)."""
        return resume_hint(self.exit_save) if self.exit_save is not None else ""

    def switch(self, ref: str):
        if self.store is None:
            raise SessionStoreError("no session store")
        return self.timelines.switch(ref)   # a live branch from memory, else from disk: no prefill either way

    def took_over(self, info):
        """The live timeline is `info`, just loaded into self.session: its transcript and fields."""
        text = self.tok.decode(self.session.tokens)
        self.transcript = transcript_from_text(text)
        self.pending_eos = not text.endswith(EOS_TEXT) and "<｜Assistant｜>" in text and not _ends_open(text)
        self.cfg.think_mode = info.think_mode or self.cfg.think_mode
        self.session_name = info.name or info.sha[:8]
        self.current_sha, self._continues = info.sha, None
        self.branch = info.branch if info.branch and info.tip else new_branch_id()   # an older save: a new branch
        self.modified = False
        self._status()
        return info

    def history(self, n: int = 3) -> list[str]:
        users = [m for m in self.transcript if m.role == "user"]
        return [m.content for m in users[-n:]]

    # -- slash commands ---------------------------------------------------------------------------
    def command(self, line: str) -> str:
        """Run a slash command; returns the text to show. '/quit' returns 'quit'."""
        self._interrupt.clear()
        parts = line.strip().split(maxsplit=1)
        cmd, arg = parts[0].lower(), (parts[1].strip() if len(parts) > 1 else "")
        if cmd in ("/quit", "/exit"):
            self.save_on_exit()
            return "quit"
        if cmd == "/help":
            return HELP
        if cmd == "/save":
            info = self.save(arg or None, quiet=True)
            return f"saved session {info.sha[:8]}{' as ' + info.name if info.name else ''} ({info.tokens} tokens)" if info else "save failed"
        if cmd == "/list":
            if self.store is None:
                return "no session store"
            return list_text(self.store, "all" if arg == "all" else "project", self.current_sha, branch=self.branch)
        if cmd == "/delete":
            return self._delete(arg)
        if cmd == "/fork":
            return self.timelines.fork(arg, new_branch_id())
        if cmd == "/switch":
            if not arg:
                return "usage: /switch ID|NAME"
            if self.modified:
                self.save(quiet=True)
            try:
                info = self.switch(arg)
            except SessionStoreError as e:
                return f"switch failed: {e}"
            last = self.history(3)
            return (f"switched to session {info.sha[:8]} ({info.tokens} tokens)" +
                    "".join(f"\n  > {_one_line(u)}" for u in last))
        if cmd == "/resume":
            every = self.store.list("project") if self.store is not None else []
            rows = [r for r in every if r.ok]
            # the newer damaged ones are said, not silently passed over
            skipped = "".join(f"session {r.sha[:8]} is damaged, not resumed: {_one_line(r.error, 160)}\n"
                              for r in every[:every.index(rows[0]) if rows else len(every)])
            if not rows:
                return skipped + "no saved session in this directory to resume"
            return skipped + self.command(f"/switch {rows[0].sha}")
        if cmd == "/new":
            if self.modified:
                self.save(quiet=True)
            self.start()
            return "new session"
        if cmd == "/history":
            n = int(arg) if arg.isdigit() else 3
            return "\n".join(f"  > {_one_line(u, 200)}" for u in self.history(n)) or "(no user turns yet)"
        if cmd == "/think":
            mode = {"on": "high", "high": "high", "off": "none", "none": "none", "max": "max"}.get(arg)
            if mode is None:
                return f"thinking is {self.cfg.think_mode}; usage: /think on|off|max"
            self.cfg.think_mode = mode
            self._status()
            eff = self.think_mode
            return f"thinking: {mode}" + (f" (runs as {eff}: Think Max needs a context of 393216)" if eff != mode else "")
        if cmd == "/ctx":
            used, ctx = self.session.pos, self.cfg.ctx
            return f"context: {used} / {ctx} tokens ({100 * used / ctx:.1f} %), KV state {self.session.kv_bytes() / 2**20:.0f} MiB"
        if cmd == "/compact":
            return "compacted" if self.compact("requested by /compact") else "not compacted"
        if cmd in ("/undo", "/redo", "/checkpoints"):
            return self.checkpoints.command(cmd, arg)
        if cmd == "/mcp":
            return mcp_command(self.mcp, arg)
        return f"unknown command {cmd} (/help lists them)"

    def _delete(self, ref: str) -> str:
        if self.store is None:
            return "no session store"
        if not ref:
            return "usage: /delete ID|NAME (/list shows them)"
        try:
            info = self.store.delete(ref)
        except SessionStoreError as e:
            return f"delete failed: {e}"
        out = f"deleted session {info.id} ({info.label})"
        if info.sha == self.current_sha and not info.fork_pending:   # (a fork's own deletion leaves the file)
            # the live timeline goes on; it is saved again (as a new session) only if continued
            self.current_sha = None
            self.store.forget(self.session)
            self.session_name = "deleted"
            self._status()
            out += "; it was the session you are in: it is saved again only if you continue it"
        return out

    def _status(self, busy: str = ""):
        used, ctx = self.session.pos, self.cfg.ctx
        warn = f"context {100 * used // ctx}% full: compaction at {int(COMPACT_AT * 100)}%" if used >= WARN_AT * ctx else ""
        self.emit(E.Status(self.model_name, self.engine.backend, used, ctx,
                           self.prefill_tps, self.gen_tps, self.session_name, self.cfg.think_mode, busy, warn,
                           getattr(self.engine, "expert_status", ""), mtp_status(self.mtp_counts)))


# -- helpers ---------------------------------------------------------------------------------------
def mtp_status(counts) -> str:
    """The status bar's MTP field: the share of drafts the verify accepted ("" before any)."""
    drafted, accepted = counts
    return f"mtp {100 * accepted // drafted}%" if drafted else ""


def new_branch_id() -> str:
    """A timeline's branch id: 12 hex digits, fixed for the branch's life (session ids change on
    every save; a branch's checkpoints and lineage need a name that does not)."""
    return secrets.token_hex(6)


def approval_summary(name: str, args: dict) -> str:
    if name == "bash":
        return f"run: {args.get('command', '')}"
    if name in ("write", "edit"):
        return f"{name} {args.get('path', '')}"
    if name == "git_commit":
        return f"git commit: {args.get('message', '')}"
    return f"{name} {json.dumps(args, ensure_ascii=False)[:200]}"


def recent_tail(messages: list[Message], keep_chars: int) -> list[Message]:
    """The last messages worth about keep_chars of text, starting at a user turn."""
    total, start = 0, len(messages)
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        total += len(m.content or "") + len(m.reasoning or "") + sum(len(c.arguments_json) for c in m.tool_calls)
        if total > keep_chars:
            break
        start = i
    while start < len(messages) and messages[start].role != "user":
        start += 1
    return messages[start:]


def transcript_from_text(text: str) -> list[Message]:
    """Messages recovered from a rendered timeline (after /switch): system, user turns, tool results
    and assistant turns (parsed with the DSML parser)."""
    body = text.replace(prompts.BOS, "", 1)
    out: list[Message] = []
    first_user = body.find(prompts.USER)
    system = body if first_user < 0 else body[:first_user]
    out.append(Message("system", strip_system_extras(system)))
    if first_user < 0:
        return out
    for chunk in body[first_user + len(prompts.USER):].split(prompts.USER):
        user_part, _, rest = chunk.partition(prompts.ASSISTANT)
        if user_part.startswith("<tool_result>"):
            for piece in user_part.split("<tool_result>")[1:]:
                out.append(Message("tool", piece.rsplit("</tool_result>", 1)[0]))
        else:
            out.append(Message("user", user_part))
        if not rest:
            continue
        gen = rest.split(EOS_TEXT)[0]
        mode = "high" if gen.startswith("<think>") else "none"
        gen = gen[len("<think>"):] if gen.startswith("<think>") else gen[len("</think>"):] if gen.startswith("</think>") else gen
        if mode == "high" and "</think>" not in gen:
            # a turn stopped while it reasoned (Esc, the cap): all of it is reasoning (the parser,
            # ds4's rule for a finished reply, would give an unclosed think block as the answer)
            out.append(Message("assistant", "", gen))
            continue
        parsed = prompts.parse_output(gen, mode)
        out.append(Message("assistant", parsed.content or "", parsed.reasoning,
                           [ToolCall(None, c.name, c.arguments_json, parsed.dsml) for c in parsed.tool_calls]))
    return out


def strip_system_extras(system: str) -> str:
    """The system message proper of a rendered system block: without the Think Max prefix and the
    tools block the renderer puts in front of it (they are re-rendered from the current tools)."""
    if system.startswith(prompts.THINK_MAX_PREFIX):
        system = system[len(prompts.THINK_MAX_PREFIX):]
    if system.startswith(TOOLS_HEAD) and TOOLS_TAIL in system:
        system = system.split(TOOLS_TAIL, 1)[1]
        system = system[2:] if system.startswith("\n\n") else system
    return system


def _ends_open(text: str) -> bool:
    return text.endswith(prompts.ASSISTANT + "<think>") or text.endswith(prompts.ASSISTANT + "</think>")


def _one_line(s: str, n: int = 100) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."

