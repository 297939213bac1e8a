"""outline: a file's symbols with line ranges (tree-sitter), or where a name is defined.

The model reads a large file cheaply by looking at its outline first and then reading only the
lines of the function it needs; `name=` finds a definition in the project without a regex.
Languages: Python, JavaScript, TypeScript/TSX, C, C++, Go, Rust, Java, Ruby.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from .base import MAX_RESULT_CHARS, Tool, ToolContext, ToolError, ToolResult, register
from .fileutil import MAX_FILE_BYTES, is_binary, load_text, project_files
from .safefs import read_inside

LANG_BY_EXT = {
    ".py": "python", ".pyi": "python", ".pyw": "python",
    ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript", ".jsx": "javascript",
    ".ts": "typescript", ".mts": "typescript", ".cts": "typescript", ".tsx": "tsx",
    ".c": "c", ".h": "c",
    ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".c++": "cpp", ".hpp": "cpp", ".hh": "cpp",
    ".hxx": "cpp", ".h++": "cpp", ".ipp": "cpp", ".inl": "cpp", ".cu": "cpp", ".cuh": "cpp",
    ".go": "go", ".rs": "rust", ".java": "java", ".rb": "ruby",
}
HEADER_EXTS = {".h", ".hpp", ".hh", ".hxx", ".h++", ".cuh"}
SIG_CHARS = 160
MAX_DIR_FILES = 300          # a folder outline parses at most this many files
MAX_DEFINITIONS = 50

# Nodes whose text is elided as {…} in a signature.
_BLOCKS = {"block", "compound_statement", "field_declaration_list", "declaration_list", "class_body",
           "interface_body", "enum_body", "statement_block", "enumerator_list", "enum_variant_list",
           "object_type", "constructor_body", "body_statement"}


@dataclass
class Sym:
    kind: str
    name: str
    qual: str          # Container.name
    line: int          # first line (decorators / export included)
    end: int
    depth: int
    sig: str


@functools.lru_cache(maxsize=None)
def _parser(lang: str):
    try:
        from tree_sitter_language_pack import get_parser
    except ImportError:
        raise ToolError("outline needs the tree-sitter-language-pack package") from None
    return get_parser(lang)


def _text(src: bytes, node) -> str:
    return src[node.start_byte:node.end_byte].decode("utf-8", "replace")


def _squash(s: str, limit: int = SIG_CHARS) -> str:
    s = " ".join(s.split())
    return s if len(s) <= limit else s[:limit - 1] + "…"


def _elided(src: bytes, node) -> str:
    """The node's text with nested bodies replaced by {…}."""
    spans: list[tuple[int, int]] = []

    def find(n):
        for ch in n.children:
            if ch.type in _BLOCKS or ch.type == "interface_type":
                spans.append((ch.start_byte, ch.end_byte))
            else:
                find(ch)
    find(node)
    out, pos = [], node.start_byte
    for a, b in spans:
        out.append(src[pos:a].decode("utf-8", "replace"))
        out.append("interface{…}" if src[a:a + 9] == b"interface" else "{…}")
        pos = b
    out.append(src[pos:node.end_byte].decode("utf-8", "replace"))
    return "".join(out)


def _header(src: bytes, node, body=None) -> str:
    body = body if body is not None else node.child_by_field_name("body")
    if body is not None and body.type in _BLOCKS:
        s = src[node.start_byte:body.start_byte].decode("utf-8", "replace")
        return _squash(s).rstrip(" :{")
    return _squash(_elided(src, node)).rstrip(" ;")


def _first_line(src: bytes, node, limit: int = 100) -> str:
    s = _text(src, node).split("\n", 1)[0]
    return _squash(s, limit)


def _c_name(node) -> str | None:
    """The identifier at the bottom of a C/C++ declarator chain."""
    while node is not None:
        if node.type in ("identifier", "field_identifier", "type_identifier", "qualified_identifier",
                         "destructor_name", "operator_name", "primitive_type"):
            return node
        nxt = node.child_by_field_name("declarator")
        if nxt is None:
            nxt = next((c for c in node.named_children if c.type.endswith(("declarator", "identifier"))), None)
        node = nxt
    return None


def _has_function_declarator(node) -> bool:
    d = node.child_by_field_name("declarator")
    while d is not None:
        if d.type == "function_declarator":
            return True
        d = d.child_by_field_name("declarator")
    return False


