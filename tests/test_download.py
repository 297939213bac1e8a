"""`ds4-agent download` against a stand-in Hub on localhost (HF_ENDPOINT): metadata first, free
space checked, a connection dropped mid-file resumed in the same run, a run that gives up resumed
by the next one, the sha256 checked, the path recorded so `ds4-agent` finds the model. Nothing here
reaches the internet: every request goes to the server in this file."""
from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
import time
from collections import namedtuple

import pytest

from ds4agent import cli
from ds4agent import download as D

SIZE = 3 * 1024 * 1024 + 123
PAYLOAD = os.urandom(SIZE)
SHA = hashlib.sha256(PAYLOAD).hexdigest()


class Hub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.requests = []          # (method, path, Range header)
        self.drops = []             # for each coming GET: cut the body after this many bytes (None: whole)
        self.payload, self.sha = PAYLOAD, SHA
        self.errors = []            # a client that hangs up mid-body (as a refused resume does)

    def handle_error(self, request, client_address):
        import sys
        self.errors.append(sys.exc_info()[1])


class HubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _known(self):
        want = f"/{D.REPO}/resolve/main/"
        return self.path.startswith(want) and self.path[len(want):] in {r.file for r in D.RECIPES.values()} | {r.file for r, _ in D.COMPONENTS.values()}

    def do_HEAD(self):
        self.server.requests.append(("HEAD", self.path, self.headers.get("Range")))
        if not self._known():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        # what the Hub says of an LFS file: its commit, its sha256 as the linked etag, its size
        self.send_response(200)
        self.send_header("X-Repo-Commit", "a" * 40)
        self.send_header("X-Linked-Etag", f'"{self.server.sha}"')
        self.send_header("ETag", f'"{self.server.sha}"')
        self.send_header("X-Linked-Size", str(len(self.server.payload)))
        self.send_header("Content-Length", str(len(self.server.payload)))
        self.end_headers()

    def do_GET(self):
        self.server.requests.append(("GET", self.path, self.headers.get("Range")))
        data, start = self.server.payload, 0
        rng = self.headers.get("Range")
        if rng:
            start = int(rng.split("=")[1].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = self.server.drops.pop(0) if self.server.drops else None
        if cut is None:
            self.wfile.write(body)
            return
        self.wfile.write(body[:cut])           # then the connection dies mid-body
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(2)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Every name lookup and connection in these tests is to this machine: a request that would
    leave it (huggingface_hub's own side requests included) fails the test instead."""
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *a, **k):
        assert host in ("127.0.0.1", "localhost", "::1"), f"a lookup of {host!r} in a test"
        return real_getaddrinfo(host, *a, **k)

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            assert address[0] in ("127.0.0.1", "::1"), f"a connection to {address!r} in a test"
        return real_connect(self, address)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = Hub()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    # huggingface_hub reads these once, at its import (maybe before this test): its user-agent
    # telemetry fetches {ENDPOINT}/api/agent-harnesses, which must not go to huggingface.co
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))       # no saved token of the machine's
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(D.time, "sleep", lambda s: None)
    yield server
    server.shutdown()
    server.server_close()


def gets(hub):
    return [r for r in hub.requests if r[0] == "GET"]


