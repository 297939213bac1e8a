"""Where the cupy backend runs: a CUDA device through CuPy, or (DS4_CUDA_EMULATE=1) the host
emulation through the NumPy-backed stand-in. Cheap to import: the registry asks `why_not()` of
every entry, so nothing here loads CuPy or touches a driver beyond one libcuda call.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import shutil

EMULATE_ENV = "DS4_CUDA_EMULATE"


def emulated() -> bool:
    """DS4_CUDA_EMULATE=1: the backend runs on the stand-in (slow; tiny models only)."""
    return os.environ.get(EMULATE_ENV, "").strip() == "1"


def compiler() -> str | None:
    """The C++ compiler the emulation builds the kernels with (CXX, else c++ / g++ / clang++)."""
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


@functools.lru_cache(maxsize=1)
def cuda_devices() -> int | str:
    """The number of CUDA devices the driver sees, or why none can be asked (one line)."""
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cu = ctypes.CDLL(lib)
            break
        except OSError:
            continue
    else:
        return "no NVIDIA driver (libcuda not found)"
    n = ctypes.c_int(0)
    if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return "the NVIDIA driver found no usable device (cuInit failed)"
    return n.value


def why_not() -> str | None:
    """None when the backend can serve here, else the reason (one line)."""
    if emulated():
        if compiler() is None:
            return f"{EMULATE_ENV}=1 runs the CUDA kernels as host C++ and needs a C++ compiler (g++ not found)"
        return None
    hint = f"no GPU: {EMULATE_ENV}=1 runs it on the host emulation, tiny models only"
    if importlib.util.find_spec("cupy") is None:
        return f"cupy is not installed (pip install 'ds4-agent[cuda]'; {hint})"
    n = cuda_devices()
    if isinstance(n, str):
        return f"no CUDA device: {n} ({hint})"
    if n == 0:
        return f"no CUDA device ({hint})"
    return None


def namespace():
    """The array namespace: the stand-in when emulated, else cupy."""
    if emulated():
        from . import standin
        return standin
    import cupy
    return cupy
