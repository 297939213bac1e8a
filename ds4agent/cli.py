"""`ds4-agent`: the coding agent, in the project directory it is started from.

  ds4-agent [--model PATH] [--ctx N] [--nothink|--think-max] [--yolo] [--resume [NAME|ID|pick]]
  ds4-agent sessions [list [--all] | show ID|NAME | delete ID|NAME | prune --max-size SIZE [--yes]]
                               saved sessions, no model needed
  ds4-agent -p "task"          headless: run one task, print the answer and a tool summary
  ds4-agent --serve [--port 8000] [--kv-disk-dir DIR] ...   the HTTP shim for other agents
  ds4-agent download q2|q4|q2-imatrix|q4-imatrix|mtp [--dir DIR]   fetch ds4's published GGUF

The model is --model, else $DS4_MODEL, else ./ds4flash.gguf, else `model` in
~/.ds4-agent/config.toml (or $DS4_AGENT_HOME/config.toml), which `download` writes.
"""
from __future__ import annotations

import os
import signal
import sys
import tomllib
from pathlib import Path

from engine.console import console_main, exit_now

from .home import agent_home

GUIDANCE = """no model found (looked for {tried}).

ds4-agent runs DeepSeek V4 Flash from one of ds4's GGUF files:
  q2 (about 81 GB, needs ~96 GB of RAM or unified memory):
      DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf
  q4 (about 153 GB, needs ~170 GB):
      DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf
Get one with `ds4-agent download q2-imatrix` (or q4-imatrix, q2, q4; it says which fits this
machine and records the path), or pass --model PATH, set $DS4_MODEL, put the file at
./ds4flash.gguf, or set `model = "/path/to/file.gguf"` in {config}.
To try the agent without the real weights: `ds4-gguf synth tiny.gguf && ds4-agent --model tiny.gguf`
(random weights: it answers gibberish, but every part of the agent runs)."""


def load_config() -> dict:
    p = agent_home() / "config.toml"
    from tools.safefs import read_regular
    try:     # a FIFO or /dev/zero there must not hang or fill memory: regular and small only
        return tomllib.loads(read_regular(p, 1 << 20, nofollow=False).decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        print(f"warning: ignoring {p}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return {}


def find_model(arg: str | None, cfg: dict) -> tuple[str | None, list[str]]:
    tried = []
    for cand in (arg, os.environ.get("DS4_MODEL"), "ds4flash.gguf", cfg.get("model")):
        if not cand:
            continue
        tried.append(cand)
        if arg and cand == arg:
            return cand, tried          # an explicit path is used as given (errors are reported)
        if os.path.isfile(os.path.expanduser(cand)):
            return os.path.expanduser(cand), tried
    return None, tried


EPILOG = """other commands:
  ds4-agent download q2|q4|q2-imatrix|q4-imatrix [--dir DIR]
                        download ds4's published GGUF (resumable) and record its path
  ds4-agent doctor [--model PATH] [--hash]
                        check the model file, run the official test vectors, measure speed
  ds4-agent sessions [list [--all] | show ID|NAME | delete ID|NAME | prune --max-size SIZE [--yes]]
                        the saved sessions, without loading a model"""
DEFAULT_CTX = 65536


def _parser():
    from engine.cli_help import ArgumentParser, DefaultsHelpFormatter, add_version_flag
    p = ArgumentParser(prog="ds4-agent", description="a native coding agent for DeepSeek V4 Flash",
                       formatter_class=DefaultsHelpFormatter, epilog=EPILOG)
    add_version_flag(p)
    p.add_argument("-m", "--model", help="path to a ds4 GGUF (else $DS4_MODEL, ./ds4flash.gguf, the config's model)")
    p.add_argument("--ctx", type=int, metavar="N", help=f"context size in tokens (default {DEFAULT_CTX}, or `ctx` in the config)")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--think", dest="think", action="store_const", const="high",
                   help="the model reasons before it answers (the default, or `think` in the config)")
    t.add_argument("--nothink", dest="think", action="store_const", const="none",
                   help="answer at once, without reasoning (/think on|off|max switches in the TUI)")
    t.add_argument("--think-max", dest="think", action="store_const", const="max",
                   help="the longest reasoning (ds4's Think Max; it needs --ctx 393216 or more, else --think)")
    p.add_argument("--yolo", action="store_true", help="run bash/write/edit/git commit without asking")
    p.add_argument("--allow-outside", action="store_true", help="let tools use paths outside the project")
    p.add_argument("--resume", nargs="?", const=True, metavar="NAME|ID|pick",
                   help="continue the last session of this directory; NAME or ID: that session; "
                        "pick: choose from a numbered list (`ds4-agent sessions` lists, shows, deletes)")
    p.add_argument("-p", "--prompt", help="headless: run this task, print the answer, exit")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="with -p: do not stream the model's reasoning to stderr")
    p.add_argument("--temp", type=float, help="sampling temperature (default 1.0, or `temperature` in the config)")
    p.add_argument("--seed", type=int, help="sampling seed, for repeatable runs (default: a random seed)")
    p.add_argument("--serve", action="store_true",
                   help="serve the model over HTTP for Claude Code, Codex, opencode, Pi and the SDKs")
    from engine.mtp_options import add_mtp_flags
    from engine.options import add_engine_flags

    from .serve.cli import add_flags
    add_engine_flags(p)
    add_mtp_flags(p, config_keys=True)
    add_flags(p)
    return p


