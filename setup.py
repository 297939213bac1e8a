"""Build of the optional C extension engine.backends.cpu._kernels (fast CPU matmul/dequantization kernels).

Everything else about the package is in pyproject.toml.  The extension is optional: without a
working C compiler the package still installs and engine.backends.cpu.kernels falls back to NumPy.  Flags are
portable (no -march=native): the AVX2 and AVX-512 kernels are compiled with per-file
`#pragma GCC target` and chosen at run time.  -ffp-contract=off keeps the dequantizers bit-exact
with engine/gguf/quants.py; OpenMP is used when the compiler accepts -fopenmp.
"""
import importlib.util
import os
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# the file list and the source hash live in engine/backends/cpu/kernel_sources.py (loaded by path: the build
# environment has neither numpy nor the engine package)
ROOT = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("kernel_sources", os.path.join(ROOT, "engine", "backends", "cpu", "kernel_sources.py"))
_ks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ks)
SOURCES, DEPENDS = _ks.SOURCES, _ks.DEPENDS
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
        stamp = [f'-DDS4_KERNELS_SRC_HASH="{_ks.source_hash(ROOT) or ""}"']
        for ext in self.extensions:
            ext.extra_compile_args = CFLAGS + omp + stamp
            ext.extra_link_args = omp
        super().build_extensions()


setup(
    ext_modules=[Extension("engine.backends.cpu._kernels", SOURCES, depends=DEPENDS, optional=True)],
    cmdclass={"build_ext": BuildExt},
)