class _Walker:
    def __init__(self, lang: str, src: bytes, header_file: bool):
        self.lang, self.src, self.header_file = lang, src, header_file
        self.out: list[Sym] = []

    def add(self, node, kind: str, name: str, depth: int, qual: str, start: int | None,
            sig: str) -> Sym:
        q = f"{qual}.{name}" if qual else name
        end = node.end_point[0] + (0 if node.end_point[1] == 0 and node.end_point[0] > node.start_point[0] else 1)
        s = Sym(kind, name, q, start or node.start_point[0] + 1, end, depth, sig)
        self.out.append(s)
        return s

    def children(self, node, depth: int, qual: str) -> None:
        for ch in node.named_children:
            self.visit(ch, depth, qual, None)

    def visit(self, node, depth: int, qual: str, start: int | None) -> None:
        getattr(self, "v_" + self.lang.replace("tsx", "typescript"))(node, depth, qual, start)

    # -- Python
    def v_python(self, n, depth, qual, start):
        t, src = n.type, self.src
        if t == "decorated_definition":
            d = n.child_by_field_name("definition")
            if d is not None:
                self.visit(d, depth, qual, start or n.start_point[0] + 1)
        elif t in ("class_definition", "function_definition"):
            name = _text(src, n.child_by_field_name("name"))
            kind = "class" if t == "class_definition" else ("method" if depth else "function")
            self.add(n, kind, name, depth, qual, start, _header(src, n))
            if t == "class_definition" and n.child_by_field_name("body") is not None:
                self.children(n.child_by_field_name("body"), depth + 1, f"{qual}.{name}" if qual else name)
        elif t == "expression_statement":
            self.children(n, depth, qual)
        elif t == "assignment":
            left = n.child_by_field_name("left")
            if left is not None and left.type == "identifier":
                self.add(n, "variable", _text(src, left), depth, qual, start, _first_line(src, n))

    # -- JavaScript / TypeScript
    def v_javascript(self, n, depth, qual, start):
        t, src = n.type, self.src
        kinds = {"function_declaration": "function", "generator_function_declaration": "function",
                 "function_signature": "function", "class_declaration": "class",
                 "abstract_class_declaration": "class", "class": "class",
                 "method_definition": "method", "abstract_method_signature": "method",
                 "interface_declaration": "interface", "type_alias_declaration": "type",
                 "enum_declaration": "enum", "internal_module": "namespace", "module": "namespace"}
        if t in ("export_statement", "ambient_declaration"):
            first = len(self.out)
            for ch in n.named_children:
                self.visit(ch, depth, qual, start or n.start_point[0] + 1)
            word = _text(src, n).split("{", 1)[0].split()
            word = " ".join(word[:2]) if word[:2] == ["export", "default"] else word[0] if word else ""
            for sym in self.out[first:]:
                if sym.depth == depth and not sym.sig.startswith(word):
                    sym.sig = f"{word} {sym.sig}"
        elif t == "expression_statement" and depth == 0:
            self.children(n, depth, qual)
        elif t in kinds:
            name_node = n.child_by_field_name("name")
            name = _text(src, name_node) if name_node is not None else "default"
            self.add(n, kinds[t], name, depth, qual, start, _header(src, n))
            if t in ("class_declaration", "abstract_class_declaration", "class", "internal_module", "module"):
                body = n.child_by_field_name("body")
                if body is not None:
                    self.children(body, depth + 1, f"{qual}.{name}" if qual else name)
        elif t in ("lexical_declaration", "variable_declaration") and depth == 0:
            for d in n.named_children:
                if d.type != "variable_declarator":
                    continue
                nm, val = d.child_by_field_name("name"), d.child_by_field_name("value")
                if nm is None or nm.type != "identifier":
                    continue
                fn = val is not None and val.type in ("arrow_function", "function_expression",
                                                      "function", "generator_function")
                if fn:
                    sig = _header(src, n, val.child_by_field_name("body"))
                elif val is not None and val.type == "class":
                    sig = _header(src, n, val.child_by_field_name("body"))
                else:
                    sig = _first_line(src, n)
                kind = "function" if fn else ("class" if val is not None and val.type == "class" else "variable")
                self.add(n, kind, _text(src, nm), depth, qual, start, sig)

    v_typescript = v_javascript

    # -- C and C++
    def v_c(self, n, depth, qual, start):
        t, src = n.type, self.src
        if t in ("preproc_ifdef", "preproc_if", "preproc_else", "preproc_elif", "preproc_elifdef",
                 "linkage_specification", "declaration_list"):
            body = n.child_by_field_name("body") if t == "linkage_specification" else None
            self.children(body if body is not None else n, depth, qual)
        elif t == "template_declaration":
            for ch in n.named_children:
                self.visit(ch, depth, qual, start or n.start_point[0] + 1)
        elif t == "function_definition":
            nm = _c_name(n.child_by_field_name("declarator"))
            if nm is not None:
                full = _text(src, nm)
                name = re.split(r"::", full)[-1]
                q = qual or "::".join(full.split("::")[:-1]).replace("::", ".")
                self.add(n, "method" if depth else "function", name, depth, q, start, _header(src, n))
        elif t in ("declaration", "field_declaration") and _has_function_declarator(n):
            if self.header_file or t == "field_declaration" or depth:
                nm = _c_name(n.child_by_field_name("declarator"))
                if nm is not None:
                    name = _text(src, nm).split("::")[-1]
                    self.add(n, "declaration", name, depth, qual, start, _header(src, n))
        elif t in ("struct_specifier", "union_specifier", "enum_specifier", "class_specifier"):
            nm, body = n.child_by_field_name("name"), n.child_by_field_name("body")
            if nm is not None and body is not None:
                name = _text(src, nm)
                self.add(n, t.split("_")[0], name, depth, qual, start, _header(src, n))
                if self.lang == "cpp" and t != "enum_specifier":
                    self.children(body, depth + 1, f"{qual}.{name}" if qual else name)
        elif t in ("declaration", "field_declaration"):
            # `struct s {...} x;` declares the struct too
            ty = n.child_by_field_name("type")
            if ty is not None and ty.type in ("struct_specifier", "union_specifier", "enum_specifier",
                                              "class_specifier"):
                self.visit(ty, depth, qual, start or n.start_point[0] + 1)
        elif t == "type_definition":
            nm = _c_name(n.child_by_field_name("declarator"))
            if nm is not None:
                self.add(n, "typedef", _text(src, nm), depth, qual, start, _header(src, n))
        elif t in ("preproc_def", "preproc_function_def"):
            nm = n.child_by_field_name("name")
            if nm is not None:
                self.add(n, "macro", _text(src, nm), depth, qual, start, _first_line(src, n))
        elif t == "namespace_definition":
            nm, body = n.child_by_field_name("name"), n.child_by_field_name("body")
            name = _text(src, nm) if nm is not None else "(anonymous)"
            self.add(n, "namespace", name, depth, qual, start, _header(src, n))
            if body is not None:
                self.children(body, depth + 1, f"{qual}.{name}" if qual else name)
        elif t in ("access_specifier",):
            pass

    v_cpp = v_c

    # -- Go
    def v_go(self, n, depth, qual, start):
        t, src = n.type, self.src
        if t == "function_declaration":
            self.add(n, "func", _text(src, n.child_by_field_name("name")), depth, qual, start,
                     _header(src, n))
        elif t == "method_declaration":
            recv = n.child_by_field_name("receiver")
            m = re.search(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\s*\)\s*$", _text(src, recv) if recv else "")
            self.add(n, "method", _text(src, n.child_by_field_name("name")), depth,
                     m.group(1) if m else qual, start, _header(src, n))
        elif t == "type_declaration":
            for spec in n.named_children:
                if spec.type in ("type_spec", "type_alias"):
                    nm = spec.child_by_field_name("name")
                    if nm is not None:
                        self.add(spec, "type", _text(src, nm), depth, qual,
                                 start or (n.start_point[0] + 1 if len(n.named_children) == 1 else None),
                                 "type " + _squash(_elided(src, spec)))
        elif t in ("const_declaration", "var_declaration"):
            for spec in n.named_children:
                for nm in spec.children_by_field_name("name") if spec.type in ("const_spec", "var_spec") else []:
                    self.add(spec, t.split("_")[0], _text(src, nm), depth, qual, None,
                             t.split("_")[0] + " " + _first_line(src, spec))

    # -- Rust
    def v_rust(self, n, depth, qual, start):
        t, src = n.type, self.src
        kinds = {"function_item": "fn", "function_signature_item": "fn", "struct_item": "struct",
                 "enum_item": "enum", "union_item": "union", "type_item": "type",
                 "const_item": "const", "static_item": "static", "macro_definition": "macro",
                 "trait_item": "trait", "mod_item": "mod"}
        if t in kinds:
            nm = n.child_by_field_name("name")
            if nm is None:
                return
            name = _text(src, nm)
            kind = "method" if t == "function_item" and depth else kinds[t]
            sig = _first_line(src, n) if t in ("const_item", "static_item", "macro_definition") else _header(src, n)
            self.add(n, kind, name, depth, qual, start, sig)
            body = n.child_by_field_name("body")
            if t in ("trait_item", "mod_item") and body is not None:
                self.children(body, depth + 1, f"{qual}.{name}" if qual else name)
        elif t == "impl_item":
            ty = n.child_by_field_name("type")
            name = _text(src, ty) if ty is not None else "?"
            self.add(n, "impl", name, depth, qual, start, _header(src, n))
            body = n.child_by_field_name("body")
            if body is not None:
                self.children(body, depth + 1, re.sub(r"<.*", "", name))

    # -- Java
    def v_java(self, n, depth, qual, start):
        t, src = n.type, self.src
        containers = {"class_declaration": "class", "interface_declaration": "interface",
                      "enum_declaration": "enum", "record_declaration": "record",
                      "annotation_type_declaration": "annotation"}
        if t in containers:
            name = _text(src, n.child_by_field_name("name"))
            self.add(n, containers[t], name, depth, qual, start, _header(src, n))
            body = n.child_by_field_name("body")
            if body is not None:
                self.children(body, depth + 1, f"{qual}.{name}" if qual else name)
        elif t == "enum_body_declarations":
            self.children(n, depth, qual)
        elif t in ("method_declaration", "constructor_declaration"):
            self.add(n, "method" if t == "method_declaration" else "constructor",
                     _text(src, n.child_by_field_name("name")), depth, qual, start, _header(src, n))

    # -- Ruby
    def v_ruby(self, n, depth, qual, start):
        t, src = n.type, self.src
        if t in ("class", "module"):
            name = _text(src, n.child_by_field_name("name"))
            self.add(n, t, name, depth, qual, start, _header(src, n))
            body = n.child_by_field_name("body")
            if body is not None:
                self.children(body, depth + 1, f"{qual}.{name}" if qual else name)
        elif t in ("method", "singleton_method"):
            self.add(n, "method" if depth else "def", _text(src, n.child_by_field_name("name")), depth,
                     qual, start, _header(src, n))


