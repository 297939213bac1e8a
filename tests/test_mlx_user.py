"""The mlx backend where users meet it, on MLX's CPU device (Linux CI): `ds4-agent --backend mlx`
completes turns, `/save` and `--resume` (the CLI and the agent loop), a session saved on mlx resumes
on the host backends through its KV file, the shim answers an OpenAI SDK chat request on mlx (in
process, and `ds4-agent --serve --backend mlx` as a subprocess), `ds4 --backend mlx` agrees with the
NumPy reference, and `ds4-bench --backend mlx --peer cpu` says on which device MLX ran.

The synthetic 2-layer `agent_model` (tests/conftest.py); every agent here shares one session folder,
so its sysprompt.kv (~3.7k tokens of tool schemas) is prefilled once, on a host backend, and every
mlx agent starts from that file: KV files cross between backends in both directions.
"""
from __future__ import annotations

import functools
import json
import platform
import subprocess

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")

from ds4agent import agent as agent_mod  # noqa: E402
from ds4agent import cli  # noqa: E402
from ds4agent.agent import Agent, AgentConfig  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from engine.backends import registry as R  # noqa: E402
from sessions import SessionStore  # noqa: E402

if R.get("mlx").available() is not None:
    pytest.skip(f"mlx cannot serve here: {R.get('mlx').available()}", allow_module_level=True)

SYSTEM = "You are ds4-agent under test on mlx."
CTX = 8192


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """DS4_AGENT_HOME for the CLI; its sessions/ is every agent's session folder here."""
    return tmp_path_factory.mktemp("home")


