"""Compare ds4's decode intermediates with the reference's, op by op (issue 33).

    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src dump NAME OUT
    .venv/bin/python scripts/ds4_dump_compare.py NAME OUT [--backend numpy] [--positions 2]
    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src dump NAME OUT --prefill --tokens 8 --positions 8
    .venv/bin/python scripts/ds4_dump_compare.py NAME OUT --prefill --positions 8 [--forced]

The first writes OUT/NAME.dump (build edit 7: records tag, position, layer, float32 values) from
a debug build of ds4; this one feeds the same ids one at a time to our engine (ds4 numerics),
records the same tensors by wrapping the model's and the ops' methods on the instance (nothing in
the engine changes, nothing costs anything when this script does not run), and prints per
position, layer and tensor the largest difference, in absolute terms and in float32 ulps of the
largest value, with how many values differ. The first tensor that differs beyond rounding is the
op to read in ds4.c. With --prefill both sides take their batched prefill path instead: ds4 one
ds4_session_sync of the ids (OUT/NAME-prefill.dump, a record per row), ours one multi-row
Session.sync; row t is position t. --forced runs each op of ours on ds4's own inputs from the
dump instead of one pass, and says per op at how many (position, layer) its output differs from
ds4's: which ds4 function rounds otherwise, whatever came before it (docs/numerics.md, "ds4's
prefill path").
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def read_dump(path: Path) -> dict:
    """(pos, layer, tag) -> float32 values, from the debug build's records."""
    raw = path.read_bytes()
    out, i = {}, 0
    while i < len(raw):
        tag = raw[i:i + 16].split(b"\0")[0].decode()
        pos, il, n = np.frombuffer(raw, np.int32, 3, i + 16)
        i += 28
        out[(int(pos), int(il), tag)] = np.frombuffer(raw, np.float32, int(n), i).copy()
        i += 4 * int(n)
    return out


def wrap(obj, name, after) -> None:
    """obj.name (an instance attribute from now on) calls after(result, *args) once it returns."""
    orig = getattr(obj, name)

    def f(*a, **k):
        r = orig(*a, **k)
        after(r, *a, **k)
        return r
    setattr(obj, name, f)


