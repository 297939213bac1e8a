"""`ds4`: one-shot generation with DeepSeek V4 Flash, streaming text as it is sampled.

  ds4 -m model.gguf -p "hello" -n 64 [--nothink] [--temp 0] [--dump-logprobs out.json]
  echo "hello" | ds4 -m model.gguf      the prompt from stdin (when neither -p nor --prompt-file)

The prompt is rendered by the prompt layer as one user turn (BOS, <｜User｜> prompt <｜Assistant｜>,
then <think> or </think>); markers typed in the prompt are recognised as ds4 recognises them.
Prefill and generation speeds go to stderr at the end: the tokens the model generated (the
end-of-turn token is not one) and a rate only where there was time to measure. A prompt is
required (an empty or blank one is refused: it used to generate from nothing); a bad model file or
argument is one `error:` line and exit status 1.
"""
from __future__ import annotations

import json
import sys
import time

from engine import ModelFileError
from engine.cli_help import ArgumentParser, DefaultsHelpFormatter, add_version_flag
from engine.console import console_main
from engine.mtp_options import add_mtp_flags
from engine.options import EngineOptions, add_engine_flags
from prompts.messages import Message
from prompts.render import render_messages, think_mode_for_context

from .perplexity import add_flags as add_perplexity_flags, main_perplexity


def render_user_turn(prompt: str, think: str) -> str:
    """One plain user turn, rendered by the prompt layer exactly as ds4 renders it."""
    return render_messages([Message("user", prompt)], None, think)


