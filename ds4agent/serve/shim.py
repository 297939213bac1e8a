"""The shim's request side: a raw request body -> a rendered, tokenized Job for the worker, with
the exact DSML blocks of earlier tool calls looked up by id, and ds4's refusals as RequestError.
Runs on the app's thread pool (tokenizing a 100 KB prompt takes tens of milliseconds), never on
the inference thread.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time

import prompts
from engine import Engine, SamplingParams
from prompts import ContextLengthError, ToolCall, ToolMemory, render_request, render_tool_calls
from prompts.messages import body_text
from sessions.prefix_cache import PrefixCache

from .config import DEFAULT_MODEL_ID, MODEL_ALIASES, ServeConfig
from .edge import rendered_text_problem, text_problem
from .worker import Job, Worker

log = logging.getLogger("ds4agent.serve")


class Shim:
    """Everything behind the HTTP routes: the engine, the worker, tool memory and the disk cache."""

    def __init__(self, engine: Engine, cfg: ServeConfig, *, model_name: str | None = None):
        self.engine = engine
        self.cfg = cfg
        self.model_name = model_name or DEFAULT_MODEL_ID
        memory = ToolMemory(cfg.tool_memory_max_ids) if cfg.exact_replay else None
        cache = None
        if cfg.kv_disk_dir:
            cache = PrefixCache(
                cfg.kv_disk_dir, space_mb=cfg.kv_disk_space_mb, min_tokens=cfg.kv_cache_min_tokens,
                cold_max_tokens=cfg.kv_cache_cold_max_tokens,
                continued_interval=cfg.kv_cache_continued_interval_tokens,
                boundary_trim=cfg.kv_cache_boundary_trim_tokens,
                boundary_align=cfg.kv_cache_boundary_align_tokens,
                reject_different_quant=cfg.kv_cache_reject_different_quant,
                log=lambda m: log.info("%s", m), warn=lambda m: log.warning("%s", m))
        self.worker = Worker(engine, cfg, memory=memory, cache=cache)
        self._seq = itertools.count(1)
        self._trace_lock = threading.Lock()

    def start(self):
        self.worker.start()

    def stop(self):
        self.worker.stop()

    def next_seq(self) -> int:
        return next(self._seq)

    # -- request -> job ------------------------------------------------------------------------
    def prepare(self, api: str, body: bytes, emit) -> Job:
        """Parse, render and tokenize. Raises RequestError (ds4's 4xx) for what cannot run."""
        # text that is not Unicode can be neither tokenized nor matched as a stop word: a 400
        # before parsing (a body given as str or dict may hold lone surrogates as characters)
        raw = body if isinstance(body, (bytes, bytearray)) else \
            body_text(body).encode("utf-8", "surrogatepass")
        problem = text_problem(bytes(raw))
        if problem:
            raise prompts.RequestError(problem)
        raw = None
        w = self.worker
        replay = _Replay(w) if w.memory is not None else None
        r = render_request(api, body, self.cfg.ctx, live_call_ids=w.live_call_ids(api), replay=replay)
        problem = rendered_text_problem(r.text)     # JSON nested in a string (tool arguments)
        if problem:
            raise prompts.RequestError(problem)
        conv = r.conversation
        tokens = self._tokens(r.text)
        p = conv.params
        sampling = SamplingParams(
            temperature=float(p.get("temperature", 1.0)), top_k=int(p.get("top_k", 0)),
            top_p=float(p.get("top_p", 1.0)), min_p=float(p.get("min_p", 0.05)))
        cap = self.cfg.max_tokens
        want = p.get("max_tokens")
        max_tokens = self.cfg.ctx if want is None else max(0, int(want))
        capped = cap is not None and cap < max_tokens
        if capped:
            max_tokens = cap
        job = Job(api=api, rendered=r, tokens=tokens, sampling=sampling, max_tokens=max_tokens,
                  stop=[s for s in p.get("stop", []) if s], emit=emit, seed=int(p.get("seed", 0) or 0),
                  forced=self._forced_tool_call(r), server_capped=capped)
        job.trace.update(api=api, model=conv.model, think_mode=r.think_mode, stream=bool(p.get("stream")),
                         prompt_text=r.text)
        return job

    def _tokens(self, text: str) -> list[int]:
        """The prompt's tokens, or ContextLengthError without tokenizing it all. Each token
        stands for at most `max_token_bytes` bytes of UTF-8, so a text longer than
        (ctx - 1) * max_token_bytes bytes has at least ctx tokens: refused without tokenizing.
        Else the tokenizer stops once it has shown ctx tokens (memory and time then follow ctx,
        not the body, also on text with no newline or space to cut it at: issue 32 item 5)."""
        ctx = self.cfg.ctx
        tok = self.engine.tokenizer
        per = tok.max_token_bytes
        if per:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > (ctx - 1) * per:
                raise ContextLengthError(-(-size // per), ctx, at_least=True)
        tokens, complete = tok.encode_upto(text, ctx)
        if not complete or len(tokens) >= ctx:
            # not complete: at least ctx tokens were shown, maybe fewer of them listed
            raise ContextLengthError(max(len(tokens), ctx), ctx, at_least=not complete)
        return tokens

    def model_for(self, conv) -> str:
        return conv.model if conv is not None and conv.model else self.model_name

    def _forced_tool_call(self, r) -> str | None:
        """Test hook (--test-forced-tool-call): the first prompt of a conversation that offers one
        of the named tools is answered with a canonical call of it instead of sampled text."""
        forced = self.cfg.forced_tool_calls
        conv = r.conversation
        if not forced or not r.has_tools or conv is None or not conv.messages:
            return None
        last = next((m for m in reversed(conv.messages) if m.role not in ("system", "developer")), None)
        if last is None or last.role != "user":
            return None
        if any(m.tool_calls or m.result_ids() for m in conv.messages):
            return None          # once per conversation: the reply to the tool result is sampled
        offered = set()
        for line in conv.tools_active:
            try:
                name = json.loads(line).get("name")
            except (ValueError, AttributeError):
                continue
            if isinstance(name, str):
                offered.add(name)
        for name, args in forced.items():
            if name in offered:
                block = render_tool_calls([ToolCall(None, name, json.dumps(args))])
                head = "Calling the tool." + prompts.render.THINK_CLOSE if r.think_mode != "none" else ""
                return head + block
        return None

    # -- trace -------------------------------------------------------------------------------
    def trace(self, record: dict):
        path = self.cfg.trace
        if not path:
            return
        record = dict(record, time=round(time.time(), 3))
        line = json.dumps(record, ensure_ascii=False, default=str)
        line = line.encode("utf-8", "replace").decode("utf-8") + "\n"
        with self._trace_lock:
            try:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError as e:
                log.warning("trace: cannot write %s: %s", path, e)

    def models(self) -> list[dict]:
        ctx = self.cfg.ctx
        max_out = min(self.cfg.max_tokens or ctx, ctx)
        out = []
        for mid in (self.model_name,) + tuple(a for a in MODEL_ALIASES if a != self.model_name):
            out.append({"id": mid, "object": "model", "created": 1767225600, "owned_by": "ds4-agent",
                        "name": "DeepSeek V4 Flash", "context_length": ctx,
                        "top_provider": {"context_length": ctx, "max_completion_tokens": max_out,
                                         "is_moderated": False},
                        "supported_parameters": ["tools", "tool_choice", "max_tokens", "temperature",
                                                 "top_p", "top_k", "min_p", "stop", "seed", "stream",
                                                 "reasoning_effort"]})
        return out


class _Replay:
    """id -> exact sampled DSML block for one request: RAM tool memory first; on the first miss
    every disk checkpoint's tool map is read once (ds4 scans the trailers for each request)."""

    def __init__(self, worker: Worker):
        self.w = worker
        self._disk: dict | None = None

    def get(self, tool_id: str) -> str | None:
        w = self.w
        with w.lock:
            block = w.memory.get(tool_id)
        if block is not None or w.cache is None or not tool_id:
            return block
        if self._disk is None:
            self._disk = w.disk_tool_maps()
        block = self._disk.get(tool_id)
        if block is not None:
            with w.lock:
                w.memory.remember(tool_id, block, "disk")
        return block


__all__ = ["Shim"]
