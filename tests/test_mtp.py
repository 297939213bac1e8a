"""MTP speculative decoding (issue 37): the MTP file, the drafter, the verify and its exactness.

Exactness: with any drafter, greedy decoding with speculation gives plain decoding's tokens and
leaves the session's snapshot byte for byte as plain decoding does. Three drafters: the honest one
(the synthetic MTP file: acceptance about 0 on random weights), one that proposes the true
continuation (acceptance 100 %) and one right every other token. Sampling: the rejection rule is
checked on distributions with a chi-square over 20,000 seeded draws, and a biased rule must fail
the same check.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine import Engine, ModelFileError, Rng, SamplingParams, Session
from engine.backends import registry
from engine.gguf.mtp_file import MTPFile, mtp_tensors, write_synthetic_mtp
from engine.gguf.synth import config_for, write_synthetic
from engine.runtime.mtp_drafter import MTPDrafter, attach_mtp
from engine.runtime.speculative import Speculator, accept_drafts, draw, target_probs
from engine.runtime.sampling import sample

GREEDY = SamplingParams(temperature=0.0)
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """A 3-layer model (sliding window, ratio 4 with an indexer that engages from 20 tokens, ratio
    128) and its MTP file."""
    d = tmp_path_factory.mktemp("mtp")
    cfg, vocab = config_for("tiny", n_layer=3, ratios=[0, 4, 128], vocab=465, idx_n_head=16, idx_topk=4,
                            n_hash_layer=1)
    main = write_synthetic(d / "main.gguf", cfg, recipe="q2", vocab=vocab, seed=3).path
    return main, write_synthetic_mtp(d / "mtp.gguf", cfg, seed=4), cfg


# -- the file -------------------------------------------------------------------------------------

def test_mtp_file_has_ds4s_32_tensors_and_opens_against_its_model(mtp_models):
    main, mtp, cfg = mtp_models
    assert len(mtp_tensors(cfg)) == 32
    with MTPFile.open(mtp, cfg) as f:
        assert len(f.gguf.tensors) == 32
        assert f.tensor("ffn_gate_exps.weight").dims == (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert)


def test_a_wrong_mtp_file_is_one_line(mtp_models, tmp_path):
    main, mtp, cfg = mtp_models
    cases = {"main": main}
    other, _ = config_for("tiny", n_layer=3, ratios=[0, 4, 128], vocab=465, n_embd=512)
    cases["other"] = write_synthetic_mtp(tmp_path / "other.gguf", other)
    data = open(mtp, "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    cases["cut"] = tmp_path / "cut.gguf"
    (tmp_path / "empty.gguf").write_bytes(b"")
    cases["empty"] = tmp_path / "empty.gguf"
    msgs = {}
    for k, path in cases.items():
        with pytest.raises(ModelFileError) as e:
            MTPFile.open(path, cfg)
        msgs[k] = str(e.value)
        assert "\n" not in msgs[k] and str(path) in msgs[k]
    assert "not an MTP file" in msgs["main"]
    assert "mtp.0.e_proj.weight" in msgs["other"] and "expected [256, 256]" in msgs["other"]


def test_a_wrong_tensor_type_is_named(mtp_models, tmp_path, monkeypatch):
    main, mtp, cfg = mtp_models
    from engine.gguf import mtp_file as MF
    real = MF.mtp_tensors

    def f16_eproj(c):      # a writer that types e_proj F16 (ds4 binds Q8_0 only)
        return [s if s.name != "mtp.0.e_proj.weight" else s.__class__(s.name, s.dims, MF.PLAIN, s.component, s.layer)
                for s in real(c)]
    monkeypatch.setattr(MF, "mtp_tensors", f16_eproj)
    bad = write_synthetic_mtp(tmp_path / "f16.gguf", cfg)
    monkeypatch.setattr(MF, "mtp_tensors", real)
    with pytest.raises(ModelFileError, match=r"mtp.0.e_proj.weight' has type F16, expected Q8_0"):
        MTPFile.open(bad, cfg)


# -- greedy exactness -----------------------------------------------------------------------------

class TruthDrafter:
    """Proposes the true continuation (`every` 2: every other proposal is off by one id)."""

    def __init__(self, truth, vocab, n_prompt, every=1):
        self.truth, self.vocab, self.every, self.n_prompt = truth, vocab, every, n_prompt

    def propose(self, s, y, n):
        i = s.pos - self.n_prompt + 1
        out = []
        for j in range(n):
            t = self.truth[i + j] if i + j < len(self.truth) else 0
            out.append((t + 1) % self.vocab if self.every == 2 and (i + j) % 2 else t)
        return out, None

    def commit(self, s, kept, hc):
        pass

    def reset(self):
        pass


def _plain(eng, n, prompt, snaps=None):
    """n greedy tokens; `snaps` (a dict) gets the snapshot at every length on the way."""
    s = Session(eng, 256)
    s.sync(prompt)
    out = []
    for _ in range(n):
        t = s.sample(GREEDY)
        out.append(t)
        s.eval(t)
        if snaps is not None:
            snaps[s.pos] = s.snapshot()
    return out, s.snapshot()


def _speculative(eng, drafter, n, n_draft, prompt=PROMPT, snaps=None):
    """The same with speculation; with `snaps`, the state after every step is checked against
    plain decoding's at that length (a row a rejected draft left behind would show there; the
    last step, limited to the tokens left, often drafts nothing and would hide it)."""
    s = Session(eng, 256)
    s.sync(prompt)
    sp = Speculator(s, drafter, n_draft)
    out = []
    while len(out) < n:
        out += sp.step(GREEDY, Rng(1), limit=n - len(out))
        if snaps is not None:
            assert s.snapshot() == snaps[s.pos], f"the state at {s.pos} tokens differs from plain decoding's"
    return out, s.snapshot(), sp


def _check_greedy(main, mtp, backend, n, n_draft, prompt=PROMPT, every_step=True):
    with Engine.open(main, backend=backend) as eng:
        attach_mtp(eng, mtp)
        snaps = {}
        plain, snap = _plain(eng, n, prompt, snaps)
        V, k = eng.config.n_vocab, len(prompt)
        for name, dr in (("mtp", MTPDrafter(eng)), ("truth", TruthDrafter(plain, V, k)),
                         ("half", TruthDrafter(plain, V, k, every=2))):
            out, got, sp = _speculative(eng, dr, n, n_draft, prompt, snaps if every_step else None)
            assert out == plain, name
            assert got == snap, f"{name}: the snapshot differs from plain decoding's"
            if name == "truth":
                assert sp.acceptance == 1.0
            if name == "half":
                assert 0.2 < sp.acceptance < 0.8
            if name == "mtp":
                assert sp.stats["drafted"] > 0


def _backends():
    return [b for b in ("numpy", "cpu", "mlx") if b in registry.available_names()]


def test_greedy_with_speculation_is_plain_decoding_numpy(mtp_models):
    main, mtp, _ = mtp_models
    _check_greedy(main, mtp, "numpy", 8, 2, PROMPT[:18])     # (the indexer starts at 20 tokens)


@pytest.mark.slow       # 110 tokens x 4 runs a backend: 30-60 s each on 2 cores
@pytest.mark.parametrize("backend", _backends())
def test_greedy_with_speculation_is_plain_decoding_110_tokens(mtp_models, backend):
    """The same tokens and, at the end, the same snapshot bytes."""
    main, mtp, _ = mtp_models
    _check_greedy(main, mtp, backend, 110, 3, every_step=False)


@pytest.mark.slow
@pytest.mark.parametrize("backend", _backends())
def test_greedy_with_speculation_every_step_110_tokens(mtp_models, backend):
    main, mtp, _ = mtp_models
    _check_greedy(main, mtp, backend, 110, 3)


def test_verify_rows_are_decode_steps_bit_for_bit(mtp_models):
    """forward_verify's rows equal one-token decode steps' logits exactly (the premise of the
    snapshot equality), here across a ratio-4 window end and the indexer's start."""
    main, _, _ = mtp_models
    with Engine.open(main) as eng:
        toks = [7, 300, 12, 99, 5]
        a = Session(eng, 128)
        a.sync(PROMPT[:17])
        rows = [a.eval(t).copy() for t in toks]
        b = Session(eng, 128)
        b.sync(PROMPT[:17])
        got = eng.model.forward_verify(np.asarray(toks), b.pos, b.state)
        assert np.array_equal(np.stack(rows), got)


