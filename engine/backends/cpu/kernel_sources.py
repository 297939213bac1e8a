"""The C extension's source files and their hash (standard library only: setup.py loads this file
by path in the build environment, where numpy and the engine package are not importable).

setup.py compiles the hash into engine.backends.cpu._kernels (its `source_hash`); engine.backends.cpu.kernels compares it
with the sources next to the package, so a checkout whose extension failed to rebuild (it is an
optional extension: pip install succeeds and keeps the old binary) is noticed instead of tested."""
from __future__ import annotations

import hashlib
import os

SOURCES = [
    "engine/backends/cpu/csrc/binding.c",
    "engine/backends/cpu/csrc/sched.c",
    "engine/backends/cpu/csrc/ops.c",
    "engine/backends/cpu/csrc/ops_ds4.c",
    "engine/backends/cpu/csrc/kern_tables.c",
    "engine/backends/cpu/csrc/kern_generic.c",
    "engine/backends/cpu/csrc/kern_avx2.c",
    "engine/backends/cpu/csrc/kern_avx512.c",
    "engine/backends/cpu/csrc/kern_q8.c",
    "engine/backends/cpu/csrc/mrow_f16.c",
    "engine/backends/cpu/csrc/mrow_q8.c",
]
DEPENDS = [
    "engine/backends/cpu/csrc/module.h",
    "engine/backends/cpu/csrc/mrow_transpose.h",
    "engine/backends/cpu/csrc/kern.h",
    "engine/backends/cpu/csrc/kern_dequant_body.h",
    "engine/backends/cpu/csrc/kern_simd_body.h",
    "engine/backends/cpu/csrc/kern_q8_body.h",
    "engine/backends/cpu/csrc/kern_gemm_body.h",
    "engine/backends/cpu/csrc/kern_gemm_avx2.h",
    "engine/backends/cpu/csrc/kern_iq2_vbmi.h",
]


def source_hash(root: str) -> str | None:
    """16 hex digits of sha256 over every source and header (paths relative to the project root
    `root`); None when a file is missing (the wheel ships them beside the package, so an installed
    copy checks its build too)."""
    h = hashlib.sha256()
    for rel in sorted(SOURCES + DEPENDS):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                h.update(rel.encode() + b"\0" + f.read())
        except OSError:
            return None
    return h.hexdigest()[:16]
