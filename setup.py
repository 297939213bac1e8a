"""Build of the optional C extension engine._kernels (fast CPU matmul/dequantization kernels).

Everything else about the package is in pyproject.toml.  The extension is optional: without a
working C compiler the package still installs and engine.kernels falls back to NumPy.  Flags are
portable (no -march=native): the AVX2 and AVX-512 kernels are compiled with per-file
`#pragma GCC target` and chosen at run time.  -ffp-contract=off keeps the dequantizers bit-exact
with engine/quants.py; OpenMP is used when the compiler accepts -fopenmp.
"""
import os
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = [
    "engine/_kernels.c",
    "engine/csrc/kern_tables.c",
    "engine/csrc/kern_generic.c",
    "engine/csrc/kern_avx2.c",
    "engine/csrc/kern_avx512.c",
    "engine/csrc/kern_q8.c",
]
CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"]
OPENMP = ["-fopenmp"]


class BuildExt(build_ext):
    def _accepts(self, flags):
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "t.c")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 0; }\n")
            try:
                objs = self.compiler.compile([src], output_dir=d, extra_postargs=flags)
                self.compiler.link_executable(objs, os.path.join(d, "t"), extra_postargs=flags)
            except Exception:
                return False
        return True

    def build_extensions(self):
        omp = OPENMP if self._accepts(OPENMP) else []
        for ext in self.extensions:
            ext.extra_compile_args = CFLAGS + omp
            ext.extra_link_args = omp
        super().build_extensions()


setup(
    ext_modules=[Extension("engine._kernels", SOURCES, depends=[
        "engine/csrc/kern.h", "engine/csrc/kern_dequant_body.h", "engine/csrc/kern_simd_body.h",
    "engine/csrc/kern_q8_body.h"],
        optional=True)],
    cmdclass={"build_ext": BuildExt},
)