def language_of(path: Path) -> str | None:
    return LANG_BY_EXT.get(path.suffix.lower())


def symbols(path: Path, src: bytes) -> list[Sym]:
    lang = language_of(path)
    if lang is None:
        return []
    w = _Walker(lang, src, path.suffix.lower() in HEADER_EXTS)
    w.children(_parser(lang).parse(src).root_node, 0, "")
    return w.out


def _format(syms: list[Sym], *, max_depth: int | None = None) -> list[str]:
    return [f"{s.line}-{s.end}  {'  ' * s.depth}{s.sig}" for s in syms
            if max_depth is None or s.depth <= max_depth]


def _supported() -> str:
    return ", ".join(sorted(set(LANG_BY_EXT.values())))


def _outline_file(ctx: ToolContext, path: Path) -> ToolResult:
    rel = ctx.rel(path)
    lang = language_of(path)
    if lang is None:
        raise ToolError(f"{rel}: no outline for this file type (supported: {_supported()}); use "
                        "read or search")
    data, _, _ = load_text(ctx, path)
    syms = symbols(path, data)
    nlines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    if not syms:
        return ToolResult(f"{rel} ({lang}, {nlines} lines): no symbols found")
    body, cut = [], False
    used = 0
    for line in _format(syms):
        if used + len(line) > MAX_RESULT_CHARS - 300:
            cut = True
            break
        body.append(line)
        used += len(line) + 1
    head = f"{rel} ({lang}, {nlines} lines, {len(syms)} symbols; LINES  signature):"
    if cut:
        body.append(f"[... truncated: {len(syms) - len(body)} more symbols; read the rest of the "
                    f"file from line {syms[len(body)].line} ...]")
    return ToolResult("\n".join([head] + body), truncated=cut)


