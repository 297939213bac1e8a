"""Every available backend against every ds4 oracle, token by token (issue 33, item 4).

The oracles are logits from ds4's own C CPU path: tests/oracles/<name>/ (made by
scripts/build_ds4_oracle.py; the model is regenerated here from its `ds4-gguf synth` arguments
and checked by sha256) and ../shared/ds4-oracle (and any sibling oracle folder, as in
test_engine_oracle.py) when present. Per position the max-abs logit error; over positions the
median, p90, top-1 agreement and mean KL(ds4 || ours), with the issue's bars: median <= 0.2,
p90 <= 0.5, top-1 >= 85 %, KL <= 0.02. The default run feeds the first 200 tokens one at a time;
the slow run feeds every token up to the oracle's last kept row. A table of the figures is
written to the terminal at the end of the run (whatever -s says), so a drift shows in CI logs.

Like with like: these tests feed every token, the first included, through our decode path one at a
time, so the bars judge ds4's all-decode rows (ds4 fed the same way: build edit 8; for
../shared/ds4-oracle, tests/oracles/shared-decode/). ds4's sync-first rows (the first token
through its prefill path, as a real prompt's first token goes) are printed beside them from the same
decode, for information; the prefill test is judged against ds4's prefill rows. One engine and one
token-by-token decode per (backend, oracle) serve every test and row of it in a worker (the tests
are grouped by that pair).

A backend x oracle that misses the bars today is listed in KNOWN_MISSES with its measured figures.
It is reported as xfail only while it stays within SLACK of those figures: a regression past them
fails, and so does a fix that brings it within the bars (then its entry goes).
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, Session
from engine.backends import registry

from test_engine_oracle import ORACLES as SHARED_ORACLES, stats

OURS = Path(__file__).resolve().parent / "oracles"
DEFAULT_POSITIONS = 200
BARS = {"median": 0.2, "p90": 0.5, "top1": 0.85, "kl": 0.02}
# a handful of prefill checkpoints: test_engine_oracle's prefill bars (no p90 / top-1 over ~8 rows)
PREFILL_BARS = {"median": 0.3, "p90": float("inf"), "top1": 0.0, "kl": 0.03}
BACKENDS = [b for b in ("numpy", "cpu", "mlx") if b in registry.available_names()]
TABLE_ROW = "ds4_oracle_row"    # the user_properties key conftest.py gathers
REGENERATE = ".venv/bin/python scripts/build_ds4_oracle.py --ds4-src DS4_TREE make NAME"

# (test, backend, oracle) -> why it misses the bars today: the figures against ds4's all-decode rows,
# measured on Linux x86-64 on 2026-12-08 (at 66b039c; mlx on its CPU device, where it runs the
# reference's steps: its figures are numpy's). Like with like, numpy and mlx meet the bars on every
# oracle (median 0.000 over the first 200 positions on s101, s202, s303; 0.037 and 0.042 on the
# shared oracle and s404): their old misses
# on s101 and s404 were ds4's own sync-first vs all-decode gap (docs/numerics.md). cpu is numpy's
# bit for bit except its Q4_K experts (rule 24: its kernels keep the exact sum), so on the q4 oracle
# it leaves ds4 at position 0 (0.095) and misses over all positions.
# (a Mac's Metal run was not measured, so no mark applies there)
KNOWN_MISSES: dict[tuple[str, str, str], str] = {
    # slow: every kept row (positions 0..299 and the checkpoints up to 1024 and the last)
    ("decode-all", "cpu", "s404-q4-8layers"): "median 0.199 p90 0.635 top-1 85.2% KL 0.0067",
}


@dataclass
class Oracle:
    name: str
    folder: Path
    token_ids: list
    decode_positions: np.ndarray     # rows of decode_logits: positions, ascending
    decode_logits: np.ndarray        # float32 [rows, vocab]: sync-first (ds4's first token prefilled)
    prefill_positions: np.ndarray
    prefill_logits: np.ndarray
    synth: list | None = None        # ds4-gguf synth arguments of the model (None: a GGUF on disk)
    gguf_sha256: str | None = None
    all_decode_positions: np.ndarray | None = None   # rows of all_decode_logits (None: none made)
    all_decode_logits: np.ndarray | None = None      # every token through ds4's decode path


ALL_DECODE = "ds4_logits_all_decode.npz"
SHARED_DECODE = OURS / "shared-decode"      # the all-decode rows of ../shared/ds4-oracle's model


def _ours(folder: Path) -> Oracle:
    meta = json.loads((folder / "oracle.json").read_text())
    z, a = np.load(folder / "ds4_logits.npz"), np.load(folder / ALL_DECODE)
    return Oracle(folder.name, folder, meta["token_ids"], z["decode_positions"], z["decode_logits"],
                  z["prefill_positions"], z["prefill_logits"], meta["synth"], meta["gguf_sha256"],
                  a["decode_positions"], a["decode_logits"])


def _shared(folder: Path) -> Oracle:
    z = np.load(folder / "ds4_logits.npz")
    ids = json.loads((folder / "tokens.json").read_text())["token_ids"]
    dec = z["decode_logits_all"]
    o = Oracle(folder.name, folder, ids, np.arange(len(dec)), dec, z["positions"],
               z["prefill_logits_at_positions"])
    meta = SHARED_DECODE / "oracle_decode.json"
    # the all-decode rows were made from one model: they judge only a folder holding that file
    if folder.name == "ds4-oracle" and meta.exists():
        gguf = next(iter(sorted(folder.glob("*.gguf"))))
        if hashlib.sha256(gguf.read_bytes()).hexdigest() == json.loads(meta.read_text())["gguf_sha256"]:
            a = np.load(SHARED_DECODE / ALL_DECODE)
            o.all_decode_positions, o.all_decode_logits = a["decode_positions"], a["decode_logits"]
    return o


def _all_oracles() -> list[Path]:
    ours = sorted(p for p in OURS.iterdir() if (p / "oracle.json").exists()) if OURS.exists() else []
    return ours + [p for p in SHARED_ORACLES if (p / "ds4_logits.npz").exists()]


ORACLE_DIRS = _all_oracles()


def _params(test: str):
    out = []
    for b in BACKENDS:
        for d in ORACLE_DIRS:
            out.append(pytest.param(b, d, id=f"{b}-{d.name}"))
    return out


def parametrize(test: str):
    # scope="module": pytest runs a (backend, oracle)'s tests one after another, so the `runs`
    # fixture's one open engine and decode serve them all
    return pytest.mark.parametrize("backend,folder", _params(test), scope="module")


@pytest.fixture
def table(request):
    """Where a test puts its row of figures: the report's user_properties, which pytest-xdist carries
    from a worker to the controller; conftest.py gathers the rows and writes the table at the end of
    the run (a worker has no terminal of its own)."""
    class Rows:
        def append(self, row: tuple) -> None:
            request.node.user_properties.append((TABLE_ROW, row))
    return Rows()


def _write_table(tr, rows) -> None:
    tr.line("")
    tr.write_line(f"ds4 oracles, ds4 numerics: max-abs logit error per position (bars: median <= "
                  f"{BARS['median']}, p90 <= {BARS['p90']}, top-1 >= {BARS['top1']:.0%}, KL <= {BARS['kl']}; "
                  f"prefill rows: median <= {PREFILL_BARS['median']}, KL <= {PREFILL_BARS['kl']})")
    tr.write_line("paths: dec = ds4 fed token by token, all through its decode path (judged); sync = the "
                  "same decode of ours against ds4's sync-first rows (its first token prefilled; info)")
    tr.write_line(f"{'backend':8} {'oracle':22} {'path':8} {'n':>5} {'pos0':>6} {'median':>7} {'p90':>7} "
                  f"{'max':>7} {'@pos':>5} {'top-1':>7} {'KL':>8}  verdict")
    for r in rows:
        tr.write_line("{:8} {:22} {:8} {:5d} {:6.3f} {:7.3f} {:7.3f} {:7.3f} {:5d} {:6.1%} {:8.4f}  {}".format(*r))


@pytest.fixture(scope="module")
def oracles(models_dir):
    """name -> (Oracle, its GGUF path); synth models are written once, into the session's folder."""
    cache: dict[str, tuple[Oracle, Path]] = {}

    def get(folder: Path):
        if folder.name not in cache:
            o = _ours(folder) if (folder / "oracle.json").exists() else _shared(folder)
            cache[folder.name] = (o, _model(o, models_dir))
        return cache[folder.name]
    return get