def test_download_records_the_model_so_the_agent_finds_it(hub, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('ctx = 4096\n\n[extra]\nmodel = "not this one"\n')
    assert cli.main(["download", "q2-imatrix", "--dir", str(tmp_path / "models")]) == 0
    dest = tmp_path / "models" / D.RECIPES["q2-imatrix"].file
    assert dest.read_bytes() == PAYLOAD and not dest.with_name(dest.name + ".part").exists()
    err = capsys.readouterr().err
    assert "q4-imatrix" in err and "needs ~96 GB of memory" in err and "recorded in" in err
    cfg = cli.load_config()
    assert cfg["model"] == str(dest) and cfg["ctx"] == 4096 and cfg["extra"]["model"] == "not this one"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DS4_MODEL", raising=False)
    assert cli.find_model(None, cfg)[0] == str(dest)
    # a second run finds the file complete and fetches nothing
    n = len(gets(hub))
    assert cli.main(["download", "q2-imatrix", "--dir", str(tmp_path / "models")]) == 0
    assert len(gets(hub)) == n and "already downloaded" in capsys.readouterr().err


def test_a_dropped_connection_resumes_in_the_same_run(hub, tmp_path):
    hub.drops = [SIZE // 3]
    dest = D.download("q4", tmp_path / "m", tmp_path / "home" / "config.toml", out=open(os.devnull, "w"))
    assert dest.read_bytes() == PAYLOAD
    first, second = gets(hub)
    # the second asked only for the rest: from what had arrived whole (a cut chunk is fetched again)
    assert first[2] is None and second[2].startswith("bytes=") and 0 < int(second[2][6:-1]) <= SIZE // 3


def test_an_interrupted_run_resumes_in_the_next(hub, tmp_path, capsys):
    """The first run's connection dies and it gives up (no reconnects left): the part file stays;
    the next run asks for the rest only, and the whole file's sha256 is checked."""
    hub.drops = [SIZE // 2]
    folder = tmp_path / "m"
    with pytest.raises(D.DownloadError, match="run the same command again to resume"):
        D.download("q2", folder, tmp_path / "config.toml", out=open(os.devnull, "w"), retries=0)
    part = folder / (D.RECIPES["q2"].file + ".part")
    have = part.stat().st_size
    assert 0 < have <= SIZE // 2 and not (folder / D.RECIPES["q2"].file).exists()
    assert not (tmp_path / "config.toml").exists()            # nothing recorded for a partial file
    dest = D.download("q2", folder, tmp_path / "config.toml", out=open(os.devnull, "w"), retries=0)
    assert dest.read_bytes() == PAYLOAD
    assert gets(hub)[-1][2] == f"bytes={have}-"


def test_a_resume_at_the_wrong_offset_is_refused(hub, tmp_path, monkeypatch):
    hub.drops = [SIZE // 2]
    monkeypatch.setattr(HubHandler, "send_header", _shifted_range(HubHandler.send_header))
    with pytest.raises(D.DownloadError, match="resumed at the wrong place"):
        D.download("q2", tmp_path / "m", tmp_path / "config.toml", out=open(os.devnull, "w"))


def _shifted_range(real):
    def send_header(self, key, value):
        if key == "Content-Range":           # a server that answers a range it was not asked for
            start, rest = value[len("bytes "):].split("-", 1)
            value = f"bytes {int(start) + 1}-{rest}"
        return real(self, key, value)
    return send_header


def test_a_corrupt_download_is_caught_by_the_sha256(hub, tmp_path):
    hub.sha = "0" * 64
    with pytest.raises(D.DownloadError, match="sha256 does not match"):
        D.download("q2", tmp_path / "m", tmp_path / "config.toml", out=open(os.devnull, "w"))
    assert list((tmp_path / "m").iterdir()) == []


def test_free_space_is_checked_before_any_byte(hub, tmp_path, monkeypatch, capsys):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(D.shutil, "disk_usage", lambda p: Usage(10**12, 10**12 - 10**6, 10**6))
    assert cli.main(["download", "q2", "--dir", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: not enough free space in ") and "use --dir on a larger disk" in err[-1]
    assert [r[0] for r in hub.requests] == ["HEAD"]             # the size came first, no download


def test_the_stand_in_hub_gets_every_request(hub, tmp_path):
    D.download("q2", tmp_path / "m", tmp_path / "config.toml", out=open(os.devnull, "w"))
    assert [r[0] for r in hub.requests] == ["HEAD", "GET"]


def test_bad_recipe_and_unreachable_hub_are_one_line(hub, tmp_path, monkeypatch, capsys):
    assert cli.main(["download", "q3"]) == 1
    assert capsys.readouterr().err.strip() == "error: unknown recipe 'q3': choose one of q2-imatrix, q4-imatrix, q2, q4, mtp"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")       # nothing listens there
    assert cli.main(["download", "q2", "--dir", str(tmp_path / "m")]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach http://127.0.0.1:9")


def test_memory_table_says_what_fits():
    table = D.recipe_table(128 * D.GB, "q2")
    q2 = next(line for line in table.splitlines() if line.lstrip(" *").startswith("q2 "))
    q4 = next(line for line in table.splitlines() if line.lstrip(" *").startswith("q4 "))
    assert "fits" in q2 and "does not fit" not in q2 and "does not fit" in q4 and q2.startswith(" *")
    assert "none fits" in D.recipe_table(32 * D.GB)


def test_config_keeps_its_other_keys_and_refuses_a_broken_file(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('# mine\nmodel = "/old.gguf"\nyolo = true\n')
    D.record_model(tmp_path / 'a "quoted" path.gguf', cfg)
    text = cfg.read_text()
    assert text.startswith("# mine\n") and "yolo = true" in text and "/old.gguf" not in text
    assert cli.tomllib.loads(text)["model"] == str(tmp_path / 'a "quoted" path.gguf')
    cfg.write_text("model = [unclosed\n")
    with pytest.raises(D.DownloadError, match="not valid TOML"):
        D.record_model(tmp_path / "x.gguf", cfg)
    assert cfg.read_text() == "model = [unclosed\n"


def test_no_model_message_names_download_and_ds4_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DS4_MODEL", raising=False)
    assert cli.main(["-p", "x"]) == 1
    err = capsys.readouterr().err
    assert "ds4-agent download q2-imatrix" in err and "$DS4_MODEL" in err


# -- issue 32 item 4, issue 35 item 4: the files are the download's own, offline is quick --------
def _threaded(fn, limit=20.0):
    """fn() in a thread: a result, or "hung" when it does not end in `limit` s (a FIFO)."""
    box = []
    t = threading.Thread(target=lambda: box.append(_catch(fn)), daemon=True)
    t.start()
    t.join(limit)
    return box[0] if box else "hung"


def _catch(fn):
    try:
        return fn()
    except Exception as e:      # noqa: BLE001 - the test looks at what it was
        return e


def test_a_symlinked_part_is_not_followed(hub, tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 190)
    m = tmp_path / "m"
    m.mkdir()
    (m / (D.RECIPES["q2"].file + ".part")).symlink_to(outside)
    got = _threaded(lambda: D.download("q2", m, tmp_path / "config.toml", out=open(os.devnull, "w")))
    assert isinstance(got, D.DownloadError) and "symlink" in str(got), got
    assert outside.read_bytes() == b"x" * 190 and not (tmp_path / "config.toml").exists()


def test_a_fifo_part_is_refused_not_waited_on(hub, tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    os.mkfifo(m / (D.RECIPES["q2"].file + ".part"))
    got = _threaded(lambda: D.download("q2", m, tmp_path / "config.toml", out=open(os.devnull, "w")))
    assert isinstance(got, D.DownloadError) and "not a regular file" in str(got), got


def test_a_same_size_symlink_or_wrong_file_at_the_destination_is_not_recorded(hub, tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    dest, cfg = m / D.RECIPES["q2"].file, tmp_path / "config.toml"
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * SIZE)                         # the size, not the bytes
    dest.symlink_to(other)
    got = _catch(lambda: D.download("q2", m, cfg, out=open(os.devnull, "w")))
    assert isinstance(got, D.DownloadError) and "symlink" in str(got) and not cfg.exists()
    dest.unlink()
    dest.write_bytes(b"\0" * SIZE)
    got = _catch(lambda: D.download("q2", m, cfg, out=open(os.devnull, "w")))
    assert isinstance(got, D.DownloadError) and "sha256" in str(got) and not cfg.exists()
    assert other.read_bytes() == b"\0" * SIZE


def test_a_non_utf8_dir_is_one_line(hub, tmp_path, capsys):
    bad = os.fsdecode(bytes(tmp_path) + b"/m\xff")
    assert cli.main(["download", "q2", "--dir", bad]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --dir") and "UTF-8" in err and "\n" not in err
    assert not os.path.exists(bad) and gets(hub) == []


def test_offline_fails_in_seconds_with_one_line(hub, tmp_path, monkeypatch, capsys):
    """A refused connection is not transient: the Hub library's retries took 26-28 s offline."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                          # a port nothing listens on
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t = time.monotonic()
    assert cli.main(["download", "q2", "--dir", str(tmp_path / "m")]) == 1
    took = time.monotonic() - t
    err = capsys.readouterr().err
    assert took < 10, took
    assert err.strip().splitlines()[-1].startswith(f"error: cannot reach http://127.0.0.1:{port}")
    assert "retry" not in err.lower() and "Traceback" not in err


def test_download_mtp_fetches_ds4s_mtp_file_and_records_it_as_mtp(hub, tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('model = "/m.gguf"\n')
    assert cli.main(["download", "mtp", "--dir", str(tmp_path / "models")]) == 0
    dest = tmp_path / "models" / "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf"
    assert dest.read_bytes() == PAYLOAD
    assert any(r[1].endswith("/DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf") for r in gets(hub))
    cfg = cli.load_config()
    assert cfg["mtp"] == str(dest) and cfg["model"] == "/m.gguf"
    from engine.gguf.mtp_file import FILE_NAME
    assert D.MTP_FILE == FILE_NAME          # the name --mtp's errors tell the user to get
