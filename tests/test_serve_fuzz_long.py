"""The long fuzz run (`pytest -m slow tests/test_serve_fuzz_long.py`): tests/test_serve_fuzz.py with
every case count multiplied by DS4_FUZZ_SCALE (5: about 12,500 requests), in a process of its
own, and its report of every answer read back: at least 10,000 requests, no 5xx, no log record
with a traceback or an error, no request left without an answer (each must finish within the
fuzz module's TIMEOUT, or its test fails). The figures are printed (-s shows them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_long_fuzz_run(tmp_path):
    report = tmp_path / "fuzz-report.json"
    env = dict(os.environ, DS4_FUZZ_SCALE=os.environ.get("DS4_FUZZ_SCALE", "5"), DS4_FUZZ_REPORT=str(report))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                        "--basetemp", str(tmp_path / "run"), "tests/test_serve_fuzz.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=3 * 3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    rep = json.loads(report.read_text())
    statuses = rep["statuses"]
    total = sum(statuses.values())
    answered = sum(n for k, n in statuses.items() if k.isdigit())
    server_errors = sum(n for k, n in statuses.items() if k.isdigit() and int(k) >= 500 and k != "503")
    print(f"\nlong fuzz run: {total} requests, {answered} answered with a status, "
          f"statuses {dict(sorted(statuses.items()))}, worker {rep['worker']}, "
          f"log records with errors {rep['n_bad_log_records']}\n{r.stdout.strip().splitlines()[-1]}")
    assert total >= 10_000, statuses
    assert server_errors == 0 and statuses.get("503", 0) == 0, statuses
    assert rep["n_bad_log_records"] == 0, rep["bad_log_records"]
