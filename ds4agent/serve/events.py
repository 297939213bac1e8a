"""What the inference worker reports for one request, in order (the wire modules turn these into
each API's JSON and SSE):

    Prefill*  (progress while the prompt is prefilled; the app sends SSE keep-alives meanwhile)
    Begin     (the prompt is in the KV: usage known, tokens follow)
    Reasoning* / Text* / ToolStart, ToolArgs*, ToolEnd ...   (interleaved as sampled)
    Finish    (always last on success)
or, at any point before Finish:
    Failure   (nothing more follows)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

__all__ = ["Usage", "Prefill", "Begin", "Reasoning", "Text", "ToolStart", "ToolArgs", "ToolEnd",
           "CallOut", "Finish", "Failure", "Event", "FINISHES"]

# finish reasons, as ds4 names them internally; each wire maps them to its API's words
FINISHES = ("stop", "length", "tool_calls", "error")


@dataclass(frozen=True)
class Usage:
    """prompt_tokens: the effective prompt actually in the KV (may differ a little from the
    canonical tokenization after a text-prefix reuse); cached_tokens: how many of them were
    reused (live session or disk); completion_tokens: sampled tokens, reasoning included, EOS
    excluded."""
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def write_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Prefill:
    done: int
    total: int


@dataclass(frozen=True)
class Begin:
    usage: Usage            # completion_tokens 0
    source: str = "cold"    # how the prompt was reused: memory-token, memory-text, disk-text, ...


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class ToolStart:
    """A tool call is recognised (its invoke tag is complete): the id is final from here on."""
    index: int
    id: str
    name: str               # the name as the model wrote it (a Responses namespace is prefixed)


@dataclass(frozen=True)
class ToolArgs:
    index: int
    text: str               # a fragment of the OpenAI `arguments` string (protocol.md §3.8)


@dataclass(frozen=True)
class CallOut:
    """One parsed call. arguments_json: compact JSON in DSML order (§7.1), "{}" if unparseable."""
    index: int
    id: str
    name: str
    arguments_json: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolEnd:
    call: CallOut


@dataclass(frozen=True)
class Finish:
    """finish: stop | length | tool_calls | error. reasoning is None when the turn had no
    thinking; reasoning_closed tells whether `</think>` was sampled. content is the final text
    (after a recovered malformed block: the raw text, which may extend what was streamed)."""
    finish: str
    content: str
    reasoning: str | None
    calls: tuple[CallOut, ...]
    usage: Usage
    reasoning_closed: bool = True
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Failure:
    """The request failed. status: the HTTP status when nothing was sent yet (409 lost live tool
    state, 400 context full, 500 prefill failure, 503 shutting down); after SSE headers it becomes
    the API's error event. n_prompt/n_ctx: set when the prompt did not fit the context (each API
    then has its own context-length error). interrupted: the server is stopping and cut the
    answer (each API's way of ending an answer that did not complete)."""
    message: str
    status: int = 500
    n_prompt: int | None = None
    n_ctx: int | None = None
    interrupted: bool = False

    @property
    def context_full(self) -> bool:
        return self.n_ctx is not None


Event = Union[Prefill, Begin, Reasoning, Text, ToolStart, ToolArgs, ToolEnd, Finish, Failure]