def _source_files(ctx: ToolContext, base: Path) -> tuple[list[Path], bool]:
    files, hit = project_files(ctx, base)
    return [f for f in files if language_of(f) is not None], hit


def _read_small(ctx: ToolContext, f: Path) -> bytes | None:
    try:     # through a descriptor checked to be inside (a symlink swapped in since the listing)
        _, data = read_inside(ctx, f, MAX_FILE_BYTES)
    except (OSError, ToolError):
        return None
    return None if data is None or is_binary(data) else data


def _outline_dir(ctx: ToolContext, base: Path) -> ToolResult:
    files, _ = _source_files(ctx, base)
    if not files:
        raise ToolError(f"{ctx.rel(base)}: no source files of a supported language ({_supported()})")
    out, used, cut_files = [], 0, 0
    for i, f in enumerate(files):
        if i >= MAX_DIR_FILES or used > MAX_RESULT_CHARS - 500:
            cut_files = len(files) - i
            break
        data = _read_small(ctx, f)
        if data is None:
            continue
        lines = _format(symbols(f, data), max_depth=0)
        block = "\n".join([ctx.rel(f)] + [f"  {l}" for l in lines])
        if used + len(block) > MAX_RESULT_CHARS - 500 and out:
            cut_files = len(files) - i
            break
        out.append(block)
        used += len(block) + 1
    text = (f"{ctx.rel(base)}: top-level symbols of {len(files)} source files (LINES  signature; "
            f"outline a file for its methods):\n" + "\n".join(out))
    if cut_files:
        text += (f"\n[... truncated: {cut_files} more files not shown; outline a subfolder or a "
                 "single file ...]")
    return ToolResult(text, truncated=bool(cut_files))


