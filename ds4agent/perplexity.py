"""`ds4 --perplexity FILE --ctx N`: how well the model predicts a text, and `--kl-base FILE`: how
far one run's predictions are from another's (backend, quantization or numerics).

The text is tokenized as it is (no BOS, no chat template) and scored by engine/quality.py's plan;
progress goes to stderr, the result to stdout:

  PPL = 8.1234 +/- 0.0567   (3 chunks of 512, 1533 tokens scored)

`--kl-base FILE`: when FILE does not exist, the run's top-k log-probabilities are saved there;
when it does, this run is compared with it on the same positions (mean KL, top-1 agreement, the
worst positions). Ctrl-C stops between pieces of evaluation and reports (and saves) what was
scored so far. docs/quality.md says what each number means.
"""
from __future__ import annotations

import os
import sys
import time

PROGRESS_EVERY_S = 2.0
MANY_WINDOWS = 100


def add_flags(p):
    g = p.add_argument_group("perplexity (docs/quality.md)")
    g.add_argument("--perplexity", metavar="FILE",
                   help="score a text file (no BOS, no template) in chunks of --ctx tokens and print PPL")
    g.add_argument("--ppl-stride", type=int, default=0, metavar="N",
                   help="sliding windows every N tokens, each scoring only new tokens (0: independent chunks)")
    g.add_argument("--ppl-second-half", action="store_true",
                   help="score only the second half of each chunk, as llama-perplexity does")
    g.add_argument("--kl-base", metavar="FILE",
                   help="save this run's top-k logprobs to FILE, or, when FILE exists, compare against them")
    g.add_argument("--kl-top-k", type=int, default=32, help="log-probabilities kept per position in a --kl-base")


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def main_perplexity(a) -> int:
    """The --perplexity mode of `ds4` (a: its parsed arguments)."""
    from engine.options import EngineOptions
    if a.prompt is not None or a.prompt_file:
        return _fail("--perplexity scores a file: it takes no -p or --prompt-file")
    if a.kl_top_k < 1 or a.ppl_stride < 0:
        return _fail("--kl-top-k must be at least 1 and --ppl-stride at least 0")
    try:
        options = EngineOptions.from_args(a)
    except ValueError as e:
        return _fail(str(e))
    try:
        with open(a.perplexity, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return _fail(f"{a.perplexity}: cannot read the text: {getattr(e, 'strerror', None) or e}")
    from engine import ModelFileError
    try:
        return _run(a, options, text)
    except BrokenPipeError:
        raise                         # a reader that went away: console_main ends quietly
    except (ModelFileError, ValueError, OSError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:         # before scoring began (opening, tokenizing): nothing to report
        print("\ninterrupted", file=sys.stderr)
        return 130


def _run(a, options, text: str) -> int:
    from engine import Engine, Session
    from engine import quality as q

    base = None
    if a.kl_base and os.path.exists(a.kl_base):
        base = q.load_base(a.kl_base)
    eng = Engine.open(a.model, options)
    try:
        tokens = eng.tokenizer.encode(text)
        windows = q.plan_windows(len(tokens), a.ctx, a.ppl_stride, a.ppl_second_half)
        meta = {"tokens": len(tokens), "digest": q.token_digest(tokens), "ctx": a.ctx,
                "stride": a.ppl_stride, "second_half": a.ppl_second_half}
        if base is not None:
            _check_base(a.kl_base, base[0], meta)
        k = min(base[0]["k"] if base else a.kl_top_k, eng.config.n_vocab)
        scores = q.Scores(k)
        total = sum(e - f for _, e, f in windows)
        limit = len(base[1]["pos"]) if base else total
        where = f"{eng.backend} backend, numerics {eng.numerics}"
        print(f"perplexity: {len(tokens)} tokens, {len(windows)} window(s) of up to {a.ctx}, "
              f"{min(total, limit)} to score ({where})", file=sys.stderr)
        done = _score(a, eng, Session, q, tokens, windows, scores, base, limit)
        _report(a, q, eng, scores, windows, base, meta, where, done)
        return 0 if done else 130
    finally:
        eng.close()


def _check_base(path, bmeta: dict, meta: dict):
    for key, flag in (("digest", "text"), ("ctx", "--ctx"), ("stride", "--ppl-stride"),
                      ("second_half", "--ppl-second-half")):
        if bmeta.get(key) != meta[key]:
            raise ValueError(f"{path} was made with another {flag} ({bmeta.get(key)!r}, this run "
                             f"{meta[key]!r}): compare runs of the same text and options")


def _score(a, eng, Session, q, tokens, windows, scores, base, limit) -> bool:
    """Score every window (or up to the base's positions); False when Ctrl-C stopped it."""
    piece = max(1, min(a.chunk, 512))
    sess = Session(eng, a.ctx, chunk=piece)
    base_ids = q.BaseIds(base[1]["pos"], base[1]["top_ids"]) if base else None
    stop_pos = int(base[1]["pos"][-1]) + 1 if base and len(base[1]["pos"]) else None
    t0 = last = time.perf_counter()

    def progress(_n):
        nonlocal last
        now = time.perf_counter()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            nll = scores.nll()
            p = q.ppl(nll)[0] if len(nll) else float("nan")
            print(f"  scored {len(nll)}/{limit} tokens, PPL so far {p:.4f}, {now - t0:.0f} s", file=sys.stderr)
    try:
        for i, w in enumerate(windows):
            if stop_pos is not None and w[2] >= stop_pos:
                break
            q.score_window(sess, tokens, w, scores, piece=piece, base_ids=base_ids, stop_at=stop_pos,
                           on_piece=progress)
            # a line per window, unless there are so many that only one every PROGRESS_EVERY_S is read
            if len(windows) > 1 and (len(windows) <= MANY_WINDOWS or time.perf_counter() - last >= PROGRESS_EVERY_S):
                last = time.perf_counter()
                print(f"  window {i + 1}/{len(windows)}: {len(scores)}/{limit} tokens scored", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"\ninterrupted: reporting the {len(scores)} tokens scored so far", file=sys.stderr)
        return False
    return True


def _report(a, q, eng, scores, windows, base, meta, where, done):
    nll = scores.nll()
    p, err = q.ppl(nll)
    part = "" if done else ", interrupted"
    print(f"PPL = {p:.4f} +/- {err:.4f}   ({len(nll)} tokens scored in {len(windows)} window(s) of "
          f"{a.ctx}{part}; {where})")
    if len(nll):
        print(f"tokens={meta['tokens']} scored={len(nll)} nll={nll.sum():.6f} avg_nll={nll.mean():.6f}")
    if not a.kl_base:
        return
    if base is None:
        if not len(nll):
            print(f"nothing scored: {a.kl_base} not written", file=sys.stderr)
            return
        q.save_base(a.kl_base, dict(meta, k=scores.k, backend=eng.backend, numerics=eng.numerics,
                                    model=os.path.basename(a.model)), scores)
        print(f"kl base: saved the top-{scores.k} logprobs of {len(nll)} positions to {a.kl_base}")
        return
    r = q.compare(base[1], scores)
    b = base[0]
    print(f"kl vs {a.kl_base} ({b.get('backend')}, numerics {b.get('numerics')}; {r['n']} positions, "
          f"top-{b['k']} + rest):")
    print(f"  mean KL = {r['kl_mean']:.6g} +/- {r['kl_err']:.2g}   p99 {r['kl_p99']:.6g}   max {r['kl_max']:.6g}")
    print(f"  top-1 agreement = {100 * r['top1']:.2f} %   PPL base {r['ppl_base']:.4f}, this run {r['ppl_new']:.4f}")
    tok = eng.tokenizer
    for w in r["worst"]:
        print(f"  worst: pos {w['pos']}  KL {w['kl']:.6g}  top-1 base {_piece(tok, w['base_top'])} "
              f"this run {_piece(tok, w['new_top'])}")


def _piece(tok, t: int) -> str:
    import json
    return json.dumps(tok.token_bytes(t).decode("utf-8", errors="backslashreplace"), ensure_ascii=False)
