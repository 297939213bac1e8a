"""`ds4-eval`: multiple-choice and numeric questions from a JSONL file, answered by the model and
graded by ds4agent/eval_items.py's extractors.

  ds4-eval -m model.gguf [--items FILE] [--nothink|--think|--think-max] [-n TOKENS] [--trace FILE] [--resume]

Every item is one user turn (as `ds4` renders it), generated greedily by default up to -n tokens;
with thinking on, `</think>` is forced when only --reply-budget tokens are left, so a long
reasoning still leaves room for the answer (ds4-eval's hard limit). One line per item as it ends,
then the accuracy with its 95 % Wilson interval. The trace (JSONL: a settings line, then one line
per item with the prompt, the whole output, what was extracted and the verdict) is rewritten
after every item; --resume continues an interrupted run from it. Ctrl-C stops at once and reports
the items already done. Without --items, the small set shipped in ds4agent/data (written for this
project) is used.
"""
from __future__ import annotations

import json
import os
import sys
import time
from importlib.resources import files

from engine.cli_help import ArgumentParser, DefaultsHelpFormatter, add_version_flag
from engine.console import console_main
from engine.options import EngineOptions, add_engine_flags
from prompts.render import THINK_MAX_MIN_CONTEXT as THINK_MAX_CTX

from . import eval_items as ev

PROGRESS_EVERY_S = 10.0


def _parser():
    p = ArgumentParser(prog="ds4-eval", formatter_class=DefaultsHelpFormatter,
                       description="grade the model on multiple-choice and numeric questions (docs/quality.md)")
    add_version_flag(p)
    p.add_argument("-m", "--model", required=True, help="path to a ds4 GGUF")
    p.add_argument("--items", help="a JSONL file of items (default: the set shipped with ds4-agent)")
    p.add_argument("-n", "--max-tokens", type=int, default=4096, help="most tokens generated per item")
    p.add_argument("--reply-budget", type=int, default=512,
                   help="with thinking: force </think> when this many tokens are left (at most half of -n)")
    p.add_argument("--limit", type=int, default=0, help="only the first N items (0: all)")
    p.add_argument("--ctx", type=int, default=0, help="context size (0: the longest prompt plus -n)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=1, help="sampling seed (with --temp > 0)")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--think", dest="think", action="store_const", const="high", help="reason before answering (default)")
    t.add_argument("--nothink", dest="think", action="store_const", const="none", help="answer at once")
    t.add_argument("--think-max", dest="think", action="store_const", const="max", help="ds4's Think Max")
    p.set_defaults(think="high")
    p.add_argument("--trace", default="ds4-eval.trace.jsonl", help="the per-item trace (JSONL)")
    p.add_argument("--resume", action="store_true", help="continue the run recorded in --trace")
    add_engine_flags(p)
    return p


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def default_items() -> str:
    return str(files("ds4agent").joinpath("data/eval_items.jsonl"))


