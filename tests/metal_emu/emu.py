"""Host emulation of the mlx backend's Metal kernels: wraps each kernel body (the very files that
metal.py hands to mx.fast.metal_kernel) in a C++ function whose parameters are its input and output
names, as MLX's generated signature has them, compiles them all with g++ against metal_compat.h into
one driver program, and runs a kernel on numpy arrays in a child process (so a kernel that reads
past a buffer, which hits a guard page, fails its test instead of the test session).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

import engine
from engine.backends.kernel_sources import kernel_dir
from engine.backends.mlx import metal

HERE = Path(__file__).resolve().parent
CORE = Path(engine.__file__).resolve().parent / "backends" / "cupy" / "emu_support"   # fibers.h, shared with CUDA
KERNEL_DIR = Path(str(kernel_dir("metal_kernels")))

# Metal type of each parameter, as MLX names the dtype of the array passed (metal.py casts to these)
_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.int32): "int32_t", np.dtype(np.uint8): "uint8_t"}
DTYPES = {
    "gather_matvec_decode": dict(raw=np.uint8, x=np.float32, experts=np.int32, toks=np.int32, dims=np.int32,
                                 out=np.float32),
    "gather_matvec_batched": dict(raw=np.uint8, x=np.float32, experts=np.int32, toks=np.int32, perm=np.int32,
                                  chunks=np.int32, dims=np.int32, out=np.float32),
    "hc_split": dict(mix=np.float32, scale=np.float32, base=np.float32, eps=np.float32, iters=np.int32,
                     dims=np.int32, pre=np.float32, post=np.float32, C=np.float32),
    "attention": dict(q=np.float32, keys=np.float32, mask=np.uint8, sinks=np.float32, scale=np.float32,
                      dims=np.int32, out=np.float32),
    "topk": dict(scores=np.float32, dims=np.int32, out=np.int32),
}
# the template values the tests instantiate: entry name -> (kernel, {template name: value})
ENTRIES = {
    "gather_matvec_decode_iq2_xxs": ("gather_matvec_decode", {"KIND": 0}),
    "gather_matvec_decode_q2_k": ("gather_matvec_decode", {"KIND": 1}),
    "gather_matvec_batched_iq2_xxs": ("gather_matvec_batched", {"KIND": 0}),
    "gather_matvec_batched_q2_k": ("gather_matvec_batched", {"KIND": 1}),
    "hc_split": ("hc_split", {"N": 4}),
    "attention": ("attention", {}),
    "topk": ("topk", {}),
}
# MLX's thread attributes (the ones our bodies may use) and their types
_ATTRS = {
    "thread_position_in_grid": ("uint3", "pos_in_grid()"),
    "thread_position_in_threadgroup": ("uint3", "pos_in_tg()"),
    "threadgroup_position_in_grid": ("uint3", "tg_in_grid()"),
    "threads_per_threadgroup": ("uint3", "tg_size()"),
    "thread_index_in_threadgroup": ("uint", "index_in_tg()"),
    "thread_index_in_simdgroup": ("uint", "lane()"),
    "simdgroup_index_in_threadgroup": ("uint", "simdgroup()"),
}


class EmulationError(RuntimeError):
    pass


def compiler() -> str | None:
    return shutil.which("g++")


def _wrapper(entry: str, kernel: str, templ: dict, body_text: str, body_file: Path) -> str:
    _, inputs, outputs = metal.KERNELS[kernel]
    lines = [f"namespace k_{entry} {{"]
    lines += [f"constexpr int {k} = {v};" for k, v in templ.items()]
    lines.append("void body(void** bufs_) {")
    for i, name in enumerate(inputs + outputs):
        ctype = _CTYPE[np.dtype(DTYPES[kernel][name])]
        const = "const " if name in inputs else ""
        lines.append(f"  {const}device {ctype}* {name} = static_cast<{const}{ctype}*>(bufs_[{i}]);")
    for attr, (ctype, fn) in _ATTRS.items():
        if attr in body_text:          # MLX adds an attribute to the signature only when used
            lines.append(f"  const {ctype} {attr} = metal_emu::{fn};")
    lines += [f'#line 1 "{body_file}"', body_text, "}", "}  // namespace"]
    return "\n".join(lines)


def _read(file: Path, patch: dict) -> str:
    text = file.read_text()
    if file.name in patch:              # a deliberate mutation (the tests that prove they can fail)
        old, new = patch[file.name]
        assert text.count(old) == 1, f"{old!r} is not once in {file.name}"
        text = text.replace(old, new)
    return text


def generate(patch: dict | None = None, only: tuple = ()) -> str:
    """The driver's C++ source; patch = {file name: (old, new)} edits a kernel file's text;
    only = the entries to build (default all)."""
    patch = patch or {}
    header = KERNEL_DIR / "common.metal"
    parts = ['#include "metal_compat.h"', f'#line 1 "{header}"', _read(header, patch)]
    entries = {e: ENTRIES[e] for e in (only or ENTRIES)}
    for entry, (kernel, templ) in entries.items():
        body_file = KERNEL_DIR / metal.KERNELS[kernel][0]
        parts.append(_wrapper(entry, kernel, templ, _read(body_file, patch), body_file))
    parts.append("struct Entry { const char* name; void (*fn)(void**); };")
    parts.append("static const Entry ENTRIES[] = {" + ", ".join(
        f'{{"{e}", k_{e}::body}}' for e in entries) + "};")
    parts.append('#include "driver.cpp"')
    return "\n".join(parts) + "\n"


def build(src: str | None = None, cache: Path | None = None, opt: str = "-O1") -> Path:
    """Compile the driver (cached by the hash of its source and the compat files); -O0 compiles
    faster, for the one-off builds of deliberately broken kernels."""
    src = generate() if src is None else src
    compat = [HERE / "metal_compat.h", HERE / "driver.cpp", CORE / "fibers.h"]
    key = hashlib.sha256((opt + src + "".join(f.read_text() for f in compat)).encode()).hexdigest()[:16]
    cache = cache or Path(tempfile.gettempdir()) / "ds4_metal_emu"
    cache.mkdir(parents=True, exist_ok=True)
    exe = cache / f"driver_{key}"
    if exe.exists():
        return exe
    cpp = cache / f"gen_{key}.cpp"
    cpp.write_text(src)
    cmd = [compiler(), "-std=c++20", opt, "-Wall", "-Wno-unused-variable", "-I", str(HERE), "-I", str(CORE), str(cpp),
           "-o", str(exe) + ".tmp"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise EmulationError("g++ failed:\n" + r.stderr[-6000:])
    Path(str(exe) + ".tmp").rename(exe)
    return exe


def run(exe: Path, entry: str, inputs: list, outputs: list, grid, tg, workdir: Path,
        both_orders: bool = True) -> list[np.ndarray]:
    """Runs one kernel: inputs numpy arrays (in KERNELS order, dtypes as DTYPES), outputs
    (shape, dtype) pairs, grid = threads (as MLX's grid), tg = threadgroup size. both_orders=False
    runs the threads first to last only (half the time; no check of the barriers)."""
    kernel = ENTRIES[entry][0]
    _, in_names, out_names = metal.KERNELS[kernel]
    assert len(inputs) == len(in_names) and len(outputs) == len(out_names)
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = []
    for i, (name, a) in enumerate(zip(in_names, inputs)):
        a = np.ascontiguousarray(a)
        if a.dtype != np.dtype(DTYPES[kernel][name]):
            raise TypeError(f"{entry}: input {name} is {a.dtype}, the kernel takes {DTYPES[kernel][name]}")
        (workdir / f"in{i}.bin").write_bytes(a.tobytes())
        sizes.append(a.nbytes)
    sizes += [int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in outputs]
    spec = [*grid, *tg, len(inputs), len(outputs), *sizes]
    (workdir / "spec.txt").write_text(" ".join(map(str, spec)))
    results = []
    # twice: threads scheduled first to last, then last to first; a kernel whose threads share
    # threadgroup memory without the barriers it needs gives two answers
    for env in ({}, {"METAL_EMU_REVERSE": "1"})[:2 if both_orders else 1]:
        r = subprocess.run([str(exe), entry, str(workdir)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **env})
        if r.returncode != 0:
            why = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
            raise EmulationError(f"{entry} failed ({why}): {r.stderr.strip()}")
        results.append([np.fromfile(workdir / f"out{i}.bin", dtype=dt).reshape(shape)
                        for i, (shape, dt) in enumerate(outputs)])
    for a, b in zip(results[0], results[-1]):      # (one order: itself)
        if a.tobytes() != b.tobytes():
            raise EmulationError(f"{entry}: the result depends on the order threads run in (a missing barrier?)")
    return results[0]
