"""The shim's inference worker: one thread owns the one live Session and runs requests in arrival
order (protocol.md §5.0, §7). For each job it picks how much of the prompt is already in the KV
(§7.2, plus in-place cut-back, which ds4 cannot do), prefills the rest, samples with DSML syntax
greedy (§3.7), streams events to the request's sink, and remembers what the next request of a
stateless client will need: exact DSML blocks by tool id (§6.2), live bindings (§7.3) and disk
checkpoints (kvcache.md §4).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import prompts
from engine import ContextFull, Engine, Rng, SamplingParams, Session
from prompts import DsmlStream, Rendered, ToolMemory, new_tool_id
from sessions.prefix_cache import PrefixCache, token_text

from . import events as E
from ..generation import GenerationResult, generate
from .config import ServeConfig

log = logging.getLogger("ds4agent.serve")

# Thinking mode samples with DeepSeek's hosted defaults whatever the request asks (§4.4).
THINKING_SAMPLING = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05)


class Cancelled(Exception):
    pass


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


@dataclass
class Binding:
    """A live continuation the next request may take (§7.3): valid while the session is still at
    `frontier`. visible: the transcript a client will resend (its bytes are a prefix of that
    request's prompt); ids: the tool calls of the turn."""
    kind: str                          # "responses" | "anthropic" | "thinking"
    frontier: int
    visible: bytes | None = None
    ids: frozenset = frozenset()


class Worker:
    def __init__(self, engine: Engine, cfg: ServeConfig, *, memory: ToolMemory | None = None,
                 cache: PrefixCache | None = None):
        self.engine = engine
        self.tok = engine.tokenizer
        self.cfg = cfg
        self.session = Session(engine, cfg.ctx, chunk=cfg.chunk)
        self.memory = memory
        self.cache = cache
        self.bindings: dict[str, Binding] = {}
        self.lock = threading.Lock()           # guards bindings and memory against the app's reads
        self._q: queue.Queue = queue.Queue()
        self._forced: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()      # set by the worker once it saved the live session
        self.busy = False
        self.closing = False
        self._submit_lock = threading.Lock()
        self._job_s = 1.0                      # a job's run time, smoothed: the Retry-After estimate
        self.stats = {"requests": 0, "prefilled": 0, "reused": 0, "generated": 0}

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self):
        self._thread = threading.Thread(target=self._loop, name="ds4-inference", daemon=True)
        self._thread.start()

    def submit(self, job: Job):
        """Queue a job, or raise QueueFull when --max-queue live jobs already wait."""
        if self.closing:
            job.emit(E.Failure("server shutting down", 503))
            return
        with self._submit_lock:
            self.check_room()
            self._q.put(job)

    def check_room(self):
        """Raise QueueFull when --max-queue live jobs already wait. The app asks once before it
        reads and tokenizes a body (a refusal then costs nothing), and submit asks again."""
        waiting = self.waiting()
        if waiting >= self.cfg.max_queue:
            raise QueueFull(waiting, self.retry_after())

    def queued(self) -> int:
        return self._q.qsize()

    def waiting(self) -> int:
        """Jobs queued whose client is still there (a job cancelled while queued is skipped)."""
        with self._q.mutex:
            return sum(1 for j in self._q.queue if j is not None and not j.cancel.is_set())

    def retry_after(self) -> int:
        """Seconds until a queue place is likely free: about one job's run time (1-60)."""
        return int(min(60, max(1, round(self._job_s))))

    def stop(self, timeout: float | None = None):
        """Finish the running and queued jobs, then save the live session (the shutdown moment)."""
        self.closing = True
        self._q.put(None)
        if self._thread is None or not self._stopped.wait(timeout):
            self._store_live("shutdown")

    def force(self, *texts: str):
        """Test hook: the next generations emit these texts instead of sampling (one per job);
        every forced token is still evaluated, so the KV state stays real."""
        with self.lock:
            self._forced.extend(texts)

    def _loop(self):
        while True:
            job = self._q.get()
            if job is None:
                try:
                    self._store_live("shutdown")
                finally:
                    self._stopped.set()
                if getattr(self.engine.model.ops, "keep_threads", False):
                    # parked, not returned: with MLX 0.32 a thread that ran MLX work and then ends
                    # could abort the process as it exits ("terminate called without an active
                    # exception", about 1 exit in 4); a parked daemon thread is left behind at exit
                    threading.Event().wait()
                return
            if job.cancel.is_set():
                continue             # the client left while queued
            self.busy = True
            t0 = time.monotonic()
            try:
                self._run(job)
            except Cancelled:
                log.info("request cancelled by the client")
            except Exception as e:       # never let one request kill the worker
                log.exception("request failed")
                job.emit(E.Failure(f"inference failed: {e}", 500))
            finally:
                self.busy = False
                self._job_s = 0.7 * self._job_s + 0.3 * (time.monotonic() - t0)

    # -- live state the app asks about ---------------------------------------------------------
    def live_call_ids(self, api: str) -> frozenset:
        with self.lock:
            b = self.bindings.get(api)
            return b.ids if b is not None and b.frontier == self.session.pos else frozenset()

    def disk_tool_maps(self) -> dict[str, str]:
        """Every tool id -> block pair the disk checkpoints' trailers hold (kvcache.md §2.4)."""
        from sessions.kvfile import KVFileError, read_info
        found: dict[str, str] = {}
        if self.cache is None:
            return found
        for e in self.cache.entries():
            if not e.header.flags & 1:
                continue
            try:
                found.update(read_info(e.path).tool_map or {})
            except (KVFileError, OSError):
                continue
        return found

    # -- one job -------------------------------------------------------------------------------
    def _run(self, job: Job):
        self.stats["requests"] += 1
        t0 = time.perf_counter()
        try:
            source, cached = self._prepare(job)
        except ContextFull as e:
            job.emit(E.Failure(f"prompt exceeds context: {e}", 400))
            return
        except _LostLiveState as e:
            job.emit(E.Failure(str(e), 409))
            return
        prompt_n = self.session.pos
        job.trace.update(source=source, cached=cached, prompt_tokens=prompt_n,
                         prefill_s=round(time.perf_counter() - t0, 3))
        self.stats["prefilled"] += prompt_n - cached
        self.stats["reused"] += cached
        log.info("request %s: %d prompt tokens, %d reused (%s)", job.api, prompt_n, cached, source)
        job.emit(E.Begin(E.Usage(prompt_n, cached), source))
        self._generate(job, E.Usage(prompt_n, cached))

    # -- reuse decision (§7.2) -----------------------------------------------------------------
    def _prepare(self, job: Job) -> tuple[str, int]:
        s = self.session
        L = s.pos
        prompt = job.prompt_bytes
        r = job.rendered
        with self.lock:
            b_resp = self._valid("responses")
            b_anth = self._valid("anthropic")
            b_think = self._valid("thinking")
        live_text = token_text(s) if L else b""

        def extend(tail: str, source: str, keep: tuple = ()) -> tuple[str, int]:
            self._keep_bindings(keep)
            target = s.tokens + self.tok.encode(tail)
            self._prefill(job, target, cached=L)
            return source, L

        # 1-3: continuations that only a live session can serve
        if L and job.api == "responses" and b_resp is not None:
            if b_resp.visible and len(prompt) > len(b_resp.visible) and prompt.startswith(b_resp.visible):
                tail = _decode_tail(prompt[len(b_resp.visible):])
                if tail is not None:
                    return extend(tail, "responses-visible", ("responses",))
            if r.live_tail and b_resp.ids and set(r.live_call_ids) == set(b_resp.ids):
                return extend(r.live_tail, "responses-tool-output", ("responses",))
        if L and job.api == "anthropic" and b_anth is not None and r.live_tail and b_anth.ids \
                and set(r.live_call_ids) == set(b_anth.ids):
            return extend(r.live_tail, "anthropic-tool-output", ("anthropic",))
        if r.requires_live_tool_state:
            what = "input" if job.api == "responses" else "messages"
            name = "Responses" if job.api == "responses" else "Anthropic"
            raise _LostLiveState(f"{name} continuation state is not available; retry by replaying "
                                 f"the full {what} history")
        # 5: the live timeline is a token prefix of the prompt
        if L and len(job.tokens) >= L and job.tokens[:L] == s.tokens:
            self._keep_bindings(())
            self._prefill(job, job.tokens, cached=L)
            return "memory-token", L
        # 6: a thinking turn whose hidden reasoning the client will not resend
        if L and job.api in ("openai_chat", "anthropic") and b_think is not None and b_think.visible \
                and len(prompt) > len(b_think.visible) and prompt.startswith(b_think.visible):
            tail = _decode_tail(prompt[len(b_think.visible):])
            if tail is not None:
                return extend(tail, "thinking-visible")
        # 7: same bytes, tokenized differently at some boundary
        if L and prompt.startswith(live_text):
            tail = _decode_tail(prompt[len(live_text):])
            if tail is not None:
                return extend(tail, "memory-text")
        return self._prepare_branch(job, prompt)

    def _prepare_branch(self, job: Job, prompt: bytes) -> tuple[str, int]:
        """Steps 8-9 of _prepare: the prompt shares only part of the live timeline (or nothing)."""
        s = self.session
        L = s.pos
        # 8: part of the live timeline, cut back in place, or a disk checkpoint: the longer wins
        keep = s.reusable(job.tokens) if L else 0
        cand = self.cache.find(prompt, s) if self.cache is not None else None
        if cand is not None and cand.tokens <= keep:
            cand = None
        self._keep_bindings(())
        if self.cache is not None and L - keep >= max(1, self.cache.min_tokens):
            # a real branch of the live timeline is about to be lost: save it first (ds4's evict
            # moment; alternating conversations then come back from disk). Dropping a few tokens
            # of a conversation's own tail is not worth a checkpoint write.
            self.cache.reset_continued()
            self._store_live("evict")
        if cand is not None:
            got = self.cache.restore(s, prompt)
            if got is not None:
                info, suffix = got
                self._merge_tool_map(info.tool_map)
                n = s.pos
                tail = _decode_tail(suffix)
                # a checkpoint ending inside a character: resync from the canonical tokens
                target = s.tokens + self.tok.encode(tail) if tail is not None else job.tokens
                reused = s.reusable(target)
                self._prefill(job, target, cached=reused)
                return "disk-text", min(n, reused)
            keep = s.reusable(job.tokens) if s.pos else 0
        if keep and (self.cache is None or keep >= self.cache.min_tokens):
            self._prefill(job, job.tokens, cached=keep)
            return "memory-prefix", keep
        if keep:
            # a sliver of the live timeline (BOS, a few tokens) is still reused, but the request
            # is new as far as the disk cache goes: its system+tools prefix gets the cold save
            self._prefill(job, job.tokens, cached=keep, cold=True)
            return "memory-prefix", keep
        # 9: cold
        self._prefill(job, job.tokens, cached=0, cold=True)
        return "cold", 0

    def _valid(self, kind: str) -> Binding | None:
        b = self.bindings.get(kind)
        return b if b is not None and b.frontier == self.session.pos else None

    def _keep_bindings(self, keep: tuple):
        """After a request chooses its path, only the binding it continued from survives (§7.2)."""
        with self.lock:
            self.bindings = {k: v for k, v in self.bindings.items() if k in keep}

    def _merge_tool_map(self, tool_map: dict | None):
        if self.memory is None or not tool_map:
            return
        with self.lock:
            for i, block in tool_map.items():
                if self.memory.source(i) != "ram":
                    self.memory.remember(i, block, "disk")

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(self, job: Job, target: list[int], *, cached: int, cold: bool = False):
        """Bring the session to `target`, stopping at the disk cache's save frontiers on the way
        (cold anchor, continued multiples) so those checkpoints are exact prefixes."""
        s = self.session
        if len(target) >= s.ctx:
            raise ContextFull(f"{len(target)} tokens do not fit the context of {s.ctx}")
        stops: list[tuple[int, str]] = []
        c = self.cache
        if c is not None:
            if cold and c.cold_max_tokens and c.min_tokens <= len(target) <= c.cold_max_tokens:
                n = c.cold_store_target(target, self.tok.special(prompts.USER),
                                        self.tok.special(prompts.ASSISTANT))
                if n:
                    stops.append((n, "cold"))
            step = c.continued_step()
            if step:
                f = (max(cached, 1) // step + 1) * step
                while f <= len(target):
                    if f >= c.min_tokens:
                        stops.append((f, "continued"))
                    f += step
        frontiers = sorted({n for n, _ in stops} | {len(target)})
        total = max(1, len(target) - cached)
        for n in frontiers:
            if n <= cached and n != len(target):
                continue
            base = min(s.pos, cached)

            def progress(done, _total, base=base):
                if job.cancel.is_set():
                    return False
                job.emit(E.Prefill(min(total, max(0, base - cached) + done), total))
                return True

            if s.sync(target[:n], progress) is False or job.cancel.is_set():
                raise Cancelled()
            for m, reason in stops:
                if m == n and c is not None and (reason == "cold" or c.should_store_continued(n)):
                    if self._store_live(reason) and reason == "cold":
                        c.note_store(n)

    def _store_live(self, reason: str) -> bool:
        """Save the whole live timeline to the disk cache, keyed by a valid visible transcript
        when there is one (so a client that resends only what it saw still finds it)."""
        c = self.cache
        s = self.session
        if c is None or s.pos < max(1, c.min_tokens):
            return False
        key, kind = None, "token-text"
        with self.lock:
            b = self._valid("responses")
            if b is not None and b.visible:
                key, kind = b.visible, "responses-visible"
            else:
                b = self._valid("thinking")
                if b is not None and b.visible:
                    key, kind = b.visible, "thinking-visible"
        text = key if key is not None else token_text(s)
        tool_map = None
        if self.memory is not None:
            with self.lock:
                tool_map = dict(self.memory.items_for_text(text.decode("utf-8", "replace"))) or None
        try:
            return c.store(s, text if kind != "token-text" else None, reason, tool_map=tool_map,
                           key_kind=kind)
        except (OSError, ValueError) as e:
            log.warning("kv cache: could not store (%s): %s", reason, e)
            return False

    # -- generation ----------------------------------------------------------------------------
    def _generate(self, job: Job, usage: E.Usage):
        s, tok = self.session, self.tok
        r = job.rendered
        thinking = r.think_mode in ("high", "max")
        stream = DsmlStream(r.think_mode, has_tools=r.has_tools, stop=job.stop)
        with self.lock:
            forced_text = job.forced if job.forced is not None else (
                self._forced.pop(0) if self._forced else None)
        forced = tok.encode(forced_text) if forced_text is not None else None
        room = s.ctx - s.pos - 1
        # a forced reply (test hook) is written whole, like a sampled one that fits the context
        limit = max(0, room if forced is not None else min(job.max_tokens, room))
        ids: dict[int, str] = {}
        taken: set[str] = set()
        kind = "anthropic" if job.api == "anthropic" else "openai"

        def checkpoint():
            if self.cache is not None and not (r.has_tools and (stream.saw_tool_start or stream.in_dsml_syntax)) \
                    and self.cache.should_store_continued(s.pos):
                self._store_live("continued")

        out = generate(s, stream, sampling=THINKING_SAMPLING if thinking else job.sampling,
                       rng=Rng(job.seed or None), limit=limit, eos_id=tok.eos_id,
                       token_bytes=tok.token_bytes, forced=forced, should_stop=job.cancel.is_set,
                       before_token=checkpoint,
                       on_events=lambda evs: self._forward(job, evs, ids, lambda: self._new_id(kind, taken)))
        n = out.n_tokens
        self.stats["generated"] += n
        job.trace.update(gen_tokens=n, gen_s=round(out.elapsed, 3), output=stream.text)
        if out.cancelled:
            self._keep_bindings(())
            raise Cancelled()
        res = stream.result
        calls = [E.CallOut(i, ids.get(i) or self._new_id(kind, taken), c.name, c.arguments_json,
                           dict(c.arguments)) for i, c in enumerate(res.tool_calls)]
        fin = self._finish_reason(job, res.finish_reason, out)
        self._remember(job, res, calls, fin)
        if fin == "tool_calls" and calls and self.memory is None and job.api in ("openai_chat", "anthropic"):
            self._canonicalize(job, res, calls, usage.prompt_tokens)
        content, reasoning = res.content, res.reasoning if thinking else None
        if job.api == "openai_completions":      # raw text, reasoning and </think> included (§2.6)
            content, reasoning = stream.text, None
        job.emit(E.Finish(fin, content, reasoning, tuple(calls),
                          E.Usage(usage.prompt_tokens, usage.cached_tokens, n),
                          reasoning_closed=not thinking or "</think>" in stream.text,
                          stop_sequence=stream.stop_hit))

    @staticmethod
    def _forward(job: Job, evs, ids: dict[int, str], new_id: Callable[[], str]):
        """The stream's events as the wire's, tool calls numbered with this job's ids."""
        for ev in evs:
            if isinstance(ev, prompts.ReasoningDelta):
                job.emit(E.Reasoning(ev.text))
            elif isinstance(ev, prompts.TextDelta):
                job.emit(E.Text(ev.text))
            elif isinstance(ev, prompts.ToolCallStart):
                ids[ev.index] = new_id()
                job.emit(E.ToolStart(ev.index, ids[ev.index], ev.name))
            elif isinstance(ev, prompts.ToolArgsDelta):
                job.emit(E.ToolArgs(ev.index, ev.text))
            elif isinstance(ev, prompts.ToolCallEnd):
                if ev.index not in ids:
                    ids[ev.index] = new_id()
                c = ev.call
                job.emit(E.ToolEnd(E.CallOut(ev.index, ids[ev.index], c.name, c.arguments_json,
                                             dict(c.arguments))))

    @staticmethod
    def _finish_reason(job: Job, parsed: str, out: GenerationResult) -> str:
        """The finish reason the client sees, from the parse's and why sampling ended."""
        if parsed == "length" and out.n_tokens >= job.max_tokens and job.server_capped:
            # --max-tokens is the operator's runaway guard, not a limit the client asked for: the
            # turn ends as if the model had stopped, so agents carry on (Codex fails a turn on
            # "incomplete"); the trace and the log say it was capped
            job.trace["capped"] = True
            log.info("generation stopped at the server's --max-tokens cap (%d tokens)", out.n_tokens)
            return "stop"
        if parsed == "error" and out.finish == "length":
            # the token cap cut a tool block: ds4 says "error"; the truth for the client is that
            # it ran out of tokens (clients such as Pi treat "error" as a provider failure)
            return "length"
        return parsed

    def _canonicalize(self, job: Job, res, calls: list[E.CallOut], prompt_n: int):
        """Without exact replay the next request renders this turn's calls as canonical DSML, not
        the sampled bytes: bring the live timeline to that rendering now (cutting back to where
        they differ), so the next request continues it instead of missing (§6.3)."""
        from prompts import ToolCall, render_tool_calls
        think = job.rendered.think_mode in ("high", "max")
        suffix = ((res.reasoning or "") + prompts.render.THINK_CLOSE if think else "") + res.content \
            + render_tool_calls([ToolCall(c.id, c.name, c.arguments_json) for c in calls]) + prompts.EOS
        s = self.session
        target = s.tokens[:prompt_n] + self.tok.encode(suffix)
        if target == s.tokens or len(target) >= s.ctx:
            return
        s.sync(target)
        # the timeline now ends with the EOS a live tool-output tail would add again
        self._keep_bindings(())
        job.trace["canonicalized"] = True

    def _new_id(self, kind: str, taken: set) -> str:
        with self.lock:
            mem = self.memory

            class _Taken:
                def __contains__(_, x):
                    return x in taken or (mem is not None and x in mem)

            tid = new_tool_id(kind, _Taken())
        taken.add(tid)
        return tid

    def _remember(self, job: Job, res, calls: list[E.CallOut], finish: str):
        """Tool memory (§6.2) and the live bindings for the next request (§7.3)."""
        s = self.session
        r = job.rendered
        new: dict[str, Binding] = {}
        if finish == "tool_calls" and calls and self.memory is not None and res.dsml:
            with self.lock:
                for c in calls:
                    try:
                        self.memory.remember(c.id, res.dsml)
                    except ValueError as e:
                        log.warning("tool memory: %s", e)
        ok = finish not in ("error", "length")
        thinking = r.think_mode in ("high", "max")
        block = res.dsml or ""
        if ok and job.api == "responses":
            vis = r.text
            if thinking:
                summary = r.conversation is not None and r.conversation.reasoning_summary
                vis += ((res.reasoning or "") if summary and calls else "") + prompts.render.THINK_CLOSE
            vis += res.content + block + prompts.EOS
            new["responses"] = Binding("responses", s.pos, prompts.to_bytes(vis),
                                       frozenset(c.id for c in calls))
        if ok and job.api == "anthropic" and calls:
            new["anthropic"] = Binding("anthropic", s.pos, None, frozenset(c.id for c in calls))
        if ok and thinking and not r.has_tools and not r.preserves_reasoning and not calls \
                and job.api in ("openai_chat", "anthropic") and r.text.endswith(prompts.render.THINK_OPEN):
            vis = r.text[:-len(prompts.render.THINK_OPEN)] + prompts.render.THINK_CLOSE + res.content + prompts.EOS
            new["thinking"] = Binding("thinking", s.pos, prompts.to_bytes(vis))
        with self.lock:
            self.bindings = new


class _LostLiveState(Exception):
    pass


def _decode_tail(b: bytes) -> str | None:
    """A byte suffix of rendered text as text to tokenize, or None when the cut falls inside a
    UTF-8 character (then the boundary cannot be reused as text)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None
