"""The fast CPU backend: the NumPy reference's ops with every weight matmul on the C kernels
(engine/kernels.py: fused decode-and-multiply straight from the map, multi-threaded).

Only the matmuls change. The activation rounding of ds4 mode (Q8_0 / Q8_K) is still done by the
reference code before the kernel runs, so both numerics modes keep their meaning; the kernels
accumulate in float32 where the reference accumulates in float64, so results differ from the
reference by rounding only (tests/test_ops_cpu.py measures it on whole forward passes).
"""
from __future__ import annotations

import numpy as np

from . import kernels as K
from . import numerics as N
from . import quants as Q
from .model_file import QTensor
from .ops_numpy import NumpyOps

_KERNEL_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4})


class CpuOps(NumpyOps):
    name = "cpu"

    def _mm(self, w: QTensor, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        data = w.data if rows is None else w.data[rows]
        if w.type_id not in _KERNEL_TYPES:
            return Q.matvec(w.type_id, data, np.asarray(x, np.float32).T, accumulate=np.float64).T
        x = np.ascontiguousarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        y = K.matmul(w.type_id, data, x[None] if squeeze else x)
        return y[0] if squeeze else y

    def linear(self, w: QTensor, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        if self.ds4 and w.type_id == Q.Q8_0:
            x = N.q8_0_round(x)
        return self._mm(w, x, rows)

    def expert_linear(self, w: QTensor, x_rounded: np.ndarray) -> np.ndarray:
        return self._mm(w, x_rounded)


def available() -> bool:
    return K.available()
