"""Host emulation of CUDA kernels: cuda_kernels/*.cu compiled as C++ (g++) and run on the CPU.

The part of cupy.RawModule the backend uses, on NumPy arrays: `load_module(code=... | path=...)`,
`module.get_function(name)`, `fn(grid, block, args, shared_mem=0)`. Arguments follow CuPy's
RawKernel: arrays are passed by pointer and written in place, scalars must be NumPy scalars of
the kernel parameter's exact type (checked here: CuPy would pass a wrong one silently).

How it runs (emu_support/): cuda_emu.h maps the CUDA vocabulary onto the fiber core shared with
the Metal emulation (fibers.h: a fiber per thread, one block at a time, strict __syncthreads and
warp collectives; __shared__ memory poisoned before every block); every array is copied into a
buffer that ends at a guard page (one array passed twice is one buffer); each launch runs
with SIGSEGV caught (a stray read or write is an error, not a crash of the caller); and twice, with
the threads of a block scheduled first to last and last to first: results that differ mean a
missing barrier. For tiny models only (DS4_CUDA_EMULATE=1): it is slow, and needs g++.

Environment: DS4_CUDA_EMU_ORDERS=1 runs one order only (half the time, no barrier check);
DS4_CUDA_EMU_ISOLATE=1 runs each launch in a forked child (about 10 ms a launch; a wild write that
hits no guard page then cannot reach this process's memory either).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np

from ..kernel_sources import kernel_dir

SUPPORT = Path(__file__).resolve().parent / "emu_support"
_SUPPORT_FILES = ("fibers.h", "cuda_emu.h", "cuda_fp16.h", "launch.inc")
# the C types of kernel parameters and the NumPy types that match them
_CTYPES = {
    "float": np.float32, "double": np.float64, "int": np.int32, "unsigned int": np.uint32,
    "unsigned": np.uint32, "long long": np.int64, "unsigned long long": np.uint64,
    "unsigned char": np.uint8, "signed char": np.int8, "char": np.int8, "short": np.int16,
    "unsigned short": np.uint16, "__half": np.float16, "int32_t": np.int32, "uint32_t": np.uint32,
    "uint8_t": np.uint8, "int8_t": np.int8, "int64_t": np.int64, "uint16_t": np.uint16,
}
_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                        r'(\w+)\s*\(([^)]*)\)')
ERRLEN = 4096

launches: Counter = Counter()      # kernel name -> launches run (the backend's tests read it)
_LOCK = threading.Lock()


class EmulationError(RuntimeError):
    pass


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


class Param:
    """One kernel parameter: its C type text, NumPy dtype, pointer or not, const or not."""

    def __init__(self, text: str):
        words = text.replace("*", " * ").replace("__restrict__", " ").split()
        if len(words) < 2:
            raise EmulationError(f"cannot read kernel parameter {text!r}")
        self.name = words[-1]
        self.pointer = "*" in words
        self.const = "const" in words[:words.index("*")] if self.pointer else False
        base = " ".join(w for w in words[:-1] if w not in ("const", "*"))
        if base not in _CTYPES:
            raise EmulationError(f"kernel parameter type {base!r} is not one the emulation maps")
        self.dtype = np.dtype(_CTYPES[base])
        self.ctype = " ".join(w for w in words[:-1])      # as declared, without __restrict__
        self.ctype = self.ctype.replace(" *", "*")


def parse_kernels(src: str) -> dict[str, list[Param]]:
    """name -> parameters of every `extern "C" __global__` kernel in src (preprocessed: kernels
    that a macro stamps out per format are found too)."""
    out = {}
    for m in _KERNEL_RE.finditer(src):
        params = [p.strip() for p in m.group(2).split(",") if p.strip() and p.strip() != "void"]
        out[m.group(1)] = [Param(p) for p in params]
    return out


def _preprocess(src: str, dirs: list[Path]) -> str:
    """src after the C preprocessor (its includes and macros), with the CUDA keywords kept."""
    r = subprocess.run([compiler(), "-x", "c++", "-std=c++20", "-E", "-P", "-I", str(SUPPORT),
                        *[a for d in dirs for a in ("-I", str(d))], "-"], input=src, capture_output=True, text=True)
    if r.returncode != 0:
        raise EmulationError("the preprocessor failed:\n" + r.stderr[-4000:])
    return r.stdout


def _generate(src: str, label: str, kernels: dict[str, list[Param]]) -> str:
    parts = [f'#line 1 "{label}"', src, "#line 1 \"<emu entries>\""]
    for name, params in kernels.items():
        call = ", ".join(f"*static_cast<{p.ctype}*>(a[{i}])" for i, p in enumerate(params))
        parts.append(f"static void emu_entry_{name}(void** a) {{ (void)a; {name}({call}); }}")
    parts.append("struct EmuEntry { const char* name; void (*fn)(void**); };")
    parts.append("static const EmuEntry EMU_ENTRIES[] = {" + ", ".join(
        f'{{"{n}", emu_entry_{n}}}' for n in kernels) + (", " if kernels else "") + "{nullptr, nullptr}};")
    parts.append('#include "launch.inc"')
    return "\n".join(parts) + "\n"


def _include_dirs(path: Path | None, options) -> list[Path]:
    """-I folders of the options first (so a test can shadow a header), then the source's own
    folder, then cuda_kernels/ (its common.cuh)."""
    dirs = []
    opts = list(options)
    for i, o in enumerate(opts):
        if o == "-I" and i + 1 < len(opts):
            dirs.append(Path(opts[i + 1]))
        elif o.startswith("-I") and len(o) > 2:
            dirs.append(Path(o[2:]))
    if path is not None:
        dirs.append(Path(path).resolve().parent)
    dirs.append(Path(str(kernel_dir("cuda_kernels"))))
    return dirs


def build(src: str, path: Path | None = None, options=(), cache: Path | None = None,
          opt: str = "-O1") -> tuple[Path, dict[str, list[Param]]]:
    """The shared library for one kernel source (cached by the hash of everything it includes)
    and its kernels' parameters."""
    if compiler() is None:
        raise EmulationError("the CUDA emulation needs a C++ compiler (g++) on PATH")
    label = str(path) if path is not None else "<code>"
    dirs = _include_dirs(path, options)
    key = hashlib.sha256()
    for text in [opt, label, src, *[(SUPPORT / f).read_text() for f in _SUPPORT_FILES]]:
        key.update(text.encode())
    for d in dirs:                  # headers the source may include
        for h in sorted(d.glob("*.cuh")) if d.is_dir() else ():
            key.update(h.read_bytes())
    cache = cache or Path(tempfile.gettempdir()) / f"ds4_cuda_emu_{os.getuid()}"
    cache.mkdir(parents=True, exist_ok=True)
    lib, sig = cache / f"kern_{key.hexdigest()[:16]}.so", cache / f"kern_{key.hexdigest()[:16]}.sig"
    if lib.exists() and sig.exists():
        return lib, parse_kernels(sig.read_text())
    kernels = parse_kernels(_preprocess(src, dirs))
    decls = "\n".join(f'extern "C" __global__ void {n}({", ".join(p.ctype + " " + p.name for p in ps)});'
                      for n, ps in kernels.items())
    cpp = cache / f"gen_{key.hexdigest()[:16]}_{os.getpid()}.cpp"
    cpp.write_text(_generate(src, label, kernels))
    tmp = f"{lib}.{os.getpid()}.tmp"
    cmd = [compiler(), "-std=c++20", opt, "-fPIC", "-shared", "-ffp-contract=off", "-U_FORTIFY_SOURCE", "-w",
           "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fno-gnu-unique",
           "-I", str(SUPPORT),
           *[a for d in dirs for a in ("-I", str(d))], "-include", str(SUPPORT / "cuda_emu.h"), str(cpp), "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    cpp.unlink(missing_ok=True)
    if r.returncode != 0:
        raise EmulationError(f"g++ failed on {label}:\n" + r.stderr[-6000:])
    _write(sig, decls)
    os.replace(tmp, lib)
    return lib, kernels


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_module(code: str | None = None, path: str | Path | None = None, options=(), opt: str = "-O1") -> "Module":
    """cupy.RawModule(code=...) or (path=...), emulated (opt: g++'s optimisation level)."""
    if (code is None) == (path is None):
        raise ValueError("load_module: give code or path, not both")
    src = Path(path).read_text() if code is None else code
    lib, kernels = build(src, Path(path) if path is not None else None, options, opt=opt)
    return Module(lib, kernels)


class Module:
    def __init__(self, lib: Path, kernels: dict[str, list[Param]]):
        self._lib = ctypes.CDLL(str(lib))
        self._lib.emu_alloc.restype = ctypes.c_void_p
        self._lib.emu_alloc.argtypes = [ctypes.c_size_t]
        self._lib.emu_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._lib.emu_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p,
                                         ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        self.kernels = kernels

    def get_function(self, name: str) -> "Function":
        if name not in self.kernels:
            raise EmulationError(f"no kernel {name!r} in this module (has {', '.join(self.kernels)})")
        return Function(self, name, self.kernels[name])


def _dims(v, what: str) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(v) <= 3 or any(int(d) < 1 for d in v):
        raise EmulationError(f"invalid launch configuration: {what} {v}")
    return tuple(int(d) for d in v) + (1,) * (3 - len(v))


class Function:
    """One kernel: fn(grid, block, args, shared_mem=0), as cupy.RawKernel."""

    def __init__(self, module: Module, name: str, params: list[Param]):
        self.module, self.name, self.params = module, name, params

    def _check(self, args) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        for p, a in zip(self.params, args):
            if p.pointer:
                if not isinstance(a, np.ndarray):
                    raise TypeError(f"{self.name}: {p.name} is a pointer; pass an array, not {type(a).__name__}")
                if a.dtype != p.dtype or not a.flags.c_contiguous:
                    raise TypeError(f"{self.name}: {p.name} wants a contiguous {p.dtype} array, "
                                    f"got {a.dtype}{'' if a.flags.c_contiguous else ' (not contiguous)'}")
            elif not isinstance(a, np.generic) or a.dtype != p.dtype:
                raise TypeError(f"{self.name}: {p.name} wants a NumPy {p.dtype} scalar, got {type(a).__name__}")

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        args = tuple(args)
        self._check(args)
        if shared_mem:
            raise EmulationError(f"{self.name}: dynamic shared memory is not emulated (kernels use static)")
        g, b = _dims(grid, "grid"), _dims(block, "block")
        if b[0] * b[1] * b[2] > 1024:
            raise EmulationError(f"invalid launch configuration: block {b} has over 1024 threads")
        launches[self.name] += 1
        with _LOCK:                         # one emulated GPU: the C++ runtime is a process singleton
            return self._launch(g + b, args)

    def _launch(self, dims, args) -> None:
        """Copies every distinct array into a guarded buffer (one array passed twice is one buffer,
        as on the device; arrays that only partly overlap are refused) and runs the launch."""
        lib = self.module._lib
        uniq, where = [], {}                # distinct arrays; argument index -> index in uniq
        for i, (p, a) in enumerate(zip(self.params, args)):
            if not p.pointer:
                continue
            key = (a.__array_interface__["data"][0], a.nbytes)
            keys = [k for k, _, _ in uniq]
            if key in keys:
                u = keys.index(key)
                uniq[u][2] = uniq[u][2] and p.const      # written if any argument writes it
            else:
                u = len(uniq)
                uniq.append([key, a, p.const])
            where[i] = u
        spans = sorted((k[0], k[0] + k[1]) for k, _, _ in uniq if k[1])
        if any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:])):
            raise EmulationError(f"{self.name}: two array arguments overlap without being the same array")
        bufs = [lib.emu_alloc(a.nbytes) for _, a, _ in uniq]
        if not all(bufs):
            raise MemoryError("emu_alloc failed")
        try:
            return self._run(lib, dims, args, uniq, where, bufs)
        finally:
            for p, (_, a, _) in zip(bufs, uniq):
                lib.emu_free(p, a.nbytes)

    def _run(self, lib, dims, args, uniq, where, bufs) -> None:
        holders = []                        # the argument values the void** slots point at
        slots = (ctypes.c_void_p * max(1, len(args)))()
        for i, (p, a) in enumerate(zip(self.params, args)):
            h = ctypes.c_void_p(bufs[where[i]]) if p.pointer else np.array(a, dtype=p.dtype)
            holders.append(h)
            slots[i] = ctypes.addressof(h) if p.pointer else h.ctypes.data
        cdims = (ctypes.c_uint * 6)(*dims)
        err = ctypes.create_string_buffer(ERRLEN)
        isolate = os.environ.get("DS4_CUDA_EMU_ISOLATE", "0") == "1"
        orders = (1, 0) if os.environ.get("DS4_CUDA_EMU_ORDERS", "2") != "1" else (0,)
        written = [(u, a) for u, (_, a, const) in enumerate(uniq) if not const]
        results = []
        for reverse in orders:              # last to first, then first to last (the one kept)
            for (_, a, _), p in zip(uniq, bufs):
                ctypes.memmove(p, a.ctypes.data, a.nbytes)
            rc = lib.emu_launch(self.name.encode(), cdims, slots, reverse, int(isolate), err, ERRLEN)
            if rc:
                raise EmulationError(f"{self.name} failed: {err.value.decode(errors='replace')}")
            results.append([ctypes.string_at(bufs[u], a.nbytes) for u, a in written])
        if results[0] != results[-1]:
            raise EmulationError(f"{self.name}: the result depends on the order threads run in (a missing barrier?)")
        for (u, a), data in zip(written, results[-1]):
            a.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
