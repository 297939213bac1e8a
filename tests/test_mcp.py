"""MCP tools (issue 25 part 3): config files, real stdio servers written here and started with the
official SDK, their tools in the system prompt and called through forced DSML, approval, servers
that fail at start or die mid-session, /mcp, and no server process left after close.

Each server start costs 2-5 s on a loaded machine (a Python interpreter importing the SDK), so the
module starts one manager for most tests; the death and trust tests start their own.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import prompts

from ds4agent import events as E
from ds4agent import mcp_client, mcp_config
from ds4agent.mcp_client import McpManager, check_arguments, result_of, start_servers, tool_name

from helpers_agent import call, start_agent, timeline

SERVER = r'''
import os, sys
try:
    from mcp.server.mcpserver import MCPServer as Server      # SDK 2.x
except ImportError:
    from mcp.server.fastmcp import FastMCP as Server          # SDK 1.x
if os.environ.get("PIDFILE"):
    open(os.environ["PIDFILE"], "w").write(str(os.getpid()))
print("test server starting", file=sys.stderr)
app = Server("demo")

@app.tool()
def add(a: int, b: int) -> str:
    """Add two whole numbers."""
    return f"the sum is {a + b} (from the MCP server)"

@app.tool()
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper() + "!"

@app.tool()
def nap(seconds: float) -> str:
    """Sleep, then answer."""
    import time
    time.sleep(seconds)
    return "rested"

@app.tool()
def fail(why: str) -> str:
    """Always fails."""
    raise ValueError("refused: " + why)

app.run()
'''


def _server_file(d: Path) -> Path:
    p = d / "mcp_test_server.py"
    p.write_text(SERVER)
    return p


def _home(d: Path, servers: dict, **top) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "mcp.json").write_text(json.dumps({"mcpServers": servers, **top}))
    return d


def _alive(pid: int) -> bool:
    """True while the process exists, zombie included (a zombie is a child nobody reaped)."""
    return Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module")
def mcp_home(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcphome")
    srv = _server_file(d)
    return _home(d / "home", {
        "demo": {"command": sys.executable, "args": [str(srv)], "env": {"PIDFILE": str(d / "demo.pid")},
                 "alwaysAllow": ["shout"]},
        "broken": {"command": sys.executable, "args": ["-c", "import sys; print('no token', file=sys.stderr); sys.exit(3)"]},
    }, allow=["mcp__demo__f*"])


@pytest.fixture(scope="module")
def mgr(mcp_home):
    notices = []
    m = start_servers(mcp_home, notices.append, home=mcp_home)
    m.start_notices = notices
    yield m
    m.close()


# -- configuration (no server started) --------------------------------------------------------------
def test_config_merges_expands_and_reports_bad_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_T_TOKEN", "s3cret")
    monkeypatch.delenv("MCP_T_UNSET", raising=False)
    home = _home(tmp_path / "home", {
        "a": {"command": "node", "args": ["a.js", "${MCP_T_TOKEN}"], "env": {"K": "${MCP_T_UNSET:-dflt}"}},
        "b": {"command": "home-b"},
        "c": {"command": "x", "type": "http"},
        "d": {"args": ["no command"]},
        "e": {"command": "y", "env": {"K": "${MCP_T_UNSET}"}},
        "bad name!": {"command": "z"},
    }, allow=["mcp__a__*"])
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / ".mcp.json").write_text(json.dumps({"mcpServers": {"b": {"command": "proj-b", "timeout": 5}}}))
    cfg = mcp_config.load(proj, home)
    assert cfg.servers["a"].args == ["a.js", "s3cret"] and cfg.servers["a"].env == {"K": "dflt"}
    assert cfg.servers["a"].cwd == str(proj.resolve()) and cfg.allow == ["mcp__a__*"]
    # the project's b replaces the user's, and waits for the user's trust
    assert "b" not in cfg.servers and cfg.untrusted["b"].command == "proj-b" and cfg.untrusted["b"].timeout == 5
    text = "\n".join(cfg.warnings)
    assert "server c: type 'http' is not supported" in text
    assert "server d: command must be a non-empty string" in text
    assert "server e: env K: ${MCP_T_UNSET} is not set" in text
    assert "'bad name!'" in text
    assert len(cfg.warnings) == 4 and all("\n" not in w and w.startswith("mcp: ") for w in cfg.warnings)
    # trusted as written now; a changed entry needs the trust again
    mcp_config.trust(proj, [cfg.untrusted["b"]], home)
    assert mcp_config.load(proj, home).servers["b"].command == "proj-b"
    (proj / ".mcp.json").write_text(json.dumps({"mcpServers": {"b": {"command": "evil-b"}}}))
    again = mcp_config.load(proj, home)
    assert "b" not in again.servers and again.untrusted["b"].command == "evil-b"


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not JSON (line 1 column 2"),
    ('["a list"]', 'expected {"mcpServers"'),
    ('{"mcpServers": []}', 'expected {"mcpServers"'),
])
def test_bad_file_is_one_warning_naming_it(tmp_path, content, problem):
    home = tmp_path / "home"
    home.mkdir()
    (home / "mcp.json").write_text(content)
    cfg = mcp_config.load(tmp_path, home)
    assert cfg.servers == {} and len(cfg.warnings) == 1
    assert str(home / "mcp.json") in cfg.warnings[0] and problem in cfg.warnings[0]
    notices = []
    assert start_servers(tmp_path, notices.append, home=home) is None     # nothing to start
    assert [n.text for n in notices] == cfg.warnings


def test_arguments_are_checked_loosely():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": ["string", "null"]}},
              "required": ["n"]}
    assert check_arguments(schema, {"n": 3, "extra": 1}) == {"n": 3, "extra": 1}   # extra keys: the server's call
    assert check_arguments(schema, '{"n": 1, "s": null}') == {"n": 1, "s": None}
    for bad, msg in [({}, "missing required argument 'n'"), ({"n": "3"}, "'n' must be integer"),
                     ({"n": True}, "'n' must be integer"), ([1], "must be a JSON object"),
                     ("{x", "not valid JSON")]:
        with pytest.raises(mcp_client.tools.ToolError, match=msg):
            check_arguments(schema, bad)
    with pytest.raises(mcp_client.tools.ToolError, match="unknown argument 'x'"):
        check_arguments({**schema, "additionalProperties": False}, {"n": 1, "x": 2})


def test_results_join_text_and_summarize_the_rest():
    res = result_of({"content": [{"type": "text", "text": "one"}, {"type": "image", "data": "A" * 400, "mimeType": "image/png"},
                                 {"type": "resource", "resource": {"uri": "file:///x", "text": "inline"}},
                                 {"type": "resource_link", "uri": "file:///y", "name": "y"}]})
    assert res.ok and res.text == "one\n[image: 300 bytes, image/png]\ninline\n[resource link: file:///y]"
    err = result_of({"content": [{"type": "text", "text": "bad day"}], "isError": True})
    assert not err.ok and err.text == "error: bad day"
    assert tool_name("my server", "get.thing") == "mcp__my_server__get_thing"


# -- a running server ---------------------------------------------------------------------------------
def test_a_server_failing_at_start_is_one_notice(mgr, mcp_home):
    lines = [n.text for n in mgr.start_notices]
    assert len(lines) == 1 and lines[0].startswith("mcp: server broken failed to start: ")
    assert str(mcp_home / "logs" / "mcp-broken.log") in lines[0]           # where its stderr went
    assert "no token" in (mcp_home / "logs" / "mcp-broken.log").read_text()
    assert mgr.servers["broken"].status == "failed" and mgr.servers["demo"].status == "running"
    assert not any(t.startswith("mcp__broken__") for t in mgr._tools)


def test_tools_are_in_the_system_prompt_after_the_builtin_ones(mgr, agent_engine, git_project, sessions_root):
    agent, rec = start_agent(agent_engine, git_project, sessions_root, mcp=mgr)
    prefix = agent.system_prefix()
    names = [json.loads(s)["function"]["name"] for s in agent.tool_schemas()]
    assert names[-4:] == ["mcp__demo__add", "mcp__demo__fail", "mcp__demo__nap", "mcp__demo__shout"] and names[0] == "read"
    assert '"name":"mcp__demo__add","description":"Add two whole numbers."' in prefix
    assert "mcp__demo__add" in timeline(agent)                # it is what was prefilled
    assert agent.system_prefix() == prefix                     # stable: the prompt cache matches


def test_forced_call_is_approved_and_its_result_reaches_the_model(mgr, agent_engine, git_project, sessions_root):
    agent, rec = start_agent(agent_engine, git_project, sessions_root, answer="y", mcp=mgr)
    agent.force("Adding." + call("mcp__demo__add", a=2, b=40), "Done.")
    fin = agent.submit("add 2 and 40")
    assert fin.tool_calls == 1 and fin.finish_reason == "stop"
    assert [a.name for a in rec.of(E.ApprovalNeeded)] == ["mcp__demo__add"]
    done = rec.of(E.ToolFinished)[0]
    assert done.ok and done.approved and done.text == "the sum is 42 (from the MCP server)"
    text = timeline(agent)          # the KV timeline holds the result, and the model went on after it
    assert "<tool_result>the sum is 42 (from the MCP server)</tool_result>" in text and text.endswith("Done.")


def test_refused_approval_and_allowed_tools(mgr, agent_engine, git_project, sessions_root):
    agent, rec = start_agent(agent_engine, git_project, sessions_root, answer="n", mcp=mgr)
    calls = [("mcp__demo__add", {"a": 1, "b": 1}), ("mcp__demo__shout", {"text": "hi"})]
    agent.force(prompts.render_tool_calls([prompts.ToolCall(None, n, json.dumps(a)) for n, a in calls]), "ok")
    assert agent.submit("go").tool_calls == 2
    add, shout = rec.of(E.ToolFinished)
    assert not add.approved and "did not approve this mcp__demo__add call" in add.text
    assert shout.approved and shout.ok and shout.text == "HI!"              # alwaysAllow: shout
    assert [a.name for a in rec.of(E.ApprovalNeeded)] == ["mcp__demo__add"]
    assert "<tool_result>HI!</tool_result>" in timeline(agent)
    # the rules themselves, and what reaches the server (the agent passes on what call returns)
    assert not mgr.needs_approval("mcp__demo__fail") and mgr.needs_approval("mcp__demo__nap")  # allow: mcp__demo__f*
    fail = mgr.call("mcp__demo__fail", {"why": "a test"})                    # isError: an error result
    assert not fail.ok and fail.text.startswith("error: ") and "fail" in fail.text
    assert mgr.call("mcp__demo__shout", {"text": 5}).text == "error: argument 'text' must be string, got 5"


def test_mcp_command_lists_servers_and_tools(mgr, agent_engine, git_project, sessions_root):
    agent, rec = start_agent(agent_engine, git_project, sessions_root, mcp=mgr)
    out = agent.command("/mcp")
    assert "demo (" in out and "): running" in out
    assert "mcp__demo__add [asks]  Add two whole numbers." in out
    assert "mcp__demo__shout  Upper-case a text." in out
    assert "broken (" in out and "failed: " in out
    assert agent.command("/mcp frobnicate").startswith("usage: /mcp")
    assert "/mcp" in agent.command("/help")
    assert mcp_client.command(None, "").startswith("no MCP servers configured")   # an Agent without servers


# -- servers that die, trust, shutdown ----------------------------------------------------------------
def test_server_dying_mid_session_is_an_error_result_and_one_notice(mgr, mcp_home, agent_engine, git_project,
                                                                    sessions_root):
    """The module's demo server is killed here (the tests after this one expect it gone)."""
    agent, rec = start_agent(agent_engine, git_project, sessions_root, mcp=mgr)  # same prompt: from its cache file
    pid = int((mcp_home.parent / "demo.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    agent.force(call("mcp__demo__shout", text="a"), call("mcp__demo__shout", text="b"), "still here")
    fin = agent.submit("shout")
    assert fin.finish_reason == "stop" and fin.tool_calls == 2
    first, second = rec.of(E.ToolFinished)
    assert first.text == second.text == "error: mcp server demo is not running"
    said = [n.text for n in rec.of(E.Notice) if "mcp" in n.text]
    assert len(said) == 1 and said[0].startswith("mcp: server demo died (")
    assert timeline(agent).endswith("still here")
    assert "mcp__demo__shout" in agent.system_prefix()        # still in the (prefilled) prompt
    assert "demo (" in agent.command("/mcp") and "stopped: died" in agent.command("/mcp")
    agent.force("and after")                                  # the agent goes on
    assert agent.submit("next").finish_reason == "stop" and timeline(agent).endswith("and after")
    deadline = time.monotonic() + 10                           # its task reaps the process: no zombie
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_manager_close_leaves_no_child_process(tmp_path):
    srv = _server_file(tmp_path)
    home = _home(tmp_path / "home", {n: {"command": sys.executable, "args": [str(srv)],
                                         "env": {"PIDFILE": str(tmp_path / f"{n}.pid")}} for n in ("one", "two")})
    notices = []
    m = start_servers(tmp_path, notices.append, home=home)
    pids = [int((tmp_path / f"{n}.pid").read_text()) for n in ("one", "two")]
    assert notices == [] and all(_alive(p) for p in pids)
    t0 = time.perf_counter()
    m.close()
    assert time.perf_counter() - t0 < 5
    assert not any(_alive(p) for p in pids)                   # ended and reaped
    assert m.call("mcp__one__add", {"a": 1, "b": 2}).text == "error: mcp server one is not running"
    m.close()                                                 # twice is harmless


def test_hung_start_slow_call_and_esc_are_bounded(tmp_path):
    srv = _server_file(tmp_path)
    hang = tmp_path / "hang.py"
    hang.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    home = _home(tmp_path / "home", {
        "mute": {"command": sys.executable, "args": [str(hang), str(tmp_path / "mute.pid")]},
        "slow": {"command": sys.executable, "args": [str(srv)], "alwaysAllow": ["*"], "timeout": 1}})
    m = McpManager(mcp_config.load(tmp_path, home), log_dir=tmp_path / "logs")
    try:
        assert m.start(["slow"]) == []
        m.start_timeout = 2           # mute starts no interpreter of ours: 2 s is plenty to see it hang
        t0 = time.perf_counter()
        lines = m.start()
        assert time.perf_counter() - t0 < 2 + 6          # the wait, and the hung one's shutdown
        assert lines == ["mcp: server mute failed to start: no answer within 2 s"]
        assert not _alive(int((tmp_path / "mute.pid").read_text()))       # stopped and reaped
        t0 = time.perf_counter()
        res = m.call("mcp__slow__nap", {"seconds": 5})
        assert res.text.startswith("error: mcp__slow__nap timed out after 1 s") and time.perf_counter() - t0 < 4
        t0 = time.perf_counter()
        res = m.call("mcp__slow__nap", {"seconds": 5}, should_stop=lambda: time.perf_counter() - t0 > 0.3)
        assert res.text == "error: mcp__slow__nap was interrupted" and time.perf_counter() - t0 < 2
        assert m.call("mcp__slow__shout", {"text": "still up"}).text == "STILL UP!"   # the server lives on
    finally:
        m.close()


def test_project_server_starts_only_once_trusted(tmp_path, git_project):
    srv = _server_file(tmp_path)
    home = tmp_path / "home"
    (git_project / ".mcp.json").write_text(json.dumps({"mcpServers": {"proj": {
        "command": sys.executable, "args": [str(srv)], "env": {"PIDFILE": str(tmp_path / "proj.pid")}}}}))
    notices = []
    m = start_servers(git_project, notices.append, home=home)
    try:
        assert [n.text for n in notices] == [f"mcp: {git_project / '.mcp.json'} server proj not started: a project's "
                                             "servers run once you trust them (/mcp trust proj)"]
        assert m.schemas() == [] and not (tmp_path / "proj.pid").exists()
        assert "proj (" in mcp_client.command(m, "") and "not trusted" in mcp_client.command(m, "")
        assert "no untrusted project server nope" in mcp_client.command(m, "trust nope")
        out = mcp_client.command(m, "trust proj")
        assert out.startswith(f"trusted proj: {sys.executable}") and "next /new" in out
        assert m.servers["proj"].status == "running" and "mcp__proj__add" in "".join(m.schemas())
        assert mcp_config.load(git_project, home).servers["proj"].project  # remembered
    finally:
        m.close()


def test_serve_never_loads_mcp():
    code = ("import sys, ds4agent.serve.cli, ds4agent.serve.app; "
            "print(sorted(m for m in sys.modules if m == 'mcp' or 'mcp_client' in m or 'mcp_config' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
