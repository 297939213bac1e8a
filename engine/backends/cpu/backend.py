"""Registration of the cpu backend: the NumPy reference's ops with the weight matmuls and the hot
non-matmul ops in C (engine.backends.cpu._kernels, multi-threaded)."""
from __future__ import annotations

from ..host import blas_threads, keep_freed_memory
from ..registry import Backend


def _available() -> str | None:
    from . import kernels
    if kernels.available():
        return None
    return ("backend 'cpu' needs the C kernels (engine.backends.cpu._kernels), which were not built "
            "at install time (no C compiler?); use --backend numpy")


def _setup(threads: int | None) -> None:
    from . import kernels
    if threads:
        kernels.set_threads(threads)
    # The kernels' OpenMP threads own the cores: OpenBLAS threads left spinning after a NumPy call
    # (an einsum between two kernel calls) would take a core from a kernel worker, and every
    # kernel barrier would wait a scheduler tick. So BLAS runs on one thread.
    blas_threads(1)
    keep_freed_memory()


def _make_ops(numerics: str):
    from .ops import CpuOps
    return CpuOps(numerics)


BACKEND = Backend(
    name="cpu", summary="C kernels for the matmuls and hot ops (AVX-512/AVX2/generic), threaded",
    available=_available, make_ops=_make_ops, priority=20,
    # every weight is streamed once a token: from huge pages (GGUFFile.load_resident) that is faster
    default_paging="resident", setup=_setup,
    # taken from the NumPy reference on purpose: cheap elementwise ops, the indexer's rounding and
    # its float64 scores (exact ties at the top-k boundary are common: only the same sums in the
    # same order pick the same rows), and the host glue (weights, state, embedding, logits)
    reference_ops=frozenset({"sigmoid", "softplus", "softmax", "store_index", "index_qat", "indexer_scores",
                             "topk_lowest_index", "bind_weights", "new_state", "state_to_host", "state_from_host", "embed",
                             "logits_to_host"}))
