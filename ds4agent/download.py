"""`ds4-agent download q2|q4|q2-imatrix|q4-imatrix|mtp [--dir DIR]`: one of ds4's published GGUF
files from Hugging Face (antirez/deepseek-v4-gguf), then its path recorded as `model` in the
agent's config.toml, so `ds4-agent` finds it without --model (`mtp`, the optional MTP file for
speculative decoding, is recorded as `mtp`: the agent then drafts with it).

huggingface_hub gives the sign-in headers (HF_TOKEN or the saved token), the metadata HEAD (size
and the LFS sha256, through the Hub's redirects), the HTTP session and the progress bar. The
transfer loop is ours: hf_hub_download drops a partial file when a run fails (an 81 GB file would
start over) and will not fetch a plain-HTTP file over 50 GB. Here the bytes go to `<file>.part`
with HTTP Range, as ds4's download script does with `curl -C -`: a dropped connection resumes in
the same run, and a run that stops resumes in the next. The sha256 is computed as the bytes
arrive and checked against the Hub's before the file is renamed into place; free space is checked
against the bytes still to come before any are fetched.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = "antirez/deepseek-v4-gguf"
GB = 1000 ** 3
SPARE = 2 * GB            # free space to leave beside the file (the disk is not filled to the byte)
RETRIES = 5               # reconnects in one run after a dropped connection (each with new bytes resets it)
CHUNK = 1 << 20
CONNECT_S = 5             # seconds to open a connection to the Hub
META_TRIES = 3            # metadata requests when the Hub is busy (429, 5xx) or a read timed out
_BUSY = {f"HTTP {c}" for c in (408, 429, 500, 502, 503, 504)}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class Recipe:
    file: str
    size_gb: int          # the published file, about (the Hub's HEAD gives the exact size)
    memory_gb: int        # RAM or unified memory to run it well: the weights, KV and activations
    note: str


_Q2 = "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2"
_Q4 = "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2"
# file names as ds4's README and download_model.sh publish them; ds4 prefers the imatrix files
RECIPES = {
    "q2-imatrix": Recipe(f"{_Q2}-imatrix.gguf", 81, 96, "2-bit experts, imatrix-tuned: ds4's pick for 96-128 GB"),
    "q4-imatrix": Recipe(f"{_Q4}-imatrix.gguf", 153, 170, "4-bit experts, imatrix-tuned: ds4's pick for 256 GB+"),
    "q2": Recipe(f"{_Q2}.gguf", 81, 96, "2-bit experts, the older quantisation"),
    "q4": Recipe(f"{_Q4}.gguf", 153, 170, "4-bit experts, the older quantisation"),
}
# optional components beside a model: recipe name -> (file, the config.toml key it is recorded as)
MTP_FILE = "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf"      # (engine.gguf.mtp_file.FILE_NAME)
COMPONENTS = {"mtp": (Recipe(MTP_FILE, 4, 4, "the MTP block for speculative decoding (--mtp), with any recipe"), "mtp")}


class DownloadError(Exception):
    """One line for the user; the command prints it after `error:` and exits 1."""


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def recipe_table(memory: int | None, chosen: str | None = None) -> str:
    have = f"{memory / GB:.0f} GB" if memory else "an unknown amount of"
    rows = [f"recipes (this machine has {have} memory):"]
    for name, r in RECIPES.items():
        fits = "" if not memory else ("fits" if memory >= r.memory_gb * GB else "does not fit")
        mark = "*" if name == chosen else " "
        rows.append(f" {mark}{name:<11} {r.size_gb:>3} GB file, needs ~{r.memory_gb} GB of memory"
                    f"{'  ' + fits if fits else ''}   ({r.note})")
    if memory and not any(memory >= r.memory_gb * GB for r in RECIPES.values()):
        rows.append("  none fits in memory: --paging lowmem runs a file larger than the memory from disk, slowly")
    return "\n".join(rows)


def _endpoint() -> str:
    # read at call time (huggingface_hub reads HF_ENDPOINT once, when it is imported)
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def remote_file(name: str, endpoint: str) -> tuple[str, int, str | None]:
    """(url, size, sha256 or None) of the file on the Hub, from one metadata request."""
    from urllib.parse import quote

    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.errors import HfHubHTTPError
    # built here, not with hf_hub_url: that one starts from the endpoint huggingface_hub saw at import
    from huggingface_hub.utils import httpx as http
    url = f"{endpoint}/{REPO}/resolve/main/{quote(name)}"
    # Our own retries, not the library's: it retried a refused connection or a failed DNS lookup
    # for 26-28 s offline. Those fail at once; a busy Hub (429, 5xx) or a read that timed out
    # gets a few more tries. A connection that cannot be made in CONNECT_S is not coming.
    timeout = http.Timeout(30, connect=CONNECT_S)
    for attempt in range(META_TRIES):
        try:
            meta = get_hf_file_metadata(url, timeout=timeout, endpoint=endpoint, retry_on_errors=False,
                                        **_library())
            break
        except HfHubHTTPError as e:
            if _status(e) in _BUSY and attempt + 1 < META_TRIES:
                time.sleep(2 ** attempt)
                continue
            hint = "; set HF_TOKEN if the repository needs a sign-in" if _status(e) in ("HTTP 401", "HTTP 403") else ""
            raise DownloadError(f"{endpoint} answered {_status(e)} for {REPO}/{name}{hint}") from None
        except (http.ReadTimeout, http.RemoteProtocolError) as e:
            if attempt + 1 < META_TRIES:
                continue
            raise DownloadError(f"cannot reach {endpoint}: {_one_line(e)}") from None
        except Exception as e:    # no network, no DNS, refused: not transient, one line now
            raise DownloadError(f"cannot reach {endpoint}: {_one_line(e)}") from None
    if meta.size is None:
        raise DownloadError(f"{endpoint} did not say the size of {name}")
    etag = (meta.etag or "").strip('"').lower()
    return url, meta.size, etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None


def _library() -> dict:
    from engine.cli_help import package_version
    return {"library_name": "ds4-agent", "library_version": package_version()}


def _range_start(content_range: str | None) -> int | None:
    m = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*", content_range or "")
    return int(m.group(1)) if m else None


def _status(e) -> str:
    resp = getattr(e, "response", None)
    return f"HTTP {resp.status_code}" if resp is not None else _one_line(e)


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def check_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed + SPARE:
        raise DownloadError(f"not enough free space in {folder}: {_gb(needed)} still to download "
                            f"(+{_gb(SPARE)} spare), {_gb(free)} free; use --dir on a larger disk")


def open_regular(path: Path, *, write: bool) -> int | None:
    """A descriptor of the regular file at path (None: nothing there and not `write`), never
    through a symlink and never waiting on a FIFO: an outside file linked as the `.part` would
    grow, and a FIFO would hang the download. With write the file is made when missing."""
    flags = (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY) | os.O_NONBLOCK | os.O_CLOEXEC | _NOFOLLOW
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if write:
            raise
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DownloadError(f"{path} is a symlink; it is not followed (remove it, or choose "
                                "another --dir)") from None
        if e.errno != errno.EISDIR:
            raise
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise DownloadError(f"{path} is not a regular file (remove it, or choose another --dir)")
    os.set_blocking(fd, True)
    return fd


def _hash_existing(f, have: int, out, what: str = "already downloaded") -> "hashlib._Hash":
    """The sha256 of the first `have` bytes of the open file f."""
    h = hashlib.sha256()
    if have:
        print(f"checking the {_gb(have)} {what}", file=out)
        f.seek(0)
        left = have
        while left and (block := f.read(min(left, 16 * CHUNK))):
            h.update(block)
            left -= len(block)
    return h


def fetch(url: str, f, size: int, *, out, retries: int = RETRIES, name: str = "") -> "hashlib._Hash":
    """Bring the open `.part` file f to `size` bytes from `url` with Range requests; the sha256
    of the whole file."""
    from huggingface_hub.utils import build_hf_headers, get_session
    from huggingface_hub.utils import httpx as http     # the HTTP library huggingface_hub's session is of
    from huggingface_hub.utils import tqdm as hf_tqdm
    have = os.fstat(f.fileno()).st_size
    if have > size:                  # not a prefix of this file: start over
        have = 0
    digest = _hash_existing(f, have, out)
    left = retries
    bar = hf_tqdm(total=size, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=name[:40],
                  file=out, dynamic_ncols=True)
    try:
        while have < size:
            headers = build_hf_headers(**_library())
            headers["Accept-Encoding"] = "identity"    # the bytes of the file, not a compressed stream
            if have:
                headers["Range"] = f"bytes={have}-"
            try:
                with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as r:
                    if r.status_code == 200 and have:     # the server ignored the range: from the start
                        have, digest = 0, hashlib.sha256()
                        bar.reset(total=size)
                    elif r.status_code not in (200, 206):
                        raise DownloadError(f"the download answered HTTP {r.status_code}")
                    elif r.status_code == 206 and _range_start(r.headers.get("Content-Range")) != have:
                        raise DownloadError(f"the server resumed at the wrong place ({r.headers.get('Content-Range')}, "
                                            f"asked for byte {have})")
                    f.seek(have)
                    f.truncate()
                    for chunk in r.iter_bytes(CHUNK):
                        if have + len(chunk) > size:
                            raise DownloadError(f"the server sent more than the {size} bytes it announced")
                        f.write(chunk)
                        digest.update(chunk)
                        have += len(chunk)
                        bar.update(len(chunk))
                        left = retries          # progress: the reconnects count afresh
                    f.flush()
                    os.fsync(f.fileno())
            except http.TransportError as e:
                if left <= 0:
                    raise DownloadError(f"the connection failed at {_gb(have)} of {_gb(size)} ({_one_line(e)}); "
                                        "run the same command again to resume") from None
                left -= 1
                print(f"\nconnection lost at {_gb(have)} ({_one_line(e)}); resuming", file=out)
                time.sleep(min(8.0, 0.5 * 2 ** (retries - left - 1)))
                # the error comes between chunks: the file holds exactly the bytes hashed so far
                f.flush()
                if os.fstat(f.fileno()).st_size != have:
                    have = os.fstat(f.fileno()).st_size
                    digest = _hash_existing(f, have, out)
            else:
                if have < size:         # a body that ended early without an error: ask for the rest
                    if left <= 0:
                        raise DownloadError(f"the server stopped at {_gb(have)} of {_gb(size)}; run again to resume")
                    left -= 1
    finally:
        bar.close()
    return digest


def record_model(path: Path, config: Path, key: str = "model") -> None:
    """Set `model = "<path>"` (or another top-level `key`) among config.toml's top-level keys (the
    rest of the file as it was), written to a temp name and renamed."""
    from engine.atomic import atomic_write
    from tools.safefs import read_regular
    try:     # a FIFO or /dev/zero there is refused, not waited on or read forever
        text = read_regular(config, 1 << 20, nofollow=False).decode("utf-8")
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as e:
        raise DownloadError(f"cannot read {config} ({getattr(e, 'strerror', None) or e}); set {key} = "
                            f"\"{path}\" there by hand") from None
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise DownloadError(f"{config} is not valid TOML ({e}); set {key} = \"{path}\" there by hand") from None
    line = f"{key} = {json.dumps(str(path), ensure_ascii=False)}"
    lines = text.splitlines()
    top = next((i for i, s in enumerate(lines) if s.lstrip().startswith("[")), len(lines))
    for i in range(top):
        if re.match(rf"\s*{key}\s*=", lines[i]):
            lines[i] = line
            break
    else:
        lines.insert(0, line)
    new = "\n".join(lines) + "\n"
    try:
        ok = tomllib.loads(new).get(key) == str(path)
    except tomllib.TOMLDecodeError:
        ok = False
    if not ok:
        raise DownloadError(f"could not write the path into {config}; set {key} = \"{path}\" there by hand")
    config.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(config, [new.encode("utf-8")])


def download(recipe: str, folder: Path, config: Path, *, out=None, retries: int = RETRIES) -> Path:
    out = out or sys.stderr
    r, key = COMPONENTS.get(recipe) or (RECIPES[recipe], "model")
    if key == "model":
        print(recipe_table(machine_memory(), recipe), file=out)
    endpoint = _endpoint()
    url, size, sha = remote_file(r.file, endpoint)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DownloadError(f"cannot create {folder}: {e.strerror or e}") from None
    dest = folder / r.file
    if not _have_already(dest, size, sha, out):
        _download_to(dest, url, size, sha, endpoint, out=out, retries=retries)
    record_model(dest, config, key)
    print(f"saved {dest}\nrecorded in {config}: `ds4-agent` in any project now uses this "
          + ("model" if key == "model" else f"{recipe} file"), file=out)
    return dest


def _have_already(dest: Path, size: int, sha: str | None, out) -> bool:
    """Whether dest already is the published file: a regular file (not a symlink to one) of its
    size and, where the Hub gives one, its sha256 (checked before its path is recorded)."""
    fd = open_regular(dest, write=False)
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as f:
        have = os.fstat(fd).st_size
        if have != size:
            return False
        if sha and _hash_existing(f, have, out, "of the file already there").hexdigest() != sha:
            raise DownloadError(f"{dest} has the size but not the sha256 of the published file; "
                                "remove it and run the command again")
    print(f"already downloaded: {dest}", file=out)
    return True


def _download_to(dest: Path, url: str, size: int, sha: str | None, endpoint: str, *, out, retries: int):
    part = dest.with_name(dest.name + ".part")
    with os.fdopen(open_regular(part, write=True), "r+b") as f:
        have = os.fstat(f.fileno()).st_size
        check_space(dest.parent, size - min(have, size))
        print(f"downloading {dest.name} ({_gb(size)}) from {endpoint}/{REPO}\n  to {dest}"
              + (f"\n  resuming at {_gb(have)}" if have else "")
              + "\n  (if it stops, run the same command again: it resumes)", file=out)
        digest = fetch(url, f, size, out=out, retries=retries, name=dest.name)
        got = os.fstat(f.fileno())
        if got.st_size != size:
            raise DownloadError(f"{part} has {got.st_size} bytes, not {size}; run again to resume")
        if sha and digest.hexdigest() != sha:
            f.truncate(0)
            _unlink(part, got)
            raise DownloadError(f"{dest.name}: the sha256 does not match the Hub's; the download was removed, "
                                "run the command again")
        os.replace(part, dest)
        now = os.lstat(dest)       # the file renamed is the one written (not a .part swapped meanwhile)
        if (now.st_dev, now.st_ino) != (got.st_dev, got.st_ino):
            raise DownloadError(f"{part} changed while it was downloaded; run the command again")


def _unlink(p: Path, st: os.stat_result) -> None:
    try:
        now = os.lstat(p)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(p)
    except OSError:
        pass


def _parser() -> argparse.ArgumentParser:
    from .home import agent_home
    from engine.cli_help import ArgumentParser    # a bad argument: one line, exit 1
    p = ArgumentParser(prog="ds4-agent download", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=f"download one of ds4's published GGUF files from {REPO} "
                                            "(resumable) and record its path for ds4-agent",
                                epilog=recipe_table(machine_memory()))
    p.add_argument("recipe", metavar="RECIPE", help="q2-imatrix, q4-imatrix, q2 or q4 (the imatrix files are ds4's pick), "
                                                    "or mtp (the optional MTP file, ~3.5 GB)")
    p.add_argument("--dir", type=Path, default=agent_home() / "models",
                   help=f"folder for the file (default: {agent_home() / 'models'})")
    return p


def main(argv=None) -> int:
    from .home import agent_home
    a = _parser().parse_args(argv)
    if a.recipe not in RECIPES and a.recipe not in COMPONENTS:
        print(f"error: unknown recipe {a.recipe!r}: choose one of {', '.join([*RECIPES, *COMPONENTS])}", file=sys.stderr)
        return 1
    try:
        str(a.dir).encode("utf-8")
    except UnicodeEncodeError:      # config.toml records the path as UTF-8 text
        print(f"error: --dir {ascii(str(a.dir))[1:-1]} is not a UTF-8 path; choose a folder whose name is UTF-8",
              file=sys.stderr)
        return 1
    try:
        download(a.recipe, a.dir.expanduser().absolute(), agent_home() / "config.toml")
    except DownloadError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"\nerror: {getattr(e, 'filename', None) or a.dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return 0
