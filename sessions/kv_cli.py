"""`ds4-kv`: inspect and validate ds4 KV cache files (spec/kvcache.md §2-3).

  ds4-kv FILE [FILE...] [-m MODEL]

For each file: the KVC header fields, the cached text (size and a one-line preview), the tool-id
map, the file size against the size its header promises, and whether the file is valid. Without a
model the checks are structural (everything `read_kv` checks before it touches a session, plus the
DSV4 payload header); with `-m MODEL` the payload is also loaded into a Session of that model (ctx =
the header's context), which validates every count and byte length against the model.

A FIFO or device is reported, never opened (it would block or have side effects); a symlink named
on the command line is followed (the user chose it), unlike links inside a cache folder. With a
model, the payload's token ids must spell the file's text (kvfile.check_payload_text).

Exit status 0 when every file is valid, 1 otherwise. A bad file's report ends `invalid` (as a good
one's ends `valid`) and its problem is said once, on stderr: `error: FILE: problem` (it was on
both before). Never a traceback; a reader that goes away (`| head`) ends it quietly
(engine/console.py).
"""
from __future__ import annotations

import argparse
import os
import re
import struct
import sys
from datetime import datetime, timezone

from engine.console import console_main

from . import safeio
from .kvfile import (FLAG_RESPONSES_KEY, FLAG_THINKING_KEY, FLAG_TOOL_MAP, PREFIX_BYTES,
                     KVFileError, KVHeader, decode_tool_map, read_header, read_kv, routed_quant_bits,
                     sha1_name)

PAYLOAD_HEADER = struct.Struct("<13I")
PAYLOAD_MAGIC, PAYLOAD_VERSION = 0x34565344, 1
CACHE_NAME = re.compile(r"^[0-9a-fA-F]{40}\.kv$")
PREVIEW_CHARS = 100
MAX_IDS_SHOWN = 20


# -- formatting ----------------------------------------------------------------------------------
def utc(ts: int) -> str:
    try:
        return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return f"{ts} (out of range)"


def flag_names(flags: int) -> str:
    names = []
    if flags & FLAG_TOOL_MAP:
        names.append("tool-id map")
    if flags & FLAG_RESPONSES_KEY:
        names.append("responses-visible key")
    if flags & FLAG_THINKING_KEY:
        names.append("thinking-visible key")
    other = flags & ~(FLAG_TOOL_MAP | FLAG_RESPONSES_KEY | FLAG_THINKING_KEY)
    if other:
        names.append(f"unknown bits {other:#04x}")
    return ", ".join(names) or "none"


def escape(s: str) -> str:
    """One printable line: control characters and backslashes escaped, everything else (the
    ｜-markers, ▁, any printable Unicode) kept as is."""
    out = []
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ch == '"':
            out.append('\\"')
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)


def preview(text: bytes, n: int = PREVIEW_CHARS) -> str:
    s = text.decode("utf-8", "backslashreplace")
    more = len(s) > n
    return '"' + escape(s[:n]) + '"' + ("…" if more else "")


# -- structural checks (no model) ----------------------------------------------------------------
def trailer_bytes(buf: bytes) -> int:
    """Length of a KTM section that decode_tool_map accepted."""
    (n,) = struct.unpack_from("<I", buf, 4)
    p = 8
    for _ in range(n):
        il, dl = struct.unpack_from("<II", buf, p)
        p += 8 + il + dl
    return p


def check_payload_header(path: str, h: KVHeader, head: bytes) -> tuple:
    """The DSV4 payload header, checked against the KVC header (what read_kv checks first)."""
    if len(head) < PAYLOAD_HEADER.size:
        raise KVFileError(path, f"payload is {len(head)} bytes, shorter than its {PAYLOAD_HEADER.size}-byte header")
    f = PAYLOAD_HEADER.unpack_from(head)
    magic, version, ctx, _pcap, raw_cap, raw_window, _ccap, T, n_layer, hd, ihd, vocab, R = f
    if magic != PAYLOAD_MAGIC:
        raise KVFileError(path, f"payload: not a DSV4 session payload (magic {magic:#x})")
    if version != PAYLOAD_VERSION:
        raise KVFileError(path, f"payload: unsupported payload version {version}")
    if T != h.tokens:
        raise KVFileError(path, f"KV payload token count mismatch (header {h.tokens}, payload {T})")
    if T >= ctx:
        raise KVFileError(path, f"payload: holds {T} tokens, its context is {ctx}")
    if R != min(T, raw_window) or raw_cap == 0 or R > raw_cap:
        raise KVFileError(path, f"payload: raw row count {R} does not match its {T} tokens")
    # the smallest body these fields allow (frontiers and compressed rows need the model's ratios)
    least = PAYLOAD_HEADER.size + 4 * T + 4 * vocab + 8 * n_layer + 4 * n_layer * R * hd
    if h.payload_bytes < least:
        raise KVFileError(path, f"payload: {h.payload_bytes} bytes, its header needs at least {least}")
    return f


