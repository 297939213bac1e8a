"""The README stays a page for users: it opens with the two commands (CI greps the test one), stays
under 260 lines, and quotes no speeds (those live, dated, in docs/performance.md)."""
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

