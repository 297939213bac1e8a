"""Compare ds4's decode intermediates with the reference's, op by op (issue 33).

    .venv/bin/python scripts/build_ds4_oracle.py --ds4-src /tmp/ds4-src dump NAME OUT
    .venv/bin/python scripts/ds4_dump_compare.py NAME OUT [--backend numpy] [--positions 2]

The first writes OUT/NAME.dump (build edit 7: records tag, position, layer, float32 values) from
a debug build of ds4; this one feeds the same ids one at a time to our engine (ds4 numerics),
records the same tensors by wrapping the model's and the ops' methods on the instance (nothing in
the engine changes, nothing costs anything when this script does not run), and prints per
position, layer and tensor the largest difference, in absolute terms and in float32 ulps of the
largest value, with how many values differ. The first tensor that differs beyond rounding is the
op to read in ds4.c.
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


def record(model, rec: dict, state: dict) -> None:
    """Wrap `model`'s methods and its ops' (instance attributes) so one decode step fills rec."""
    ops, c = model.ops, model.c

    def put(tag, x, il=None):
        key = (state["pos"], state["il"] if il is None else il, tag)
        rec.setdefault(key, np.asarray(x, dtype=np.float32).reshape(-1).copy())

    def wrap(obj, name, after):
        orig = getattr(obj, name)

        def f(*a, **k):
            r = orig(*a, **k)
            after(r, *a, **k)
            return r
        setattr(obj, name, f)

    def attention(il, lw):
        state.update(il=lw.il if hasattr(lw, "il") else il, hc=0, rope=0, kv=0)
    orig_att = model._attention

    def _attention(lw, il, X, segs, pos):
        state.update(il=il, hc=0, rope=0, kv=0, head=False)
        put("hc_in", X[0])
        r = orig_att(lw, il, X, segs, pos)
        put("after_attn", r[0])
        return r
    model._attention = _attention
    wrap(model, "_ffn", lambda r, *a: put("out_hc", r[0]))

    def hc_pre(r, *a):
        x, post, C = r
        kind = "attn" if state["hc"] == 0 else "ffn"
        state["hc"] += 1
        put(f"{kind}_x", x[0]), put(f"{kind}_post", post[0]), put(f"{kind}_comb", C[0])
    wrap(model, "_hc_pre", hc_pre)
    wrap(model, "_attend", lambda r, *a: put("heads", r[0]))
    orig_head = model._head

    def _head(X):
        state.update(head=True)
        return orig_head(X)
    model._head = _head
    names = {}
    for lw in model.w.layers:
        names.update({id(lw.attn_norm): "attn_norm", id(lw.q_a_norm): "qr_norm", id(lw.ffn_norm): "ffn_norm",
                      id(lw.out_b): "attn_out"})
    names[id(model.w.out_norm)] = "head_norm"

    def rmsnorm(r, x, w, eps):
        if w is not None and id(w) in names:
            put(names[id(w)], r[0], 0 if state.get("head") else None)
    wrap(ops, "rmsnorm", rmsnorm)
    wrap(ops, "linear", lambda r, w, x, rows=None: put(names[id(w)], r[0]) if id(w) in names else None)

    def rope(r, x, th, inverse=False, inplace=False):
        if not inverse and x.ndim == 3 and x.shape[1] == c.n_head and state["rope"] == 0:
            state["rope"] = 1
            put("q", r[0])
    wrap(ops, "rope", rope)

    def store_kv(r, rows, n_nope):
        if state["kv"] == 0:
            state["kv"] = 1
            put("kv", r[0])
    wrap(ops, "store_kv", store_kv)
    wrap(ops, "routed", lambda r, *a: put("ffn_moe", r[0]))
    wrap(ops, "shared_expert", lambda r, *a: put("ffn_shared", r[0]))

    def pre_mix(r, pre, X):
        if state.get("head"):
            put("head_w", pre[0], 0), put("head_x", r[0], 0)
    wrap(ops, "hc_pre_mix", pre_mix)


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
            d = np.abs(a.astype(np.float64) - b)
            ulp = np.spacing(np.float32(np.abs(a).max()))
            print(f"   L{il} {tag:12} max {d.max():.3e}  {d.max() / ulp:8.1f} ulp(max)  differ {np.count_nonzero(d)}/{d.size}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name")
    p.add_argument("out", type=Path)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--positions", type=int, default=2)
    p.add_argument("--save", type=Path, metavar="NPZ", help="also write ds4's records below --positions "
                   "(keys p{pos}_l{layer}_{tag}) with the token ids: the fixture of tests/test_ds4_rules.py")
    a = p.parse_args(argv)
    from engine import Engine, Session
    from engine.gguf.gguf_cli import main as gguf_main
    meta = json.loads((ROOT / "tests" / "oracles" / a.name / "oracle.json").read_text())
    gguf = a.out / f"{a.name}.gguf"
    if not gguf.exists():
        gguf_main(["synth", str(gguf), *meta["synth"]])
    ds4 = read_dump(a.out / f"{a.name}.dump")
    if a.save:
        keep = {f"p{q}_l{il}_{tag}": v for (q, il, tag), v in ds4.items() if q < a.positions}
        tmp = a.save.with_name(a.save.name + ".tmp.npz")
        np.savez_compressed(tmp, token_ids=np.array(meta["token_ids"][:a.positions], np.int32),
                            synth=np.array(meta["synth"]), gguf_sha256=np.array(meta["gguf_sha256"]), **keep)
        tmp.replace(a.save)
    ds4_logits = np.fromfile(a.out / f"{a.name}.f32", np.float32).reshape(-1, meta["n_vocab"])
    rec, state = {}, {"pos": 0, "il": 0}
    with Engine.open(gguf, backend=a.backend, numerics="ds4", threads=1) as e:
        s = Session(e, 64)
        record(e.model, rec, state)
        logits = []
        for i, t in enumerate(meta["token_ids"][:len(ds4_logits)]):
            state.update(pos=i, il=0)
            logits.append(np.asarray(s.eval(t), np.float32))
    compare(ds4, rec, a.positions)
    d = np.abs(np.array(logits) - ds4_logits).max(axis=1)
    print("logits max-abs per position:", " ".join(f"{x:.3f}" for x in d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