def _model(o: Oracle, models_dir: Path) -> Path:
    if o.synth is None:
        return next(iter(sorted(o.folder.glob("*.gguf"))))
    from engine.gguf.gguf_cli import main as gguf_main
    path = models_dir / f"oracle-{o.name}.gguf"
    if not path.exists():
        assert gguf_main(["synth", str(path), *o.synth]) == 0, o.synth
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == o.gguf_sha256, (
        f"ds4-gguf synth {' '.join(o.synth)} no longer writes the model oracle {o.name} was made from "
        f"(sha256 {digest[:12]} != {o.gguf_sha256[:12]}); regenerate it: {REGENERATE}")
    return path


class Run:
    """One backend on one oracle's model: its engine, and one session fed the oracle's tokens one at
    a time (the decode path), grown as far as a test asks; the logits after each token are kept."""

    def __init__(self, gguf: Path, backend: str, token_ids):
        self.engine = Engine.open(gguf, backend=backend, numerics="ds4", threads=1)
        self.ids = token_ids
        self.session = Session(self.engine, len(token_ids) + 16)
        self.rows: list[np.ndarray] = []

    def decoded(self, n: int) -> np.ndarray:
        """Logits after each of the first n tokens, fed one at a time."""
        for t in self.ids[len(self.rows):n]:
            self.rows.append(np.asarray(self.session.eval(t), dtype=np.float32))
        return np.array(self.rows[:n])

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="module")
def runs(oracles):
    """(backend, folder) -> (Oracle, Run); the latest Run stays open (the tests of one pair run
    together: see `parametrize`), an older one is closed when another pair starts."""
    held: dict = {}

    def get(backend: str, folder: Path):
        o, gguf = oracles(folder)
        key = (backend, folder.name)
        if key not in held:
            for old in held.values():
                old.close()
            held.clear()
            held[key] = Run(gguf, backend, o.token_ids)
        return o, held[key]
    yield get
    for r in held.values():
        r.close()


