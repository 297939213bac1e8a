"""Request errors with the message and HTTP status ds4-server answers (protocol.md §5.1)."""
from __future__ import annotations

from .jsonspan import json_escape

__all__ = ["RequestError", "ContextLengthError", "INVALID_JSON"]

INVALID_JSON = "invalid JSON request"


class RequestError(ValueError):
    """A request ds4 would refuse. `message` is the API's error text, `status` the HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status

    def body(self, api: str | None = None) -> str:
        """The response body ds4 sends: the same shape for every API, newline-terminated."""
        return '{"error":{"message":' + json_escape(self.message) + ',"type":"invalid_request_error"}}\n'


class ContextLengthError(RequestError):
    """The tokenized prompt does not leave one free slot (`n_prompt >= n_ctx`). `at_least`: the
    prompt was refused before all of it was tokenized, and n_prompt_tokens is a lower bound."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int, at_least: bool = False):
        super().__init__(f"Prompt has {'at least ' if at_least else ''}{n_prompt_tokens} tokens, "
                         f"but the configured context size is {n_ctx} tokens", 400)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def body(self, api: str | None = None) -> str:
        tail = f',"n_prompt_tokens":{self.n_prompt_tokens},"n_ctx":{self.n_ctx}}}}}\n'
        if api == "anthropic":
            return ('{"type":"error","error":{"type":"invalid_request_error","message":'
                    + json_escape(self.message) + tail)
        param = {"responses": "input", "openai_completions": "prompt"}.get(api or "", "messages")
        return ('{"error":{"message":' + json_escape(self.message)
                + ',"type":"invalid_request_error","param":' + json_escape(param)
                + ',"code":"context_length_exceeded"' + tail)