def record(model, rec: dict, state: dict) -> None:
    """Wrap `model`'s methods and its ops' (instance attributes) so one decode step fills rec."""
    ops, c = model.ops, model.c

    def put(tag, rows, il=None):
        """rows: the pass's rows (one in a decode step); row t is position state["pos"] + t."""
        rows = np.asarray(rows, dtype=np.float32)
        for t in range(len(rows)):
            key = (state["pos"] + t, state["il"] if il is None else il, tag)
            rec.setdefault(key, rows[t].reshape(-1).copy())

    def put_head(tag, rows):
        """The head's rows: a prefill computes only the last one (position state["last"])."""
        if len(rows) == 1:
            rec.setdefault((state["last"], 0, tag), np.asarray(rows[0], np.float32).reshape(-1).copy())
        else:
            put(tag, rows, 0)

    orig_att = model._attention

    def _attention(lw, il, X, segs, pos):
        state.update(il=il, hc=0, rope=0, kv=0, head=False)
        put("hc_in", X)
        r = orig_att(lw, il, X, segs, pos)
        put("after_attn", r)
        return r
    model._attention = _attention
    wrap(model, "_ffn", lambda r, *a: put("out_hc", r))

    def hc_pre(r, *a):
        x, post, C = r
        kind = "attn" if state["hc"] == 0 else "ffn"
        state["hc"] += 1
        put(f"{kind}_x", x), put(f"{kind}_post", post), put(f"{kind}_comb", C)
    wrap(model, "_hc_pre", hc_pre)
    wrap(model, "_attend", lambda r, *a: put("heads", r))
    orig_head = model._head

    def _head(X):
        state.update(head=True)
        return orig_head(X)
    model._head = _head
    names = {}
    for lw in model.w.layers:
        names.update({id(lw.attn_norm): "attn_norm", id(lw.q_a_norm): "qr_norm", id(lw.ffn_norm): "ffn_norm",
                      id(lw.out_b): "attn_out", id(lw.q_a): "qr"})
    names[id(model.w.out_norm)] = "head_norm"

    def rmsnorm(r, x, w, eps):
        if w is not None and id(w) in names:
            put_head(names[id(w)], r) if state.get("head") else put(names[id(w)], r)
    wrap(ops, "rmsnorm", rmsnorm)
    wrap(ops, "linear", lambda r, w, x, rows=None: put(names[id(w)], r) if id(w) in names else None)
    if hasattr(ops, "linears"):
        wrap(ops, "linears", lambda r, ws, x, *a, **k: [put(names[id(w)], y) for w, y in zip(ws, r) if id(w) in names])

    def rope(r, x, th, inverse=False, inplace=False):
        if not inverse and x.ndim == 3 and x.shape[1] == c.n_head and state["rope"] == 0:
            state["rope"] = 1
            put("q", r)
    wrap(ops, "rope", rope)

    def store_kv(r, rows, n_nope):
        if state["kv"] == 0:
            state["kv"] = 1
            put("kv", r)
    wrap(ops, "store_kv", store_kv)
    wrap(ops, "routed", lambda r, *a: put("ffn_moe", r))
    wrap(ops, "shared_expert", lambda r, *a: put("ffn_shared", r))

    def pre_mix(r, pre, X):
        if state.get("head"):
            put_head("head_w", pre), put_head("head_x", r)
    wrap(ops, "hc_pre_mix", pre_mix)
    if getattr(ops, "hc_head", None) is not None:     # ds4 numerics' own collapse (no weights out)
        wrap(ops, "hc_head", lambda r, *a: put_head("head_x", r))


# --forced: each op of ours on ds4's own inputs (from the dump), against ds4's output of it: which
# ds4 function computes it otherwise, whatever came before. (op, ds4's functions in its batched
# prefill path, the tags compared)
FORCED = [
    ("attention HC pre + norm", "hc_pre_norm_batch", ("attn_x", "attn_post", "attn_comb", "attn_norm")),
    ("q_a matmul", "matmul_q8_0_batch", ("qr",)),
    ("q_a norm", "rms_norm_weight (its copy in layer_attention_raw_swa_batch)", ("qr_norm",)),
    ("q_b matmul, head norm, RoPE", "matmul_q8_0_batch, head_rms_norm_inplace, rope_tail_layer_inplace", ("q",)),
    ("kv matmul, norm, RoPE, FP8, f16", "matmul_q8_0_batch, rms_norm_weight, rope, FP8, kv_cache_push_raw", ("kv",)),
    ("inverse RoPE, grouped out, out_b", "rope_tail_layer_inplace, layer_grouped_out_batch", ("attn_out",)),
    ("attention HC post", "hc_post_batch", ("after_attn",)),
    ("FFN HC pre + norm", "hc_pre_norm_batch", ("ffn_x", "ffn_post", "ffn_comb", "ffn_norm")),
    ("routed experts", "layer_routed_moe_one_prealloc (< 64 rows)", ("ffn_moe",)),
    ("shared expert", "layer_shared_ffn_batch", ("ffn_shared",)),
    ("FFN HC post (moe + shared)", "hc_post_sum_batch", ("out_hc",)),
    ("head: HC collapse", "output_logits_one (output_hc_head_one)", ("head_x",)),
    ("head: norm", "output_logits_one (rms_norm_weight)", ("head_norm",)),
]


