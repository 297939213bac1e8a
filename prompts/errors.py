"""Request errors with the message and HTTP status ds4-server answers (protocol.md §5.1)."""
from __future__ import annotations

import json
import re

from .jsonspan import Cursor, JSONBad, json_escape

__all__ = ["RequestError", "ContextLengthError", "INVALID_JSON", "field_problem"]

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


_EXPECTED = {"'['": "an array", "'{'": "an object", "a string": "a string", "a number": "a number",
             "a boolean": "a boolean"}
_FOUND = {'"': "a string", "[": "an array", "{": "an object", "t": "a boolean", "f": "a boolean",
          "n": "null"}


def field_problem(text: str, start: int, key: str, e: JSONBad) -> str:
    """The message for a top-level field whose value the parser refused (issue 35 item 12):
    ds4's bare "invalid JSON request" where the value is not JSON at all, else that message
    naming the field and what was expected there, e.g. `{"messages":"x"}` ->
    `invalid JSON request: field "messages" must be an array, not a string`."""
    probe = Cursor(text, start)
    try:
        probe.skip()
    except JSONBad:
        return INVALID_JSON                 # broken JSON: no field to blame
    probe = Cursor(text, start)
    probe.ws()
    name = json.dumps(key[:64])
    m = re.fullmatch(r"expected (.+) at offset (\d+)", str(e))
    if not m:
        whole = re.fullmatch(r"(\w+) is not (an? [\w ]+)", str(e))
        if whole and whole.group(1) == key:     # the parsers' own words for the whole value
            return f"{INVALID_JSON}: field {name} must be {whole.group(2)}, not {_found(text, probe.i)}"
        return f"{INVALID_JSON}: in field {name}: {str(e)[:200]}"
    want, at = _EXPECTED.get(m.group(1), m.group(1)), int(m.group(2))
    found = _found(text, at)
    if at == probe.i:
        return f"{INVALID_JSON}: field {name} must be {want}, not {found}"
    return f"{INVALID_JSON}: in field {name}: expected {want} at offset {at}, found {found}"


def _found(text: str, at: int) -> str:
    c = text[at:at + 1]
    return _FOUND.get(c, "a number" if c and c in "+-.0123456789iInN" else "something else")

