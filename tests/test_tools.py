"""The model's tools: read, write, edit, list, search, outline, bash (+ status/stop), git, git_commit.

Every test works in a fresh git repository under tmp_path and goes through `tools.call`, the way
the agent calls tools: arguments as JSON-like dicts or JSON text, results never raised.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import tools
from tools import REGISTRY, ToolContext, ToolResult, call, schemas
from tools import files as files_mod

PY_SRC = '''"""A module."""
import os

LIMIT = 10


class Greeter:
    greeting: str = "hi"

    def __init__(self, name):
        self.name = name

    @property
    def loud(self):
        return self.name.upper()


@staticmethod
def helper(x, y=2):
    return x + y


async def fetch():
    pass
'''

C_SRC = '''#include <stdio.h>
#define MAX_ITEMS 16
#define SQUARE(x) ((x) * (x))

typedef struct {
    int x, y;
} point;

struct node {
    int value;
    struct node *next;
};

enum color { RED, GREEN };

static int *find(struct node *head, int value)
{
    return 0;
}

int main(void) {
    printf("%d\\n", SQUARE(3));
    return 0;
}
'''


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def proj(tmp_path) -> Path:
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "a.py").write_text(PY_SRC)
    (root / "src" / "lib.c").write_text(C_SRC)
    (root / "notes.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    (root / ".gitignore").write_text("build/\n*.log\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "t@example.com")
    git(root, "config", "user.name", "Tester")
    git(root, "config", "commit.gpgsign", "false")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "initial")
    return root


@pytest.fixture
def ctx(proj, tmp_path) -> ToolContext:
    c = ToolContext(root=proj, scratch=tmp_path / "scratch")
    yield c
    tools.close(c)


def alive(pid: int) -> bool:
    """Running (a killed orphan may stay a zombie where init does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def ok(res: ToolResult) -> str:
    assert res.ok, res.text
    return res.text


def err(res: ToolResult) -> str:
    assert not res.ok, res.text
    assert res.text.startswith("error: ")
    return res.text


# ---------------------------------------------------------------------------------------- registry

def test_registry_schemas_and_approval():
    names = [json.loads(s)["function"]["name"] for s in schemas()]
    assert names == ["read", "list", "search", "outline", "edit", "write", "bash", "bash_status",
                     "bash_stop", "git", "git_commit"]
    assert schemas() == schemas()               # stable
    for s in schemas():
        d = json.loads(s)
        assert d["type"] == "function"
        fn = d["function"]
        assert len(fn["description"]) > 100, fn["name"]
        params = fn["parameters"]
        assert params["type"] == "object"
        for k in params.get("required", []):
            assert k in params["properties"]
        for p in params["properties"].values():
            assert p.get("type") and p.get("description")
    approval = {n for n, t in REGISTRY.items() if t.needs_approval}
    assert approval == {"write", "edit", "bash", "git_commit"}


def test_bad_arguments_become_error_results(ctx):
    assert "missing required argument 'path'" in err(call("read", {}, ctx))
    assert "must be integer, got string" in err(call("read", {"path": "a.py", "start_line": "3"}, ctx))
    assert "must be integer" in err(call("read", {"path": "a.py", "start_line": 1.5}, ctx))
    assert "must be integer, got boolean" in err(call("read", {"path": "a.py", "start_line": True}, ctx))
    assert "unknown argument 'lines'" in err(call("read", {"path": "a.py", "lines": 3}, ctx))
    assert "not valid JSON" in err(call("read", '{"path": "a.py"', ctx))
    assert "must be a JSON object" in err(call("read", "[1, 2]", ctx))
    assert "must be in 1..inf" in err(call("read", {"path": "a.py", "start_line": 0}, ctx))
    assert "must be one of" in err(call("git", {"subcommand": "push"}, ctx))
    assert "array of strings" in err(call("git_commit", {"message": "m", "paths": [1]}, ctx))
    assert "unknown tool 'rm'" in err(call("rm", {}, ctx))
    assert "must be a non-empty string" in err(call("read", {"path": ""}, ctx))
    # JSON text, an integral float and a null optional are fine
    assert ok(call("read", '{"path": "a.py", "start_line": 2.0, "end_line": null}', ctx)).startswith("a.py: lines 2-")


def test_a_tool_bug_is_an_error_result_not_a_crash(ctx, monkeypatch):
    def boom(args, ctx):
        raise KeyError("oops")
    monkeypatch.setattr(REGISTRY["list"], "run", boom)
    assert "list failed: KeyError" in err(call("list", {}, ctx))


def test_summary_for_approval():
    assert tools.summary("bash", {"command": "make test"}) == "run: make test"
    assert tools.summary("edit", {"path": "a.py", "new": "", "start_line": 3}) == "edit a.py lines 3-3"
    assert "a.py" in tools.summary("write", {"path": "a.py", "content": "x"})
    assert "fix bug" in tools.summary("git_commit", {"message": "fix bug\n\nlong", "all": True})
    assert "invalid" in tools.summary("bash", {})


# ---------------------------------------------------------------------------------------- read

def test_read_numbered_ranges(ctx):
    text = ok(call("read", {"path": "notes.txt", "start_line": 3, "end_line": 5}, ctx))
    assert text == "notes.txt: lines 3-5 of 10\n3\tline 3\n4\tline 4\n5\tline 5"
    text = ok(call("read", {"path": "./notes.txt"}, ctx))
    assert text.splitlines()[0] == "notes.txt: lines 1-10 of 10" and "truncated" not in text
    # end past EOF is clamped; start past EOF is an error
    assert ok(call("read", {"path": "notes.txt", "start_line": 9, "end_line": 99}, ctx)).startswith(
        "notes.txt: lines 9-10 of 10")
    assert "past the end" in err(call("read", {"path": "notes.txt", "start_line": 11}, ctx))
    assert "before start_line" in err(call("read", {"path": "notes.txt", "start_line": 5, "end_line": 2}, ctx))
    assert "no such file" in err(call("read", {"path": "nope.txt"}, ctx))
    assert "is a directory" in err(call("read", {"path": "src"}, ctx))


def test_read_limits_are_marked(ctx, proj):
    (proj / "long.txt").write_text("".join(f"row {i}\n" for i in range(1, 1201)))
    res = call("read", {"path": "long.txt"}, ctx)
    lines = ok(res).splitlines()
    assert lines[0] == "long.txt: lines 1-500 of 1200"
    assert lines[-1].startswith("[... truncated: lines 501-1200 not shown; continue with start_line=501")
    assert res.truncated
    # the size cap stops early and says where to continue
    (proj / "wide.txt").write_text("".join(("w" * 199) + "\n" for _ in range(300)))
    res = call("read", {"path": "wide.txt", "start_line": 1, "end_line": 300}, ctx)
    last = ok(res).splitlines()[-1]
    assert last.startswith("[... truncated at the size limit: lines ") and res.truncated
    assert len(res.text) <= 24_000
    # a very long line is cut with a marker
    (proj / "one.txt").write_text("x" * 5000 + "\n")
    text = ok(call("read", {"path": "one.txt"}, ctx))
    assert "[... line truncated: 3000 more characters ...]" in text


def test_read_refuses_binary_and_handles_odd_text(ctx, proj):
    (proj / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    assert "binary file" in err(call("read", {"path": "blob.bin"}, ctx))
    (proj / "empty.txt").write_text("")
    assert ok(call("read", {"path": "empty.txt"}, ctx)) == "empty.txt: empty file (0 lines)"
    (proj / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    assert ok(call("read", {"path": "crlf.txt"}, ctx)).splitlines()[1:] == ["1\tone", "2\ttwo"]
    os.mkfifo(proj / "pipe")
    assert "not a regular file" in err(call("read", {"path": "pipe"}, ctx))
    assert "not a regular file" in err(call("edit", {"path": "pipe", "old": "a", "new": "b"}, ctx))
    assert "not a regular file" in err(call("write", {"path": "pipe", "content": "x"}, ctx))
    (proj / "latin.txt").write_bytes(b"caf\xe9\nbar\n")
    text = ok(call("read", {"path": "latin.txt"}, ctx))
    assert "not valid UTF-8" in text and "caf\ufffd" in text
    # an edit elsewhere in the file keeps the bytes it did not touch
    ok(call("edit", {"path": "latin.txt", "start_line": 2, "new": "baz"}, ctx))
    ok(call("edit", {"path": "latin.txt", "old": "baz", "new": "qux"}, ctx))
    assert (proj / "latin.txt").read_bytes() == b"caf\xe9\nqux\n"


def test_read_large_file_streams(ctx, proj, monkeypatch):
    monkeypatch.setattr(files_mod, "MAX_FILE_BYTES", 1000)
    (proj / "big.log").write_text("".join(f"entry {i}\n" for i in range(1, 2001)))
    res = call("read", {"path": "big.log", "start_line": 1500, "end_line": 1502}, ctx)
    assert ok(res).splitlines() == [
        "big.log: lines 1500-1502 of 2000 (large file, 20893 bytes: not editable by line number)",
        "1500\tentry 1500", "1501\tentry 1501", "1502\tentry 1502"]


# ---------------------------------------------------------------------------------------- write

def test_write_creates_dirs_and_returns_diff(ctx, proj):
    res = call("write", {"path": "pkg/sub/new.py", "content": "x = 1\ny = 2\n"}, ctx)
    assert ok(res) == "Created pkg/sub/new.py (2 lines, 12 bytes)"
    assert (proj / "pkg/sub/new.py").read_text() == "x = 1\ny = 2\n"
    assert res.diff.startswith("--- /dev/null\n+++ b/pkg/sub/new.py") and "+y = 2" in res.diff
    res = call("write", {"path": "pkg/sub/new.py", "content": "x = 1\ny = 3\n"}, ctx)
    assert ok(res).startswith("Overwrote pkg/sub/new.py (2 lines")
    assert "-y = 2\n+y = 3" in res.diff
    assert "already has exactly this content" in ok(call("write", {"path": "pkg/sub/new.py",
                                                                 "content": "x = 1\ny = 3\n"}, ctx))
    # what the model wrote it may edit by line number at once
    ok(call("edit", {"path": "pkg/sub/new.py", "start_line": 2, "new": "y = 4"}, ctx))
    assert (proj / "pkg/sub/new.py").read_text() == "x = 1\ny = 4\n"
    assert "is a directory" in err(call("write", {"path": "src", "content": ""}, ctx))


def test_write_keeps_permissions(ctx, proj):
    script = proj / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    ok(call("write", {"path": "run.sh", "content": "#!/bin/sh\necho hi\n"}, ctx))
    assert script.stat().st_mode & 0o777 == 0o755
    assert not [p for p in proj.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------- edit

def test_edit_old_new_exactly_once(ctx, proj):
    res = call("edit", {"path": "a.py", "old": "LIMIT = 10", "new": "LIMIT = 20"}, ctx)
    text = ok(res)
    assert text.startswith("Edited a.py: replaced the old text (old lines 4-4, now 1 line).")
    assert "4\tLIMIT = 20" in text
    assert "-LIMIT = 10\n+LIMIT = 20" in res.diff and res.diff.startswith("--- a/a.py\n+++ b/a.py")
    assert "LIMIT = 20" in (proj / "a.py").read_text()

    before = (proj / "a.py").read_text()
    assert "old text not found in a.py" in err(call("edit", {"path": "a.py", "old": "LIMIT = 99", "new": "x"}, ctx))
    text = err(call("edit", {"path": "a.py", "old": "self.name", "new": "self.nom"}, ctx))
    assert "occurs 2 times in a.py (at lines 11, 15)" in text
    assert (proj / "a.py").read_text() == before
    # a near miss in indentation is pointed out
    text = err(call("edit", {"path": "a.py", "old": "def loud(self):\n  return self.name.upper()", "new": "x"}, ctx))
    assert "lines 14-15 would match if whitespace were ignored" in text
    assert "not both" in err(call("edit", {"path": "a.py", "old": "LIMIT", "new": "L", "start_line": 1}, ctx))
    assert "must not be empty" in err(call("edit", {"path": "a.py", "old": "", "new": "x"}, ctx))
    assert "nothing to change" in err(call("edit", {"path": "a.py", "old": "LIMIT", "new": "LIMIT"}, ctx))
    assert "use write to create" in err(call("edit", {"path": "zzz.py", "old": "a", "new": "b"}, ctx))
    assert "edit needs old" in err(call("edit", {"path": "a.py", "new": "b"}, ctx))
    assert "missing required argument 'new'" in err(call("edit", {"path": "a.py", "old": "LIMIT"}, ctx))


def test_edit_keeps_crlf(ctx, proj):
    (proj / "w.txt").write_bytes(b"alpha\r\nbeta\r\ngamma\r\n")
    ok(call("edit", {"path": "w.txt", "old": "alpha\nbeta", "new": "one\ntwo\nthree"}, ctx))
    assert (proj / "w.txt").read_bytes() == b"one\r\ntwo\r\nthree\r\ngamma\r\n"
    ok(call("read", {"path": "w.txt"}, ctx))
    ok(call("edit", {"path": "w.txt", "start_line": 4, "new": "delta\nepsilon"}, ctx))
    assert (proj / "w.txt").read_bytes() == b"one\r\ntwo\r\nthree\r\ndelta\r\nepsilon\r\n"


def test_line_edit_needs_lines_seen_and_unchanged(ctx, proj):
    # never read
    text = err(call("edit", {"path": "notes.txt", "start_line": 2, "new": "two"}, ctx))
    assert "you have not read notes.txt" in text
    # read lines 1-3 only: line 5 was not shown
    ok(call("read", {"path": "notes.txt", "start_line": 1, "end_line": 3}, ctx))
    assert "line 4 of notes.txt was not shown" in err(
        call("edit", {"path": "notes.txt", "start_line": 4, "end_line": 5, "new": "x"}, ctx))
    # shown lines: fine (and the guard is keyed by the real path, so ./notes.txt is the same file)
    res = call("edit", {"path": "./notes.txt", "start_line": 2, "end_line": 3, "new": "two\nthree\nthree and a half"}, ctx)
    text = ok(res)
    assert text.startswith("Edited notes.txt: replaced lines 2-3 (old lines 2-3, now 3 lines). "
                           "Lines after old line 3 moved by +1 (old line 4 is now line 5)")
    assert (proj / "notes.txt").read_text().splitlines()[:5] == ["line 1", "two", "three", "three and a half", "line 4"]
    # line 10 (old line 9) moved and was not shown since ...
    assert "line 10 of notes.txt was not shown" in err(
        call("edit", {"path": "notes.txt", "start_line": 10, "new": "x"}, ctx))
    # ... but the context block (lines 1-8) was, so a chained edit inside it works
    text = ok(call("edit", {"path": "notes.txt", "start_line": 8, "new": "line seven"}, ctx))
    assert "moved" not in text and "notes.txt now, lines 4-11 of 11:" in text
    # the file changed on disk behind the model's back: everything must be read again
    ok(call("read", {"path": "notes.txt"}, ctx))
    (proj / "notes.txt").write_text("inserted\n" + (proj / "notes.txt").read_text())
    assert "changed on disk since you last saw it" in err(
        call("edit", {"path": "notes.txt", "start_line": 2, "new": "x"}, ctx))
    assert "you have not read" in err(call("edit", {"path": "notes.txt", "start_line": 2, "new": "x"}, ctx))
    ok(call("read", {"path": "notes.txt", "start_line": 1, "end_line": 3}, ctx))
    ok(call("edit", {"path": "notes.txt", "start_line": 1, "new": ""}, ctx))     # delete a line
    assert (proj / "notes.txt").read_text().startswith("line 1\ntwo\n")
    assert "outside notes.txt" in err(call("edit", {"path": "notes.txt", "start_line": 40, "new": "x"}, ctx))


def test_line_edit_after_search_and_long_lines(ctx, proj):
    ok(call("search", {"pattern": "line 7", "path": "notes.txt", "context": 1}, ctx))
    ok(call("edit", {"path": "notes.txt", "start_line": 6, "end_line": 8, "new": "six\nseven\neight\n"}, ctx))
    assert (proj / "notes.txt").read_text().splitlines()[5:8] == ["six", "seven", "eight"]
    # a line shown cut is not editable by number
    (proj / "wide.txt").write_text("short\n" + "y" * 3000 + "\n")
    ok(call("read", {"path": "wide.txt"}, ctx))
    ok(call("edit", {"path": "wide.txt", "start_line": 1, "new": "SHORT"}, ctx))
    assert "line 2 of wide.txt was not shown" in err(call("edit", {"path": "wide.txt", "start_line": 2, "new": "z"}, ctx))


# ---------------------------------------------------------------------------------------- paths

def test_paths_outside_the_project_are_refused(ctx, proj, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    (proj / "link.txt").symlink_to(secret)
    (proj / "linkdir").symlink_to(tmp_path)
    for args in ({"path": "../secret.txt"}, {"path": str(secret)}, {"path": "link.txt"},
                 {"path": "linkdir/secret.txt"}):
        assert "outside the project directory" in err(call("read", args, ctx))
    assert "outside the project" in err(call("write", {"path": "../evil.txt", "content": "x"}, ctx))
    assert not (tmp_path / "evil.txt").exists()
    assert "outside the project" in err(call("write", {"path": "linkdir/evil.txt", "content": "x"}, ctx))
    assert "outside the project" in err(call("edit", {"path": "link.txt", "old": "top", "new": "x"}, ctx))
    assert "outside the project" in err(call("list", {"path": ".."}, ctx))
    assert "outside the project" in err(call("search", {"pattern": "x", "path": "/"}, ctx))
    assert "outside the project" in err(call("outline", {"path": "../secret.txt"}, ctx))
    assert "outside the project" in err(call("git", {"subcommand": "diff", "path": "../x"}, ctx))
    # search does not follow a symlink out of the project either
    assert "top secret" not in ok(call("search", {"pattern": "secret"}, ctx))
    # the user may allow more
    free = ToolContext(root=proj, allow_outside=True)
    assert "top secret" in ok(call("read", {"path": "link.txt"}, free))
    assert "top secret" in ok(call("read", {"path": str(secret)}, free))
    ok(call("write", {"path": "../evil.txt", "content": "x"}, free))
    assert (tmp_path / "evil.txt").read_text() == "x"


# ---------------------------------------------------------------------------------------- list

def test_list(ctx, proj):
    (proj / "build").mkdir()
    (proj / "build" / "out.o").write_bytes(b"\0")
    (proj / "src" / "deep").mkdir()
    (proj / "src" / "deep" / "x.h").write_text("int x;\n")
    text = ok(call("list", {}, ctx))
    assert text.splitlines() == ["./", ".git/  (" + text.split(".git/  (")[1].split("\n")[0],
                                 "build/  (1 entry)", "src/  (2 entries)", ".gitignore  13B",
                                 "a.py  " + text.split("a.py  ")[1].split("\n")[0],
                                 "notes.txt  71B"]
    text = ok(call("list", {"path": "src", "depth": 3}, ctx))
    assert text.splitlines() == ["src/", "deep/", "  x.h  7B", "lib.c  " + text.split("lib.c  ")[1]]
    text = ok(call("list", {"depth": 2}, ctx))
    assert ".git/  (" in text and "not expanded" in text           # .git is never expanded
    assert "build/  (1 entry, not expanded)" in text                # git-ignored
    assert "  lib.c" in text
    (proj / "ln").symlink_to("src")
    assert "ln/ -> src" in ok(call("list", {}, ctx))
    assert "a file, not a directory" in ok(call("list", {"path": "a.py"}, ctx))
    assert "no such file" in err(call("list", {"path": "nowhere"}, ctx))


def test_list_limit_is_marked(ctx, proj):
    many = proj / "many"
    many.mkdir()
    for i in range(450):
        (many / f"f{i:03}").write_text("")
    res = call("list", {"path": "many"}, ctx)
    assert res.truncated and ok(res).splitlines()[-1].startswith("[... truncated after 400 entries")


# ---------------------------------------------------------------------------------------- search

def test_search_regex_literal_glob_context(ctx, proj):
    text = ok(call("search", {"pattern": r"def \w+\("}, ctx))
    assert text.splitlines()[0] == r"4 matching lines in 1 file for /def \w+\(/ in ."
    assert text.endswith("a.py\n10:    def __init__(self, name):\n--\n14:    def loud(self):\n--\n"
                         "19:def helper(x, y=2):\n--\n23:async def fetch():")
    # literal: regex characters are plain text
    text = ok(call("search", {"pattern": "SQUARE(x)", "literal": True}, ctx))
    assert "src/lib.c\n3:#define SQUARE(x) ((x) * (x))" in text and "1 matching line" in text
    assert "invalid regular expression" in err(call("search", {"pattern": "SQUARE(x"}, ctx))
    # case and glob
    assert "No matches" in ok(call("search", {"pattern": "greeter"}, ctx))
    assert "7:class Greeter:" in ok(call("search", {"pattern": "greeter", "ignore_case": True}, ctx))
    text = ok(call("search", {"pattern": "return", "glob": "*.c"}, ctx))
    assert "src/lib.c" in text and "a.py" not in text
    assert "src/lib.c" in ok(call("search", {"pattern": "return", "glob": "src/**/*.{c,h}"}, ctx))
    # context lines: `-` for context, `:` for matches, overlapping windows merged
    text = ok(call("search", {"pattern": "line [45]$", "path": "notes.txt", "context": 1}, ctx))
    assert text.split("\n\n", 1)[1] == "notes.txt\n3-line 3\n4:line 4\n5:line 5\n6-line 6"


def test_search_skips_ignored_and_binary_and_marks_max(ctx, proj):
    (proj / "build").mkdir()
    (proj / "build" / "gen.py").write_text("needle\n")
    (proj / "debug.log").write_text("needle\n")
    (proj / "data.bin").write_bytes(b"needle\0\0")
    (proj / "node_modules" / "m").mkdir(parents=True)
    (proj / "node_modules" / "m" / "i.js").write_text("needle\n")
    (proj / "kept.txt").write_text("needle\n" * 5)
    res = call("search", {"pattern": "needle"}, ctx)
    text = ok(res)
    assert text.startswith("5 matching lines in 1 file") and "1 binary files skipped" in text
    assert "build/" not in text and "debug.log" not in text and "node_modules" not in text
    # an ignored folder asked for by name is searched
    assert "gen.py" in ok(call("search", {"pattern": "needle", "path": "build"}, ctx))
    res = call("search", {"pattern": "needle", "max_matches": 2}, ctx)
    assert res.truncated and "[... truncated: stopped at max_matches=2; more matches exist" in ok(res)
    assert ok(res).count("\n1:") + ok(res).count("\n2:") == 2


# ---------------------------------------------------------------------------------------- bash

def test_bash_exit_status_and_output(ctx, proj):
    res = call("bash", {"command": "echo out; echo err >&2; pwd; exit 3"}, ctx)
    text = ok(res)
    assert res.exit_status == 3
    assert "finished after" in text and "exit status 3" in text
    assert text.endswith(f"output:\nout\nerr\n{os.path.realpath(proj)}")
    res = call("bash", {"command": "cat; true"}, ctx)        # stdin is empty: cat ends at once
    assert res.exit_status == 0 and "no output" in ok(res)
    res = call("bash", {"command": "kill -TERM $$"}, ctx)
    assert res.exit_status == 143 and "killed by SIGTERM" in ok(res)
    assert "command is empty" in err(call("bash", {"command": "  "}, ctx))
    assert "must be in 0..600" in err(call("bash", {"command": "true", "timeout": 601}, ctx))


def test_bash_long_output_head_tail_and_log(ctx):
    res = call("bash", {"command": "seq 1 1000; printf '\\033[31mred\\033[0m\\n'"}, ctx)
    text = ok(res)
    assert res.truncated and res.exit_status == 0
    log = text.split("full log: ")[1].split(")")[0]
    assert Path(log).read_text().startswith("1\n2\n")
    lines = text.splitlines()
    assert lines[2:4] == ["1", "2"]
    assert "[... truncated: log lines 41-921 not shown; read them with read path=" in text
    assert lines[-2:] == ["1000", "red"]                    # colour codes removed
    # the log is outside the project, yet the read tool can open it
    part = ok(call("read", {"path": log, "start_line": 41, "end_line": 42}, ctx))
    assert part.splitlines()[1:] == ["41\t41", "42\t42"]


def test_bash_background_job_status_and_stop(ctx, proj):
    cmd = "echo start; while [ ! -e go ]; do sleep 0.02; done; echo done"
    first = call("bash", {"command": cmd, "timeout": 0.3}, ctx)
    assert "still running as job 1" in ok(first) and first.exit_status is None
    (proj / "go").touch()
    res = call("bash_status", {"job": 1, "wait": 10}, ctx)
    assert res.exit_status == 0 and "finished" in ok(res)
    # each observation shows only what is new (a slow machine may not have printed "start" yet)
    assert ((first.text.endswith("output:\nstart") and res.text.endswith("new output (log lines 2-2):\ndone"))
            or (first.text.endswith("no output") and res.text.endswith("output:\nstart\ndone")))
    assert "no new output" in ok(call("bash_status", {"job": 1}, ctx))

    marker = proj / "child.pid"
    res = call("bash", {"command": f"sleep 30 & echo $! > {marker}.tmp; mv {marker}.tmp {marker}; wait",
                        "timeout": 0.2}, ctx)
    assert "still running as job 2" in ok(res)
    for _ in range(250):
        if marker.exists():
            break
        time.sleep(0.02)
    child = int(marker.read_text())
    jobs = ok(call("bash_status", {}, ctx))
    assert "job 1: exit status 0" in jobs and "job 2: running" in jobs
    t0 = time.monotonic()
    res = call("bash_stop", {"job": 2}, ctx)
    assert time.monotonic() - t0 < 5
    assert "stopped by bash_stop" in ok(res) and res.exit_status == 143
    time.sleep(0.05)
    assert not alive(child)                        # the whole process group is gone
    assert "no bash job 9 (jobs: 1, 2)" in err(call("bash_status", {"job": 9}, ctx))
    assert "no bash job" in err(call("bash_stop", {"job": 9}, ctx))


def test_bash_logs_go_to_scratch_or_a_temp_dir_removed_on_close(proj, tmp_path):
    c = ToolContext(root=proj)
    text = ok(call("bash", {"command": "echo hi"}, c))
    d = Path(c.state["bash_log_dir"])
    assert d.is_dir() and not str(d).startswith(str(proj))
    ok(call("bash", {"command": "sleep 30", "timeout": 0}, c))
    proc = c.state["bash_jobs"][2].proc
    tools.close(c)
    assert not d.exists() and proc.poll() is not None
    assert text


# ---------------------------------------------------------------------------------------- git

def test_git_read_only_subcommands(ctx, proj):
    assert "(nothing to commit: the working tree is clean)" in ok(call("git", {"subcommand": "status"}, ctx))
    (proj / "a.py").write_text(PY_SRC.replace("LIMIT = 10", "LIMIT = 11"))
    (proj / "fresh.txt").write_text("new\n")
    text = ok(call("git", {"subcommand": "status"}, ctx))
    assert "## main" in text and " M a.py" in text and "?? fresh.txt" in text
    text = ok(call("git", {"subcommand": "diff"}, ctx))
    assert "-LIMIT = 10\n+LIMIT = 11" in text
    assert "a.py | 2 +-" in ok(call("git", {"subcommand": "diff", "stat": True}, ctx))
    assert "no differences" in ok(call("git", {"subcommand": "diff", "staged": True}, ctx))
    git(proj, "add", "a.py")
    assert "+LIMIT = 11" in ok(call("git", {"subcommand": "diff", "staged": True}, ctx))
    assert "no differences" in ok(call("git", {"subcommand": "diff", "path": "src"}, ctx))
    text = ok(call("git", {"subcommand": "log"}, ctx))
    assert text.endswith("Tester (HEAD -> main): initial") and len(text.splitlines()) == 1
    text = ok(call("git", {"subcommand": "show"}, ctx))
    assert "initial" in text and "+LIMIT = 10" in text and "Author:" in text
    assert "LIMIT = 10" in ok(call("git", {"subcommand": "show", "ref": "HEAD:a.py"}, ctx))
    assert "looks like an option" in err(call("git", {"subcommand": "log", "ref": "--output=/tmp/x"}, ctx))
    assert "git show failed" in err(call("git", {"subcommand": "show", "ref": "nosuchref"}, ctx))
    assert "staged applies to subcommand=diff only" in err(call("git", {"subcommand": "log", "staged": True}, ctx))


def test_git_commit_and_log(ctx, proj):
    assert "nothing is staged" in err(call("git_commit", {"message": "empty"}, ctx))
    (proj / "fresh.txt").write_text("new\n")
    (proj / "notes.txt").write_text("changed\n")
    res = call("git_commit", {"message": "Add fresh\n\nDetails.", "paths": ["fresh.txt"]}, ctx)
    text = ok(res)
    assert text.startswith("Committed ") and "Add fresh" in text and "fresh.txt | 1 +" in text
    assert "+new" in res.diff
    assert git(proj, "status", "--porcelain") == " M notes.txt\n"         # only what was asked
    res = call("git_commit", {"message": "Update notes", "all": True}, ctx)
    assert "notes.txt" in ok(res)
    assert git(proj, "status", "--porcelain") == ""
    for i in range(3):
        (proj / "notes.txt").write_text(f"v{i}\n")
        ok(call("git_commit", {"message": f"v{i}", "all": True}, ctx))
    res = call("git", {"subcommand": "log", "max_count": 2}, ctx)
    lines = ok(res).splitlines()
    assert lines[0].endswith(": v2") and lines[1].endswith(": v1") and res.truncated
    assert lines[2].startswith("[... truncated: older commits not shown")
    assert "Update notes" in ok(call("git", {"subcommand": "log", "path": "notes.txt", "max_count": 10}, ctx))
    assert "must not be empty" in err(call("git_commit", {"message": "  "}, ctx))


def test_git_outside_a_repository(tmp_path):
    c = ToolContext(root=tmp_path)
    assert "not inside a git repository" in err(call("git", {"subcommand": "status"}, c))


# ---------------------------------------------------------------------------------------- outline

def test_outline_python(ctx):
    text = ok(call("outline", {"path": "a.py"}, ctx))
    assert text.splitlines()[0] == "a.py (python, 24 lines, 7 symbols; LINES  signature):"
    body = text.splitlines()[1:]
    assert body == ["4-4  LIMIT = 10", "7-15  class Greeter", '8-8    greeting: str = "hi"',
                    "10-11    def __init__(self, name)", "13-15    def loud(self)",
                    "18-20  def helper(x, y=2)", "23-24  async def fetch()"]


def test_outline_c(ctx):
    text = ok(call("outline", {"path": "src/lib.c"}, ctx))
    assert text.splitlines()[1:] == [
        "2-2  #define MAX_ITEMS 16",
        "3-3  #define SQUARE(x) ((x) * (x))",
        "5-7  typedef struct {…} point",
        "9-12  struct node",
        "14-14  enum color",
        "16-19  static int *find(struct node *head, int value)",
        "21-24  int main(void)",
    ]


def test_outline_find_definition_and_folders(ctx, proj):
    (proj / "src" / "lib.h").write_text("struct node;\nint *find(struct node *head, int value);\n")
    text = ok(call("outline", {"name": "find"}, ctx))
    assert text.splitlines() == [
        "2 definitions of find:",
        "src/lib.c:16-19  function find: static int *find(struct node *head, int value)",
        "src/lib.h:2-2  declaration find: int *find(struct node *head, int value)"]
    text = ok(call("outline", {"name": "Greeter.loud"}, ctx))
    assert text.splitlines()[1] == "a.py:13-15  method Greeter.loud: def loud(self)"
    assert "No definition of nothing_here" in ok(call("outline", {"name": "nothing_here"}, ctx))
    assert "1 definition of main" in ok(call("outline", {"name": "main", "path": "src"}, ctx))
    text = ok(call("outline", {"path": "."}, ctx))
    assert "a.py\n  4-4  LIMIT = 10\n  7-15  class Greeter\n  18-20" in text and "src/lib.c" in text
    assert "no outline for this file type" in err(call("outline", {"path": "notes.txt"}, ctx))
    assert "give path" in err(call("outline", {}, ctx))


@pytest.mark.parametrize("name,src,want", [
    ("m.go", "package m\ntype T struct{ a int }\nfunc (t *T) Get() int { return t.a }\nfunc New() *T { return nil }\n",
     ["2-2  type T struct{…}", "3-3  func (t *T) Get() int", "4-4  func New() *T"]),
    ("m.rs", "struct S { a: i32 }\nimpl S {\n    fn get(&self) -> i32 { self.a }\n}\nfn main() {}\n",
     ["1-1  struct S", "2-4  impl S", "3-3    fn get(&self) -> i32", "5-5  fn main()"]),
    ("m.ts", "export function f(a: number): number { return a }\nexport class K {\n  m(): void {}\n}\n"
             "interface I { x: number }\nconst g = (x: number) => x * 2;\n",
     ["1-1  export function f(a: number): number", "2-4  export class K", "3-3    m(): void",
      "5-5  interface I", "6-6  const g = (x: number) => x * 2"]),
    ("M.java", "class M {\n  M() {}\n  int get(int a) { return a; }\n}\n",
     ["1-4  class M", "2-2    M()", "3-3    int get(int a)"]),
    ("m.cpp", "namespace ns {\nclass A {\n public:\n  int m(int x) const { return x; }\n  void n();\n};\n}\n"
              "void ns::A::n() {}\n",
     ["1-7  namespace ns", "2-6    class A", "4-4      int m(int x) const", "5-5      void n()",
      "8-8  void ns::A::n()"]),
])
def test_outline_other_languages(ctx, proj, name, src, want):
    (proj / name).write_text(src)
    assert ok(call("outline", {"path": name}, ctx)).splitlines()[1:] == want