def _project(root):
    root.mkdir()
    (root / "hello.py").write_text("def greet(name):\n    return 'hi ' + name\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return _project(tmp_path_factory.mktemp("p") / "proj")


@pytest.fixture(scope="module")
def mlx_engine(agent_model):
    with Engine.open(agent_model, backend="mlx") as e:
        yield e


def _agent(engine, project, home) -> Agent:
    conf = AgentConfig(ctx=CTX, think_mode="none", max_turn_tokens=8, sampling=SamplingParams(seed=1))
    agent = Agent(engine, project, config=conf, store=SessionStore(root=home / "sessions", project_dir=project),
                  system=SYSTEM)
    agent.start()
    return agent


@pytest.fixture(scope="module")
def system_prefix(agent_model, project, home):
    """The agents' sysprompt.kv, prefilled on a host backend (the C kernels where built: the
    ~3.7k tokens take seconds there, several times longer on MLX's CPU device). Every mlx agent
    then starts from a KV file another backend wrote. Returns that prefix's snapshot."""
    host = "cpu" if "cpu" in R.available_names() else "numpy"
    with Engine.open(agent_model, backend=host) as eng:
        agent = _agent(eng, project, home)
        assert agent.session.stats["prefill_tokens"] == agent.session.pos > 3000
        return agent.session.snapshot()


@pytest.fixture(scope="module")
def saved(mlx_engine, project, home, system_prefix):
    """A conversation on mlx: one sampled turn through the real loop, one forced, then `/save`.
    Returns the saved tokens, the session's snapshot (the host KV and logits) at the save and the
    saved session's id (the name "on-mlx" moves on to a continuation; the id stays on this save)."""
    agent = _agent(mlx_engine, project, home)
    assert agent.engine.backend == "mlx"
    # the host backend's sysprompt.kv, taken over by mlx and handed back: the same bytes
    assert agent.session.stats["prefill_tokens"] == 0 and agent.session.snapshot() == system_prefix
    fin = agent.submit("hello there")                  # sampled on mlx, cut at 8 tokens or ended
    assert fin.finish_reason in ("stop", "length") and not fin.interrupted
    agent.force("It returns a greeting.")
    assert agent.submit("what does greet do?").finish_reason == "stop"
    assert [m.role for m in agent.transcript] == ["system", "user", "assistant", "user", "assistant"]
    assert "on-mlx" in agent.command("/save on-mlx")
    tokens, snap, sid = agent.session.tokens, agent.session.snapshot(), agent.current_sha
    assert agent.command("/quit") == "quit"
    return tokens, snap, sid


def test_a_session_saved_on_mlx_resumes_on_mlx(saved, mlx_engine, project, home):
    tokens, snap, _ = saved
    other = _agent(mlx_engine, project, home)
    assert other.session.stats["prefill_tokens"] == 0          # the system prefix came from sysprompt.kv
    assert other.command("/resume").startswith("switched to session")
    assert other.session.tokens == tokens
    assert other.session.snapshot() == snap                    # KV and logits, bit for bit through the file
    other.force("Yes.")
    assert other.submit("and then?").finish_reason == "stop"
    assert other.tok.decode(other.session.tokens).endswith("and then?<｜Assistant｜></think>Yes.")


@pytest.mark.parametrize("peer", ["cpu", "numpy"])
def test_a_session_saved_on_mlx_resumes_on_a_host_backend(peer, saved, agent_model, project, home):
    """The KV file mlx wrote is read by another backend: the same host state bit for bit, and the
    next token's logits from it agree with the peer's own prefill of the same tokens."""
    if peer not in R.available_names():
        pytest.skip(f"{peer} cannot serve here: {R.get(peer).available()}")
    tokens, snap, sid = saved
    with Engine.open(agent_model, backend=peer) as eng:
        agent = _agent(eng, project, home)
        assert agent.session.stats["prefill_tokens"] == 0      # mlx's sysprompt.kv, read on the peer
        # by id: the previous test continued "on-mlx", and a name follows its conversation
        assert agent.command(f"/switch {sid}").startswith("switched to session")
        assert agent.session.tokens == tokens and agent.session.snapshot() == snap
        nxt = agent.tok.encode(" ok")[0]
        from_mlx = agent.session.eval(nxt).astype(np.float64)
        agent.session.reset()
        agent.session.sync(tokens)                              # the peer's own KV for the same tokens
        own = agent.session.eval(nxt).astype(np.float64)
        err = float(np.abs(from_mlx - own).max())
        scale = float(np.abs(own).max())
        # ds4 numerics round the KV rows (FP8/F16): an mlx value one float32 ulp away from a
        # rounding boundary lands on the other side, so the bound is the rounding's, not float32's
        assert err <= 0.05 * scale, f"max-abs {err:.3g} (logits up to {scale:.3g})"
        assert int(np.argmax(from_mlx)) == int(np.argmax(own))
        agent.session.reset()
        agent.session.restore(snap)
        agent.force("Resumed on " + peer + ".")
        assert agent.submit("go on").finish_reason == "stop"


def test_ds4_agent_cli_backend_mlx_turn_then_resume(agent_model, home, tmp_path, monkeypatch, capsys):
    """`ds4-agent --backend mlx -p TASK`, then `--resume -p TASK2`: the second run continues the
    session the first one autosaved. The agent's reply is forced (the synthetic model's sampled
    text would not end on its own), the system prompt is the module's (its prefix is cached)."""
    made = []

    class Scripted(Agent):
        def __init__(self, engine, project_dir, **kw):
            super().__init__(engine, project_dir, **{**kw, "system": SYSTEM})
            made.append(self)
            self.force(f"answer {len(made)}")

    monkeypatch.setattr(agent_mod, "Agent", Scripted)
    monkeypatch.setenv("DS4_AGENT_HOME", str(home))
    monkeypatch.chdir(_project(tmp_path / "cliproj"))
    base = ["--model", str(agent_model), "--backend", "mlx", "--ctx", str(CTX), "--nothink"]
    assert cli.main(base + ["-p", "first task"]) == 0
    out = capsys.readouterr()
    assert "answer 1" in out.out and "finished: stop" in out.err
    assert cli.main(base + ["--resume", "-p", "second task"]) == 0
    assert "answer 2" in capsys.readouterr().out
    assert [a.engine.backend for a in made] == ["mlx", "mlx"]
    text = made[1].tok.decode(made[1].session.tokens)
    assert text.index("first task") < text.index("answer 1") < text.index("second task") < text.index("answer 2")


def test_the_shim_answers_an_openai_chat_request_on_mlx(mlx_engine, tmp_path):
    """One OpenAI SDK chat request against the shim on mlx; its greedy answer is the text a plain
    mlx session decodes greedily from the prompt the shim rendered (its trace says which)."""
    openai = pytest.importorskip("openai")
    from ds4agent.serve import ServeConfig, ServerThread, Shim
    trace = tmp_path / "trace.jsonl"
    shim = Shim(mlx_engine, ServeConfig(ctx=CTX, max_tokens=16, trace=str(trace)))
    with ServerThread(shim) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="deepseek-v4-flash", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello."}],
                                           extra_body={"thinking": False})
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason in ("stop", "length") and 0 < r.usage.completion_tokens <= 6
    rec = json.loads(trace.read_text().splitlines()[-1])
    assert rec["status"] == 200 and rec["output"] == ch.message.content
    from engine import Session
    s = Session(mlx_engine, CTX)
    s.sync(mlx_engine.tokenizer.encode(rec["prompt_text"]))
    ids = []
    for _ in range(r.usage.completion_tokens):
        ids.append(int(np.argmax(s.logits)))
        s.eval(ids[-1])
    assert mlx_engine.tokenizer.decode(ids).startswith(ch.message.content)


