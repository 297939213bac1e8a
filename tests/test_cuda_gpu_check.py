"""scripts/gpu_check.sh, the prepared check for a lent GPU, cannot run here; what can be checked
is that it parses, that every test file and script it names exists, and that its failures reach
its exit status (a check that fails must not scroll by as one line of a long log)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_parses_and_names_only_files_that_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b((?:tests|scripts)/[\w/]+\.py)\b", text))
    assert {"tests/test_cuda_mma.py", "tests/test_cupy_graphs.py", "scripts/cuda_kernel_bench.py"} <= named
    assert [n for n in sorted(named) if not (ROOT / n).is_file()] == []


def test_gpu_check_fails_when_a_check_fails():
    text = SCRIPT.read_text()
    for what in ("tests on the device", "kernel bench", "graphs", "ds4-bench"):
        assert f'check "{what}"' in text, what
    assert text.rstrip().splitlines()[-1].startswith("(( ${#FAILED[@]} == 0 ))")