def figures(ours: np.ndarray, ref: np.ndarray, positions: np.ndarray) -> dict:
    st = stats(ours, ref)
    d = np.abs(ours - ref).max(axis=1)
    return dict(st, n=len(d), pos0=float(d[0]), max=float(d.max()), worst=int(positions[int(d.argmax())]))


# how far a known miss may drift from its recorded figures before it counts as a regression
SLACK = {"median": 0.02, "p90": 0.05, "top1": 0.015, "kl": 0.001}


def recorded(why: str) -> dict:
    """The figures of a KNOWN_MISSES entry ("median M p90 P top-1 T% KL K")."""
    w = why.split()
    return {"median": float(w[w.index("median") + 1]), "p90": float(w[w.index("p90") + 1]),
            "top1": float(w[w.index("top-1") + 1].rstrip("%")) / 100, "kl": float(w[w.index("KL") + 1])}


def check(st: dict, backend: str, o: Oracle, path: str, table: list, bars: dict = BARS, test: str = "") -> None:
    ok = (st["median"] <= bars["median"] and st["p90"] <= bars["p90"] and st["top1"] >= bars["top1"]
          and st["kl"] <= bars["kl"])
    # the misses were measured on Linux x86-64 (mlx on its CPU device); elsewhere no entry applies
    why = KNOWN_MISSES.get((test, backend, o.name)) if sys.platform == "linux" else None
    table.append((backend, o.name, path, st["n"], st["pos0"], st["median"], st["p90"], st["max"],
                  st["worst"], st["top1"], st["kl"], "ok" if ok else ("known" if why else "MISSES")))
    now = (f"{backend} on {o.name} ({path}): median {st['median']:.3f} p90 {st['p90']:.3f} "
           f"top-1 {st['top1']:.1%} KL {st['kl']:.4f}")
    if why is None:
        assert ok, now
        return
    assert not ok, f"{now}: within the bars now, remove its KNOWN_MISSES entry ({why})"
    rec = recorded(why)
    worse = [k for k in ("median", "p90", "kl") if st[k] > rec[k] + SLACK[k]]
    worse += ["top1"] if st["top1"] < rec["top1"] - SLACK["top1"] else []
    assert not worse, f"{now}: worse than its recorded miss ({why}) in {', '.join(worse)}"
    pytest.xfail(f"known miss, within {SLACK} of its record: {now}")


def info(st: dict, backend: str, o: Oracle, path: str, table) -> None:
    """A row of the table that judges nothing (ds4's sync-first rows): so a drift shows."""
    table.append((backend, o.name, path, st["n"], st["pos0"], st["median"], st["p90"], st["max"],
                  st["worst"], st["top1"], st["kl"], "info"))


