"""One live KV slot of the shim: a Session (one timeline), the live bindings a stateless client's
next request may continue (§7.3), and the thread that runs the requests given to it. For each
job it picks how much of the prompt is already in its KV (§7.2, plus in-place cut-back, which
ds4 cannot do), prefills the rest, samples with DSML syntax greedy (§3.7), streams events to the
request's sink, and remembers what the next request will need: exact DSML blocks by tool id
(§6.2, the worker's tool memory, shared by every slot: ids are unique), its own bindings, and
disk checkpoints (kvcache.md §4; the continued-save schedule is this timeline's own).

The worker (worker.py) decides which slot runs which job; `estimate` is what it asks.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import prompts
from engine import ContextFull, Rng, SamplingParams, Session
from prompts import DsmlStream, new_tool_id
from sessions.prefix_cache import token_text

from . import events as E
from ..generation import GenerationResult, generate
from ..generation_mtp import speculator_for

from .job import Job

log = logging.getLogger("ds4agent.serve")

# Thinking mode samples with DeepSeek's hosted defaults whatever the request asks (§4.4).
THINKING_SAMPLING = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05)

# the request log's name for each reuse path (§7.2): prefix = the whole live timeline continued
# (by tokens, text or a remembered visible transcript), replay = a live tool-output binding,
# cut = part of the timeline kept by cutting it back in place, disk = a checkpoint, none = cold
HOW = {"memory-token": "prefix", "memory-text": "prefix", "thinking-visible": "prefix",
       "responses-visible": "prefix", "responses-tool-output": "replay",
       "anthropic-tool-output": "replay", "memory-prefix": "cut", "disk-text": "disk", "cold": "none"}
ENDPOINT = {"openai_chat": "/v1/chat/completions", "openai_completions": "/v1/completions",
            "responses": "/v1/responses", "anthropic": "/v1/messages"}


class Cancelled(Exception):
    pass


@dataclass
class Binding:
    """A live continuation the next request may take (§7.3): valid while the session is still at
    `frontier`. visible: the transcript a client will resend (its bytes are a prefix of that
    request's prompt); ids: the tool calls of the turn."""
    kind: str                          # "responses" | "anthropic" | "thinking"
    frontier: int
    visible: bytes | None = None
    ids: frozenset = frozenset()


class Slot:
    def __init__(self, worker, index: int):      # worker: the serve.worker.Worker that owns the slot
        self.w = worker
        self.index = index
        self.engine = worker.engine
        self.tok = worker.tok
        self.cfg = worker.cfg
        self.session = Session(worker.engine, worker.cfg.ctx, chunk=worker.cfg.chunk)
        self.bindings: dict[str, Binding] = {}     # guarded by the worker's lock
        self.job: "Job | None" = None               # running or given to this slot (the worker's cv)
        self.last_used = 0.0                        # monotonic end of its last job; 0: never used
        self.last_continued = 0                     # this timeline's last cold/continued save (§4.2)
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()            # set once its live session is saved at shutdown
        self._text: tuple[int, bytes] | None = None  # (pos, token text) of an idle timeline

    @property
    def busy(self) -> bool:
        return self.job is not None

    # -- what the worker asks before it gives a job ----------------------------------------------
    def estimate(self, job: "Job") -> tuple[int, int]:
        """(tokens of the job's prompt this slot would reuse, tokens of its timeline it would
        lose), by the reuse rules of _prepare without running them (disk not counted: any slot
        can load a checkpoint). Asked only while the slot is idle (its timeline is still)."""
        s = self.session
        L = s.pos
        if not L:
            return 0, 0
        r = job.rendered
        prompt = job.prompt_bytes
        with self.w.lock:
            binds = [self._valid(k) for k in ("responses", "anthropic", "thinking")]
        for b in binds:
            if b is None:
                continue
            if b.ids and r.live_tail and set(r.live_call_ids) == set(b.ids):
                return L, 0
            if b.visible and len(prompt) > len(b.visible) and prompt.startswith(b.visible):
                return L, 0
        toks = s.tokens
        if len(job.tokens) >= L and job.tokens[:L] == toks:
            return L, 0
        if self._text is None or self._text[0] != L:
            self._text = (L, token_text(s))
        if prompt.startswith(self._text[1]):
            return L, 0
        keep = s.reusable(job.tokens)
        return keep, L - keep

    def live_call_ids(self, api: str) -> frozenset:
        with self.w.lock:
            b = self.bindings.get(api)
            return b.ids if b is not None and b.frontier == self.session.pos else frozenset()

    # -- one job -------------------------------------------------------------------------------
    def run(self, job: "Job"):
        """Run one job to its end, its events to its sink; never raises (one request must not end
        the slot). Logs the request's one line when it ends, however it ends."""
        t0 = time.perf_counter()
        finish = "error"
        job.trace["slot"] = self.index
        try:
            finish = self._run(job)
        except Cancelled:
            finish = "cancelled"
        except Exception as e:       # never let one request kill the slot
            log.exception("request failed")
            job.emit(E.Failure(f"inference failed: {e}", 500))
        finally:
            self._text = None
            self._log_request(job, finish, time.perf_counter() - t0)

    def _log_request(self, job: "Job", finish: str, secs: float):
        """llama-server's per-request line: endpoint, slot, prompt and reused tokens (and how),
        generated tokens, prefill and decode speed, duration, finish reason."""
        t = job.trace
        n, cached = t.get("prompt_tokens", len(job.tokens)), t.get("cached", 0)
        pre_s, gen_s, gen = t.get("prefill_s", 0.0), t.get("gen_s", 0.0), t.get("gen_tokens", 0)
        src = t.get("source")
        how = f"{HOW.get(src, src)}: {src}" if src else "-"
        drafted = t.get("mtp_drafted", 0)      # --mtp: how many drafts the verify accepted
        mtp = f", mtp {t.get('mtp_accepted', 0)}/{drafted} accepted" if drafted else ""
        log.info("%s slot %d (%s): prompt %d tokens, reused %d (%s), generated %d, prefill %.1f t/s, "
                 "decode %.1f t/s%s, %.2f s, %s", ENDPOINT.get(job.api, job.api), self.index,
                 t.get("slot_choice", "-"), n, cached, how, gen, (n - cached) / pre_s if pre_s > 0 else 0.0,
                 gen / gen_s if gen_s > 0 else 0.0, mtp, secs, finish)

    def _run(self, job: "Job") -> str:
        self.w.count(requests=1)
        t0 = time.perf_counter()
        try:
            source, cached = self._prepare(job)
        except ContextFull as e:
            # each API's context-length error: the numbers of the prompt that did not fit
            job.emit(E.Failure(f"prompt exceeds context: {e}", 400, n_ctx=self.session.ctx,
                               n_prompt=job.trace.get("prompt_tokens", len(job.tokens))))
            return "error (context full)"
        except _LostLiveState as e:
            job.emit(E.Failure(str(e), 409))
            return "error (live state lost)"
        prompt_n = self.session.pos
        job.trace.update(source=source, cached=cached, prompt_tokens=prompt_n,
                         prefill_s=round(time.perf_counter() - t0, 3))
        self.w.count(prefilled=prompt_n - cached, reused=cached)
        job.emit(E.Begin(E.Usage(prompt_n, cached), source))
        return self._generate(job, E.Usage(prompt_n, cached))

    # -- reuse decision (§7.2) -----------------------------------------------------------------
    def _prepare(self, job: "Job") -> tuple[str, int]:
        s = self.session
        L = s.pos
        prompt = job.prompt_bytes
        r = job.rendered
        with self.w.lock:
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

    def _prepare_branch(self, job: "Job", prompt: bytes) -> tuple[str, int]:
        """Steps 8-9 of _prepare: the prompt shares only part of the live timeline (or nothing)."""
        s = self.session
        L = s.pos
        # 8: part of the live timeline, cut back in place, or a disk checkpoint: the longer wins
        keep = s.reusable(job.tokens) if L else 0
        cand = None
        if self.w.cache is not None:
            with self.w.cache_lock:
                cand = self.w.cache.find(prompt, s)
        if cand is not None and cand.tokens <= keep:
            cand = None
        self._keep_bindings(())
        if self.w.cache is not None and L - keep >= max(1, self.w.cache.min_tokens):
            # a real branch of the live timeline is about to be lost: save it first (ds4's evict
            # moment; alternating conversations then come back from disk). Dropping a few tokens
            # of a conversation's own tail is not worth a checkpoint write.
            self.last_continued = 0
            self._store_live("evict")
        if cand is not None:
            with self.w.cache_lock:
                got = self.w.cache.restore(s, prompt)
            if got is not None:
                info, suffix = got
                self.last_continued = info.header.tokens
                self._merge_tool_map(info.tool_map)
                n = s.pos
                tail = _decode_tail(suffix)
                # a checkpoint ending inside a character: resync from the canonical tokens
                target = s.tokens + self.tok.encode(tail) if tail is not None else job.tokens
                reused = s.reusable(target)
                self._prefill(job, target, cached=reused)
                return "disk-text", min(n, reused)
            keep = s.reusable(job.tokens) if s.pos else 0
        if keep and (self.w.cache is None or keep >= self.w.cache.min_tokens):
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
        with self.w.lock:
            self.bindings = {k: v for k, v in self.bindings.items() if k in keep}

    def _merge_tool_map(self, tool_map: dict | None):
        if self.w.memory is None or not tool_map:
            return
        with self.w.lock:
            for i, block in tool_map.items():
                if self.w.memory.source(i) != "ram":
                    self.w.memory.remember(i, block, "disk")

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(self, job: "Job", target: list[int], *, cached: int, cold: bool = False):
        """Bring the session to `target`, stopping at the disk cache's save frontiers on the way
        (cold anchor, continued multiples) so those checkpoints are exact prefixes."""
        s = self.session
        if len(target) >= s.ctx:
            job.trace["prompt_tokens"] = len(target)     # the effective prompt, for the 400
            raise ContextFull(f"{len(target)} tokens do not fit the context of {s.ctx}")
        stops: list[tuple[int, str]] = []
        c = self.w.cache
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
                if m == n and c is not None and (reason == "cold" or c.should_store_continued(n, self.last_continued)):
                    if self._store_live(reason) and reason == "cold":
                        self.last_continued = max(self.last_continued, n)

    def _store_live(self, reason: str) -> bool:
        """Save the whole live timeline to the disk cache, keyed by a valid visible transcript
        when there is one (so a client that resends only what it saw still finds it)."""
        c = self.w.cache
        s = self.session
        if c is None or s.pos < max(1, c.min_tokens):
            return False
        key, kind = None, "token-text"
        with self.w.lock:
            b = self._valid("responses")
            if b is not None and b.visible:
                key, kind = b.visible, "responses-visible"
            else:
                b = self._valid("thinking")
                if b is not None and b.visible:
                    key, kind = b.visible, "thinking-visible"
        text = key if key is not None else token_text(s)
        tool_map = None
        if self.w.memory is not None:
            with self.w.lock:
                tool_map = dict(self.w.memory.items_for_text(text.decode("utf-8", "replace"))) or None
        try:
            with self.w.cache_lock:
                ok = c.store(s, text if kind != "token-text" else None, reason, tool_map=tool_map,
                             key_kind=kind)
        except (OSError, ValueError) as e:
            log.warning("kv cache: could not store (%s): %s", reason, e)
            return False
        if ok and reason in ("cold", "continued"):
            self.last_continued = max(self.last_continued, s.pos)
        return ok

    # -- generation ----------------------------------------------------------------------------
    def _generate(self, job: "Job", usage: E.Usage):
        s, tok = self.session, self.tok
        r = job.rendered
        thinking = r.think_mode in ("high", "max")
        stream = DsmlStream(r.think_mode, has_tools=r.has_tools, stop=job.stop)
        with self.w.lock:
            forced_text = job.forced if job.forced is not None else (
                self.w._forced.pop(0) if self.w._forced else None)
        forced = tok.encode(forced_text) if forced_text is not None else None
        room = s.ctx - s.pos - 1
        # a forced reply (test hook) is written whole, like a sampled one that fits the context
        limit = max(0, room if forced is not None else min(job.max_tokens, room))
        ids: dict[int, str] = {}
        taken: set[str] = set()
        kind = "anthropic" if job.api == "anthropic" else "openai"

        def checkpoint():
            if self.w.cache is not None and not (r.has_tools and (stream.saw_tool_start or stream.in_dsml_syntax)) \
                    and self.w.cache.should_store_continued(s.pos, self.last_continued):
                self._store_live("continued")

        # registered as generating: with the engine's batcher on, a decode step of the other
        # slots waits (a few ms at most) for this one's, and they run as one forward pass
        registered = getattr(s, "generating", None)
        with registered() if registered is not None else contextlib.nullcontext():
            out = generate(s, stream, sampling=THINKING_SAMPLING if thinking else job.sampling,
                           rng=Rng(job.seed or None), limit=limit, eos_id=tok.eos_id,
                           token_bytes=tok.token_bytes, forced=forced, should_stop=job.cancel.is_set,
                           before_token=checkpoint,
                           on_events=lambda evs: self._forward(job, evs, ids, lambda: self._new_id(kind, taken)),
                           speculator=speculator_for(s, getattr(s.engine, "mtp_draft", 0)))
        n = out.n_tokens
        self.w.count(generated=n)
        job.trace.update(gen_tokens=n, gen_s=round(out.elapsed, 3), output=stream.text,
                         mtp_drafted=out.drafted, mtp_accepted=out.accepted)
        if out.cancelled:
            self._keep_bindings(())
            raise Cancelled()
        res = stream.result
        calls = [E.CallOut(i, ids.get(i) or self._new_id(kind, taken), c.name, c.arguments_json,
                           dict(c.arguments)) for i, c in enumerate(res.tool_calls)]
        fin = self._finish_reason(job, res.finish_reason, out)
        self._remember(job, res, calls, fin)
        if fin == "tool_calls" and calls and self.w.memory is None and job.api in ("openai_chat", "anthropic"):
            self._canonicalize(job, res, calls, usage.prompt_tokens)
        content, reasoning = res.content, res.reasoning if thinking else None
        if job.api == "openai_completions":      # raw text, reasoning and </think> included (§2.6)
            content, reasoning = stream.text, None
        job.emit(E.Finish(fin, content, reasoning, tuple(calls),
                          E.Usage(usage.prompt_tokens, usage.cached_tokens, n),
                          reasoning_closed=not thinking or "</think>" in stream.text,
                          stop_sequence=stream.stop_hit))
        return fin

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

    def _canonicalize(self, job: "Job", res, calls: list[E.CallOut], prompt_n: int):
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
        with self.w.lock:
            mem = self.w.memory

            class _Taken:
                def __contains__(_, x):
                    return x in taken or (mem is not None and x in mem)

            tid = new_tool_id(kind, _Taken())
        taken.add(tid)
        return tid

    def _remember(self, job: "Job", res, calls: list[E.CallOut], finish: str):
        """Tool memory (§6.2) and the live bindings for the next request (§7.3)."""
        s = self.session
        r = job.rendered
        new: dict[str, Binding] = {}
        if finish == "tool_calls" and calls and self.w.memory is not None and res.dsml:
            with self.w.lock:
                for c in calls:
                    try:
                        self.w.memory.remember(c.id, res.dsml)
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
        with self.w.lock:
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