def forced(ds4: dict, model, token_ids, positions: int) -> list[tuple]:
    """Per FORCED op: (op, ds4 functions, rows checked, rows that differ, worst ulp(max))."""
    c, ops = model.c, model.ops
    ours: dict = {}
    state = {"pos": 0, "il": 0, "hc": 1, "last": 0, "kv": 1, "rope": 1}
    record(model, ours, state)
    n_hc, f = c.n_hc, np.float32
    for (p, il, tag) in sorted(k for k in ds4 if k[2] == "hc_in" and k[0] < positions):
        g = lambda t: ds4[(p, il, t)]
        lw, pos = model.w.layers[il], np.array([p])
        state.update(pos=p, il=il, hc=0)
        X = g("hc_in").reshape(1, n_hc, c.n_embd)
        x, post, C = model._hc_pre(lw.hc_attn, X)
        ops.rmsnorm(x, lw.attn_norm, c.rms_eps)
        ours[(p, il, "qr")] = np.asarray(ops.linear(lw.q_a, g("attn_norm")[None]), f).reshape(-1)
        ops.rmsnorm(g("qr")[None], lw.q_a_norm, c.rms_eps)
        q = ops.rmsnorm(ops.linear(lw.q_b, g("qr_norm")[None]).reshape(1, c.n_head, c.head_dim), None, c.rms_eps)
        state["rope"] = 0
        ops.rope(q, model._thetas(lw.ratio, pos, c.n_rot, heads=True, query=True))
        kv = ops.rmsnorm(ops.linear(lw.kv, g("attn_norm")[None]), lw.kv_norm, c.rms_eps)
        ours[(p, il, "kv")] = np.asarray(ops.store_kv(ops.rope(kv, model._thetas(lw.ratio, pos, c.n_rot)), c.n_nope),
                                         f).reshape(-1)
        o = ops.rope(g("heads").reshape(1, c.n_head, c.head_dim).copy(),
                     model._thetas(lw.ratio, pos, c.n_rot, heads=True), inverse=True)
        ours[(p, il, "attn_out")] = np.asarray(ops.linear(lw.out_b, ops.grouped_linear(
            lw.out_a, o.reshape(1, -1), c.o_groups)), f).reshape(-1)
        ours[(p, il, "after_attn")] = np.asarray(ops.hc_post(
            g("attn_out")[None], X, g("attn_post").reshape(1, n_hc), g("attn_comb").reshape(1, n_hc, n_hc)), f).reshape(-1)
        state["hc"] = 1
        model._ffn(lw, g("after_attn").reshape(1, n_hc, c.n_embd), np.array([token_ids[p]]))
        if il == c.n_layer - 1 and (p, 0, "head_x") in ds4:
            w, X = model.w, g("out_hc").reshape(1, n_hc, c.n_embd)     # Model._head's collapse, ds4 numerics
            mix = ops.linear(w.hc_head_fn, ops.rmsnorm(X.reshape(1, -1), None, c.rms_eps))
            ours[(p, 0, "head_x")] = np.asarray(ops.hc_head(mix, w.hc_head_scale[0], w.hc_head_base, c.hc_eps, X),
                                                f).reshape(-1)
            state.update(head=True, last=p)
            ops.rmsnorm(ds4[(p, 0, "head_x")][None], w.out_norm, c.rms_eps)
            state["head"] = False
    rows = []
    for op, fn, tags in FORCED:
        n = bad = 0
        worst = 0.0
        for (p, il, tag) in ds4:
            if tag in tags and p < positions and (p, il, tag) in ours:
                a, b = ds4[(p, il, tag)], ours[(p, il, tag)]
                if tag == "kv":          # ds4 dumps the row before its cache's f16 rounding; ours after
                    a = a.astype(np.float16).astype(f)
                d = np.abs(a.astype(np.float64) - b)
                n, bad = n + 1, bad + bool(d.max() > 0)
                worst = max(worst, d.max() / np.spacing(f(np.abs(a).max())))
        rows.append((op, fn, n, bad, worst))
    return rows