def _parser():
    p = ArgumentParser(prog="ds4", description="run DeepSeek V4 Flash on one prompt",
                       formatter_class=DefaultsHelpFormatter)
    add_version_flag(p)
    p.add_argument("-m", "--model", required=True, help="path to a ds4 GGUF")
    g = p.add_mutually_exclusive_group()
    g.add_argument("-p", "--prompt", help="the user message (neither this nor --prompt-file: stdin, "
                                          "when it is not a terminal)")
    g.add_argument("--prompt-file", help="read the user message from a file")
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate")
    p.add_argument("--ctx", type=int, default=4096, help="context size in tokens")
    p.add_argument("--temp", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set with this much probability")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below this fraction of the likeliest one's probability")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, for repeatable runs (0: a random seed)")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--think", dest="think", action="store_const", const="high",
                   help="the model reasons in <think> before it answers (the default)")
    t.add_argument("--nothink", dest="think", action="store_const", const="none",
                   help="answer at once, without reasoning")
    t.add_argument("--think-max", dest="think", action="store_const", const="max",
                   help="the longest reasoning (ds4's Think Max; needs --ctx 393216 or more, else --think)")
    p.set_defaults(think="high")
    add_engine_flags(p)
    add_mtp_flags(p)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk size in tokens")
    p.add_argument("--dump-tokens", action="store_true", help="print prompt and generated token ids and pieces")
    p.add_argument("--dump-logprobs", metavar="FILE", help="write the top-k log-probabilities of every step as JSON")
    p.add_argument("--logprobs-top-k", type=int, default=20, help="how many log-probabilities --dump-logprobs keeps per step")
    p.add_argument("--dump-logits", metavar="FILE", help="write every step's full logits (.npy, float32)")
    add_perplexity_flags(p)
    return p


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def _prompt(a, stdin) -> str:
    """The user message: -p, --prompt-file, else stdin when it is not a terminal. ValueError when
    there is none, or it is blank."""
    if a.prompt_file:
        try:
            with open(a.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{a.prompt_file}: cannot read the prompt: {getattr(e, 'strerror', None) or e}") from None
        where = a.prompt_file
    elif a.prompt is not None:
        prompt, where = a.prompt, "-p"
    else:
        try:
            tty = stdin is None or stdin.isatty()
        except (AttributeError, ValueError):
            tty = True
        if tty:
            raise ValueError("no prompt: give -p TEXT or --prompt-file FILE, or pipe the prompt on stdin")
        try:
            prompt = stdin.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the prompt from stdin: {getattr(e, 'strerror', None) or e}") from None
        where = "stdin"
    if not prompt.strip():
        raise ValueError(f"the prompt ({where}) is empty: there is nothing to answer")
    return prompt


@console_main
def main(argv=None, stdin=None) -> int:
    a = _parser().parse_args(argv)
    if a.perplexity:                    # a file to score, not a prompt (ds4agent/perplexity.py)
        return main_perplexity(a)
    try:
        prompt = _prompt(a, sys.stdin if stdin is None else stdin)
    except ValueError as e:
        return _fail(str(e))
    if a.n_predict < 0 or a.ctx < 16 or a.logprobs_top_k < 1:
        return _fail("-n must be >= 0, --ctx >= 16 and --logprobs-top-k >= 1")
    try:
        options = EngineOptions.from_args(a)
    except ValueError as e:
        return _fail(str(e))
    if a.mtp and (a.dump_logits or a.dump_logprobs):
        return _fail("--mtp verifies several tokens a step: it does not combine with --dump-logits or --dump-logprobs")
    think = think_mode_for_context(a.think, a.ctx)
    if think != a.think:
        print("note: --think-max needs --ctx >= 393216 (ds4's gate); using --think", file=sys.stderr)
    try:
        return _run(a, options, prompt, think)
    except ModelFileError as e:
        return _fail(str(e))
    except BrokenPipeError:
        raise                         # a reader that went away: console_main ends quietly
    except (ValueError, OSError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _run(a, options: EngineOptions, prompt: str, think: str) -> int:
    from engine import Engine, Rng, SamplingParams, Session
    from engine.runtime.session import LogitsDump

    eng = Engine.open(a.model, options, mtp=a.mtp)
    tok = eng.tokenizer
    ids = tok.encode(render_user_turn(prompt, think))
    if len(ids) + a.n_predict >= a.ctx:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus -n {a.n_predict} does not fit --ctx {a.ctx}")
    out = sys.stdout
    if a.dump_tokens:
        for i, t in enumerate(ids):
            out.write(f"prompt[{i}] {t} {_piece(tok, t)}\n")
    sess = Session(eng, a.ctx, chunk=a.chunk)
    t0 = time.perf_counter()
    sess.sync(ids)
    t_prefill = time.perf_counter() - t0
    params = SamplingParams(a.temp, a.top_k, a.top_p, a.min_p, a.seed or None)
    rng = Rng(params.seed)
    steps, logits_dump, generated = [], LogitsDump(), []
    text_out = tok.stream_decoder()
    t1 = time.perf_counter()
    spec = _speculator(a, eng, sess)
    for step in range(a.n_predict if spec is None else 0):
        if a.dump_logits:
            logits_dump.add(sess)
        t = sess.sample(params, rng)
        if a.dump_logprobs:
            top = sess.top_logprobs(a.logprobs_top_k)
            lp = sess.logprob(t)
            steps.append({"step": step, "token": _tok_json(tok, t), "logprob": lp,
                          "top_logprobs": [dict(_tok_json(tok, i), logprob=v) for i, v in top]})
        generated.append(t)
        if t == tok.eos_id:
            break  # EOS ends the turn and is never evaluated into the KV
        text = text_out.feed(t)
        if not a.dump_tokens:
            out.write(text)
            out.flush()
        if step + 1 < a.n_predict:
            sess.eval(t)
    if spec is not None:
        generated = _generate_mtp(a, spec, params, rng, tok, out, text_out)
    t_gen = time.perf_counter() - t1
    if not a.dump_tokens:
        out.write(text_out.flush())
    if a.dump_tokens:
        for i, t in enumerate(generated):
            out.write(f"gen[{i}] {t} {_piece(tok, t)}\n")
    else:
        out.write("\n")
    if a.dump_logprobs:
        _write_json(a.dump_logprobs, {"prompt_tokens": len(ids), "top_k": a.logprobs_top_k, "steps": steps})
    if a.dump_logits:
        logits_dump.save(a.dump_logits)
    ended = bool(generated) and generated[-1] == tok.eos_id
    n_gen = len(generated) - ended
    # the first token is sampled from the prefill's logits: the decode steps are the evals after it
    steps = max(0, len(generated) - 1)
    print(f"prefill: {speed(len(ids), len(ids), t_prefill)}; generation: {speed(n_gen, steps, t_gen)}"
          + ("; the model ended its turn" if ended else ""), file=sys.stderr)
    eng.close()
    return 0


def _speculator(a, eng, sess):
    if not a.mtp:
        return None
    from engine import MTPDrafter, Speculator
    return Speculator(sess, MTPDrafter(eng), a.mtp_draft)


def _generate_mtp(a, spec, params, rng, tok, out, text_out) -> list[int]:
    """The generation loop with MTP: each step adds the tokens the verify kept (greedy: the same
    tokens as the plain loop above; sampling: the same law)."""
    generated: list[int] = []
    while len(generated) < a.n_predict and (not generated or generated[-1] != tok.eos_id):
        for t in spec.step(params, rng, limit=a.n_predict - len(generated), stop=(tok.eos_id,)):
            generated.append(t)
            if t != tok.eos_id and not a.dump_tokens:
                out.write(text_out.feed(t))
        out.flush()
    acc = spec.acceptance
    print(f"mtp: {spec.stats['accepted']} of {spec.stats['drafted']} drafts accepted"
          + (f" ({100 * acc:.0f} %)" if acc is not None else "") + f", {spec.stats['steps']} verify steps",
          file=sys.stderr)
    return generated


MIN_TIMED_S = 0.01      # below this a rate says more about the clock than the model


def speed(n: int, steps: int, secs: float) -> str:
    """`N tokens in S s (R t/s)`: the rate over the `steps` that took `secs`, or none when there
    were none or too little time to measure (`ds4 -n 3` once said 3263 t/s for ~0 s)."""
    head = f"{n} token{'' if n == 1 else 's'} in {secs:.2f} s"
    if steps <= 0 or secs < MIN_TIMED_S:
        return head + " (too short to measure a rate)" if n else head
    return f"{head} ({steps / secs:.2f} t/s)"


def _piece(tok, t: int) -> str:
    return json.dumps(tok.token_bytes(t).decode("utf-8", errors="backslashreplace"), ensure_ascii=False)


def _tok_json(tok, t: int) -> dict:
    b = tok.token_bytes(t)
    return {"id": t, "text": b.decode("utf-8", errors="replace"), "bytes": list(b)}


def _write_json(path: str, obj):
    from engine.atomic import atomic_write
    atomic_write(path, [json.dumps(obj, ensure_ascii=False, indent=1).encode("utf-8")])


if __name__ == "__main__":
    sys.exit(main())
