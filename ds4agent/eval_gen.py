"""One ds4-eval answer: prefill the rendered turn, sample up to a cap, force `</think>` when only
the reply budget is left (so a reasoning that runs long still answers), stop at end of turn."""
from __future__ import annotations


def generate(eng, sess, ids: list[int], max_tokens: int, reply_budget: int, params, rng, thinking: bool,
             on_token=None) -> dict:
    """{"text", "tokens", "finish" ("stop" or "length"), "forced_close"}. The text holds the
    reasoning and the `</think>` that ends it, so the extractors can cut at it."""
    tok = eng.tokenizer
    close = tok.special("</think>")
    sess.sync(ids)
    dec, parts = tok.stream_decoder(), []
    forced, finish, n = False, "length", 0
    for n in range(1, max_tokens + 1):
        if thinking and max_tokens - n < reply_budget:
            t, forced = close, True
        else:
            t = sess.sample(params, rng)
        if t == tok.eos_id:
            finish, n = "stop", n - 1
            break
        if t == close:
            thinking = False
        parts.append(dec.feed(t))
        if on_token is not None:
            on_token(n, max_tokens)
        if n < max_tokens:
            sess.eval(t)
    parts.append(dec.flush())
    return {"text": "".join(parts), "tokens": n, "finish": finish, "forced_close": forced}
