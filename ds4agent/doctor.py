"""`ds4-agent doctor`: is this model file right, does it answer as DeepSeek's API does, and how fast.

  ds4-agent doctor [--model PATH] [--vectors DIR] [--ctx N] [--hash] [--backend ...]

One row per check, printed as it finishes (PASS, FAIL, SKIP, INFO), then a summary; exit 1 when a
check failed. The checks:
- the file: its layout (what `ds4-gguf inspect` checks), which published recipe it follows, and
  with --hash its sha256 against the one the Hub publishes (reading 81 GB takes minutes);
- memory: what is available against what the recipe needs;
- the official test vectors (ds4's tests/test-vectors: greedy continuations and top-20 logprobs
  captured from DeepSeek's API, thinking off) that fit --ctx, run as ds4's test runner runs them:
  the prompt's token count must equal the API's `prompt_tokens`; at each step the greedy token's
  bytes must equal the API's, and every official top token must be among the local top 20 with a
  logprob within 4 nats. A synthetic model cannot match them: they are skipped unless --vectors
  names a folder explicitly (vectors made from that model, as the tests do);
- a brief prefill and decode, with the backend, numerics and paging used.
Ctrl-C prints the rows done so far and the summary.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

from engine.cli_help import ArgumentParser, DefaultsHelpFormatter, add_version_flag
from engine.options import EngineOptions, add_engine_flags

SHARED_VECTORS = Path(__file__).resolve().parents[2] / "shared" / "ds4-data" / "test-vectors"
SYNTH_NAME = "ds4-agent-synthetic"
GB = 1000 ** 3


def _parser():
    p = ArgumentParser(prog="ds4-agent doctor", formatter_class=DefaultsHelpFormatter,
                       description="check a model file, run the official test vectors, measure speed")
    add_version_flag(p)
    p.add_argument("--model", help="the GGUF (default: as ds4-agent finds it: $DS4_MODEL, ./ds4flash.gguf, config)")
    p.add_argument("--vectors", help="a test-vector folder (manifest.json, prompts/, official/); default: "
                                     "ds4's, from ../shared/ds4-data when present")
    p.add_argument("--ctx", type=int, default=16384, help="run the vectors whose prompt fits this context")
    p.add_argument("--hash", action="store_true", help="also hash the whole file and compare with the Hub's sha256")
    p.add_argument("--bench-tokens", type=int, default=64, help="prompt tokens for the speed check (0: skip it)")
    add_engine_flags(p)
    return p


class Table:
    """Rows printed as they come (they are the progress), counted for the summary."""

    def __init__(self, out):
        self.out, self.counts = out, {"PASS": 0, "FAIL": 0, "SKIP": 0, "INFO": 0}

    def row(self, status: str, name: str, detail: str):
        self.counts[status] += 1
        self.out.write(f"{status:<5} {name:<30} {detail}\n")
        self.out.flush()

    def summary(self, interrupted: bool) -> str:
        c = self.counts
        return (f"doctor: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped"
                + ("; interrupted" if interrupted else ""))


def main(argv=None, find=None) -> int:
    """find(arg) -> (path or None, paths tried): how `ds4-agent` finds its model (ds4agent/cli.py
    passes it; without it only --model is looked at)."""
    a = _parser().parse_args(argv)
    if a.ctx < 16 or a.bench_tokens < 0:
        print("error: --ctx must be >= 16 and --bench-tokens >= 0", file=sys.stderr)
        return 1
    try:
        options = EngineOptions.from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    model, tried = find(a.model) if find else (a.model, [])
    if model is None:
        print(f"error: no model found (looked for {', '.join(tried) or 'nothing'}); pass --model PATH", file=sys.stderr)
        return 1
    t = Table(sys.stdout)
    interrupted = False
    try:
        _checks(a, options, model, t)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted", file=sys.stderr)
    print(t.summary(interrupted))
    return 130 if interrupted else (1 if t.counts["FAIL"] else 0)


def _checks(a, options, model: str, t: Table):
    from engine import Engine, ModelFileError
    t0 = time.perf_counter()
    try:
        eng = Engine.open(model, options)
    except (ModelFileError, ValueError, OSError) as e:
        t.row("FAIL", "open", str(e))
        return
    try:
        t.row("PASS", "open", f"{model}: layout as expected, {len(eng.file.gguf.tensors)} tensors, "
                              f"recipe {eng.file.recipe} ({time.perf_counter() - t0:.1f} s)")
        synthetic = is_synthetic(eng)
        if synthetic:
            t.row("INFO", "weights", "a synthetic model (random or zero weights): answers are not DeepSeek's")
        _check_memory(eng, t)
        _check_hash(a, model, t)
        folder = Path(a.vectors) if a.vectors else SHARED_VECTORS
        from .vectors import run_vectors
        have = (folder / "manifest.json").is_file()
        if synthetic and not a.vectors:
            t.row("SKIP", "official vectors", "they need the real weights (a synthetic model cannot match them)")
            if have and _real_vocab(eng):      # the rendering and tokenizer can still be checked
                run_vectors(eng, folder, a.ctx, t, prompts_only=True)
        elif not have:
            t.row("SKIP", "official vectors", f"no manifest.json in {folder}: pass --vectors DIR (ds4's tests/test-vectors)")
        else:
            run_vectors(eng, folder, a.ctx, t)
        _check_speed(eng, a.bench_tokens, t)
    finally:
        eng.close()


def is_synthetic(eng) -> bool:
    """True unless the file has the published Flash shape and is not named as ds4-gguf synth names
    its files (a synthetic Flash-shaped file with zero weights would pass the shape test alone)."""
    from engine.gguf.synth import config_for
    flash = config_for("flash")[0]
    c = eng.config
    f = eng.file.gguf.fields.get("general.name")
    name = getattr(f, "value", None)
    shape = (c.n_layer, c.n_embd, c.n_vocab) == (flash.n_layer, flash.n_embd, flash.n_vocab)
    return not shape or name == SYNTH_NAME


def _real_vocab(eng) -> bool:
    from engine.gguf.synth import config_for
    return eng.config.n_vocab == config_for("flash")[0].n_vocab


def _check_memory(eng, t: Table):
    from engine.runtime.session import mem_available

    from .download import RECIPES
    size = eng.file.gguf.size
    name = os.path.basename(eng.file.path)
    recipe = next((r for r in RECIPES.values() if r.file == name), None)
    need = recipe.memory_gb * GB if recipe else int(size * 1.15)
    avail = mem_available()
    what = f"recipe {name}" if recipe else "file size + 15 %"
    gb = lambda n: f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.0f} MB"  # noqa: E731
    if avail is None:
        t.row("SKIP", "memory", f"cannot read the available memory; the model needs ~{gb(need)} ({what})")
    elif avail >= need:
        t.row("PASS", "memory", f"{gb(avail)} available, ~{gb(need)} needed ({what}); paging {eng.paging}")
    else:
        t.row("INFO", "memory", f"{gb(avail)} available, ~{gb(need)} needed ({what}): "
                                f"paging {eng.paging} reads from disk, slowly")


def _check_hash(a, model: str, t: Table):
    if not a.hash:
        t.row("SKIP", "sha256", "--hash reads the whole file and compares it with the Hub's")
        return
    from .download import RECIPES, _endpoint, remote_file
    h, done, size, last = hashlib.sha256(), 0, os.path.getsize(model), time.perf_counter()
    with open(model, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            done += len(chunk)
            if time.perf_counter() - last > 5:
                last = time.perf_counter()
                print(f"  hashing: {100 * done / max(size, 1):.0f} %", file=sys.stderr)
    digest = h.hexdigest()
    name = os.path.basename(model)
    if not any(r.file == name for r in RECIPES.values()):
        t.row("INFO", "sha256", f"{digest} (not a published file name: nothing to compare with)")
        return
    try:
        _, _, published = remote_file(name, _endpoint())
    except Exception as e:      # offline, or the Hub refused: say so, the digest is still useful
        t.row("SKIP", "sha256", f"{digest}; the Hub could not be asked ({str(e)[:80]})")
        return
    ok = published == digest
    t.row("PASS" if ok else "FAIL", "sha256", digest + ("" if ok else f" != the Hub's {published}"))


def _check_speed(eng, n: int, t: Table):
    if n == 0:
        t.row("SKIP", "speed", "--bench-tokens 0")
        return
    from engine import Session
    from engine.bench import default_text
    ids = eng.tokenizer.encode(default_text())[:n]
    sess = Session(eng, n + 16)
    t0 = time.perf_counter()
    sess.sync(ids)
    pre = time.perf_counter() - t0
    t1, steps = time.perf_counter(), 8
    for _ in range(steps):
        sess.eval(sess.top_logprobs(1)[0][0])        # greedy
    dec = time.perf_counter() - t1
    t.row("INFO", "speed", f"prefill {len(ids) / pre:.1f} t/s ({len(ids)} tokens), decode {steps / dec:.1f} t/s; "
                           f"backend {eng.backend}, numerics {eng.numerics}, paging {eng.paging}")
