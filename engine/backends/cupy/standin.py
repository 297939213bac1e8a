"""A NumPy-backed stand-in for the part of CuPy the cupy backend uses (DS4_CUDA_EMULATE=1).

With it the backend's own Python runs a whole forward pass on a machine without a GPU: array ops
run in NumPy, `RawModule` / `RawKernel` launches go to the host emulation of the CUDA kernels
(emu.load_module: each .cu compiled as host C++), so launch arguments, grids, dtypes and the
state hand-off are exercised as on the device.

It is strict where CuPy is strict, so host/device mistakes show here rather than on a GPU:
* a device array is not a NumPy array: `np.asarray(dev)` raises TypeError (CuPy: "Implicit
  conversion to a NumPy array is not allowed"); `.get()` / `asnumpy` copy it out;
* an op mixing a device array with a host NumPy array raises TypeError, in both orders, as do a
  host array used as an index or assigned into a device array (upload it with `asarray` first);
* reductions return 0-d device arrays, not NumPy scalars;
* `asarray(host)` copies (the device never aliases host memory);
* kernel arguments must be C-contiguous device arrays or NumPy scalars (a Python int would be
  passed by CuPy as a 64-bit value whatever the kernel expects).
"""
from __future__ import annotations

import operator
import types

import numpy as _np

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")

# NumPy dtypes and constants under CuPy's names (CuPy re-exports NumPy's)
float16, float32, float64 = _np.float16, _np.float32, _np.float64
int8, int16, int32, int64 = _np.int8, _np.int16, _np.int32, _np.int64
uint8, uint16, uint32, uint64 = _np.uint8, _np.uint16, _np.uint32, _np.uint64
bool_, intp, dtype = _np.bool_, _np.intp, _np.dtype
inf, nan, newaxis, pi = _np.inf, _np.nan, _np.newaxis, _np.pi
errstate = _np.errstate      # (cupyx.errstate on CuPy; the backend takes whichever exists)


def _mixed(x) -> TypeError:
    return TypeError(f"Unsupported type {type(x)} (a host array where a device array is needed: "
                     f"upload it with asarray)")


