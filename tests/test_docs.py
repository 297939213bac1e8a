"""The README stays a page for users: it opens with the two commands (CI greps the test one), stays
under 260 lines, quotes no speeds (those live, dated, in docs/performance.md), and every relative
link in it and in docs/ leads to a file and heading that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _ci_command() -> str:
    # .ci/run builds the command it greps for from shell quoting; take it from there, not a copy
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    m = re.search(r"^cmd='(.*)'$", text, re.M)
    assert m, ".ci/run no longer defines cmd='...'"
    return m.group(1).replace("'\"'\"'", "'")


def _code_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)]


def test_readme_opens_with_the_two_commands():
    blocks = _code_blocks(README.read_text(encoding="utf-8"))
    assert blocks[0] == ("python3 -m venv .venv && .venv/bin/pip install -q -e . && "
                         ".venv/bin/ds4-gguf synth tiny.gguf && "
                         ".venv/bin/ds4-agent --model tiny.gguf --ctx 16384")
    assert blocks[1] == _ci_command()


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 260, f"README.md has {n} lines; move detail to docs/"


def test_readme_quotes_no_speeds():
    text = README.read_text(encoding="utf-8")
    found = re.findall(r"\d[\d.,-]*\s*(?:t/s|GB/s|GFLOP/s|MB/s)", text)
    assert not found, f"speeds belong in docs/performance.md, with their date and command: {found}"


def _slug(heading: str) -> str:
    # GitHub's anchors: lower case, punctuation dropped (not - or _), spaces to dashes
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+\s+(.*)$", text, re.M)}


def _links(path: Path):
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_relative_links_resolve():
    bad = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in _links(doc):
            name, _, frag = target.partition("#")
            dest = (doc.parent / name).resolve() if name else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _requests(text: str):
    """Each example request in a doc's code blocks: curl -d bodies to a generating route, and SDK
    .create(...) calls, as (the example, its body or arguments)."""
    for block in _code_blocks(text):
        for cmd in re.split(r"\n(?=\S)", block.replace("\\\n", " ")):
            if cmd.startswith("curl") and any(r in cmd for r in GENERATING):
                body = re.search(r"-d\s+'([^']*)'", cmd)
                yield cmd, body.group(1) if body else ""
        for call in re.findall(r"\.(?:completions|responses|messages)\.create\((.*?)\)\n", block + "\n", re.S):
            yield call, call


def test_every_example_request_sets_a_token_cap():
    """A request with no cap generates to the context's end: 8,192 tokens at 1-4 t/s on the tiny
    model, for docs/serve.md's first curl once."""
    import json
    found, bad = 0, []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for example, body in _requests(doc.read_text(encoding="utf-8")):
            found += 1
            if body.lstrip().startswith("{"):
                capped = any(k in json.loads(body) for k in CAPS)
            else:
                capped = any(re.search(rf"\b{k}\s*=", body) for k in CAPS)
            if not capped:
                bad.append(f"{doc.relative_to(ROOT)}: {example[:100]}")
    assert found >= 4, "no example requests found: the check would prove nothing"
    assert not bad, "example requests without a token cap:\n" + "\n".join(bad)
