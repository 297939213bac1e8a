"""Registration of the mlx backend (Apple Silicon). Its ops come with issue 20; until then the
name is known, `auto` passes it over, and naming it says why it cannot serve."""
from __future__ import annotations

import importlib.util

from ...errors import BackendError
from ..registry import Backend

_NOT_YET = "the mlx backend is not built yet (issue 20)"


def _available() -> str | None:
    if importlib.util.find_spec("mlx") is None:
        return "mlx is not installed (pip install 'ds4-agent[mlx]')"
    return _NOT_YET


def _make_ops(numerics: str):
    raise BackendError(f"backend 'mlx' is not available: {_NOT_YET}")


BACKEND = Backend(name="mlx", summary="Apple Silicon GPU through MLX", available=_available,
                  make_ops=_make_ops, priority=40, default_paging="prefault")
