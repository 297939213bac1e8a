"""A saved session's metadata record (`<sha1>.json`): its schema check, its title (ds4's rule),
and the branch ids and pending forks it carries (issue 25).

Branches. A timeline has a branch id (12 lowercase hex digits) fixed for its life, while its
session id (the sha1 of its text) changes on every save. Each record says which branch saved it
(`branch`; records written before branches have none).

Pending forks. `/fork` turns the live timeline into a new branch without changing a token, so the
fork's text is its parent's and, the sha being the text's hash, it cannot be a file of its own
until it diverges. It is recorded on the parent's record instead, as an entry of `forks`
({branch, name, created}): the name resolves to the parent's file with the fork's branch, the
parent is never pruned while it has one (a timeline starts from it), and the fork's first save
of a longer text takes the name and drops the entry. So a fork survives leaving the agent before
it was continued, and the branch point is kept by the same rule as any other.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

META_VERSION = 1
MAX_ANCESTORS = 256
MAX_FORKS = 64                  # pending forks on one record (each is a name and an id)
NAME_MAX = 64
U32_MAX = 0xFFFFFFFF            # token counts and contexts are u32 in the KV header
TIME_MAX = 253402300799.0       # 9999-12-31: a timestamp past it is damage, not a date
SHA_RE = re.compile(r"[0-9a-f]{40}")
BRANCH_RE = re.compile(r"[0-9a-f]{12}")
_STR_FIELDS = ("title", "name", "pinned", "project_dir", "think_mode", "model")
_NO_NUL_FIELDS = ("project_dir", "think_mode", "model")   # used as paths or keys: NUL breaks os calls
_SURROGATE = re.compile("[\ud800-\udfff]")
TITLE_MAX_BYTES = 70
USER_MARK = "<｜User｜>".encode()
ASSISTANT_MARK = "<｜Assistant｜>".encode()


@dataclass(frozen=True)
class Fork:
    """A fork that has no save of its own yet: it is its parent's text under another branch."""
    branch: str
    name: str
    created: float = 0.0


def _is_int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_time(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and 0 <= v <= TIME_MAX)


def bad_text(v: str) -> bool:
    """A lone surrogate (JSON's "\\ud800" decodes to one) cannot be printed or encoded: the
    listing that shows it would raise, so it makes the record damaged."""
    return _SURROGATE.search(v) is not None


def bad_name(name) -> bool:
    return not isinstance(name, str) or len(name) > NAME_MAX or bad_text(name) \
        or any(ord(c) < 32 or ord(c) == 127 for c in name)


def is_branch(v) -> bool:
    return isinstance(v, str) and BRANCH_RE.fullmatch(v) is not None


def check_meta(meta: dict) -> str | None:
    """The first field of a session record that breaks the schema (its name and why), or None.
    Optional fields may be absent or null; present ones must have their type and range."""
    for k in _STR_FIELDS:
        if meta.get(k) is not None and not isinstance(meta[k], str):
            return f"{k} (not text)"
        if meta.get(k) is not None and bad_text(meta[k]):
            return f"{k} (has a lone surrogate, not valid Unicode)"
    for k in _NO_NUL_FIELDS:
        if meta.get(k) is not None and "\0" in meta[k]:
            return f"{k} (has a NUL character)"
    for k in ("name", "pinned"):
        if meta.get(k) is not None and bad_name(meta[k]):
            return f"{k} (too long or has control characters)"
    if "version" in meta and not _is_int(meta["version"], 1, META_VERSION):
        return f"version (not 1..{META_VERSION})"
    for k in ("created", "updated"):
        if k in meta and not _is_time(meta[k]):
            return f"{k} (not a time in seconds)"
    for k in ("tokens", "ctx"):
        if meta.get(k) is not None and not _is_int(meta[k], 0, U32_MAX):
            return f"{k} (not a whole number 0..{U32_MAX})"
    q = meta.get("quant_bits")
    if q is not None and not (_is_int(q, 2, 4) and q != 3):
        return "quant_bits (not 2 or 4)"
    if meta.get("parent") is not None and not (isinstance(meta["parent"], str) and SHA_RE.fullmatch(meta["parent"])):
        return "parent (not a session id)"
    anc = meta.get("ancestors", [])
    if not isinstance(anc, list) or len(anc) > MAX_ANCESTORS or \
            not all(isinstance(a, str) and SHA_RE.fullmatch(a) for a in anc):
        return f"ancestors (not a list of at most {MAX_ANCESTORS} session ids)"
    if meta.get("branch") is not None and not is_branch(meta["branch"]):
        return "branch (not 12 lowercase hex digits)"
    forks = meta.get("forks", [])
    if not isinstance(forks, list) or len(forks) > MAX_FORKS or not all(
            isinstance(f, dict) and is_branch(f.get("branch")) and isinstance(f.get("name"), str)
            and f["name"].strip() and not bad_name(f["name"]) and _is_time(f.get("created", 0.0))
            for f in forks):
        return f"forks (not a list of at most {MAX_FORKS} {{branch, name, created}} entries)"
    return None


def pinned_of(meta: dict) -> str | None:
    """The name a record was saved under by the user. Records written before names moved have no
    `pinned` key: their name was given by the user, so it pins them."""
    return meta.get("pinned") if "pinned" in meta else meta.get("name")


def forks_of(meta: dict | None) -> tuple[Fork, ...]:
    """The pending forks of a checked record."""
    return tuple(Fork(f["branch"], f["name"], float(f.get("created", 0.0))) for f in (meta or {}).get("forks", ()))


def fork_entry(f: Fork) -> dict:
    return {"branch": f.branch, "name": f.name, "created": f.created}


def title_from_text(text: bytes | str, max_bytes: int = TITLE_MAX_BYTES) -> str:
    """The first user message of a rendered transcript, as ds4 titles it: the text after the first
    <｜User｜> up to the next <｜Assistant｜> or <｜User｜>, whitespace runs collapsed to one space,
    cut to max_bytes with '...' (0: no limit); '(no user prompt)' / '(empty user prompt)'."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogateescape")
    i = text.find(USER_MARK)
    if i < 0:
        return "(no user prompt)"
    p = i + len(USER_MARK)
    end = len(text)
    for mark in (ASSISTANT_MARK, USER_MARK):
        j = text.find(mark, p)
        if 0 <= j < end:
            end = j
    return clip_title(b" ".join(text[p:end].split()), max_bytes) or "(empty user prompt)"


def clip_title(title: bytes | str, max_bytes: int = TITLE_MAX_BYTES) -> str:
    if isinstance(title, str):
        title = title.encode("utf-8", "surrogateescape")
    if max_bytes and len(title) > max_bytes - 3:
        # ds4 keeps at most max_bytes - 3 bytes before the '...'; we cut on a character boundary
        cut = max(1, max_bytes - 3)
        while cut > 0 and (title[cut] & 0xC0) == 0x80:
            cut -= 1
        title = title[:cut].rstrip(b" ") + b"..."
    return title.decode("utf-8", "replace")
