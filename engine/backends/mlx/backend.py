"""Registration of the mlx backend: the forward pass in mlx.core, with custom Metal kernels on
Apple Silicon (IQ2_XXS / Q2_K expert matvecs, HC Sinkhorn split, decode attention, top-k).

`auto` takes it first on Apple Silicon. Elsewhere MLX runs on its CPU device (`pip install
'mlx[cpu]'` on Linux): it serves when named (`--backend mlx`), which is how CI tests it, but `auto`
prefers the cpu backend's C kernels there.
"""
from __future__ import annotations

import importlib.util
import platform

from ...errors import BackendError
from ..registry import Backend


def apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def _available() -> str | None:
    # (no import here: the registry asks every entry, and mlx.core is heavy)
    if importlib.util.find_spec("mlx") is None:
        return "mlx is not installed (pip install 'ds4-agent[mlx]')"
    return None


def _make_ops(numerics: str):
    try:            # a Linux 'pip install mlx' without [cpu] installs a package that cannot load
        import mlx.core  # noqa: F401
    except Exception as e:
        raise BackendError(f"backend 'mlx' is not available: mlx cannot be imported ({e}); "
                           f"pip install 'ds4-agent[mlx]'") from None
    from .ops import MlxOps
    return MlxOps(numerics)


BACKEND = Backend(
    name="mlx", summary="MLX (Apple Silicon GPU with Metal kernels; the CPU device elsewhere)",
    available=_available, make_ops=_make_ops,
    # off Apple Silicon MLX has only its CPU device: auto takes cpu (20), even numpy (10), first
    priority=40 if apple_silicon() else 5,
    # the weights are read once, sequentially, into MLX memory at open (and the map's pages let go
    # tensor by tensor): the kernel's readahead is all that helps; a prefault would hold the whole
    # file in this process besides the copy
    default_paging="none")