def judged_rows(o: Oracle, below: int):
    """The rows that judge a token-by-token decode of the first `below` positions: ds4's all-decode
    rows where the oracle has them (like with like), else its sync-first rows. (positions, logits,
    path prefix)"""
    pos, lg, path = ((o.decode_positions, o.decode_logits, "sync-only") if o.all_decode_logits is None
                     else (o.all_decode_positions, o.all_decode_logits, "dec"))
    keep = np.flatnonzero(pos < below)
    return pos[keep], lg[keep], path


def _compare(backend, o: Oracle, run: Run, below: int, label: str, test: str, table) -> dict:
    """One decode of ours (the Run's) against both of ds4's token-by-token row sets: the sync-first
    rows as an info row, then the judged rows through check()."""
    pos, ref, path = judged_rows(o, below)
    sync = np.flatnonzero(o.decode_positions < below)
    ours = run.decoded(int(max(pos.max(), o.decode_positions[sync].max())) + 1)
    if path == "dec":
        info(figures(ours[o.decode_positions[sync]], o.decode_logits[sync], o.decode_positions[sync]),
             backend, o, f"sync{label}", table)
    st = figures(ours[pos], ref, pos)
    check(st, backend, o, f"{path}{label}", table, test=test)
    return st


@parametrize("decode")
def test_decode_first_positions_match_ds4(backend, folder, runs, table, record_property):
    o, run = runs(backend, folder)
    n = min(DEFAULT_POSITIONS, len(o.token_ids))
    pos, _, _ = judged_rows(o, n)
    assert len(pos) == n and (pos == np.arange(n)).all()
    record_property("figures", _compare(backend, o, run, n, f"<{n}", "decode", table))


@pytest.mark.slow
@parametrize("decode-all")
def test_decode_all_positions_match_ds4(backend, folder, runs, table):
    o, run = runs(backend, folder)
    _compare(backend, o, run, len(o.token_ids), "-all", "decode-all", table)


@parametrize("prefill")
def test_prefill_checkpoints_match_ds4_prefill(backend, folder, runs, table):
    """One batched prefill, logits of every row kept; compared at ds4's prefill checkpoints below
    DEFAULT_POSITIONS (a fresh ds4 session prefilled to each)."""
    o, run = runs(backend, folder)
    keep = np.flatnonzero(o.prefill_positions < DEFAULT_POSITIONS)
    pos = o.prefill_positions[keep]
    ours = Session(run.engine, int(pos.max()) + 16).sync(o.token_ids[:int(pos.max()) + 1], keep_logits=True)[pos]
    check(figures(np.asarray(ours, np.float32), o.prefill_logits[keep], pos), backend, o, "prefill", table,
          PREFILL_BARS, test="prefill")


@pytest.mark.parametrize("folder", [d for d in ORACLE_DIRS if (d / "oracle.json").exists()], ids=lambda d: d.name)
def test_oracle_files_agree_with_their_description(folder):
    """What the tests rely on: the ids, positions and arrays of oracle.json and ds4_logits.npz agree,
    the prompt is 700+ tokens, every position below DEFAULT_POSITIONS is kept, and a README says how
    the oracle was made."""
    meta = json.loads((folder / "oracle.json").read_text())
    z = np.load(folder / "ds4_logits.npz")
    assert list(z["token_ids"]) == meta["token_ids"] and len(meta["token_ids"]) >= 700
    assert list(z["decode_positions"]) == meta["decode_positions"]
    assert list(z["prefill_positions"]) == meta["prefill_positions"]
    assert set(range(DEFAULT_POSITIONS)) <= set(meta["decode_positions"])
    assert z["decode_logits"].dtype == np.float32 and z["prefill_logits"].dtype == np.float32
    assert z["decode_logits"].shape == (len(meta["decode_positions"]), meta["n_vocab"])
    assert z["prefill_logits"].shape == (len(meta["prefill_positions"]), meta["n_vocab"])
    assert "build_ds4_oracle.py" in (folder / "README.md").read_text()
    a = np.load(folder / ALL_DECODE)      # the all-decode rows: the same positions, and not a copy
    assert list(a["decode_positions"]) == meta["decode_positions"]
    assert a["decode_logits"].dtype == np.float32 and a["decode_logits"].shape == z["decode_logits"].shape
    _same_drift(meta["all_decode_vs_sync_first"], a["decode_logits"], z["decode_logits"])


