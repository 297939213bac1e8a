"""The MTP flags every command that generates shares: `--mtp FILE` and `--mtp-draft N`.

(A module of its own beside engine/options.py: the file is not an engine option of every
command, only of those that decode.) `--mtp-draft` defaults to DEFAULT_DRAFT, from what
`ds4-bench --mtp` measures on the cpu backend's real-width 4-layer file: with the verify costs
there (2 / 3 / 4 / 5 rows at 1.18 / 1.62 / 1.93 / 2.33x a row's CPU time: the rows' routed experts
are each row's own) and a draft at ~9 % of a 43-layer step, 1 draft has the best expected
speed-up at the 80 % acceptance vLLM measured for R1's MTP (1.42x against 1.36 / 1.34 / 1.25x for
2-4 drafts) and ties at 85 %; only from ~90 % do 2-3 drafts gain a few per cent, and the MTP block
predicts one token ahead, so chained drafts are accepted less than the first. With the true
continuation as drafts (acceptance 100 %) more drafts pay (docs/performance.md, "the multi-token
step after the multi-row kernels").
"""
from __future__ import annotations

import argparse

DEFAULT_DRAFT = 1
MAX_DRAFT = 16      # (ds4's cap; engine/runtime/speculative.py takes it from here: this module loads no compute code)


def draft_count(text) -> int:
    """argparse type of --mtp-draft: a whole number 1..MAX_DRAFT, else one line."""
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"--mtp-draft takes a whole number, not {text!r}") from None
    if not 1 <= n <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(f"--mtp-draft is 1..{MAX_DRAFT} tokens, not {n}")
    return n


def add_mtp_flags(parser: argparse.ArgumentParser, config_keys: bool = False) -> None:
    """config_keys: the agent's flags, whose defaults come from config.toml (`mtp`, `mtp_draft`;
    resolve_mtp): the flags then default to None."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--mtp", metavar="FILE", default=None,
                   help="ds4's MTP file (DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf): draft tokens with it "
                        "and verify them in one pass; the output is the same as without")
    g.add_argument("--mtp-draft", type=draft_count, default=None if config_keys else DEFAULT_DRAFT, metavar="N",
                   help=f"tokens the MTP drafts a step (1..{MAX_DRAFT}; default {DEFAULT_DRAFT}"
                        + (", or `mtp_draft` in the config)" if config_keys else ")"))


def resolve_mtp(a, cfg: dict) -> tuple[str | None, int]:
    """(the MTP file or None, drafts a step) from the agent's flags, else its config.toml keys
    `mtp` (what `ds4-agent download mtp` records) and `mtp_draft`. A bad value: ValueError, one line."""
    path = a.mtp or cfg.get("mtp")
    if path is not None and not isinstance(path, str):
        raise ValueError(f"mtp in the config must be a file's path, not {path!r}")
    n = a.mtp_draft
    if n is None:
        try:
            n = draft_count(cfg.get("mtp_draft", DEFAULT_DRAFT))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"mtp_draft in the config: {e}") from None
    return path, n
