"""No path of a particular machine in the package: no string literal in the five packages names an
absolute folder outside the package, the user's home (Path.home(), "~") or the system's temp folder
(tempfile). ds4-bench once found its default text through Path("/work")/..., a folder that exists
only where this project is developed."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "ds4agent", "sessions", "prompts", "tools")

# The operating system's own interfaces, the same path on every Linux or macOS machine: they name
# no folder of a particular machine.
SYSTEM = ("/proc/", "/proc", "/sys/", "/dev/", "/bin/sh", "/usr/bin/env")
# Top-level folders of Linux, macOS and the usual cluster and cloud mounts. Everything in them is
# particular to a machine (a checkout, a user, a mount, an install), or is the temp folder, which
# the code finds through tempfile. A literal like "/help" or "/v1/models" (a command, a route) or
# "/queue" (a suffix joined to a found path) names no folder.
ROOTS = {"work", "home", "Users", "root", "mnt", "media", "opt", "srv", "var", "tmp", "data", "scratch",
         "Volumes", "private", "workspace", "workspaces", "content", "kaggle", "nfs", "net", "gpfs", "lustre",
         "shared", "usr", "etc", "lib", "lib64", "Library", "Applications", "System", "snap", "run", "boot",
         "cluster", "project", "projects", "storage", "efs", "fsx", "app", "code", "src", "build", "repo",
         "github", "runner", "builds", "local"}
# an absolute path inside a literal: "/" + a name, not preceded by a name, a dot, ":" (a URL), "~" or "/"
ABSOLUTE = re.compile(r"(?<![\w.:~/$-])/([A-Za-z_][\w.-]*)")


def machine_paths(source: str) -> list[tuple[int, str]]:
    """(line, literal) for each string literal of `source` that names an absolute machine folder."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        s = node.value
        for m in ABSOLUTE.finditer(s):
            if s.startswith(SYSTEM, m.start()):
                continue
            if m.group(1) in ROOTS:
                found.append((node.lineno, s[:80]))
                break
    return found


def test_no_string_literal_names_a_machine_folder():
    files = [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 100, "the packages were not found: the check would prove nothing"
    bad = [f"{f.relative_to(ROOT)}:{line}: {lit!r}" for f in files
           for line, lit in machine_paths(f.read_text(encoding="utf-8"))]
    assert not bad, "absolute folders of a particular machine:\n" + "\n".join(bad)


def test_the_scan_finds_what_it_looks_for():
    """The rule on known cases: the literal ds4-bench had, and what must pass."""
    old_bench = 'DEFAULT = [Path(__file__).parent / "x", Path("/work") / "shared"]'
    assert [lit for _, lit in machine_paths(old_bench)] == ["/work"]
    for bad in ('"/home/alice/models"', '"/tmp/ds4.sock"', 'f"/Users/{u}/x"', '"see /mnt/data/m.gguf"',
                '"/usr/local/cuda"'):
        assert machine_paths(bad), bad
    for ok in ('"/proc/self/status"', '"/dev/null"', '"/bin/sh"', '"/help"', '"/v1/models"', '"/queue"',
               '"https://host/home/x"', '"~/models"', '"a/tmp/b"', '"$HOME/x"', '"../shared/x"'):
        assert not machine_paths(ok), ok