def _dev(x):
    """The NumPy storage of a device argument; host arrays refused (CuPy does)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _np.ndarray):
        raise _mixed(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_dev(v) for v in x)
    return x


def _wrap(r):
    if isinstance(r, _np.ndarray):
        return ndarray(r)
    if isinstance(r, _np.generic) and not isinstance(r, _np.dtype):
        return ndarray(_np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


def _key(k):
    if isinstance(k, tuple):
        return tuple(_key(v) for v in k)
    if isinstance(k, list):
        raise TypeError("a list as an index: upload it with asarray")
    return _dev(k)


# -- CUDA graph capture (Stream.begin_capture / end_capture, Graph.launch) ------------------------
# While a stream captures, nothing is "queued": every op still runs at once (so the capture's own
# results are right), and each is also recorded as a step that recomputes it. Graph.launch replays
# the steps in order and writes each result into the buffer the capture produced, as a CUDA graph
# re-runs its kernels on the addresses it captured: inputs are read from their buffers at replay
# time, Python scalars are baked in. The arrays a capture made hold NaN until a launch (a device
# computes nothing while it captures); the one liberty: an in-place write to an array made before
# the capture happens at capture time too. What a graph cannot hold is an error during a capture, as on
# the device: a device -> host read (.get, asnumpy, bool/int/float of an array) and a host ->
# device upload (asarray of host data, .set).
_CAPTURING: list = []         # the capture in progress (at most one)


def _capture_guard(what: str) -> None:
    if _CAPTURING:
        raise RuntimeError(f"{what} during a CUDA graph capture (cudaErrorStreamCaptureUnsupported: "
                           f"a graph cannot hold a transfer between host and device)")


# a dict: counts what the backend issues (tests: launches per decode step). "issued": array ops,
# kernel launches and graph launches run from Python (views and no-op checks included, which
# launch nothing on a GPU); "graphs": graph launches; "in_graphs": the ops those replayed
OPS: dict | None = None


def _count(what: str, n: int = 1) -> None:
    if OPS is not None and not _CAPTURING:
        OPS[what] = OPS.get(what, 0) + n


def _run(thunk):
    """thunk() -> a NumPy-level result, wrapped; recorded while a stream captures."""
    r = _wrap(thunk())
    _count("issued")
    if _CAPTURING:
        _CAPTURING[-1].append((thunk, r))
    return r


def _mutate(thunk) -> None:
    """An in-place op (setitem, +=, out=, a kernel launch), recorded while a stream captures."""
    thunk()
    _count("issued")
    if _CAPTURING:
        _CAPTURING[-1].append((thunk, None))


def _replay(steps) -> None:
    for thunk, r in steps:
        new = thunk()
        for old, val in zip(*((r, new) if isinstance(r, (tuple, list)) else ((r,), (new,)))):
            if isinstance(old, ndarray) and isinstance(val, (_np.ndarray, _np.generic)):
                _np.copyto(old._a, val, casting="no")


class ndarray:
    """A device array: NumPy storage behind CuPy's rules (see the module docstring)."""
    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100.0

    def __init__(self, a: _np.ndarray):
        self._a = a

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def get(self, stream=None, order="C", out=None) -> _np.ndarray:
        """A host copy (CuPy's device -> host transfer)."""
        _capture_guard("a device -> host copy")
        return _np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        """Host -> device copy into this (C-contiguous) array (CuPy's `ndarray.set`)."""
        _capture_guard("a host -> device copy")
        arr = _np.asarray(arr)
        if arr.shape != self._a.shape or not self._a.flags.c_contiguous:
            raise ValueError(f"set: shape {arr.shape} into {self._a.shape} (or a non-contiguous array)")
        self._a[...] = arr

    def __repr__(self):
        return f"standin.ndarray({self._a!r})"

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(v) for v in self._a)

    def __bool__(self):
        _capture_guard("reading a device value on the host")
        return bool(self._a)

    def __int__(self):
        _capture_guard("reading a device value on the host")
        return int(self._a)

    def __float__(self):
        _capture_guard("reading a device value on the host")
        return float(self._a)

    def item(self):
        _capture_guard("reading a device value on the host")
        return self._a.item()

    def tolist(self):
        _capture_guard("reading a device value on the host")
        return self._a.tolist()

    def __getitem__(self, k):
        return _run(lambda: self._a[_key(k)])

    def __setitem__(self, k, v):
        def put():
            self._a[_key(k)] = _dev(v)
        _mutate(put)

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        # np.exp(dev) and the like: CuPy runs its own ufunc; a host operand is an error
        out = kw.pop("out", None)
        if out is not None:
            kw["out"] = tuple(_dev(o) for o in out)

        def f():
            return getattr(ufunc, method)(*(_dev(i) for i in inputs), **{k: _dev(v) for k, v in kw.items()})
        if out is not None and len(out) == 1:
            _mutate(f)
            return out[0]
        return _run(f)

    def __array_function__(self, func, types_, args, kwargs):
        # np.concatenate([dev, ...]) and the like go to this module's function of the same name
        mine = _FUNCS.get(func.__name__)
        if mine is None:
            return NotImplemented
        return mine(*args, **kwargs)

    def argsort(self, axis=-1):
        return _run(lambda: _np.argsort(self._a, axis=axis, kind="stable"))

    def __getattr__(self, name):
        if name not in _METHODS:
            raise AttributeError(f"stand-in ndarray has no attribute {name!r} (not used by the backend)")
        meth = getattr(self._a, name)

        def call(*args, **kw):
            if name == "fill":
                return _mutate(lambda: meth(*_dev(args)))
            return _run(lambda: meth(*_dev(args), **{k: _dev(v) for k, v in kw.items()}))
        return call


_METHODS = frozenset({
    "astype", "reshape", "ravel", "flatten", "transpose", "swapaxes", "copy", "view", "sum", "mean",
    "max", "min", "argmax", "argmin", "any", "all", "clip", "cumsum", "squeeze", "take",
    "fill", "dot", "nonzero", "prod", "round", "var", "std", "repeat",
})


def _binary(op, reflected=False):
    def f(self, other):
        _dev(other)                     # (a host operand is refused now, not at a replay)
        return _run(lambda: op(_dev(other), self._a) if reflected else op(self._a, _dev(other)))
    return f


def _inplace(op):
    def f(self, other):
        _mutate(lambda: op(self._a, _dev(other)))
        return self
    return f


for _n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
           "lshift", "rshift"):
    _op = getattr(operator, _n + "_" if _n in ("and", "or") else _n)
    setattr(ndarray, f"__{_n}__", _binary(_op))
    setattr(ndarray, f"__r{_n}__", _binary(_op, reflected=True))
    setattr(ndarray, f"__i{_n}__", _inplace(getattr(operator, "i" + _n)))