def compare(ds4: dict, ours: dict, positions: int) -> None:
    order = defaultdict(list)
    for (p, il, tag) in ds4:
        if p < positions:
            order[p].append((il, tag))
    for p in sorted(order):
        print(f"-- position {p}")
        for il, tag in order[p]:
            a = ds4[(p, il, tag)]
            b = ours.get((p, il, tag))
            if b is None or b.shape != a.shape:
                print(f"   L{il} {tag:12} (ours: {'missing' if b is None else b.shape})")
                continue
            if tag == "kv":            # ds4 dumps the row before its cache's f16 rounding; ours after
                a = a.astype(np.float16).astype(np.float32)
            d = np.abs(a.astype(np.float64) - b)
            ulp = np.spacing(np.float32(np.abs(a).max()))
            print(f"   L{il} {tag:12} max {d.max():.3e}  {d.max() / ulp:8.1f} ulp(max)  differ {np.count_nonzero(d)}/{d.size}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name")
    p.add_argument("out", type=Path)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--positions", type=int, default=2)
    p.add_argument("--prefill", action="store_true", help="compare the batched prefill paths (the dump "
                   "made by build_ds4_oracle.py dump --prefill): one multi-row Session.sync of ours")
    p.add_argument("--tokens", type=int, default=8, help="with --prefill: the ids ds4 synced (dump's --tokens)")
    p.add_argument("--forced", action="store_true", help="each op of ours on ds4's own inputs instead of one "
                   "pass: per op, at how many (position, layer) its output differs from ds4's")
    p.add_argument("--save", type=Path, metavar="NPZ", help="also write ds4's records below --positions "
                   "(keys p{pos}_l{layer}_{tag}) with the token ids: the fixture of tests/test_ds4_rules.py")
    a = p.parse_args(argv)
    from engine import Engine, Session
    from engine.gguf.gguf_cli import main as gguf_main
    meta = json.loads((ROOT / "tests" / "oracles" / a.name / "oracle.json").read_text())
    gguf = a.out / f"{a.name}.gguf"
    if not gguf.exists():
        gguf_main(["synth", str(gguf), *meta["synth"]])
    stem = f"{a.name}-prefill" if a.prefill else a.name
    ds4 = read_dump(a.out / f"{stem}.dump")
    if a.save:
        keep = {f"p{q}_l{il}_{tag}": v for (q, il, tag), v in ds4.items() if q < a.positions}
        tmp = a.save.with_name(a.save.name + ".tmp.npz")
        np.savez_compressed(tmp, token_ids=np.array(meta["token_ids"][:a.positions], np.int32),
                            synth=np.array(meta["synth"]), gguf_sha256=np.array(meta["gguf_sha256"]), **keep)
        tmp.replace(a.save)
    ds4_logits = np.fromfile(a.out / f"{stem}.f32", np.float32).reshape(-1, meta["n_vocab"])
    rec, state = {}, {"pos": 0, "il": 0}
    with Engine.open(gguf, backend=a.backend, numerics="ds4", threads=1) as e:
        if a.forced:
            print(f"{'op':36} {'rows':>5} {'differ':>6} {'worst ulp(max)':>14}  ds4 functions")
            for op, fn, n, bad, worst in forced(ds4, e.model, meta["token_ids"], a.positions):
                print(f"{op:36} {n:5d} {bad:6d} {worst:14.1f}  {fn}")
            return 0
        record(e.model, rec, state)
        if a.prefill:
            n = a.tokens
            state.update(last=n - 1)
            s = Session(e, n + 64)
            logits = [np.asarray(s.sync(meta["token_ids"][:n], keep_logits=True)[-1], np.float32)]
        else:
            s = Session(e, 64)
            logits = []
            for i, t in enumerate(meta["token_ids"][:len(ds4_logits)]):
                state.update(pos=i, il=0, last=i)
                logits.append(np.asarray(s.eval(t), np.float32))
    compare(ds4, rec, a.positions)
    d = np.abs(np.array(logits) - ds4_logits).max(axis=1)
    print("logits max-abs per position:", " ".join(f"{x:.3f}" for x in d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
