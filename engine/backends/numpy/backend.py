"""Registration of the NumPy reference backend: every op in float32/float64 NumPy, the referee of
every other backend (tests/test_backend_conformance.py)."""
from __future__ import annotations

from ..host import blas_threads
from ..registry import Backend


def _setup(threads: int | None) -> None:
    if threads:
        from ..cpu import kernels       # the kernels' thread count is process-wide: keep it in step
        kernels.set_threads(threads)
        blas_threads(threads)


def _make_ops(numerics: str):
    from .ops import NumpyOps
    return NumpyOps(numerics)


BACKEND = Backend(
    name="numpy", summary="the NumPy reference (float64 sums; slow, the referee)",
    available=lambda: None, make_ops=_make_ops, priority=10, default_paging="prefault", setup=_setup)
