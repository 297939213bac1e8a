"""The MTP flags every command that generates shares: `--mtp FILE` and `--mtp-draft N`.

(A module of its own beside engine/options.py: the file is not an engine option of every
command, only of those that decode.) `--mtp-draft` defaults to DEFAULT_DRAFT, measured: with the
true continuation as drafts (acceptance 100 %), `ds4-bench --mtp` on the cpu backend's real-width
4-layer file gave the most tokens per second at 1 draft in three runs (1.26-1.33x plain decoding;
2 drafts 0.95-1.23x, 3: 0.82-1.31x, 4: 0.68-1.14x), since a T-row verify step there costs about
T x 0.3-0.55 of a step more (the rows' routed experts are each row's own). At the 80 %
acceptance vLLM reports for real weights 1 draft is also the best expected speed-up at those costs
(1.27x against 1.24x for 2 and 1.18x for 3, a full-model draft at ~9 % of a step); at 90 %, 2-3
drafts gain ~3 % more (docs/performance.md, "the multi-token step after the multi-row kernels").
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