def _find(ctx: ToolContext, name: str, base: Path) -> ToolResult:
    leaf = re.split(r"\.|::", name)[-1]
    want = name.replace("::", ".")
    if not leaf:
        raise ToolError("name must be a symbol name such as parse_args or Config.load")
    files, _ = _source_files(ctx, base)
    key = leaf.encode()
    found: list[tuple[Path, Sym]] = []
    for f in files:
        data = _read_small(ctx, f)
        if data is None or key not in data:
            continue
        for s in symbols(f, data):
            if s.name == leaf and (want == leaf or s.qual == want or s.qual.endswith("." + want)):
                found.append((f, s))
    where = ctx.rel(base)
    if not found:
        return ToolResult(f"No definition of {name} found in {len(files)} source files under "
                          f"{where} (languages: {_supported()}); try search")
    # definitions before declarations (C prototypes)
    found.sort(key=lambda fs: (fs[1].kind == "declaration", str(fs[0]), fs[1].line))
    lines = [f"{ctx.rel(f)}:{s.line}-{s.end}  {s.kind} {s.qual}: {s.sig}" for f, s in found[:MAX_DEFINITIONS]]
    text = f"{len(found)} definition{'s' if len(found) != 1 else ''} of {name}:\n" + "\n".join(lines)
    cut = len(found) > MAX_DEFINITIONS
    if cut:
        text += f"\n[... truncated: {len(found) - MAX_DEFINITIONS} more; give path= to narrow ...]"
    return ToolResult(text, truncated=cut)


def _outline(args: dict, ctx: ToolContext) -> ToolResult:
    name, path = args.get("name"), args.get("path")
    if name is None and path is None:
        raise ToolError("give path (a file or folder to outline) or name (a symbol to find)")
    base = ctx.resolve(path if path is not None else ".", must_exist=True)
    if name is not None:
        if not name.strip():
            raise ToolError("name must not be empty")
        return _find(ctx, name.strip(), base)
    if base.is_dir():
        return _outline_dir(ctx, base)
    return _outline_file(ctx, base)


register(Tool(
    name="outline",
    description=(
        "Show the structure of source code without reading it all: for a file, its classes, "
        "functions, methods, types, constants and macros, one per line as `START-END  signature` "
        "(line range, indented by nesting), so you can then read just the lines you need; for a "
        "folder, the top-level symbols of each source file. With name=SYMBOL (a plain name, or "
        "Class.method) it instead finds where that symbol is defined in the project (or under "
        "path) and returns `file:START-END kind name: signature`. Languages: Python, JavaScript, "
        "TypeScript, C, C++, Go, Rust, Java, Ruby; for other files use search."),
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file or folder to outline (with name: where to look; default the project)"},
            "name": {"type": "string", "description": "find the definition of this symbol instead"},
        },
        "additionalProperties": False,
    },
    run=_outline,
))