def _interrupt_on_sigterm():
    """SIGTERM ends the agent as Ctrl+C does. Python's default ends the process at once, without
    its exit handlers: the bash tool's kill of every job's process tree (those that left their
    group with setsid or nohup included) would not run, and they would outlive the agent."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:       # not the main thread (an embedding caller): leave its handlers alone
        return None


def _whole(name: str, value, lo: int = 1):
    """A setting that must be a whole number >= lo (from a flag or the config file), or None.
    ValueError names it in one line."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be a whole number of at least {lo}, not {value!r}")
    return value


def check_ctx(ctx: int, model_file, think: str, project: Path) -> str | None:
    """Why `ctx` cannot run the agent on this model, in one line, or None. A small context needs
    the system prompt's token count, so the tokenizer is built from the file's metadata here,
    before any UI starts (1.6-1.9 s for the real 129k-entry vocabulary on a loaded 2-core VM; the
    engine builds its own later)."""
    limit = model_file.config.context_length
    if limit and ctx > limit:
        return f"--ctx {ctx} is more than the model's context length ({limit})"
    import tools
    from engine import Tokenizer
    from prompts import Message, think_mode_for_context
    from prompts.render import render_messages

    from .agent import SUMMARY_MAX_TOKENS
    from .environment import system_text
    text = render_messages([Message("system", system_text(project))], tools.schemas(),
                           think_mode_for_context(think, ctx))
    room = SUMMARY_MAX_TOKENS + 512 + 1024   # kept for a compaction summary, and a first exchange
    # no token is shorter than a byte: a context that holds the text's bytes holds its tokens, and
    # the usual context (65536 against ~15 kB) needs no tokenizer here
    if ctx >= len(text.encode("utf-8")) + room:
        return None
    try:
        n = len(Tokenizer.from_metadata(model_file.tokenizer).encode(text))
    except Exception as e:   # metadata nobody here wrote: a tokenizer that cannot be built is one line
        return f"{model_file.path}: cannot build the tokenizer: {' '.join(str(e).split())[:300] or type(e).__name__}"
    need = n + room
    if ctx < need:
        return (f"--ctx {ctx} is too small: the system prompt alone takes {n} tokens; "
                f"use --ctx {-(-need // 1024) * 1024} or more")
    return None


class _Fail(Exception):
    """One line for the user, exit 1: `error: ...`, or the line as is when `plain`."""

    def __init__(self, line: str, plain: bool = False):
        super().__init__(line)
        self.line = line if plain else f"error: {line}"