def test_the_drafter_is_not_persisted(mtp_models):
    """A session saved with MTP resumes without it and the other way round: the payload is the
    main timeline's only."""
    main, mtp, _ = mtp_models
    with Engine.open(main) as eng:
        attach_mtp(eng, mtp)
        out, snap, _ = _speculative(eng, MTPDrafter(eng), 3, 2, PROMPT[:8])
    with Engine.open(main) as plain_eng:
        s = Session(plain_eng, 256)
        s.restore(snap)
        assert s.tokens == PROMPT[:8] + out
        more = [s.sample(GREEDY)]
        s.eval(more[0])
        plain_snap = s.snapshot()
    # and a session saved without MTP goes on with it: the first step has no HC row to draft from
    with Engine.open(main, mtp=mtp) as eng:
        s = Session(eng, 256)
        s.restore(snap)
        sp = Speculator(s, MTPDrafter(eng), 2)
        assert sp.step(GREEDY, Rng(1), limit=1) == more and s.snapshot() == plain_snap
        sp.step(GREEDY, Rng(1), limit=3)
        assert sp.stats["drafted"] > 0


# -- sampling: the rejection rule -----------------------------------------------------------------

def _chi2_critical(dof: int, z: float = 3.719) -> float:
    """The chi-square value a statistic exceeds with probability ~1e-4 (Wilson-Hilferty)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def _markov(V=6, seed=0):
    """A toy 'model': P[prev] the target's next-token distribution, Q[prev] a drafter's."""
    g = np.random.default_rng(seed)
    P = g.dirichlet(np.ones(V) * 0.7, size=V)
    Q = 0.5 * g.dirichlet(np.ones(V), size=V) + 0.5 * P[:, ::-1]
    return P, Q / Q.sum(axis=1, keepdims=True)


def _two_tokens(P, Q, seed, rule):
    """The first two tokens after token 0 with one draft: y ~ P[0] as plain sampling draws it,
    d ~ Q[y], then `rule` keeps d or draws the replacement."""
    rng, drng = Rng(seed), Rng(seed ^ 0x5DEECE66D)
    y = draw(P[0], rng)
    d = draw(Q[y], drng)
    k, r = rule([P[y]], [d], [Q[y]], rng)
    return y, d if k else r


def _biased(p_rows, drafts, q_rows, rng):
    """A wrong rule: on a rejection it draws from p itself, not from max(0, p - q)."""
    k, _ = accept_drafts(p_rows, drafts, q_rows, rng)
    return (k, None) if k == len(drafts) else (k, draw(p_rows[k], rng))


@pytest.mark.parametrize("rule,ok", [(accept_drafts, True), (_biased, False)])
def test_rejection_sampling_keeps_the_target_distribution(rule, ok):
    P, Q = _markov()
    V = len(P)
    n = 20000
    counts = np.zeros((V, V))
    for seed in range(1, n + 1):
        y, x = _two_tokens(P, Q, seed, rule)
        counts[y, x] += 1
    expected = n * P[0][:, None] * P
    live = expected > 0
    stat = float((((counts - expected) ** 2)[live] / expected[live]).sum())
    assert (stat < _chi2_critical(int(live.sum()) - 1)) == ok, stat


def test_a_one_hot_drafter_is_exact_too():
    """The MTP's own drafts are argmaxes (q one-hot): kept with probability p(d), else a draw
    from p without d."""
    p = np.array([0.5, 0.3, 0.2])
    n = 20000
    counts = np.zeros(3)
    for seed in range(1, n + 1):
        k, r = accept_drafts([p], [0], None, Rng(seed))
        counts[0 if k else r] += 1
    stat = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert stat < _chi2_critical(2)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_p=0.9),
                                    SamplingParams(temperature=1.0, top_k=5, min_p=0.0)])
def test_target_probs_is_what_sample_draws_from(params):
    logits = np.random.default_rng(2).normal(0, 1.5, 40).astype(np.float32)
    p = target_probs(logits, params)
    n = 20000
    counts = np.bincount([sample(logits, params, Rng(s)) for s in range(1, n + 1)], minlength=40)
    live = p > 0
    assert counts[~live].sum() == 0
    stat = float(((counts[live] - n * p[live]) ** 2 / (n * p[live])).sum())
    assert stat < _chi2_critical(max(1, int(live.sum()) - 1))


@pytest.mark.slow       # 40 verify steps and 80 forks: ~12 s on 2 loaded cores
def test_sampling_end_to_end_follows_the_model(mtp_models):
    """On the model: with a drafter that proposes plain sampling's most likely token, the first
    token and its follower come from the model's own distributions (the verify's rows feed the
    rule), and every token lies in plain sampling's support."""
    main, _, _ = mtp_models
    params = SamplingParams(temperature=1.5, min_p=0.2)
    with Engine.open(main) as eng:
        base = Session(eng, 128)
        base.sync(PROMPT)
        p0 = target_probs(base.logits, params)

        class Top:
            def propose(self, s, y, n):
                nxt = s.fork()
                nxt.eval(y)
                return [int(np.argmax(nxt.logits))], None

            def commit(self, *a):
                pass

            def reset(self):
                pass
        firsts = []
        for seed in range(1, 41):
            s = base.fork()
            sp = Speculator(s, Top(), 1)
            out = sp.step(params, Rng(seed))
            assert p0[out[0]] > 0
            if len(out) == 2:
                p1 = target_probs(_row_after(base, out[0]), params)
                assert p1[out[1]] > 0
            firsts.append(out[0])
        # the first token is drawn exactly as plain sampling draws it, seed for seed
        assert firsts == [sample(base.logits, params, Rng(seed)) for seed in range(1, 41)]


