"""The official test vectors (ds4's tests/test-vectors) run against a loaded Engine, as ds4's own
test runner runs them: the prompt rendered as one user turn with thinking off, greedy decoding,
tokens compared by their bytes (not ids, so a vocabulary's numbering does not matter).

A folder holds manifest.json ({"prompts": [{"id", "prompt_file", "official_file", "steps"}]}),
prompts/<id>.txt and official/<id>.official.json (`usage.prompt_tokens`, and `steps`: each with
the chosen `token` {"bytes"} and `top_logprobs` [{"token": {"bytes"}, "logprob"}]).
"""
from __future__ import annotations

import json
from pathlib import Path

TOP_N = 20            # the vectors' top_logprobs, and the local top list ds4 searches
MAX_DELTA = 4.0       # ds4's tolerance on an official top token's logprob (nats)
MASKED = -1000.0      # the API reports -9999 for tokens outside its top: not compared


def load_case(folder: Path, entry: dict) -> tuple[str, dict]:
    prompt = (folder / entry["prompt_file"]).read_text(encoding="utf-8")
    official = json.loads((folder / entry["official_file"]).read_text(encoding="utf-8"))
    return prompt, official


def prompt_ids(eng, prompt: str, official: dict) -> tuple[list[int], str | None]:
    """The prompt's tokens as ds4 renders it, and why they are wrong: a count other than the API's
    `usage.prompt_tokens` (rendering or tokenizer), else None. Needs only the vocabulary."""
    from .ds4_cli import render_user_turn
    ids = eng.tokenizer.encode(render_user_turn(prompt, "none"))
    want = official.get("usage", {}).get("prompt_tokens")
    if want is not None and want != len(ids):
        return ids, f"the prompt is {len(ids)} tokens here, {want} at the API (rendering or tokenizer)"
    return ids, None


def check_case(eng, prompt: str, official: dict, ctx: int, progress=None) -> tuple[str, str]:
    """(status, detail) of one vector: PASS, FAIL, or SKIP when it does not fit `ctx`.
    progress(done, total) is called after each prefill chunk."""
    from engine import Session

    tok = eng.tokenizer
    ids, bad = prompt_ids(eng, prompt, official)
    steps = official["steps"]
    if len(ids) + len(steps) + 1 >= ctx:
        return "SKIP", f"{len(ids)} prompt tokens do not fit --ctx {ctx}"
    if bad:
        return "FAIL", bad
    sess = Session(eng, ctx)
    sess.sync(ids, progress)
    worst = 0.0
    for i, step in enumerate(steps):
        top = sess.top_logprobs(TOP_N)
        chosen = top[0][0]
        got_b, want_b = tok.token_bytes(chosen), bytes(step["token"]["bytes"])
        if got_b != want_b:
            return "FAIL", f"step {i}: greedy token {_show(got_b)}, the API's {_show(want_b)}"
        local = {tok.token_bytes(t): lp for t, lp in top}
        for o in step.get("top_logprobs", []):
            if o["logprob"] <= MASKED:
                continue
            b = bytes(o["token"]["bytes"])
            if b not in local:
                return "FAIL", f"step {i}: the API's top token {_show(b)} is not in the local top {TOP_N}"
            d = abs(local[b] - o["logprob"])
            worst = max(worst, d)
            if d > MAX_DELTA:
                return "FAIL", f"step {i}: {_show(b)} logprob {local[b]:.3f} here, {o['logprob']:.3f} at the API"
        if i + 1 < len(steps):
            sess.eval(chosen)
    return "PASS", f"{len(ids)} prompt tokens, {len(steps)} steps match, worst logprob delta {worst:.3f}"


def run_vectors(eng, folder: Path, ctx: int, table, prompts_only: bool = False):
    """One table row per vector in the folder's manifest. prompts_only: check only that each
    prompt renders to the API's token count (a synthetic model with the real vocabulary)."""
    try:
        cases = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        table.row("FAIL", "vectors", f"{folder}/manifest.json: {e}")
        return
    for entry in cases:
        name = f"vector {entry.get('id', '?')}"
        try:
            prompt, official = load_case(folder, entry)
            if prompts_only:
                ids, bad = prompt_ids(eng, prompt, official)
                status, detail = ("FAIL", bad) if bad else (
                    "SKIP", f"prompt renders to the API's {len(ids)} tokens; the continuation needs the real weights")
            else:
                status, detail = check_case(eng, prompt, official, ctx, _progress(name))
        except (OSError, ValueError, KeyError, TypeError) as e:
            status, detail = "FAIL", f"cannot read the vector: {e}"
        table.row(status, name, detail)


def _progress(name: str):
    """Prefill progress on stderr for a long prompt (every 5 s)."""
    import sys
    import time
    t0 = [time.perf_counter(), time.perf_counter()]

    def on_chunk(done: int, total: int):
        now = time.perf_counter()
        if now - t0[1] >= 5:
            t0[1] = now
            print(f"  {name}: prefill {done}/{total} tokens, {now - t0[0]:.0f} s", file=sys.stderr)
    return on_chunk


def _show(b: bytes) -> str:
    return json.dumps(b.decode("utf-8", errors="backslashreplace"), ensure_ascii=False)