# -- one file ------------------------------------------------------------------------------------
def report(path: str, engine=None, out=print) -> str | None:
    """Print what `path` holds; returns None if it is valid, else the error message."""
    out(path)
    if os.path.islink(path):        # a link named on the command line is the user's to follow
        path = os.path.realpath(path)
    try:
        h, size = read_header(path)
    except KVFileError as e:
        out("  invalid")              # the problem: the caller's one error line
        return str(e)
    try:
        return _report(path, h, size, engine, out)
    except KVFileError as e:
        out("  invalid")
        return str(e)
    except MemoryError:
        msg = f"{path}: not enough memory to load the payload"
    except Exception as e:  # never a traceback: anything unexpected is still one error line
        msg = f"{path}: {type(e).__name__}: {e}"
    out("  invalid")
    return msg


def _report(path: str, h: KVHeader, size: int, engine, out) -> str | None:
    out(f"  header:    KVC v{h.version}, {h.quant_bits}-bit routed experts, reason {h.reason_name}, "
        f"flags {h.flags:#04x} ({flag_names(h.flags)}), key {h.key_kind}")
    out(f"  tokens:    {h.tokens}   hits: {h.hits}   context: {h.ctx}")
    out(f"  created:   {utc(h.created_at)}   last used: {utc(h.last_used)}")
    with safeio.open_regular(path) as f:     # never a FIFO swapped in since read_header
        f.seek(PREFIX_BYTES)
        text = f.read(h.text_bytes)
        phead = f.read(min(h.payload_bytes, PAYLOAD_HEADER.size))
        trailer = b""
        if h.flags & FLAG_TOOL_MAP:
            f.seek(PREFIX_BYTES + h.text_bytes + h.payload_bytes)
            trailer = f.read()
    if len(text) != h.text_bytes:
        raise KVFileError(path, "truncated cached text")
    name = os.path.basename(path)
    if not CACHE_NAME.match(name):
        name_note = "not a cache-entry name (<sha1>.kv), not checked"
    elif name.lower() == sha1_name(text):
        name_note = "matches the text's SHA-1"
    else:
        name_note = None
    pl = ""
    try:
        fields = check_payload_header(path, h, phead)
        ctx, n_layer, hd, ihd, vocab, R = (fields[i] for i in (2, 8, 9, 10, 11, 12))
        pl = (f" (DSV4 v1: context {ctx}, {n_layer} layers, head dim {hd}, indexer head dim {ihd}, "
              f"vocab {vocab}, {R} raw rows per layer)")
    finally:
        out(f"  payload:   {h.payload_bytes} bytes{pl}")
        out(f"  text:      {h.text_bytes} bytes: {preview(text)}")
        if name_note:
            out(f"  name:      {name_note}")
    if name_note is None:
        raise KVFileError(path, f"file name does not match the SHA-1 of its text ({sha1_name(text)})")

    expected = PREFIX_BYTES + h.text_bytes + h.payload_bytes
    if h.flags & FLAG_TOOL_MAP:
        tool_map = decode_tool_map(path, trailer)
        expected += trailer_bytes(trailer)
        ids = list(tool_map)
        shown = ", ".join(escape(i) for i in ids[:MAX_IDS_SHOWN])
        if len(ids) > MAX_IDS_SHOWN:
            shown += f", … (+{len(ids) - MAX_IDS_SHOWN} more)"
        out(f"  tool ids:  {len(ids)}" + (f": {shown}" if ids else ""))
    else:
        out("  tool ids:  none (no tool-id map)")
    extra = size - expected
    note = "" if not extra else f" ({extra} bytes after the {'tool-id map' if h.flags & FLAG_TOOL_MAP else 'payload'})"
    out(f"  size:      {size} bytes, expected {expected}{note}")
    if extra and not h.flags & FLAG_TOOL_MAP:
        raise KVFileError(path, f"{extra} trailing bytes after the payload and no tool-id map flag")

    if engine is None:
        out("  valid (structure; pass -m MODEL to load the payload)")
        return None
    from engine import Session
    limit = engine.config.context_length
    if h.ctx < 2 or (limit and h.ctx > limit):
        raise KVFileError(path, f"context {h.ctx} in the header is outside 2..{limit or 'any'} for this model")
    session = Session(engine, h.ctx)
    read_kv(path, session)
    out(f"  valid (loaded into a {h.ctx}-token session of the {routed_quant_bits(engine)}-bit model: "
        f"{session.pos} tokens)")
    return None


# -- main ----------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from engine.cli_help import ArgumentParser, add_version_flag
    p = ArgumentParser(prog="ds4-kv", description="inspect and validate ds4 KV cache files")
    add_version_flag(p)
    p.add_argument("files", nargs="+", metavar="FILE", help="KV files (<sha1>.kv)")
    p.add_argument("-m", "--model", help="a ds4 GGUF: also load each payload into a session of it")
    return p


@console_main
def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        engine = None
        if a.model:
            from engine import Engine, ModelFileError
            try:
                engine = Engine.open(a.model)
            except (ModelFileError, ValueError, OSError) as e:
                msg = str(e) if str(e).startswith(str(a.model)) else f"{a.model}: {e}"
                print(f"error: {msg}", file=sys.stderr)
                return 1
        bad = 0
        for i, path in enumerate(a.files):
            if i:
                print()
            err = report(path, engine)
            sys.stdout.flush()
            if err is not None:
                bad += 1
                print(f"error: {err}", file=sys.stderr)
        return 1 if bad else 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
