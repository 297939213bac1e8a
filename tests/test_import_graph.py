"""The project's own import graph: no cycles among modules, and the layers point down only
(DEVELOPERS.md): ds4agent -> prompts, sessions, tools; prompts, sessions -> engine; tools
imports nothing of ours outside tools; engine imports none of the others.

The graph is read with `ast` from every .py file under the five packages (files are found,
not listed, so modules can move between folders), imports inside functions included: a
deferred import still ties the two modules together (that is how the wire modules hid their
cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ds4agent", "prompts", "sessions", "tools", "engine")

# layer -> the top-level packages of ours it may import (itself always allowed)
ALLOWED = {
    "ds4agent": {"prompts", "sessions", "tools", "engine"},
    "prompts": {"engine"},
    "sessions": {"engine"},
    "tools": set(),
    "engine": set(),
}


def module_names(root: Path, packages) -> dict[str, Path]:
    """dotted module name -> file, for every .py file under the packages."""
    mods = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` names the
    submodule pkg.name when one exists, else the package itself)."""
    mods = module_names(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def own(name: str) -> str | None:
        # the longest prefix of `name` that is one of our modules
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in mods:
                return cand
        return None

    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                dep = own(t)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (sorted)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    comps = {frozenset(u for u in reach[v] if v in reach[u]) | {v} for v in graph}
    return sorted(sorted(c) for c in comps if len(c) > 1)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        for dep in sorted(deps):
            other = dep.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                bad.append(f"{mod} imports {dep}")
    return bad


# --------------------------------------------------------------------------- the project

def test_the_graph_covers_every_package():
    graph = import_graph(ROOT)
    for pkg in PACKAGES:
        assert pkg in graph, f"{pkg}/__init__.py not found"
    assert len(graph) > 60
    assert "prompts.dsml_stream" in graph["prompts.dsml_parse"]
    across = {(m.split(".")[0], d.split(".")[0]) for m, deps in graph.items() for d in deps}
    assert {("ds4agent", "prompts"), ("ds4agent", "engine"), ("sessions", "engine")} <= across


def test_no_import_cycles():
    found = cycles(import_graph(ROOT))
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layers_point_down_only():
    bad = layer_violations(import_graph(ROOT))
    assert bad == [], "imports against the layers:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- the checker itself

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_a_deferred_import_cycle_is_found(tmp_path):
    # the shape the wire modules had: the base module imports a subclass inside a function
    root = _tree(tmp_path, {
        "ds4agent/__init__.py": "",
        "ds4agent/serve/__init__.py": "",
        "ds4agent/serve/wire.py": "def make():\n    from .wire_chat import ChatWire\n",
        "ds4agent/serve/wire_chat.py": "from .wire import make\n",
        "ds4agent/serve/app.py": "from . import wire\nfrom ds4agent.serve.wire_chat import x\n",
    })
    graph = import_graph(root, ("ds4agent",))
    assert graph["ds4agent.serve.app"] == {"ds4agent.serve.wire", "ds4agent.serve.wire_chat"}
    assert cycles(graph) == [["ds4agent.serve.wire", "ds4agent.serve.wire_chat"]]


def test_an_upward_import_is_named(tmp_path):
    root = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/model/__init__.py": "",
        "engine/model/m.py": "import prompts.render\nfrom ..x import y\n",
        "engine/x.py": "",
        "prompts/__init__.py": "",
        "prompts/render.py": "from engine.model import m\n",
        "tools/__init__.py": "from prompts import render\n",
    })
    graph = import_graph(root, ("engine", "prompts", "tools"))
    assert graph["engine.model.m"] == {"prompts.render", "engine.x"}
    assert layer_violations(graph) == ["engine.model.m imports prompts.render",
                                       "tools imports prompts.render"]
    assert cycles(graph) == [["engine.model.m", "prompts.render"]]