for _n in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(ndarray, f"__{_n}__", _binary(getattr(operator, _n)))
for _n in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_n}__", (lambda op: lambda self: _run(lambda: op(self._a)))(getattr(operator, _n)))
ndarray.__hash__ = None


# -- creation and transfer -----------------------------------------------------------------------
def asarray(a, dtype=None, order=None):
    """A device array of `a`: itself (or cast) for a device array, an upload (a copy) for host data."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == _np.dtype(dtype) else _run(lambda: a._a.astype(dtype))
    _capture_guard("a host -> device copy")
    return ndarray(_np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(a, dtype=None, copy=True, order="K"):
    if isinstance(a, ndarray):
        return _run(lambda: _np.array(a._a, dtype=dtype, copy=copy, order=order))
    _capture_guard("a host -> device copy")
    return ndarray(_np.array(a, dtype=dtype, copy=True, order=order))


def ascontiguousarray(a, dtype=None):
    if isinstance(a, ndarray):
        return _run(lambda: _np.ascontiguousarray(a._a, dtype=dtype))
    _capture_guard("a host -> device copy")
    return ndarray(_np.array(a, dtype=dtype, order="C", copy=True))


def asnumpy(a, stream=None, out=None) -> _np.ndarray:
    if isinstance(a, ndarray):
        return a.get()
    return _np.asarray(a)


def empty(shape, dtype=float32, order="C"):
    # NaN-filled floats (a kernel that leaves an output element unwritten shows)
    a = _np.empty(shape, dtype=dtype, order=order)
    if a.dtype.kind == "f":
        a.fill(_np.nan)
    return ndarray(a)


def is_available() -> bool:
    return True


def _device_fn(f):
    def call(*args, **kw):
        _dev(args), {k: _dev(v) for k, v in kw.items()}      # (host operands refused now)
        return _run(lambda: f(*_dev(args), **{k: _dev(v) for k, v in kw.items()}))
    call.__name__ = f.__name__
    return call


_NUMPY_FUNCS = (
    "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "empty_like", "arange",
    "concatenate", "stack", "where", "maximum", "minimum", "sqrt", "exp", "log", "log1p", "log2",
    "abs", "sign", "cos", "sin", "sort", "argsort", "argmax", "take_along_axis", "take", "repeat", "unique", "einsum",
    "matmul", "isnan", "isinf", "isfinite", "clip", "rint", "ceil", "floor", "ldexp", "frexp",
    "square", "sum", "mean", "max", "min", "cumsum", "nonzero", "flatnonzero", "broadcast_to",
    "expand_dims", "swapaxes", "transpose", "reshape", "left_shift", "right_shift", "bitwise_and",
    "bitwise_or", "logical_and", "logical_or", "logical_not", "searchsorted", "bincount", "tanh",
    "add", "subtract", "multiply", "divide", "negative", "array_equal", "count_nonzero", "diff",
    "tile", "squeeze", "outer", "dot",
)
_FUNCS = {n: _device_fn(getattr(_np, n)) for n in _NUMPY_FUNCS}
# CuPy's sorts are stable (radix sorts): ties keep their order, as NumPy's kind="stable"
_FUNCS["sort"] = _device_fn(lambda a, axis=-1: _np.sort(a, axis=axis, kind="stable"))
_FUNCS["argsort"] = _device_fn(lambda a, axis=-1: _np.argsort(a, axis=axis, kind="stable"))
_FUNCS.update(asarray=asarray, array=array, ascontiguousarray=ascontiguousarray, empty=empty)
globals().update({n: f for n, f in _FUNCS.items() if n not in globals()})


# -- cupy.cuda: streams, devices, pinned memory, graphs ---------------------------------------------
class Graph:
    """cupy.cuda.Graph: what a capture recorded, replayed by launch() (see _CAPTURING)."""

    def __init__(self, steps: list):
        self._steps = steps

    def launch(self, stream=None):
        _capture_guard("launching a graph")
        _count("issued"), _count("graphs"), _count("in_graphs", len(self._steps))
        _replay(self._steps)

    def upload(self, stream=None):
        pass


class Stream:
    """Kernels and copies run at once on the host: a stream orders nothing. begin_capture /
    end_capture record a CUDA graph as CuPy's do (not on the null stream, one at a time)."""
    null = None

    def __init__(self, non_blocking: bool = False, null: bool = False):
        self._null = null
        self._steps = None

    def synchronize(self):
        _capture_guard("synchronizing a stream")

    def begin_capture(self, mode=None):
        if self._null:
            raise RuntimeError("cannot capture the null (legacy) stream: capture on a Stream()")
        if _CAPTURING:
            raise RuntimeError("a stream is capturing already")
        self._steps = []
        _CAPTURING.append(self._steps)

    def end_capture(self) -> Graph:
        if self._steps is None or not _CAPTURING or _CAPTURING[-1] is not self._steps:
            raise RuntimeError("end_capture without begin_capture on this stream")
        _CAPTURING.pop()
        steps, self._steps = self._steps, None
        for _, r in steps:        # a capture computes nothing on a device: what it made holds NaN
            for a in r if isinstance(r, (tuple, list)) else (r,):       # until the graph is launched
                if isinstance(a, ndarray) and a._a.flags.owndata and a._a.dtype.kind == "f":
                    a._a.fill(_np.nan)
        return Graph(steps)

    def is_capturing(self) -> bool:
        return self._steps is not None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


