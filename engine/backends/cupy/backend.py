"""Registration of the cupy backend: the forward pass on a CUDA GPU through CuPy, with the CUDA
kernels of cuda_kernels/ (docs/cuda.md). `auto` takes it where CuPy sees a CUDA device. With
DS4_CUDA_EMULATE=1 it serves without one, on the NumPy-backed stand-in and the kernels' host
emulation, when named only (`--backend cupy`): slow, for tiny models, and it needs a C++ compiler.
"""
from __future__ import annotations

from ...errors import BackendError
from ..registry import Backend
from . import device


def _make_ops(numerics: str):
    try:
        xp = device.namespace()
    except Exception as e:          # CuPy installed but its CUDA libraries missing, ...
        raise BackendError(f"backend 'cupy' is not available: cupy cannot be imported ({e}); "
                           f"pip install 'ds4-agent[cuda]'".splitlines()[0]) from None
    from .kernels import load
    from .ops import CupyOps
    try:
        kernels = load(xp)
    except Exception as e:          # a kernel that does not build is one line, not a traceback
        raise BackendError(f"backend 'cupy': the CUDA kernels do not build: {e}".splitlines()[0]) from None
    return CupyOps(numerics, xp, kernels)


BACKEND = Backend(
    name="cupy", summary="a CUDA GPU through CuPy (DS4_CUDA_EMULATE=1: the host emulation)",
    available=device.why_not, make_ops=_make_ops, priority=30,
    # the emulation serves only when named: auto never takes a host emulation for a GPU
    in_auto=lambda: not device.emulated(),
    # the weights are read once, sequentially, into device memory at open: no prefault of the map
    default_paging="none")
