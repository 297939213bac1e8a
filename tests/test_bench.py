"""ds4-bench: the sweep's CSV, plot, token dump, determinism and bad input (spec/testing.md §1.3)."""
from __future__ import annotations

import functools
import json
import random
import xml.etree.ElementTree as ET

import pytest

from engine import Engine, Session
from engine.bench import HEADER, frontiers, greedy_no_eos, main, run_bench

WORDS = ("quel ramo del lago di Como che volge a mezzogiorno tra due catene non interrotte di monti "
         "tutto a seni e a golfi a seconda dello sporgere e del rientrare di quelli vien quasi a un tratto "
         "a ristringersi e a prender corso e figura di fiume").split()
# exact numerics: the sweep's mechanics are under test, not ds4's arithmetic (its integer block dots
# make a NumPy prefill about twice as slow)
SWEEP = ["--ctx-start", "64", "--ctx-max", "192", "--step-incr", "64", "--gen-tokens", "4", "--numerics", "exact"]
PAIR = ["--ctx-start", "64", "--ctx-max", "128", "--step-incr", "64", "--gen-tokens", "4"]   # two rows


@pytest.fixture(autouse=True)
def small_floors(monkeypatch):
    """The floors' values are not under test: a 32 MiB read and a 256-wide GEMM instead of 512 MiB
    and 2048 (the sweep test measured them twice: most of its ~60 s on a loaded machine)."""
    from engine import bench
    monkeypatch.setattr(bench, "measure_floors", functools.partial(bench.measure_floors, read_mib=32, gemm_n=256))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(3)
    p = tmp_path_factory.mktemp("bench") / "text.txt"
    p.write_text(" ".join(rng.choice(WORDS) for _ in range(3000)) + "\n")
    return p


def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_sweep_csv_plot_and_tokens(small_model, text_file, tmp_path, capsys):
    svg, dump = tmp_path / "speed.svg", tmp_path / "tokens.json"
    rc, out, err = _run(capsys, ["-m", str(small_model), "--prompt-file", str(text_file), *SWEEP,
                                 "--plot", str(svg), "--dump-tokens", str(dump)])
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == ",".join(HEADER)
    rows = [dict(zip(HEADER, ln.split(","))) for ln in lines[1:]]
    assert [int(r["ctx_tokens"]) for r in rows] == [64, 128, 192]
    assert all(int(r["prefill_tokens"]) == 64 for r in rows)
    assert all(int(r["gen_tokens"]) == 4 for r in rows)
    kv = [int(r["kvcache_bytes"]) for r in rows]
    assert kv == sorted(kv) and len(set(kv)) == 3
    assert all(float(r["prefill_tps"]) > 0 and float(r["gen_tps"]) > 0 for r in rows)
    assert "read floor" in err and "GEMM floor" in err and "Traceback" not in err

    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert len([e for e in root.iter() if e.tag.endswith("polyline")]) == 2

    first = json.loads(dump.read_text())
    assert [d["ctx_tokens"] for d in first] == [64, 128, 192]
    assert all(len(d["tokens"]) == 4 for d in first)
    # determinism: a second run decodes the same greedy tokens
    dump2 = tmp_path / "tokens2.json"
    rc, out2, _ = _run(capsys, ["-m", str(small_model), "--prompt-file", str(text_file), *SWEEP,
                                "--dump-tokens", str(dump2), "--csv", str(tmp_path / "b.csv")])
    assert rc == 0 and out2 == ""
    assert json.loads(dump2.read_text()) == first
    assert (tmp_path / "b.csv").read_text().splitlines()[0] == ",".join(HEADER)


def test_incremental_prefill_and_restore_match_fresh_sessions(small_model, text_file):
    with Engine.open(small_model, numerics="exact") as eng:
        tokens = eng.tokenizer.encode(text_file.read_text())
        eos = eng.tokenizer.eos_id
        s = Session(eng, 200)
        rows, probes = run_bench(s, tokens, [64, 128, 192], 4, eos)
        # only the new suffix is prefilled at each frontier; restore undoes the decode
        assert s.stats["prefill_tokens"] == 192 and s.stats["decode_tokens"] == 12
        assert s.tokens == tokens[:192]
        for f, probe in zip([64, 128, 192], probes):
            fresh = Session(eng, 200)
            fresh.sync(tokens[:f])
            assert greedy_no_eos(fresh, 4, eos) == probe
            assert eos not in probe


def test_frontiers():
    assert frontiers(64, 192, incr=64) == [64, 128, 192]
    assert frontiers(64, 200, incr=64) == [64, 128, 192, 200]
    assert frontiers(2, 10, mul=1.2) == [2, 3, 4, 5, 6, 8, 10]
    assert frontiers(1000, 4000, mul=2) == [1000, 2000, 4000]


@pytest.mark.parametrize("case", ["missing_model", "short_text", "bad_number", "bad_mul", "start_above_max",
                                  "missing_text"])
