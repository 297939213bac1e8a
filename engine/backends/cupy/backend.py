"""Registration of the cupy backend (a CUDA device). Its ops come with a later issue; until then
the name is known, `auto` passes it over, and naming it says why it cannot serve."""
from __future__ import annotations

from ..registry import planned

BACKEND = planned("cupy", package="cupy", extra="cuda", summary="a CUDA GPU through CuPy",
                  priority=30, comes_with="a later issue")
