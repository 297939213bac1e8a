"""Shared fixtures: synthetic models are generated once per test session, never downloaded."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# The suite's referee is the NumPy reference: Engine.open(backend="auto") would pick the C kernels
# when they are built. The kernels have their own tests (test_kernels.py, test_ops_cpu.py); a run
# may still choose them for everything with DS4_BACKEND=cpu.
os.environ.setdefault("DS4_BACKEND", "numpy")
# and the memory tests measure what a forward pass itself maps in: no prefault at open
os.environ.setdefault("DS4_PAGING", "none")
# pytest-xdist runs one worker per core: a kernel team's threads that spin at a barrier would take the
# core the other worker needs (libgomp reads this when the kernels' library loads, after this line)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # an xdist worker ignores SIGINT (the controller takes the terminal's Ctrl+C), and an ignored
    # signal stays ignored across exec: the commands the Ctrl+C tests start would never see theirs
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)

from engine import Engine
from engine.gguf.synth import config_for, write_synthetic
from helpers_git import add_user_work, make_repo

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ORACLE = SHARED / "ds4-oracle"


def need_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared/ folder beside the checkout holds it)")
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_q2(models_dir) -> Path:
    """The ds4-oracle shape, q2 recipe, seeded random weights (12 MB)."""
    cfg, vocab = config_for("tiny")
    return Path(write_synthetic(models_dir / "tiny-q2.gguf", cfg, recipe="q2", vocab=vocab, seed=1).path)


@pytest.fixture(scope="session")
def flash_q2_sparse(models_dir) -> Path:
    """The full published Flash shape and vocabulary, no data (an 86.7 GB sparse file)."""
    cfg, vocab = config_for("flash")
    return Path(write_synthetic(models_dir / "flash-q2.gguf", cfg, recipe="q2", vocab=vocab, fill="zero").path)


@pytest.fixture
def oracle_gguf() -> Path:
    return need_shared(ORACLE / "ds4-tiny-q2.gguf")


@pytest.fixture(scope="session")
def small_model(models_dir) -> Path:
    """A fast model for engine invariants: the tiny shape with a 512-id vocabulary and 16 indexer
    heads (so indexer scores have no ties), q2 experts."""
    cfg, vocab = config_for("tiny", vocab=465, idx_n_head=16)
    return Path(write_synthetic(models_dir / "small-q2.gguf", cfg, recipe="q2", vocab=vocab, seed=5).path)


@pytest.fixture(scope="session")
def agent_model(models_dir) -> Path:
    """For agent and UI tests: two layers (sliding window + ratio-128 compression) and a
    16k-entry vocabulary, so the ~11k characters of tool schemas are ~3k tokens and a turn is fast."""
    cfg, vocab = config_for("tiny", n_layer=2, ratios=[0, 128], vocab=16000)
    return Path(write_synthetic(models_dir / "agent-q2.gguf", cfg, recipe="q2", vocab=vocab, seed=9).path)


# -- engines and folders that many modules open the same way ----------------------------------------
# Module scope, as each module had its own copy: an engine (and the KV state its sessions leave) is
# never shared between modules, so a module's tests see the same isolation as before.

@pytest.fixture(scope="module")
def agent_engine(agent_model):
    """The engine on `agent_model` for one module's agent, serve and checkpoint tests. In `exact`
    numerics: these tests check the agent and the shim, not the arithmetic (the engine's own tests
    check ds4's), and on the NumPy reference exact is about twice as fast as ds4's integer block
    dots (a 512-token prefill: 1.3 s of CPU against 2.8 s)."""
    with Engine.open(agent_model, numerics="exact") as e:
        yield e


@pytest.fixture(scope="module")
def small_engine(small_model):
    """The engine on `small_model` for one module's session, KV-file and prefix-cache tests."""
    with Engine.open(small_model) as e:
        yield e


@pytest.fixture(scope="session")
def sysprompt_seed(tmp_path_factory) -> Path:
    """The system prefixes cached by any module's store so far (sessions/sysprompt_cache.py names
    each file by model, quantization and exact text): a module's store starts with them."""
    return tmp_path_factory.mktemp("sysprompt-seed")


@pytest.fixture(scope="module")
def sessions_root(tmp_path_factory, sysprompt_seed):
    """One session folder for the module: its sysprompt-*.kv makes every agent after the first
    start without prefilling the ~3.7k-token tool prompt. It starts with the prefixes earlier
    modules cached and hands its new ones on: the same prompt on the same model was prefilled
    once per module (~15 s each on 2 cores), now once per run. A test of the cache itself uses
    its own folder."""
    import shutil
    root = tmp_path_factory.mktemp("sessions")
    for f in sysprompt_seed.glob("sysprompt-*.kv"):
        shutil.copyfile(f, root / f.name)
    yield root
    for f in root.glob("sysprompt-*.kv"):
        if not (sysprompt_seed / f.name).exists():
            tmp = sysprompt_seed / (f.name + ".tmp")
            shutil.copyfile(f, tmp)
            tmp.replace(sysprompt_seed / f.name)


@pytest.fixture
def git_project(tmp_path):
    """An empty project folder in a fresh git repository (no commits)."""
    root = tmp_path / "proj"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


@pytest.fixture
def hello_project(git_project):
    """`git_project` with an untracked hello.py for the agent to read and edit."""
    (git_project / "hello.py").write_text("def greet(name):\n    return 'hi ' + name\n")
    return git_project


@pytest.fixture
def user_repo(tmp_path):
    """A project in git mid-work, as a user leaves it: history, a branch, a stash, a staged change,
    an untracked file (for the checkpoint tests: none of it may change)."""
    root = make_repo(tmp_path / "proj", {"hello.py": "def greet(name):\n    return 'hi ' + name\n",
                                         "gone.txt": "bash deletes me\n", ".gitignore": "*.log\n"})
    return add_user_work(root, stashed={"gone.txt": "stashed\n"},
                         staged={"hello.py": "def greet(name):\n    return 'hi ' + name  # staged\n"},
                         unstaged={"notes.md": "untracked\n"})


@pytest.fixture(scope="module")
def tui_env(agent_model, tmp_path_factory):
    """One engine, one git project, one session store for a module's TUI tests; the system prefix
    prefilled once (helpers_tui.start_env). On `agent_model`, made for UI tests: on `tiny_q2` (six
    layers, a 4k vocabulary, so a longer prompt) that one prefill took ~40 s of CPU a module."""
    # imported here, not at the top: the agent and its tools load only for the modules that use them
    from helpers_tui import start_env
    return start_env(agent_model, tmp_path_factory.mktemp("app"))


@pytest.fixture
def tui_project(tui_env):
    """The module's project, reset to its committed tree before and after the test."""
    from helpers_tui import reset_project
    reset_project(tui_env["proj"])
    yield tui_env["proj"]
    reset_project(tui_env["proj"])


# -- the ds4-oracle table (test_ds4_oracles.py) -------------------------------------------------------
# Each test puts its row in its report's user_properties; these hooks run where the reports arrive (the
# one process, or pytest-xdist's controller), so the table is written once, after the whole run.
_ORACLE_ROWS: list = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _ORACLE_ROWS.extend(v for k, v in report.user_properties if k == "ds4_oracle_row")


def pytest_terminal_summary(terminalreporter):
    if _ORACLE_ROWS:
        from test_ds4_oracles import _write_table
        _write_table(terminalreporter, sorted(_ORACLE_ROWS, key=lambda r: (r[0], r[1], r[2])))
