"""The wire format layer: the worker's events (events.py) -> each API's JSON bodies and SSE frames.

One `Wire` per request, made by `make_wire`. It is pure: no I/O, no clock, no randomness
beyond the ids it mints. The app sends what `frames(ev)` returns for each event of a streaming
request, `body(fin)` for a non-streaming one, and `error_frames(msg)` for a failure after the
SSE headers went out. Shapes follow protocol.md §5.1-§5.8; where this layer deliberately
differs from ds4 the subclass module says so in its docstring.

This module holds the error bodies and picks the per-API subclass; the encoder and the base
class live in wire_common.py (re-exported here), which the subclasses import, so the imports
among the wire modules point one way.
"""
from __future__ import annotations

from .wire_anthropic import AnthropicWire
from .wire_chat import ChatWire, CompletionsWire
from .wire_common import Raw, Wire, clean, context_error_body, dumps, raw_object, sse
from .wire_responses import ResponsesWire

__all__ = ["Wire", "make_wire", "error_body", "context_error_body", "dumps", "clean", "sse",
           "Raw", "raw_object", "KEEPALIVE", "APIS"]

APIS = ("openai_chat", "openai_completions", "responses", "anthropic")
_WIRES = {"openai_chat": ChatWire, "openai_completions": CompletionsWire,
          "responses": ResponsesWire, "anthropic": AnthropicWire}

# What ds4 sends every >= 5 s while a streamed request is still prefilling (§5.0).
KEEPALIVE = ": prefill\n\n"


# ------------------------------------------------------------------------------------------
# Errors (§5.1)

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def error_type(api: str, status: int) -> str:
    """The error `type` word for an HTTP status, in the API's own vocabulary."""
    if api == "anthropic":
        return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(api: str, message: str, status: int = 400, kind: str | None = None) -> str:
    """An error response body. OpenAI APIs: `{"error":{"message":M,"type":T}}`; Anthropic its own
    `{"type":"error","error":{"type":T,"message":M}}` (ds4 uses the OpenAI shape everywhere, but
    the Anthropic SDKs read theirs). `kind` overrides the type derived from `status`."""
    t = kind or error_type(api, status)
    if api == "anthropic":
        return dumps({"type": "error", "error": {"type": t, "message": message}}) + "\n"
    return dumps({"error": {"message": message, "type": t}}) + "\n"


def make_wire(api: str, conv, *, model: str, seq: int, created: int, stream: bool) -> Wire:
    """The Wire for one request. api: openai_chat | openai_completions | responses | anthropic;
    seq: the per-process request counter (chatcmpl-<seq>, cmpl-<seq>); created: unix seconds."""
    cls = _WIRES.get(api)
    if cls is None:
        raise ValueError(f"unknown api {api!r}")
    return cls(conv, model=model, seq=seq, created=created, stream=stream)
