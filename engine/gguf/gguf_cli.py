"""`ds4-gguf`: write synthetic DeepSeek V4 GGUFs and inspect/validate any GGUF.

  ds4-gguf synth OUT.gguf [--preset tiny|flash] [--recipe q2|q4|mxfp4] [--layers N] ...
  ds4-gguf inspect FILE [--tensors] [--json]

A file that fails validation prints one line, `error: FILE: problem`, and exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..console import console_main
from ..errors import ModelFileError

# CLI flag -> ModelConfig field, for shape overrides of `synth`
_SHAPE_FLAGS = [
    ("--embd", "n_embd"), ("--heads", "n_head"), ("--head-dim", "head_dim"), ("--rot", "n_rot"),
    ("--q-rank", "q_lora_rank"), ("--o-groups", "o_groups"), ("--o-rank", "o_lora_rank"),
    ("--experts", "n_expert"), ("--experts-used", "n_expert_used"), ("--ff", "n_ff_exp"),
    ("--hash-layers", "n_hash_layer"), ("--window", "n_swa"), ("--idx-heads", "idx_n_head"),
    ("--idx-dim", "idx_head_dim"), ("--idx-topk", "idx_topk"), ("--hc", "n_hc"),
    ("--sinkhorn-iters", "sinkhorn_iters"),
]
_SHAPE_HELP = {
    "n_embd": "hidden width", "n_head": "attention heads", "head_dim": "attention head width",
    "n_rot": "rotary dimensions of a head", "q_lora_rank": "rank of the query projection",
    "o_groups": "output projection groups", "o_lora_rank": "rank of the output projection",
    "n_expert": "routed experts per layer", "n_expert_used": "experts each token uses",
    "n_ff_exp": "an expert's feed-forward width", "n_hash_layer": "leading layers routed by token hash",
    "n_swa": "sliding-window length", "idx_n_head": "indexer heads", "idx_head_dim": "indexer head width",
    "idx_topk": "compressed rows the indexer keeps", "n_hc": "hyper-connection streams",
    "sinkhorn_iters": "Sinkhorn iterations of the hyper-connection mix",
}


def _parser() -> argparse.ArgumentParser:
    from ..cli_help import ArgumentParser, DefaultsHelpFormatter, add_version_flag
    from .config import FLASH
    from .synth import TINY, TINY_VOCAB_BASE
    from .synth_vocab import PROMPT_SPECIAL_IDS
    p = ArgumentParser(prog="ds4-gguf", description="DeepSeek V4 GGUF tools")
    add_version_flag(p)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="write a synthetic DeepSeek V4 GGUF in the exact ds4 layout",
                       formatter_class=DefaultsHelpFormatter)
    s.add_argument("out", help="the GGUF file to write")
    s.add_argument("--preset", choices=["tiny", "flash"], default="tiny",
                   help="tiny: the ds4-oracle shape; flash: the published shape")
    s.add_argument("--recipe", choices=["q2", "q4", "mxfp4"], default="q2", help="routed expert types")
    s.add_argument("--layers", type=int, help="number of layers (schedule 0,0,4,128,4,... unless --ratios; "
                                              f"default: tiny {TINY['n_layer']}, flash {FLASH['n_layer']})")
    s.add_argument("--ratios", help="comma-separated compress ratio per layer (0, 4 or 128; default: "
                                    "the flash schedule for the layer count)")
    n_special = len(PROMPT_SPECIAL_IDS)
    s.add_argument("--vocab", default=None,
                   help=f"'full' for all {FLASH['n_vocab']:,} ids, or N base tokens (+{n_special} prompt "
                        f"specials); default: tiny {TINY_VOCAB_BASE} base = "
                        f"{TINY_VOCAB_BASE + n_special} ids, flash full")
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    s.add_argument("--fill", choices=["random", "zero"], default="random",
                   help="zero: no data written (sparse file), for layout/size checks of big shapes")
    s.add_argument("--name", default="ds4-agent-synthetic", help="general.name in the file's metadata")
    s.add_argument("--mtp", metavar="OUT", help="also write an MTP file (ds4's mtp.0.* layout) that fits this model")
    for flag, field in _SHAPE_FLAGS:
        s.add_argument(flag, type=int, metavar="N", help=f"{_SHAPE_HELP[field]} ({field}; "
                                                         f"default: tiny {TINY[field]}, flash {FLASH[field]})")
    i = sub.add_parser("inspect", help="validate a GGUF and summarise it")
    i.add_argument("file", help="the GGUF file")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--model", metavar="MAIN", help="for an MTP file: check it against this main model")
    return p


def _synth(a) -> int:
    from .synth import config_for, write_synthetic
    overrides = {field: getattr(a, flag[2:].replace("-", "_")) for flag, field in _SHAPE_FLAGS
                 if getattr(a, flag[2:].replace("-", "_")) is not None}
    ratios = [int(x) for x in a.ratios.split(",")] if a.ratios else None
    vocab = a.vocab if a.vocab in (None, "full") else int(a.vocab)
    layers = a.layers if a.layers is not None else (len(ratios) if ratios else None)
    t0 = time.perf_counter()
    cfg, vocab = config_for(a.preset, n_layer=layers, ratios=ratios, vocab=vocab, **overrides)
    r = write_synthetic(a.out, cfg, recipe=a.recipe, vocab=vocab, seed=a.seed, fill=a.fill, name=a.name)
    print(f"wrote {r.path}: {r.n_tensors} tensors, {r.nbytes:,} bytes, {cfg.n_layer} layers, "
          f"recipe {r.recipe}, vocab {cfg.n_vocab} ({time.perf_counter() - t0:.1f} s)")
    if a.mtp:
        from .mtp_file import write_synthetic_mtp
        path = write_synthetic_mtp(a.mtp, cfg, recipe="q4" if a.recipe == "q2" else a.recipe, seed=a.seed + 1)
        print(f"wrote {path}: the MTP file for it, {os.path.getsize(path):,} bytes")
    return 0


def _inspect(a) -> int:
    from .inspect import format_report, report
    from .model_file import ModelFile
    from .mtp_inspect import inspect_mtp, is_mtp_path
    from ..model.weights import check_hash_tables
    if is_mtp_path(a.file):
        return inspect_mtp(a.file, a.model, as_json=a.json, show_tensors=a.tensors)
    with ModelFile.open(a.file) as m:
        check_hash_tables(m)    # the one tensor whose values the loaders check (the weights are numbers)
        r = report(m)
    if a.json:
        r = dict(r, config=r["config"].__dict__)
        print(json.dumps(r, indent=1))
    else:
        print(format_report(r, show_tensors=a.tensors))
    return 0


@console_main
def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        return {"synth": _synth, "inspect": _inspect}[a.cmd](a)
    except BrokenPipeError:
        raise                         # a reader that went away: console_main ends quietly
    except ModelFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