def test_bad_input(case, small_model, text_file, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("poche parole\n")
    argv = {
        "missing_model": ["-m", str(tmp_path / "nope.gguf"), "--prompt-file", str(text_file), *SWEEP],
        "short_text": ["-m", str(small_model), "--prompt-file", str(short), *SWEEP],
        "bad_number": ["-m", str(small_model), "--prompt-file", str(text_file), "--gen-tokens", "x"],
        "bad_mul": ["-m", str(small_model), "--prompt-file", str(text_file), "--step-mul", "0.5"],
        "start_above_max": ["-m", str(small_model), "--prompt-file", str(text_file),
                            "--ctx-start", "300", "--ctx-max", "100"],
        "missing_text": ["-m", str(small_model), "--prompt-file", str(tmp_path / "none.txt"), *SWEEP],
    }[case]
    rc, out, err = _run(capsys, argv)
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err


def _csv_rows(text: str) -> list[dict]:
    lines = text.strip().splitlines()
    head = lines[0].split(",")
    return [dict(zip(head, ln.split(","))) for ln in lines[1:]]


def test_peer_measures_a_second_backend_in_the_same_run(small_model, text_file, tmp_path, capsys, monkeypatch):
    """--peer: both backends over the same frontiers, a backend column, one ratio line per row that
    agrees with the CSV, each backend's device and memory lines, both in the plot and the dump."""
    from engine import bench
    from engine.backends import registry
    others = [n for n in registry.available_names() if n != "numpy"]
    if not others:
        pytest.skip("no backend besides numpy can serve here to be the peer")
    peer = others[-1]             # the lowest priority besides numpy (mlx on Linux, where it serves)
    svg, dump = tmp_path / "both.svg", tmp_path / "both.json"
    rc, out, err = _run(capsys, ["-m", str(small_model), "--prompt-file", str(text_file), *PAIR,
                                 "--backend", "numpy", "--peer", peer, "--plot", str(svg),
                                 "--dump-tokens", str(dump)])
    assert rc == 0, err
    assert out.splitlines()[0] == ",".join(["backend", *HEADER])
    rows = _csv_rows(out)
    mine, theirs = [r for r in rows if r["backend"] == "numpy"], [r for r in rows if r["backend"] == peer]
    assert len(mine) == len(theirs) == 2 and len(rows) == 4
    assert [r["ctx_tokens"] for r in mine] == [r["ctx_tokens"] for r in theirs] == ["64", "128"]
    # the snapshot format is the backends' common host layout: the same size on both
    assert [r["kvcache_bytes"] for r in mine] == [r["kvcache_bytes"] for r in theirs]
    ratios = [ln for ln in err.splitlines() if f": numpy/{peer} prefill " in ln]
    assert len(ratios) == 2
    for ln, a, b in zip(ratios, mine, theirs):
        assert ln.startswith(f"ctx {a['ctx_tokens']}: ")
        said = float(ln.split(" prefill ")[1].split("x")[0])
        assert said == pytest.approx(float(a["prefill_tps"]) / float(b["prefill_tps"]), rel=0.02, abs=0.01)
    for name in ("numpy", peer):
        assert f"backend {name}, bind " in err and f"memory: {name} " in err
    assert err.count("device: ") == 2 and err.count("floors: ") == 1 and "Traceback" not in err
    root = ET.parse(svg).getroot()
    assert len([e for e in root.iter() if e.tag.endswith("polyline")]) == 4
    d = json.loads(dump.read_text())
    assert [len(x["tokens"]) for x in d] == [len(x["peer_tokens"]) for x in d] == [4, 4]


@pytest.mark.parametrize("peer", ["nosuch", "numpy"])
def test_a_bad_peer_is_one_line_before_any_sweep(peer, small_model, text_file, capsys):
    rc, out, err = _run(capsys, ["-m", str(small_model), "--prompt-file", str(text_file), *SWEEP,
                                 "--backend", "numpy", "--peer", peer])
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and peer in lines[0], err
    assert "floors" not in err             # refused before the first backend was measured


def test_default_text_ships_with_the_package_and_the_plan_comes_first(small_model, capsys, monkeypatch):
    """No --prompt-file: the text is package data (no folder of one machine), and before any row the
    frontiers and an estimate are printed; each row says how many are done and the time left."""
    from engine import bench
    text = bench.default_text()
    assert text.lstrip().startswith("I PROMESSI SPOSI") and len(text) > 200_000
    rc, out, err = _run(capsys, ["-m", str(small_model), *SWEEP])
    assert rc == 0, err
    assert [int(r["ctx_tokens"]) for r in _csv_rows(out)] == [64, 128, 192]
    lines = err.splitlines()
    plan = next(i for i, ln in enumerate(lines) if ln.startswith("plan: "))
    est = next(i for i, ln in enumerate(lines) if ln.startswith("estimate: about "))
    first_row = next(i for i, ln in enumerate(lines) if ln.startswith("ctx 64: "))
    assert plan < est < first_row
    assert lines[plan].startswith("plan: 3 frontiers 64, 128, 192; 192 tokens to prefill, 3 x 4 tokens")
    assert "1/3, about " in lines[first_row] and " left" in lines[first_row]


def test_ctrl_c_keeps_the_rows_measured(small_model, text_file, tmp_path, capsys, monkeypatch):
    """Ctrl+C in the second frontier: the first row is written to the CSV (and the dump), one line says
    how many were measured, exit 130."""
    from engine import bench
    calls = []
    real = bench.greedy_no_eos

    def greedy(session, n, eos):        # call 1: the probe, 2: frontier 64, 3: frontier 128
        calls.append(n)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(session, n, eos)

    monkeypatch.setattr(bench, "greedy_no_eos", greedy)
    csv_path, dump = tmp_path / "part.csv", tmp_path / "part.json"
    rc, out, err = _run(capsys, ["-m", str(small_model), "--prompt-file", str(text_file), *SWEEP,
                                 "--csv", str(csv_path), "--dump-tokens", str(dump)])
    assert rc == 130 and out == ""
    assert [int(r["ctx_tokens"]) for r in _csv_rows(csv_path.read_text())] == [64]
    assert [d["ctx_tokens"] for d in json.loads(dump.read_text())] == [64]
    assert "interrupted: 1 of 3 frontiers measured on numpy" in err and "Traceback" not in err
    # without --csv the rows measured go to stdout
    calls.clear()
    rc, out, err = _run(capsys, ["-m", str(small_model), "--prompt-file", str(text_file), *SWEEP])
    assert rc == 130 and [int(r["ctx_tokens"]) for r in _csv_rows(out)] == [64]