def _subcommand(argv: list) -> int | None:
    """`download` and `sessions` need no model: run them, or None for the agent itself."""
    if argv[:1] == ["download"]:
        from .download import main as download_main
        return download_main(argv[1:])
    if argv[:1] == ["sessions"]:
        from .sessions_cli import main as sessions_main
        return sessions_main(argv[1:])
    if argv[:1] == ["doctor"]:
        from .doctor import main as doctor_main
        return doctor_main(argv[1:], find=lambda arg: find_model(arg, load_config()))
    return None


def _limits(a, cfg: dict) -> tuple[int, int | None]:
    # checked before anything loads: --ctx 0 and -5 were taken as the default or reached the UI
    try:
        ctx = _whole("--ctx", a.ctx) or _whole("ctx in the config", cfg.get("ctx", DEFAULT_CTX))
        max_tokens = _whole("--max-tokens", a.max_tokens) or _whole("max_tokens in the config", cfg.get("max_tokens"))
    except ValueError as e:
        raise _Fail(str(e)) from None
    return ctx, max_tokens


def _resume_ctx(store, resume, ctx: int, model: str) -> int:
    """The context to continue the resumed session at: its own when --ctx is smaller and it fits
    memory (said in one line), else one line with the fix (ds4agent/resume_ctx.py)."""
    if not resume:
        return ctx
    from engine import ModelFile, ModelFileError

    from .resume_ctx import ResumeContextError, resume_ctx
    try:
        with ModelFile.open(model) as mf:
            ctx, note = resume_ctx(store, resume, ctx, mf.config)
    except ResumeContextError as e:
        raise _Fail(str(e)) from None
    except ModelFileError as e:
        raise _Fail(str(e)) from None
    if note:
        print(note, file=sys.stderr)
    return ctx


def _headless_keep(cfg: dict) -> int:
    """How many unnamed headless sessions a project keeps (`headless_keep` in the config)."""
    from sessions.retention import HEADLESS_KEEP
    try:
        return _whole("headless_keep in the config", cfg.get("headless_keep", HEADLESS_KEEP))
    except ValueError as e:
        raise _Fail(str(e)) from None


def _retain(store, keep: int):
    """After a headless run: the project's older unnamed headless sessions go (one line says so)."""
    from sessions.retention import prune_headless
    gone = prune_headless(store, keep)
    if gone:
        print(f"removed {len(gone)} older unnamed headless session(s) of this project (the newest {keep} "
              f"are kept; `headless_keep` in the config, or name a session to keep it)", file=sys.stderr)


def _check_model(a, model: str, ctx: int, think: str, options, project: Path):
    """Validate up front (O(metadata)): a bad file, backend or context is one line and exit 1,
    before any UI."""
    from engine import BackendError, ModelFile, ModelFileError
    try:
        mf = ModelFile.open(model)
        try:
            problem = None if a.serve else check_ctx(ctx, mf, think, project)
        finally:
            mf.close()
        options.check()
    except (ModelFileError, BackendError) as e:
        raise _Fail(str(e)) from None
    if problem:
        raise _Fail(problem)


def _check_mtp(a, cfg: dict, model: str):
    """(the MTP file or None, drafts a step): --mtp or `mtp` in the config, checked against the
    model before any UI (a wrong or corrupt file: one line, exit 1)."""
    from engine import ModelFile, ModelFileError
    from engine.gguf.mtp_file import MTPFile
    from engine.mtp_options import resolve_mtp
    try:
        path, n = resolve_mtp(a, cfg)
        if path:
            path = os.path.expanduser(path)
            with ModelFile.open(model) as mf:
                MTPFile.open(path, mf.config).close()
    except (ValueError, ModelFileError) as e:
        raise _Fail(str(e)) from None
    a.mtp = path
    return path, n


def _resume_choice(store, resume):
    """True: the last session; a name, an id or "pick": resolved here, before the model loads."""
    if not isinstance(resume, str):
        return resume
    from sessions import SessionStoreError

    from .sessions_cli import NoChoice, choose_resume
    try:
        return choose_resume(store, resume)
    except SessionStoreError as e:
        raise _Fail(str(e)) from None
    except NoChoice:
        raise _Fail("no session chosen", plain=True) from None


