"""The one generation loop of the agent and the shim: sample (greedy inside DSML syntax), evaluate
every token into the live Session, feed it to the DsmlStream, stop at EOS, the stream's end (a
closed tool block, a stop string), the token limit, a full context or the caller's stop flag.

What differs between the callers is passed in: the sampling parameters and Rng, the limit, a
forced reply (test hooks: its tokens are evaluated like sampled ones, so the KV state stays
real), a stop flag (the agent's Esc, a client that left), a hook run before each token (the
shim's continued disk checkpoint) and the sink of the stream's events.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from engine import ContextFull, Rng, SamplingParams, Session
from prompts import DsmlStream

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class GenerationResult:
    n_tokens: int        # tokens evaluated into the session (forced ones included, EOS not)
    finish: str          # "stop": EOS, a forced text's end, or the stream is done (closing tag,
    #                      stop string); "length": the limit or the context; "cancelled": should_stop
    elapsed: float       # seconds in the loop, the stream's finish included
    drafted: int = 0     # with MTP (generation_mtp.py): drafts proposed, and accepted by the verify
    accepted: int = 0

    @property
    def cancelled(self) -> bool:
        return self.finish == "cancelled"


def _never() -> bool:
    return False


def _drop(_events) -> None:
    return None


def generate(session: Session, stream: DsmlStream, *, sampling: SamplingParams, rng: Rng,
             limit: int, eos_id: int, token_bytes: Callable[[int], bytes],
             forced: Iterable[int] | None = None,
             should_stop: Callable[[], bool] = _never,
             before_token: Callable[[], None] | None = None,
             on_events: Callable[[list], None] | None = None, speculator=None) -> GenerationResult:
    """Generate at most `limit` tokens. `forced`: these tokens instead of sampling, ending as if
    EOS had been sampled (the rng is not drawn). `should_stop` is asked before each token;
    `before_token` runs after it, before the token is chosen; `on_events` gets the events of each
    fed token, then those of the stream's finish (told "length" when sampling was cut: the limit,
    the context or a stop, so a half-written tool block reads as cut, not as finished).
    `speculator`: an engine.Speculator (MTP): several tokens a main-model pass, the same output
    (`before_token` then runs once a step)."""
    todo = list(forced) if forced is not None else None
    on_events = on_events or _drop
    if speculator is not None and todo is None:     # MTP (ds4agent/generation_mtp.py): the same tokens
        from .generation_mtp import generate_speculative
        return generate_speculative(session, stream, speculator, sampling=sampling, greedy=GREEDY, rng=rng,
                                    limit=max(0, limit), eos_id=eos_id, token_bytes=token_bytes,
                                    should_stop=should_stop, before_token=before_token, on_events=on_events,
                                    result=GenerationResult)
    n, finish = 0, "length"
    t0 = time.perf_counter()
    for _ in range(max(0, limit)):
        if should_stop():
            finish = "cancelled"
            break
        if before_token is not None:
            before_token()
        if todo is not None:
            if not todo:
                finish = "stop"
                break
            t = todo.pop(0)
        else:
            t = session.sample(GREEDY if stream.in_dsml_syntax else sampling, rng)
        if t == eos_id:
            finish = "stop"
            break
        try:
            session.eval(t)
        except ContextFull:
            break
        n += 1
        on_events(stream.feed(token_bytes(t)))
        if stream.done:
            finish = "stop"
            break
    on_events(stream.finish(None if finish == "stop" else "length"))
    return GenerationResult(n, finish, time.perf_counter() - t0)
