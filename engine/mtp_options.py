"""The MTP flags every command that generates shares: `--mtp FILE` and `--mtp-draft N`.

(A module of its own beside engine/options.py: the file is not an engine option of every
command, only of those that decode.) `--mtp-draft` defaults to DEFAULT_DRAFT: on random weights
the acceptance is about 0 and nothing pays; on the real model ds4 and vLLM report 80-90 % for
the first draft, and with the verify costs `ds4-bench --mtp` measures, 2 drafts is where the
expected speed-up stops growing at a = 0.8 (docs/performance.md).
"""
from __future__ import annotations

import argparse

from .runtime.speculative import MAX_DRAFT

DEFAULT_DRAFT = 2


def draft_count(text) -> int:
    """argparse type of --mtp-draft: a whole number 1..MAX_DRAFT, else one line."""
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"--mtp-draft takes a whole number, not {text!r}") from None
    if not 1 <= n <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(f"--mtp-draft is 1..{MAX_DRAFT} tokens, not {n}")
    return n


def add_mtp_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--mtp", metavar="FILE", default=None,
                   help="ds4's MTP file (DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf): draft tokens with it "
                        "and verify them in one pass; the output is the same as without")
    g.add_argument("--mtp-draft", type=draft_count, default=DEFAULT_DRAFT, metavar="N",
                   help=f"tokens the MTP drafts a step (1..{MAX_DRAFT})")