def _same_drift(recorded_drift: dict, all_decode: np.ndarray, sync_first: np.ndarray) -> None:
    """The json's all-decode vs sync-first figures are those of the stored arrays, and row 0 differs
    (ds4's prefill and decode paths round the first token differently): the two sets are not swapped
    for copies of each other."""
    d = np.abs(all_decode - sync_first).max(axis=1)
    assert d[0] > 0 and round(float(d[0]), 4) == recorded_drift["pos0"]
    assert round(float(np.median(d)), 4) == recorded_drift["median"]


def test_shared_decode_rows_agree_with_their_description():
    """tests/oracles/shared-decode: ../shared/ds4-oracle's model fed all-decode; a README says how."""
    meta = json.loads((SHARED_DECODE / "oracle_decode.json").read_text())
    a = np.load(SHARED_DECODE / ALL_DECODE)
    assert list(a["decode_positions"]) == meta["decode_positions"]
    assert set(range(DEFAULT_POSITIONS)) <= set(meta["decode_positions"])
    assert a["decode_logits"].dtype == np.float32 and a["decode_logits"].shape[0] == len(meta["decode_positions"])
    assert "build_ds4_oracle.py" in (SHARED_DECODE / "README.md").read_text()
    shared = [d for d in ORACLE_DIRS if d.name == "ds4-oracle"]
    if not shared:
        pytest.skip("../shared/ds4-oracle is not present: nothing to compare the rows' drift with")
    sync = np.load(shared[0] / "ds4_logits.npz")["decode_logits_all"][meta["decode_positions"]]
    _same_drift(meta["all_decode_vs_sync_first"], a["decode_logits"], sync)
    assert _shared(shared[0]).all_decode_logits is not None, "the shared model's sha256 no longer matches"


def test_known_misses_name_existing_oracles():
    """A stale xfail entry (an oracle renamed or removed) would silently stop meaning anything."""
    names = {d.name for d in ORACLE_DIRS} | {"ds4-oracle"}
    assert {k[2] for k in KNOWN_MISSES} <= names
    assert {k[0] for k in KNOWN_MISSES} <= {"decode", "decode-all", "prefill"}


def test_a_known_miss_that_gets_worse_or_passes_fails(monkeypatch):
    """The KNOWN_MISSES bookkeeping can fail: a miss past its record's slack, or one now within the
    bars, is an error, not an xfail."""
    monkeypatch.setattr(sys, "platform", "linux")
    key = ("decode", "numpy", "s101-q2")          # an entry of its own: the real ones come and go
    monkeypatch.setitem(KNOWN_MISSES, key, "median 0.124 p90 0.634 top-1 87.0% KL 0.0045")
    rec = recorded(KNOWN_MISSES[key])
    o = Oracle(key[2], Path("."), [], np.zeros(0), np.zeros((0, 0)), np.zeros(0), np.zeros((0, 0)))
    base = dict(rec, n=1, pos0=0.0, max=1.0, worst=0)
    with pytest.raises(AssertionError, match="worse than its recorded miss"):
        check(dict(base, p90=rec["p90"] + 0.2), key[1], o, "x", [], test=key[0])
    with pytest.raises(AssertionError, match="within the bars now"):
        check(dict(base, median=0.1, p90=0.3, top1=0.9, kl=0.001), key[1], o, "x", [], test=key[0])
    with pytest.raises(pytest.xfail.Exception):
        check(base, key[1], o, "x", [], test=key[0])


DS4_TREE = Path(__import__("os").environ.get("DS4_SRC", "/tmp/ds4-src"))


@pytest.mark.skipif(not (DS4_TREE / "ds4.c").exists(), reason="no ds4 source tree (set DS4_SRC to a checkout "
                    "of antirez/ds4): the build script's edits are checked against ds4's own source")
def test_every_oracle_build_sends_the_first_token_down_the_decode_path(tiny_q2):
    """Build edit 8 is part of every oracle build, not only the debug dump's (the all-decode rows
    come from it); edit 7's dump calls come only with dump=True, in the decode and prefill paths."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import build_ds4_oracle as b
    src, cfg = (DS4_TREE / "ds4.c").read_text(), b.model_config(tiny_q2)
    plain, dump = b.edit_source(src, cfg), b.edit_source(src, cfg, dump=True)
    assert "void ds4_session_oracle_decode_first(ds4_session *s)" in plain
    assert "ds4_oracle_dump" not in plain
    assert dump.count("ds4_oracle_dump_rows(") == 1 + 14 and dump.count("ds4_session_oracle_decode_first") == 1
