"""How the engine runs, as one value: `EngineOptions` and the flags every command shares.

`ds4`, `ds4-agent` (and its `--serve`), `ds4-bench` and the scripts all call `add_engine_flags()`
on their parser and `EngineOptions.from_args()` on the result, so a choice is spelled, checked
and documented once. `Engine.open(path, options=...)` takes the value.

"numerics" is the one name of the arithmetic a backend follows, in options, on Engine and on
every ops object: "ds4" (ds4's own rounding steps, what the published model was run with) or
"exact" (plain float32, as transformers computes it: the golden references). The two names are
defined beside ds4's rounding math, in engine/model/numerics.py.
Backend names are not listed here: the registry in `engine.backends` owns them and
`Engine.open` checks them, so a new backend needs no edit to this file.

Nothing here loads compute code: the registry's entries are cheap to import, so a command's
parser is built before any model or kernel is touched.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from .model.numerics import DS4, EXACT, NUMERICS

__all__ = ["DS4", "EXACT", "NUMERICS", "PAGING", "EngineOptions", "add_engine_flags"]

MAX_THREADS = 1024     # the C kernels' own limit, checked here too: before the agent's UI starts

# auto: DS4_PAGING if set, else by the file's size against the memory and by backend
PAGING = ("auto", "resident", "prefault", "lowmem", "none")


@dataclass(frozen=True)
class EngineOptions:
    """backend: a registered name or "auto" (DS4_BACKEND if set, else the best available);
    numerics: one of NUMERICS; paging: one of PAGING; threads: compute threads, None for the
    backend's default. Construction checks every field; a bad one is a ValueError of one line."""
    backend: str = "auto"
    numerics: str = DS4
    paging: str = "auto"
    threads: int | None = None
    # a split across ranks under mlx.launch (engine/runtime/split_engine.py): None, "auto" or "a:b,c:d,..."
    layers: str | None = None
    # the routed experts' bounded cache (engine/gguf/expert_cache.py): None off, "auto", or bytes
    expert_cache: int | str | None = None

    def __post_init__(self):
        if self.layers is not None:
            from .model.layer_split import check_spec
            check_spec(self.layers)
        if not isinstance(self.backend, str) or not self.backend.strip():
            raise ValueError(f"backend must be a backend's name or 'auto', not {self.backend!r}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, not {self.numerics!r}")
        if self.paging not in PAGING:
            raise ValueError(f"paging must be one of {', '.join(PAGING)}, not {self.paging!r}")
        t = self.threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_THREADS):
            raise ValueError(f"threads must be a whole number from 1 to {MAX_THREADS}, not {t!r}")
        if self.expert_cache is not None:
            from .gguf.expert_cache import parse_size
            object.__setattr__(self, "expert_cache", parse_size(self.expert_cache))

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "EngineOptions":
        """The options from a namespace parsed by a parser that add_engine_flags() set up."""
        return cls(layers=getattr(ns, "layers", None),
                   backend=ns.backend, numerics=ns.numerics, paging=ns.paging, threads=ns.threads,
                   expert_cache=getattr(ns, "expert_cache", None))

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self) -> str:
        """The backend these options resolve to ("auto" included), or engine.errors.BackendError
        (one line) when it is unknown, cannot serve here or lacks these numerics: what Engine.open
        checks, without reading a file, so a command can refuse before it starts a UI or writes
        anything."""
        from .backends import registry
        from .errors import BackendError
        entry = registry.pick(self.backend)
        if self.numerics not in entry.numerics:
            raise BackendError(f"backend {entry.name!r} does not support numerics {self.numerics!r} "
                               f"(it has: {', '.join(entry.numerics)})")
        return entry.name


def add_engine_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--backend, --numerics, --paging and --threads, in a group of their own. Values are checked
    by EngineOptions (not by argparse choices) so a bad one is one `error:` line and exit 1 in
    every command, as a bad model file is."""
    from .backends import registry
    d = EngineOptions()
    g = parser.add_argument_group("engine")
    g.add_argument("--backend", default=d.backend, metavar="NAME",
                   help=f"compute backend: {', '.join(registry.names())}, best first; auto (default) takes "
                        "$DS4_BACKEND if set, else the best that can serve here")
    g.add_argument("--numerics", default=d.numerics, metavar="{" + ",".join(NUMERICS) + "}",
                   help="ds4: ds4's own rounding steps, as the model was run (default); "
                        "exact: plain float32, as transformers computes it")
    g.add_argument("--paging", default=d.paging, metavar="{" + ",".join(PAGING) + "}",
                   help="how the weights reach memory: resident (a copy in huge-page memory), prefault "
                        "(the map populated at open), lowmem (files larger than the memory), none (the "
                        "kernel's defaults); auto (default) takes $DS4_PAGING if set, else picks by the "
                        "file's size and the backend")
    g.add_argument("-t", "--threads", type=int, default=d.threads, metavar="N",
                   help="compute threads (default: the backend's; for cpu $DS4_KERNEL_THREADS, else every "
                        "core this process may use)")
    g.add_argument("--expert-cache", default=None, metavar="SIZE|auto",
                   help="read the routed experts from the file into a cache of SIZE bytes (8G, 512M) "
                        "instead of mapping them: for files larger than the memory; auto: the memory left "
                        "after the other weights and a margin (cpu and numpy backends)")
    g.add_argument("--layers", default=None, metavar="auto|a:b,c:d,...",
                   help="split the model by layers across the ranks mlx.launch starts, one range per rank "
                        "(rank 0 first); auto: by each rank's free memory (docs/distributed.md)")
    return g