@console_main
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    sub = _subcommand(argv)
    if sub is not None:
        return sub
    try:
        rc = _main(_parser().parse_args(argv))
    except _Fail as e:
        print(e.line, file=sys.stderr)
        return 1
    worker = sys.modules.get(__package__ + ".worker")
    if worker is not None and worker.busy_mlx():
        # the engine thread is still inside MLX (an interrupted turn that did not stop in time):
        # finalizing the interpreter would abort the process (ds4agent/worker.py)
        exit_now(rc)
    return rc


def _main(a) -> int:
    if a.prompt is not None and not a.prompt.strip():
        # an empty task once ran a whole turn (117 s on the real model) on nothing
        raise _Fail("the task given with -p is empty: say what to do, e.g. -p \"explain this project\"")
    from engine.options import EngineOptions
    try:
        options = EngineOptions.from_args(a)
    except ValueError as e:
        raise _Fail(str(e)) from None
    cfg = load_config()
    ctx, max_tokens = _limits(a, cfg)
    model, tried = find_model(a.model, cfg)
    if model is None:
        raise _Fail(GUIDANCE.format(tried=", ".join(tried) or "nothing", config=agent_home() / "config.toml"))
    from engine import Engine, ModelFileError, SamplingParams
    think = a.think or cfg.get("think", "high")
    project = Path.cwd()
    _check_model(a, model, ctx, think, options, project)
    mtp, a.mtp_draft = _check_mtp(a, cfg, model)
    if options.layers is not None:       # (mlx.launch's ranks above 0 serve their layers here, before any UI)
        from engine.runtime.split_engine import serve_if_worker
        serve_if_worker(model, options, Engine)
    if a.serve:
        from .serve.cli import serve_main
        return serve_main(a, model, ctx, options)
    from sessions import SessionStore, SessionStoreError

    from .agent import Agent, AgentConfig
    sampling = SamplingParams(temperature=a.temp if a.temp is not None else float(cfg.get("temperature", 1.0)),
                              seed=a.seed)
    conf = AgentConfig(ctx=ctx, think_mode=think, yolo=a.yolo or bool(cfg.get("yolo", False)),
                       sampling=sampling, allow_outside=a.allow_outside, max_tokens=max_tokens,
                       checkpoints=cfg.get("checkpoints", True) is not False,   # `checkpoints = false`: no /undo
                       mtp_draft=a.mtp_draft if mtp else 0)
    try:
        store = SessionStore(project_dir=project)
    except SessionStoreError as e:
        raise _Fail(str(e)) from None
    resume = _resume_choice(store, a.resume)
    keep = _headless_keep(cfg)
    conf.ctx = ctx = _resume_ctx(store, resume, ctx, model)

    started = []      # the MCP servers, stopped on the way out (their processes must not outlive us)

    def make_agent(emit):
        from .mcp_client import start_servers
        eng = Engine.open(model, options, mtp=mtp)
        started.append(start_servers(project, emit))   # before the system prompt: their tools are in it
        return Agent(eng, project, config=conf, store=store, emit=emit, mcp=started[-1])

    previous = _interrupt_on_sigterm()
    try:
        if a.prompt is not None:
            from sessions.retention import HEADLESS

            from .headless import run_headless
            # a new headless conversation falls under the retention rule below; one that continues
            # a session (--resume) stays a session like the TUI's (sessions/retention.py)
            store.origin = None if resume else HEADLESS
            rc = run_headless(make_agent, a.prompt, resume=resume, quiet=a.quiet)
            _retain(store, keep)
            return rc
        from .app import run_app
        banner = f"ds4-agent · {Path(model).name} · context {ctx} · {project}"
        return run_app(make_agent, resume=resume, banner=banner) or 0
    except ModelFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        for m in started:
            if m is not None:
                m.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
