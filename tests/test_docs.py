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