@console_main
def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.max_tokens < 1 or a.reply_budget < 0 or a.limit < 0 or a.ctx < 0 or a.temp < 0:
        return _fail("-n must be >= 1; --reply-budget, --limit, --ctx and --temp >= 0")
    if a.think == "max" and a.ctx < THINK_MAX_CTX:
        # ds4's gate: Think Max only with a context that can hold its reasoning
        print(f"note: --think-max needs --ctx >= {THINK_MAX_CTX} (ds4's gate); using --think", file=sys.stderr)
        a.think = "high"
    try:
        options = EngineOptions.from_args(a)
        items = ev.load_items(a.items or default_items())
        if a.limit:
            items = items[:a.limit]
        settings = {"items": os.path.basename(a.items or default_items()), "model": os.path.basename(a.model),
                    "think": a.think, "max_tokens": a.max_tokens, "reply_budget": a.reply_budget,
                    "temp": a.temp, "seed": a.seed}
        done = _start_trace(a.trace, settings, a.resume)
    except ValueError as e:
        return _fail(str(e))
    from engine import ModelFileError
    try:
        return _run(a, options, items, settings, done)
    except BrokenPipeError:
        raise
    except (ModelFileError, ValueError, OSError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:          # while the model opens: nothing measured yet
        print("\ninterrupted", file=sys.stderr)
        return 130


def _start_trace(path: str, settings: dict, resume: bool) -> list[dict]:
    """The items already done (with --resume), after checking the trace was made the same way."""
    if not os.path.exists(path):
        if resume:
            raise ValueError(f"--resume: there is no trace at {path}")
        return []
    if not resume:
        raise ValueError(f"{path} exists: --resume continues that run, or give another --trace")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(x) for x in f if x.strip()]
        head = lines[0]["settings"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{path}: not a ds4-eval trace ({e})") from None
    if head != settings:
        diff = ", ".join(f"{k} {head.get(k)!r} there, {v!r} now" for k, v in settings.items() if head.get(k) != v)
        raise ValueError(f"--resume: {path} was made with other settings ({diff})")
    return lines[1:]


def _write_trace(path: str, settings: dict, records: list[dict]):
    from engine.atomic import atomic_write
    lines = [json.dumps({"ds4_eval": 1, "settings": settings})] + [json.dumps(r, ensure_ascii=False) for r in records]
    atomic_write(path, ["\n".join(lines).encode("utf-8"), b"\n"])


def _run(a, options, items, settings, records) -> int:
    from engine import Engine, Rng, SamplingParams, Session

    from .ds4_cli import render_user_turn
    from .eval_gen import generate

    done = {r["id"] for r in records}
    todo = [it for it in items if it["id"] not in done]
    if records:
        print(f"resuming {a.trace}: {len(records)} item(s) done, {len(todo)} to go", file=sys.stderr)
    eng = Engine.open(a.model, options)
    interrupted = False
    try:
        tok = eng.tokenizer
        prompts = {it["id"]: tok.encode(render_user_turn(ev.render_question(it), a.think)) for it in todo}
        ctx = a.ctx or (max((len(p) for p in prompts.values()), default=0) + a.max_tokens + 2)
        sess = Session(eng, ctx) if todo else None
        params = SamplingParams(a.temp, 0, 1.0, 0.05 if a.temp > 0 else 0.0, a.seed)
        rng = Rng(a.seed)
        budget = min(a.reply_budget, a.max_tokens // 2) if a.think != "none" else 0
        for i, it in enumerate(todo):
            ids = prompts[it["id"]]
            t0 = time.perf_counter()
            if len(ids) + a.max_tokens >= ctx:
                rec = {"id": it["id"], "status": "skipped", "prompt_tokens": len(ids),
                       "detail": f"does not fit --ctx {ctx}"}
            else:
                g = generate(eng, sess, ids, a.max_tokens, budget, params, rng, a.think != "none", _progress(it["id"]))
                got, ok = ev.grade(it, g["text"])
                rec = {"id": it["id"], "status": "pass" if ok else "fail", "given": got, "expected": it["answer"],
                       "prompt_tokens": len(ids), "gen_tokens": g["tokens"], "finish": g["finish"],
                       "forced_close": g["forced_close"], "seconds": round(time.perf_counter() - t0, 2),
                       "prompt": ev.render_question(it), "output": g["text"]}
            records.append(rec)
            _write_trace(a.trace, settings, records)
            _line(len(records), len(items), rec)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted: {len(records)} item(s) done are in {a.trace}; --resume continues", file=sys.stderr)
    finally:
        eng.close()
    report(records, sys.stdout, interrupted)
    return 130 if interrupted else 0


def _progress(item_id: str):
    last = [time.perf_counter()]

    def on_token(n: int, cap: int):
        now = time.perf_counter()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            print(f"  {item_id}: {n}/{cap} tokens", file=sys.stderr)
    return on_token


def _line(k: int, n: int, r: dict):
    if r["status"] == "skipped":
        print(f"[{k}/{n}] {r['id']}: SKIPPED ({r['detail']})")
        return
    print(f"[{k}/{n}] {r['id']}: {r['status'].upper()} got {r['given'] if r['given'] is not None else '-'} "
          f"expected {r['expected']} ({r['seconds']:.1f} s, {r['gen_tokens']} tokens, {r['finish']})", flush=True)


def report(records: list[dict], out, interrupted: bool = False):
    graded = [r for r in records if r["status"] in ("pass", "fail")]
    k, n = sum(r["status"] == "pass" for r in graded), len(graded)
    lo, hi = ev.wilson(k, n)
    skipped = len(records) - n
    acc = f"{100 * k / n:.1f} %" if n else "-"
    out.write(f"accuracy = {k}/{n} = {acc}  (95 % Wilson interval {100 * lo:.1f}-{100 * hi:.1f} %)"
              + (f", {skipped} skipped" if skipped else "") + ("; interrupted" if interrupted else "") + "\n")
    capped = sum(1 for r in graded if r.get("finish") == "length")
    if capped:
        out.write(f"{capped} item(s) hit the token cap (-n): their answer may be cut short\n")


if __name__ == "__main__":
    sys.exit(main())
