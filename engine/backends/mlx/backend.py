"""Registration of the mlx backend (Apple Silicon). Its ops come with issue 20; until then the
name is known, `auto` passes it over, and naming it says why it cannot serve."""
from __future__ import annotations

from ..registry import planned

BACKEND = planned("mlx", package="mlx", extra="mlx", summary="Apple Silicon GPU through MLX",
                  priority=40, comes_with="issue 20")
