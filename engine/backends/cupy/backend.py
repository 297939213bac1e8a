"""Registration of the cupy backend (a CUDA device). Its ops come with a later issue; until then
the name is known, `auto` passes it over, and naming it says why it cannot serve."""
from __future__ import annotations

import importlib.util

from ...errors import BackendError
from ..registry import Backend

_NOT_YET = "the cupy backend is not built yet (a later issue)"


def _available() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'ds4-agent[cuda]')"
    return _NOT_YET


def _make_ops(numerics: str):
    raise BackendError(f"backend 'cupy' is not available: {_NOT_YET}")


BACKEND = Backend(name="cupy", summary="a CUDA GPU through CuPy", available=_available,
                  make_ops=_make_ops, priority=30, default_paging="prefault")
