"""The shim's request edge: what every request must pass before anything parses or runs it.

* Host: only loopback names (localhost, 127.0.0.0/8, ::1) and the name or address given to
  `--host`; any Host when bound to all interfaces (0.0.0.0, ::). A DNS-rebinding page reaches a
  loopback server under its own name (`Host: rebind.evil.example`): refusing foreign names keeps
  its script from reading answers.
* Origin: without `--cors`, a browser request from another origin (an `Origin` header that is
  not this server's, or `Sec-Fetch-Site: cross-site/same-site`) is refused before it can start a
  generation (a `text/plain` POST needs no CORS preflight). SDKs and agent CLIs send neither.
* Body size: a declared Content-Length over the limit is refused before reading; the app counts
  the bytes of a chunked body as they arrive.
* Text: the body must be UTF-8 and its JSON strings whole Unicode characters (no lone UTF-16
  surrogate escape such as `\\ud800`): such a string cannot be written as UTF-8, so it can reach
  neither the tokenizer nor a stop-string matcher. The OpenAI and Anthropic services refuse such
  bodies too. JSON nested in a string (a tool call's `arguments`) is only decoded when the
  prompt is rendered: `rendered_text_problem` checks the rendered text for the same reason.

Every refusal is a JSON error in the shape of the API the path belongs to.
"""
from __future__ import annotations

import ipaddress
import re
import socket

from .config import MAX_BODY_BYTES, ServeConfig
from .wire import error_body

__all__ = ["EdgeGuard", "api_for_path", "host_allowed", "origin_allowed", "text_problem", "rendered_text_problem",
           "exposure_warning", "ALL_INTERFACES"]

ALL_INTERFACES = ("0.0.0.0", "::", "", "0:0:0:0:0:0:0:0", "[::]")
_NUMERIC_V4 = re.compile(r"[0-9a-fx.]+")
_ANTHROPIC_PREFIX = "/v1/messages"


def api_for_path(path: str) -> str:
    """The API whose error shape a path gets: Anthropic's under /v1/messages, else OpenAI's."""
    p = path.rstrip("/")
    if p == _ANTHROPIC_PREFIX or p.startswith(_ANTHROPIC_PREFIX + "/"):
        return "anthropic"
    return {"/v1/completions": "openai_completions", "/v1/responses": "responses"}.get(p, "openai_chat")


# ------------------------------------------------------------------------------------------
# Host

def _host_name(host: str) -> str | None:
    """The name of a Host header value (`name[:port]`, `[v6][:port]`), lowercased, without one
    trailing dot; None when it is not a well-formed host."""
    h = host.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        rest = h[end + 1:] if end > 0 else "?"
        if rest and not (rest[0] == ":" and rest[1:].isdigit()):
            return None
        return h[1:end]
    name, sep, port = h.partition(":")
    if ":" in port or (sep and not port.isdigit()):
        return None
    return name[:-1] if name.endswith(".") else name


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        if not _NUMERIC_V4.fullmatch(name):
            return False
        try:    # the resolver's IPv4 forms (127.1, 0x7f.0.0.1): numbers, never a DNS name
            addr = ipaddress.ip_address(socket.inet_aton(name))
        except (OSError, ValueError):
            return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def host_allowed(host: str | None, bind: str) -> bool:
    """Whether a request's Host header names this server. `bind` is the `--host` value."""
    if bind.strip().lower() in ALL_INTERFACES:
        return True
    if host is None:            # HTTP/1.0 without Host: not a browser, nothing to rebind
        return True
    name = _host_name(host)
    if name is None:
        return False
    if _is_loopback(name):
        return True
    own = _bind_name(bind)
    return own is not None and _canon(name) == _canon(own)


def _bind_name(bind: str) -> str | None:
    b = bind.strip().lower()
    if b.count(":") > 1 and not b.startswith("["):
        return b                # a bare IPv6 --host value
    return _host_name(b)


def _canon(name: str) -> str:
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name


# ------------------------------------------------------------------------------------------
# Origin

def _default_port(netloc: str, scheme: str) -> str:
    """`netloc` with the scheme's default port dropped (browsers omit it in both headers)."""
    default = {"http": ":80", "https": ":443"}.get(scheme)
    return netloc[:-len(default)] if default and netloc.endswith(default) else netloc


def origin_allowed(origin: str | None, fetch_site: str | None, host: str | None, cors: bool) -> bool:
    """Whether a request may come from where the browser says it comes from. With `--cors`
    every origin may; without it only requests with no Origin (non-browser clients) or this
    server's own origin."""
    if cors:
        return True
    if fetch_site is not None and fetch_site.strip().lower() in ("cross-site", "same-site"):
        return False
    if origin is None:
        return True
    o = origin.strip().lower()
    scheme, sep, netloc = o.partition("://")
    if not sep or scheme not in ("http", "https") or host is None or "/" in netloc:
        return False            # includes "null" (sandboxed frames, file: pages)
    return _default_port(netloc, scheme) == _default_port(host.strip().lower(), scheme)


