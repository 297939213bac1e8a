"""Every available backend against every ds4 oracle, token by token (issue 33, item 4).

The oracles are logits from ds4's own C CPU path: tests/oracles/<name>/ (made by
scripts/build_ds4_oracle.py; the model is regenerated here from its `ds4-gguf synth` arguments
and checked by sha256) and ../shared/ds4-oracle (and any sibling oracle folder, as in
test_engine_oracle.py) when present. Per position the max-abs logit error; over positions the
median, p90, top-1 agreement and mean KL(ds4 || ours), with the issue's bars: median <= 0.2,
p90 <= 0.5, top-1 >= 85 %, KL <= 0.02. The default run feeds the first 200 tokens one at a time;
the slow run feeds every token up to the oracle's last kept row. A table of the figures is
written to the terminal at the end of the module (whatever -s says), so a drift shows in CI logs.

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

# (test, backend, oracle) -> why it misses the bars today: the figures measured on Linux x86-64 at
# efe4e45 (slow rows: numpy/cpu at 52efae4, before e080dd9; mlx at e080dd9); numpy's and cpu's
# default rows at 4f37e74 (issue 33's rules 13-24; cpu's s101 passes now, by a luckier divergence:
# it follows fewer of them). Why s101 and s404 still miss: ds4 ITSELF, fed every token
# through its decode path, misses them too (s101 median 0.122 p90 0.622 top-1 88.5 %; s404 0.172 /
# 0.551 / 84.5 %): the oracles' row 0 comes from ds4's prefill path, the seed of a divergence the
# decode path cannot follow (docs/numerics.md); against that all-decode run the reference's median
# is 0.000 on s101 and 0.042 on s404.
# (mlx there runs on its CPU device; a Mac's Metal run was not measured, so no mark applies there)
KNOWN_MISSES: dict[tuple[str, str, str], str] = {
    ("decode", "numpy", "s101-q2"): "median 0.124 p90 0.634 top-1 87.0% KL 0.0045",
    # mlx default rows: measured at 9f0e219 (on the CPU device mlx runs the reference's steps,
    # bit for bit: its figures are numpy's)
    ("decode", "mlx", "s101-q2"): "median 0.124 p90 0.634 top-1 87.0% KL 0.0045",
    ("decode", "numpy", "s404-q4-8layers"): "median 0.177 p90 0.641 top-1 84.0% KL 0.0054",
    ("decode", "cpu", "s404-q4-8layers"): "median 0.176 p90 0.625 top-1 86.0% KL 0.0060",
    ("decode", "mlx", "s404-q4-8layers"): "median 0.177 p90 0.641 top-1 84.0% KL 0.0054",
    # slow: every kept row (positions 0..299 and the checkpoints up to 1024 and the last)
    ("decode-all", "numpy", "s101-q2"): "median 0.208 p90 0.952 top-1 82.6% KL 0.0083",
    ("decode-all", "numpy", "s202-q2-16experts"): "median 0.179 p90 0.539 top-1 87.1% KL 0.0037",
    ("decode-all", "numpy", "s404-q4-8layers"): "median 0.299 p90 1.044 top-1 79.4% KL 0.0124",
    ("decode-all", "cpu", "s101-q2"): "median 0.190 p90 0.804 top-1 84.6% KL 0.0075",
    ("decode-all", "cpu", "s202-q2-16experts"): "median 0.188 p90 0.597 top-1 90.0% KL 0.0043",
    ("decode-all", "cpu", "s303-q2-r128first"): "median 0.195 p90 0.702 top-1 89.7% KL 0.0061",
    ("decode-all", "cpu", "s404-q4-8layers"): "median 0.265 p90 0.917 top-1 82.0% KL 0.0098",
    ("decode-all", "mlx", "s101-q2"): "median 0.243 p90 1.029 top-1 82.0% KL 0.0103",
    ("decode-all", "mlx", "s202-q2-16experts"): "median 0.196 p90 0.598 top-1 87.5% KL 0.0043",
    ("decode-all", "mlx", "s303-q2-r128first"): "median 0.216 p90 0.678 top-1 86.5% KL 0.0061",
    ("decode-all", "mlx", "s404-q4-8layers"): "median 0.290 p90 0.928 top-1 79.4% KL 0.0111",
    ("decode-all", "mlx", "ds4-oracle"): "median 0.183 p90 0.714 top-1 83.5% KL 0.0111",
}


@dataclass
class Oracle:
    name: str
    folder: Path
    token_ids: list
    decode_positions: np.ndarray     # rows of decode_logits: positions, ascending
    decode_logits: np.ndarray        # float32 [rows, vocab]
    prefill_positions: np.ndarray
    prefill_logits: np.ndarray
    synth: list | None = None        # ds4-gguf synth arguments of the model (None: a GGUF on disk)
    gguf_sha256: str | None = None


def _ours(folder: Path) -> Oracle:
    meta = json.loads((folder / "oracle.json").read_text())
    z = np.load(folder / "ds4_logits.npz")
    return Oracle(folder.name, folder, meta["token_ids"], z["decode_positions"], z["decode_logits"],
                  z["prefill_positions"], z["prefill_logits"], meta["synth"], meta["gguf_sha256"])


def _shared(folder: Path) -> Oracle:
    z = np.load(folder / "ds4_logits.npz")
    ids = json.loads((folder / "tokens.json").read_text())["token_ids"]
    dec = z["decode_logits_all"]
    return Oracle(folder.name, folder, ids, np.arange(len(dec)), dec, z["positions"],
                  z["prefill_logits_at_positions"])


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


def decode_logits(gguf: Path, backend: str, token_ids, n: int) -> np.ndarray:
    """Logits after each of the first n tokens, fed one at a time (the decode path)."""
    with Engine.open(gguf, backend=backend, numerics="ds4", threads=1) as e:
        s = Session(e, n + 16)
        return np.array([np.asarray(s.eval(t), dtype=np.float32) for t in token_ids[:n]])


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


@pytest.mark.parametrize("backend,folder", _params("decode"))
def test_decode_first_positions_match_ds4(backend, folder, oracles, table, record_property):
    o, gguf = oracles(folder)
    n = min(DEFAULT_POSITIONS, len(o.token_ids))
    rows = np.flatnonzero(o.decode_positions < n)
    assert len(rows) == n and (o.decode_positions[rows] == np.arange(n)).all()
    ours = decode_logits(gguf, backend, o.token_ids, n)
    st = figures(ours, o.decode_logits[rows], o.decode_positions[rows])
    record_property("figures", st)
    check(st, backend, o, f"dec<{n}", table, test="decode")


@pytest.mark.slow
@pytest.mark.parametrize("backend,folder", _params("decode-all"))
def test_decode_all_positions_match_ds4(backend, folder, oracles, table):
    o, gguf = oracles(folder)
    n = int(o.decode_positions.max()) + 1
    ours = decode_logits(gguf, backend, o.token_ids, n)[o.decode_positions]
    check(figures(ours, o.decode_logits, o.decode_positions), backend, o, "dec-all", table, test="decode-all")


@pytest.mark.parametrize("backend,folder", _params("prefill"))
def test_prefill_checkpoints_match_ds4_prefill(backend, folder, oracles, table):
    """One batched prefill, logits of every row kept; compared at ds4's prefill checkpoints below
    DEFAULT_POSITIONS (a fresh ds4 session prefilled to each)."""
    o, gguf = oracles(folder)
    keep = np.flatnonzero(o.prefill_positions < DEFAULT_POSITIONS)
    pos = o.prefill_positions[keep]
    with Engine.open(gguf, backend=backend, numerics="ds4", threads=1) as e:
        ours = Session(e, int(pos.max()) + 16).sync(o.token_ids[:int(pos.max()) + 1], keep_logits=True)[pos]
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


def test_known_misses_name_existing_oracles():
    """A stale xfail entry (an oracle renamed or removed) would silently stop meaning anything."""
    names = {d.name for d in ORACLE_DIRS} | {"ds4-oracle"}
    assert {k[2] for k in KNOWN_MISSES} <= names
    assert {k[0] for k in KNOWN_MISSES} <= {"decode", "decode-all", "prefill"}


def test_a_known_miss_that_gets_worse_or_passes_fails(monkeypatch):
    """The KNOWN_MISSES bookkeeping can fail: a miss past its record's slack, or one now within the
    bars, is an error, not an xfail."""
    monkeypatch.setattr(sys, "platform", "linux")
    key = next(iter(KNOWN_MISSES))
    rec = recorded(KNOWN_MISSES[key])
    o = Oracle(key[2], Path("."), [], np.zeros(0), np.zeros((0, 0)), np.zeros(0), np.zeros((0, 0)))
    base = dict(rec, n=1, pos0=0.0, max=1.0, worst=0)
    with pytest.raises(AssertionError, match="worse than its recorded miss"):
        check(dict(base, p90=rec["p90"] + 0.2), key[1], o, "x", [], test=key[0])
    with pytest.raises(AssertionError, match="within the bars now"):
        check(dict(base, median=0.1, p90=0.3, top1=0.9, kl=0.001), key[1], o, "x", [], test=key[0])
    with pytest.raises(pytest.xfail.Exception):
        check(base, key[1], o, "x", [], test=key[0])
