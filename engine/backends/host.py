"""Process set-up shared by the host backends (numpy, cpu): BLAS thread pools and glibc's
allocator. Each backend's `setup(threads)` calls what it needs from here."""
from __future__ import annotations


def blas_threads(n: int):
    from threadpoolctl import threadpool_limits
    threadpool_limits(n, user_api="blas")


def keep_freed_memory() -> bool:
    """glibc: serve every allocation from the heap and keep freed memory there. By default an
    array over the mmap threshold (at most 32 MiB) is a fresh mapping, and every page of it faults
    and is zeroed by the kernel on first touch: at a 512-token prefill the [T, 4, 4096] streams
    are 33.5 MiB each, and clear_page was 10 % of the run. Reused heap memory faults once.
    (Nothing happens on other C libraries.)"""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
