"""`ds4-gguf inspect` of an MTP file: its tensors and totals, and with `--model MAIN` the check
against that model (the MTP file carries no config of its own: ds4 reads none)."""
from __future__ import annotations

import json

from .gguf_file import GGUFFile
from .mtp_file import PREFIX, MTPFile, is_mtp_file


def is_mtp_path(path) -> bool:
    """Whether the file parses as a GGUF holding an MTP block (a bad file: False, and the model
    path reports it)."""
    try:
        with GGUFFile(path) as g:
            return is_mtp_file(g)
    except Exception:   # (any parse failure: the ordinary inspect path says what is wrong)
        return False


def inspect_mtp(path, model, *, as_json: bool, show_tensors: bool) -> int:
    checked = None
    if model:
        from .model_file import ModelFile
        with ModelFile.open(model) as m:
            MTPFile.open(path, m.config).close()      # (a misfit: ModelFileError, one line)
        checked = str(model)
    with GGUFFile(path) as g:
        tensors = [(ti.name, ti.type_name, list(ti.dims), ti.nbytes) for ti in g.tensors.values()]
        gate = g.tensors.get(PREFIX + "ffn_gate_exps.weight")
        e_proj = g.tensors.get(PREFIX + "e_proj.weight")
        r = {"path": str(path), "kind": "mtp", "file_bytes": g.size, "n_tensors": len(tensors),
             "name": g.get("general.name"), "n_embd": e_proj.dims[0] if e_proj else None,
             "n_expert": gate.dims[2] if gate and len(gate.dims) == 3 else None,
             "routed_type": gate.type_name if gate else None, "checked_against": checked,
             "tensors": tensors}
    if as_json:
        print(json.dumps(r, indent=1))
        return 0
    lines = [f"{r['path']}: an MTP file (ds4's mtp.0.* layout), {r['n_tensors']} tensors, {r['file_bytes']:,} bytes",
             f"  width {r['n_embd']}, {r['n_expert']} routed experts ({r['routed_type']})",
             f"  checked against {checked}: fits" if checked else
             "  (its shapes follow the main model: --model MAIN checks it against one)"]
    if show_tensors:
        lines += [f"  {n:40s} {t:8s} {d} {b:,}" for n, t, d, b in tensors]
    print("\n".join(lines))
    return 0