Stream.null = Stream(null=True)


class MemoryPool:
    """cupy.cuda.MemoryPool: a graph's private pool on CuPy; NumPy memory is never reused here."""

    def malloc(self, nbytes):
        return None

    def free_all_blocks(self):
        pass


class _UsingAllocator:
    def __init__(self, allocator=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Device:
    def __init__(self, device_id: int = 0):
        self.id = device_id
        self.compute_capability = "90"

    def synchronize(self):
        pass

    @property
    def mem_info(self):
        return (64 << 30, 80 << 30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def alloc_pinned_memory(nbytes: int):
    """Host memory a copy to the device reads from (page-locked on CUDA; plain bytes here)."""
    return memoryview(bytearray(nbytes))


def _runtime_info():
    return types.SimpleNamespace(
        getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"name": b"CuPy stand-in (host emulation)",
                                                                 "totalGlobalMem": 80 << 30},
        runtimeGetVersion=lambda: 12000, driverGetVersion=lambda: 12000, memGetInfo=lambda: (64 << 30, 80 << 30))


cuda = types.SimpleNamespace(Stream=Stream, Device=Device, alloc_pinned_memory=alloc_pinned_memory,
                             runtime=_runtime_info(), get_current_stream=lambda: Stream.null,
                             Graph=Graph, MemoryPool=MemoryPool, using_allocator=_UsingAllocator,
                             emulated=True)
LAUNCH_LOG: list | None = None    # a list: every kernel launch appends (name, grid, block, scalars)


# -- RawModule / RawKernel: the host emulation of the .cu kernels ----------------------------------
def _kernel_arg(a, name: str, i: int):
    if isinstance(a, ndarray):
        if not a._a.flags.c_contiguous:
            raise ValueError(f"kernel {name}: argument {i} is not C-contiguous (a kernel reads it by pointer)")
        return a._a
    if isinstance(a, _np.generic):
        return a
    if isinstance(a, _np.ndarray):
        raise _mixed(a)
    raise TypeError(f"kernel {name}: argument {i} is a {type(a).__name__}; pass a NumPy scalar of "
                    f"the kernel's type (CuPy would pass a Python int as 64 bits)")


class _Function:
    def __init__(self, fn, name: str):
        self._fn, self.name = fn, name
        self.launches = 0

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        host = [_kernel_arg(a, self.name, i) for i, a in enumerate(args)]
        self.launches += 1
        entry = (self.name, tuple(int(g) for g in grid), tuple(int(b) for b in block),
                 tuple(a.item() if isinstance(a, _np.generic) else a.shape for a in host))

        def launch():
            if LAUNCH_LOG is not None and not _CAPTURING:     # (a capture runs nothing on a device)
                LAUNCH_LOG.append(entry)
            self._fn(entry[1], entry[2], host, shared_mem=shared_mem)
        _mutate(launch)


class RawModule:
    """cupy.RawModule over the emulation: the source compiled as host C++ (needs a C++ compiler)."""

    def __init__(self, code: str | None = None, path: str | None = None, options=(), backend="nvrtc",
                 name_expressions=None, jitify=False):
        from . import emu
        self._mod = emu.load_module(code=code, path=path, options=tuple(options))
        self._fns: dict = {}

    def get_function(self, name: str) -> _Function:
        if name not in self._fns:
            self._fns[name] = _Function(self._mod.get_function(name), name)
        return self._fns[name]


class RawKernel:
    def __init__(self, code: str, name: str, options=(), backend="nvrtc", jitify=False):
        self._fn = RawModule(code=code, options=options).get_function(name)

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        self._fn(grid, block, args, shared_mem=shared_mem)

