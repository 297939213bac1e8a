"""Helpers shared by the TUI tests (test_app, test_tui_sessions, test_tui_display,
test_checkpoints_tui): an event loop per async test, a pilot that types and waits, and agents over
the module's engine and session store (the `tui_env` and `tui_project` fixtures in conftest.py).
Its users import it after pytest.importorskip("textual")."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from pathlib import Path

from textual import events

import prompts
from ds4agent import events as E
from ds4agent.agent import Agent, AgentConfig
from engine import Engine
from helpers_git import git
from sessions import SessionStore

CTX = 8192
SIZE = (110, 44)
HELLO = 'def greet():\n    print("helo world")\n'


def sync(fn):
    """Run an async test body in its own event loop (no pytest async plugin needed)."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        return asyncio.run(fn(*a, **k))
    return wrapper


def start_env(model: Path, root: Path) -> dict:
    """One engine, one git project, one session store under root; the system prefix prefilled once
    (every agent of the module then starts from the store's cached sysprompt)."""
    proj = root / "proj"
    proj.mkdir()
    (proj / "hello.py").write_text(HELLO)
    git(proj, "init", "-q")
    git(proj, "add", ".")
    git(proj, "commit", "-qm", "init")
    engine = Engine.open(model, numerics="exact")     # as conftest's agent_engine, and why
    store_root = root / "sessions"
    warm = Agent(engine, proj, config=AgentConfig(ctx=CTX, think_mode="none"),
                 store=SessionStore(root=store_root, project_dir=proj))
    warm.start()                  # caches sysprompt.kv in the store
    return {"engine": engine, "proj": proj, "store_root": store_root}


def reset_project(proj: Path) -> None:
    """The project back to its committed tree (the system text, which lists it, stays the same)."""
    git(proj, "checkout", "-q", "--", ".")
    git(proj, "clean", "-fdq")


def make_factory(env, *, think_mode="none", max_turn_tokens=24, on_event=None, agents=None):
    """make_agent(emit) for AgentApp; on_event(agent, ev) runs on the worker thread after each event."""
    def make(emit):
        holder = []

        def hook(ev):
            emit(ev)
            if on_event is not None and holder:
                on_event(holder[0], ev)
        a = Agent(env["engine"], env["proj"],
                  config=AgentConfig(ctx=CTX, think_mode=think_mode, autosave=True, max_turn_tokens=max_turn_tokens),
                  store=SessionStore(root=env["store_root"], project_dir=env["proj"]), emit=hook,
                  model_name="tiny-q2.gguf")
        holder.append(a)
        if agents is not None:
            agents.append(a)
        return a
    return make


async def until(pilot, cond, what: str, timeout: float = 30.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.03)


async def press(pilot, *keys: str):
    """Keys as a user types them. Pilot.press waits for the whole process to go CPU-idle after each
    key (up to 2 s), which never happens while the engine thread computes: post them directly."""
    for k in keys:
        char = k if len(k) == 1 else ("\r" if k == "enter" else None)
        ev = events.Key(k, char)
        ev.set_sender(pilot.app)
        pilot.app._driver.send_message(ev)
        await pilot.pause(0.02)


async def send(pilot, text: str):
    pilot.app.input.load_text(text)
    await press(pilot, "enter")


async def ready(pilot):
    await until(pilot, lambda: pilot.app.ready and not pilot.app.busy, "the agent to start")


async def idle(pilot, turns: int, timeout: float = 30.0):
    app = pilot.app
    await until(pilot, lambda: app.turns_finished >= turns and not app.busy and not app.queue,
                f"{turns} finished turn(s)", timeout)
    await pilot.pause(0.1)


def shutdown(app):
    if app.worker is not None:
        app.worker.interrupt()
        app.worker.stop(10)


@contextlib.asynccontextmanager
async def running(app, size=SIZE):
    """A pilot on `app` once its agent has started; the worker is stopped on the way out, passed or
    failed (an engine thread left running would hold the next test up)."""
    try:
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            yield pilot
    finally:
        shutdown(app)


def edit_call(path="hello.py", old="helo", new="hello") -> str:
    args = json.dumps({"path": path, "old": old, "new": new})
    return prompts.render_tool_calls([prompts.ToolCall(None, "edit", args)])


def finish_after_tool(answer: str):
    """After a tool result, the next generation is this answer and EOS (not gibberish to the cap)."""
    def on_event(agent, ev):
        if isinstance(ev, E.ToolFinished):
            agent.force(answer + prompts.EOS)
    return on_event