def test_ds4_agent_serve_backend_mlx_answers(agent_model, tmp_path):
    """`ds4-agent --serve --backend mlx` as a user starts it (a subprocess): a chat request is
    answered 200 with the model's text, and SIGTERM ends it cleanly."""
    import httpx
    from test_serve_runtime import NO_THINK, Proc
    srv = Proc(agent_model, tmp_path, "--backend", "mlx")
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, **NO_THINK})
    finally:
        rc = srv.stop()
    log = srv.text()
    assert r.status_code == 200, (r.text, log[-3000:])
    assert r.json()["choices"][0]["message"]["content"] and r.json()["usage"]["completion_tokens"] <= 3
    assert rc == 0 and "Traceback" not in log, log[-3000:]


def test_ds4_backend_mlx_matches_the_reference_in_exact_numerics(small_model, tmp_path, capsys):
    """`ds4 --backend mlx` generates; in exact numerics its logits at every step are the NumPy
    reference's within float32 summation error, and greedy picks the same tokens."""
    from ds4agent.ds4_cli import main
    got = {}
    for be in ("mlx", "numpy"):
        lg = tmp_path / f"{be}.npy"
        rc = main(["-m", str(small_model), "-p", "Once upon a time", "-n", "8", "--temp", "0", "--nothink",
                   "--backend", be, "--numerics", "exact", "--dump-logits", str(lg), "--dump-tokens"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        got[be] = (np.load(lg).astype(np.float64), [ln for ln in out.out.splitlines() if ln.startswith("gen[")])
    (a, ta), (b, tb) = got["mlx"], got["numpy"]
    assert a.shape == b.shape and ta == tb
    err = float(np.abs(a - b).max())
    assert err <= 1e-4 * max(1.0, float(np.abs(b).max())), f"max-abs {err:.3g}"


def test_bench_mlx_beside_cpu_says_where_mlx_ran(small_model, tmp_path, capsys, monkeypatch):
    """`ds4-bench --backend mlx --peer cpu`: both backends' rows in one CSV, the ratio line, and
    the device MLX ran on (its CPU off Apple Silicon, said as such)."""
    if "cpu" not in R.available_names():
        pytest.skip(f"cpu cannot serve here: {R.get('cpu').available()}")
    from engine import bench
    # the floors' values are not under test here: a smaller buffer and matrix keep the run short
    monkeypatch.setattr(bench, "measure_floors", functools.partial(bench.measure_floors, read_mib=32, gemm_n=256))
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["quel ramo del lago di Como"] * 60) + "\n")
    rc = bench.main(["-m", str(small_model), "--prompt-file", str(text), "--ctx-start", "48", "--ctx-max", "48",
                     "--gen-tokens", "3", "--backend", "mlx", "--peer", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert [ln.split(",")[0] for ln in out.splitlines()] == ["backend", "mlx", "cpu"]
    dev = next(ln for ln in err.splitlines() if ln.startswith("device: mlx"))
    assert str(mx.default_device()) in dev
    if mx.default_device().type == mx.DeviceType.cpu:
        assert "these are CPU figures" in dev
    if platform.system() == "Linux":
        assert "Metal kernels off" in dev and "on Linux MLX has no GPU" in dev
    assert "ctx 48: mlx/cpu prefill " in err and "device: cpu, the C kernels" in err