# ------------------------------------------------------------------------------------------
# Text

# A run of backslashes then `u` and a surrogate code unit: an escape when the run is odd.
_SURROGATE_ESCAPE = re.compile(r"(\\+)u([dD][89a-fA-F][0-9a-fA-F]{2})")


def text_problem(body: bytes) -> str | None:
    """Why a request body cannot be taken as text, or None: bytes that are not UTF-8, or a JSON
    string escape that is half of a UTF-16 surrogate pair without its other half."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"invalid JSON request: the body is not valid UTF-8 (byte 0x{body[e.start]:02x} "
                f"at offset {e.start})")
    pending = None             # a high-surrogate escape whose low half must follow at once
    for m in _SURROGATE_ESCAPE.finditer(text):
        if len(m.group(1)) % 2 == 0:
            continue           # `\\ud800`: an escaped backslash, then plain text
        unit = int(m.group(2), 16)
        if pending is not None:
            if unit >= 0xDC00 and m.start() == pending.end() and len(m.group(1)) == 1:
                pending = None
                continue
            return _lone(text, pending)
        if unit >= 0xDC00:
            return _lone(text, m)
        pending = m
    return _lone(text, pending) if pending is not None else None


_SURROGATE = re.compile("[\ud800-\udfff]")


def rendered_text_problem(text: str) -> str | None:
    """Why a rendered prompt cannot be tokenized, or None: a lone surrogate that `text_problem`
    could not see because it was escaped twice, in JSON inside a JSON string (a tool call's
    `arguments` string holding the six characters backslash, u, d, 8, 0, 0). Such arguments are
    decoded only when the prompt is rendered, and the tokenizer then failed (a 500)."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    return (f"invalid JSON request: a string nested in the request (a tool call's arguments) holds "
            f"\\u{ord(m.group()):04x}, half of a UTF-16 surrogate pair without its other half "
            f"(not a Unicode character)")


def _lone(text: str, m: re.Match) -> str:
    at = len(text[:m.start(1) + len(m.group(1)) - 1].encode("utf-8"))
    return (f"invalid JSON request: \\u{m.group(2).lower()} at offset {at} is half of a UTF-16 "
            f"surrogate pair without its other half (not a Unicode character)")


# ------------------------------------------------------------------------------------------
# Start-up

def exposure_warning(cfg: ServeConfig) -> str | None:
    """The warning for a server reachable from other machines with no API key."""
    if cfg.api_key:
        return None
    bind = cfg.host.strip().lower()
    name = _bind_name(bind)
    if bind not in ALL_INTERFACES and name is not None and _is_loopback(name):
        return None
    where = "all interfaces" if bind in ALL_INTERFACES else cfg.host
    # on all interfaces any Host name is accepted, so a web page can reach it by DNS rebinding
    browsers = " (web pages too, through DNS rebinding)" if bind in ALL_INTERFACES else ""
    return (f"warning: serving on {where} without --api-key: anyone who can reach this port{browsers} "
            f"can run the model and read its answers (add --api-key KEY, or bind to 127.0.0.1)")


# ------------------------------------------------------------------------------------------
# The ASGI layer

class EdgeGuard:
    """ASGI middleware: Host, Origin and a declared body size are checked on the headers alone,
    so a refused request is never parsed, queued or generated."""

    def __init__(self, app, cfg: ServeConfig, cors_headers: dict):
        self.app = app
        self.cfg = cfg
        self.cors_headers = cors_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host")
        refusal = None
        if not host_allowed(host, self.cfg.host):
            refusal = (403, f"Host {host!r} is not a name of this server (DNS rebinding "
                            f"protection); start with --host NAME to serve it under that name")
        elif not origin_allowed(headers.get("origin"), headers.get("sec-fetch-site"), host,
                                self.cfg.cors):
            refusal = (403, f"cross-origin request from {headers.get('origin') or 'another site'} "
                            f"refused: browsers are answered only with --cors")
        else:
            n = headers.get("content-length", "").strip()
            if n.isdigit() and int(n) > MAX_BODY_BYTES:
                refusal = (413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        if refusal is None:
            return await self.app(scope, receive, send)
        status, message = refusal
        body = error_body(api_for_path(scope.get("path", "")), message, status).encode("utf-8")
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 413:
            out.append((b"connection", b"close"))     # the unread body must not be parsed as a request
        if self.cfg.cors:
            out += [(k.lower().encode(), v.encode()) for k, v in self.cors_headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body",
                    "body": b"" if scope.get("method") == "HEAD" else body})