def _row_after(base, t):
    s = base.fork()
    return s.eval(t).copy()


def test_engine_open_takes_the_mtp_file_and_refuses_a_wrong_one(mtp_models):
    main, mtp, _ = mtp_models
    with Engine.open(main, mtp=mtp) as eng:
        assert eng.mtp is not None and eng.model.keep_hc >= 1
    with pytest.raises(ModelFileError, match="not an MTP file"):
        Engine.open(main, mtp=main)


def test_gguf_cli_writes_and_recognises_an_mtp_file(tmp_path, capsys):
    from engine.gguf.gguf_cli import main
    m, x = tmp_path / "m.gguf", tmp_path / "x.gguf"
    assert main(["synth", str(m), "--layers", "1", "--vocab", "300", "--mtp", str(x)]) == 0
    assert main(["inspect", str(x), "--model", str(m)]) == 0
    assert "an MTP file" in capsys.readouterr().out
    other = tmp_path / "o.gguf"
    assert main(["synth", str(other), "--layers", "1", "--vocab", "300", "--embd", "512"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(x), "--model", str(other)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "mtp.0." in err


def test_ds4_cli_with_mtp_prints_plain_greedy_tokens(mtp_models, capsys):
    from ds4agent.ds4_cli import main
    main_path, mtp, _ = mtp_models
    args = ["-m", str(main_path), "-p", "Once upon", "-n", "6", "--temp", "0", "--nothink", "--dump-tokens"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--mtp", str(mtp), "--mtp-draft", "3"]) == 0
    got = capsys.readouterr()
    assert got.out == plain and "drafts accepted" in got.err
    assert main(args + ["--mtp", str(main_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not an MTP file" in err and "\n" not in err


def test_expected_speedup_follows_from_costs_and_acceptance():
    from engine.bench_mtp import expected_speedup, expected_tokens
    assert expected_tokens(2, 0.0) == 1.0 and expected_tokens(2, 1.0) == 3.0
    assert abs(expected_tokens(2, 0.5) - 1.75) < 1e-12
    costs = {1: 1.0, 2: 1.2, 3: 1.4}
    # 1.75 tokens for a 3-token verify (1.4) and two drafts (0.2): 1.75 / 1.6
    assert abs(expected_speedup(costs, 0.1, 2, 0.5) - 1.75 / 1.6) < 1e-12


def test_bench_mtp_prints_step_costs_and_speedups(mtp_models, capsys):
    from engine.bench import main
    main_path, mtp, _ = mtp_models
    args = ["-m", str(main_path), "--ctx-start", "16", "--gen-tokens", "3", "--mtp-reps", "1"]
    assert main(args + ["--mtp", str(mtp), "--mtp-draft", "1"]) == 0
    text = capsys.readouterr().out
    assert "a=0.8" in text and "measured acceptance with --mtp-draft 1" in text
    # wall and CPU time, the read floor; then the same steps with the rows sharing their experts
    out = text.splitlines()
    heads = [i for i, l in enumerate(out) if l == "tokens,ms,x_one_token,cpu_ms,x_cpu,floor_MB,x_floor"]
    assert len(heads) == 2 and "sharing the first row's experts" in out[heads[1] - 1]
    for h in heads:
        assert [r.split(",")[0] for r in out[h + 1:h + 6]] == ["1", "2", "3", "4", "5"]
        one = out[h + 1].split(",")
        assert one[2] == one[4] == one[6] == "1.000" and len(out[h + 2].split(",")) == 7
    # tokens per second with the true continuation as drafts, against plain decoding (N = 0)
    at = out.index("N,tokens_per_s,x_plain")
    assert [r.split(",")[0] for r in out[at + 1:at + 6]] == ["0", "1", "2", "3", "4"]
    assert out[at + 1].endswith(",1.000") and all(float(r.split(",")[1]) > 0 for r in out[at + 1:at + 6])
    assert main(args + ["--mtp", str(main_path)]) == 1
    assert "not an MTP file" in capsys.readouterr().err


def test_the_agents_generation_loop_with_mtp_leaves_what_the_plain_loop_leaves(mtp_models):
    """ds4agent.generation.generate with a speculator: the same tokens, result and snapshot as
    the plain loop, also when the stream ends inside a step (a stop string: the tokens the step
    evaluated past it are cut back)."""
    from ds4agent.generation import generate
    from ds4agent.generation_mtp import speculator_for
    from prompts import DsmlStream
    main, mtp, _ = mtp_models
    with Engine.open(main, mtp=mtp) as eng:
        tb = eng.tokenizer.token_bytes

        def run(spec_truth, stop):
            s = Session(eng, 256)
            s.sync(PROMPT[:18])
            sp = None
            if spec_truth is not None:
                sp = speculator_for(s, 4)
                sp.drafter = TruthDrafter(spec_truth, eng.config.n_vocab, 18)
            toks = []
            res = generate(s, DsmlStream("none", has_tools=True, stop=stop), sampling=GREEDY, rng=Rng(1),
                           limit=10, eos_id=eng.tokenizer.eos_id, token_bytes=lambda t: (toks.append(t), tb(t))[1],
                           speculator=sp)
            return toks, (res.n_tokens, res.finish), s.snapshot(), res
        toks, res, snap, _ = run(None, ())
        stop = tb(toks[6])
        for stop_s in ((), (stop,)):
            plain = run(None, stop_s)
            spec = run(toks, stop_s)
            assert spec[:3] == plain[:3]
            assert spec[3].drafted > 0
        assert plain[1][1] == "stop" and len(plain[0]) <= 7       # the stop string did end it early


def test_agent_flags_and_config_keys(mtp_models, tmp_path, monkeypatch, capsys):
    """--mtp/--mtp-draft, else `mtp`/`mtp_draft` in config.toml; a wrong MTP file is one line and
    exit 1 before any UI; the status bar shows the acceptance."""
    import argparse

    from ds4agent import cli
    from ds4agent.agent import mtp_status
    from ds4agent.events import Status
    from ds4agent.tui_widgets import status_fields
    from engine.mtp_options import resolve_mtp
    main_path, mtp, _ = mtp_models
    ns = argparse.Namespace(mtp=None, mtp_draft=None)
    assert resolve_mtp(ns, {"mtp": "/x.gguf", "mtp_draft": 3}) == ("/x.gguf", 3)
    assert resolve_mtp(argparse.Namespace(mtp="/y", mtp_draft=1), {"mtp": "/x.gguf"}) == ("/y", 1)
    with pytest.raises(ValueError, match="mtp_draft in the config"):
        resolve_mtp(ns, {"mtp_draft": 40})
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--model", str(main_path), "--mtp", str(main_path), "-p", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not an MTP file" in err and "\n" not in err
    assert mtp_status([0, 0]) == "" and mtp_status([10, 4]) == "mtp 40%"
    st = Status("m", "numpy", 10, 100, 0.0, 1.0, "s", "high", mtp="mtp 40%")
    assert any("mtp 40%" in f.forms[0] for f in status_fields(st, "idle"))


def _corrupt_runs(main_path, mtp, tmp_path, monkeypatch, commands):
    """Every corrupted variant of the MTP file through `commands`: exit 0, or 1 with one line."""
    from test_gguf_corruption import clean, gguf_corrupt, run_cli
    monkeypatch.setenv("DS4_AGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    variants = gguf_corrupt.mtp_variants(mtp, seed=0)
    assert len(variants) >= 40
    path = tmp_path / "variant-mtp.gguf"
    bad, refused = [], 0
    for label, build in variants:
        path.write_bytes(build())
        for name, entry, argv in commands(str(path)):
            rc, err = run_cli(entry, argv)
            refused += rc == 1
            if not clean(name, rc, err):
                bad.append(f"{label} | {name}: {rc} {err.strip()[-300:]}")
    assert not bad, "\n".join(bad)
    return refused, len(variants)


def test_corrupt_mtp_files_are_one_line_in_inspect(mtp_models, tmp_path, monkeypatch):
    from engine.gguf.gguf_cli import main as gguf_main
    main_path, mtp, _ = mtp_models
    refused, n = _corrupt_runs(main_path, mtp, tmp_path, monkeypatch,
                               lambda p: [("ds4-gguf inspect", gguf_main, ["inspect", p, "--model", str(main_path)])])
    assert n // 2 < refused < n          # flips in weights still fit; the rest are refused


@pytest.mark.slow       # ~60 variants through three commands that open the engine: ~2 min
def test_corrupt_mtp_files_are_one_line_in_every_command(mtp_models, tmp_path, monkeypatch):
    from ds4agent.cli import main as agent_main
    from ds4agent.ds4_cli import main as ds4_main
    from engine.bench import main as bench_main
    main_path, mtp, _ = mtp_models
    m = str(main_path)
    _corrupt_runs(main_path, mtp, tmp_path, monkeypatch, lambda p: [
        ("ds4", ds4_main, ["-m", m, "-p", "hi", "-n", "2", "--nothink", "--ctx", "64", "--mtp", p]),
        ("ds4-bench", bench_main, ["-m", m, "--ctx-start", "8", "--gen-tokens", "2", "--mtp-reps", "1", "--mtp", p]),
        ("ds4-agent", agent_main, ["-m", m, "-p", "hi", "--ctx", "64", "--mtp", p])])


def test_bench_mtp_read_floor_is_the_union_of_the_rows_experts(mtp_models):
    """ds4-bench --mtp's read floor: the bytes a step must read, the routed experts counted once
    per layer for all of the step's rows (their union); with the rows sharing the first row's
    routing, a T-row step's floor is a one-row step's."""
    from engine.bench_mtp import expert_bytes, step_costs
    from engine.gguf.inspect import report
    main, _, cfg = mtp_models
    with Engine.open(main, backend="numpy") as eng:
        s = Session(eng, 64)
        s.sync(PROMPT[:20])
        fixed, per = expert_bytes(eng.file)
        one_token = report(eng.file)["bytes_per_token"]["short"]
        own = step_costs(s, 1, sizes=(1, 3))
        shared = step_costs(s, 1, sizes=(1, 3), share=True)
    k = cfg.n_expert_used
    assert fixed + k * sum(per) == one_token and own[1][2] <= one_token
    assert shared[3][2] == shared[1][2] == own[1][2]
    assert own[1][2] < own[3][2] <= fixed + 3 * k * sum(per)
    assert all(c[0] > 0 and c[1] > 0 for c in own.values())

