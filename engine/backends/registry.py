"""The backend registry: which compute backends exist, which can serve here, and the ops of one.

A backend is a folder engine/backends/<name>/ whose backend.py defines `BACKEND`, a `Backend`
entry, and a line in `BUILTIN` below (or a `register()` call, for one that lives elsewhere).
Entries are cheap to import: `available()` looks for the package or device without loading the
compute code, and `make_ops` imports it only when the backend is opened.

`pick(name)` turns a name ("auto", a backend name, or "auto" with DS4_BACKEND set) into an entry
that can serve, or raises BackendError with one line that says why not; `make_ops(entry,
numerics)` builds the ops object and checks it against the protocol (check_ops).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Callable

from ..errors import BackendError
from ..model.numerics import NUMERICS
from .protocol import ATTRIBUTES, OPERATIONS

AUTO = "auto"
# the registry lines of the backends in this package: name -> module defining BACKEND
BUILTIN = {
    "numpy": "engine.backends.numpy.backend",
    "cpu": "engine.backends.cpu.backend",
    "mlx": "engine.backends.mlx.backend",
    "cupy": "engine.backends.cupy.backend",
}


def _no_setup(threads: int | None) -> None:
    return None


@dataclass(frozen=True)
class Backend:
    """One registry entry.

    available: None when the backend can serve on this machine, else the reason (one line).
    priority: `auto` takes the available backend with the highest.
    default_paging: what paging "auto" becomes when the file fits in memory ("resident" falls
        back to "prefault" where the kernel has no transparent huge pages).
    setup(threads): process set-up before the weights are bound (thread pools, allocator).
    make_ops(numerics): the ops object (protocol.Ops).
    reference_ops: the operations this backend takes from the NumPy reference on purpose (its ops
        class inherits them); any other op its class does not define is an error at open.
    in_auto(): whether `auto` may take it when available (False: it serves only when named, as
        the cupy backend on its host emulation).
    """
    name: str
    summary: str
    available: Callable[[], str | None]
    make_ops: Callable[[str], object]
    priority: int = 0
    numerics: tuple[str, ...] = NUMERICS
    default_paging: str = "prefault"
    setup: Callable[[int | None], None] = _no_setup
    reference_ops: frozenset[str] = field(default_factory=frozenset)
    in_auto: Callable[[], bool] = lambda: True


_entries: dict[str, Backend] = {}
_loaded = False


def register(entry: Backend) -> Backend:
    """Add (or replace) a backend; returns it. Names are lower-case words, and "auto" is taken."""
    if entry.name == AUTO or not entry.name.isidentifier() or entry.name != entry.name.lower():
        raise ValueError(f"backend name {entry.name!r} must be a lower-case identifier other than {AUTO!r}")
    unknown = set(entry.reference_ops) - set(OPERATIONS)
    if unknown:
        raise ValueError(f"backend {entry.name!r} declares reference ops that are not operations: {sorted(unknown)}")
    _load_builtin()
    _entries[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    _load_builtin()
    _entries.pop(name, None)


def _load_builtin():
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name, module in BUILTIN.items():
        _entries.setdefault(name, importlib.import_module(module).BACKEND)


def names() -> tuple[str, ...]:
    """Every registered backend, best first (the order `auto` tries them)."""
    _load_builtin()
    return tuple(sorted(_entries, key=lambda n: (-_entries[n].priority, n)))


def get(name: str) -> Backend:
    _load_builtin()
    if name not in _entries:
        raise BackendError(f"unknown backend {name!r} (known: {', '.join((AUTO,) + names())})")
    return _entries[name]


def describe(name: str) -> str:
    """One line: the backend, what it is, and whether it can serve here (and why not)."""
    e = get(name)
    why = e.available()
    return f"{e.name}: {e.summary} ({'available' if why is None else 'unavailable: ' + why})"


def available_names() -> tuple[str, ...]:
    return tuple(n for n in names() if _entries[n].available() is None)


def pick(name: str | None = AUTO) -> Backend:
    """The entry for `name`: "auto" (or None) is DS4_BACKEND when set, else the available backend
    with the highest priority. Raises BackendError (one line) for an unknown or unavailable name."""
    name = (name or AUTO).strip().lower()
    env = (os.environ.get("DS4_BACKEND") or "").strip().lower()
    if name == AUTO and env not in ("", AUTO):
        try:
            return pick(env)
        except BackendError as e:       # say where the name came from: no flag named it
            raise BackendError(f"DS4_BACKEND: {e}") from None
    if name == AUTO:
        for n in names():
            if _entries[n].available() is None and _entries[n].in_auto():
                return _entries[n]
        raise BackendError("no backend is available: " + "; ".join(
            f"{n}: {_entries[n].available()}" for n in names()))
    e = get(name)
    why = e.available()
    if why is not None:
        raise BackendError(f"backend {name!r} is not available: {why}")
    return e


def check_ops(entry: Backend, ops) -> None:
    """Every protocol operation is defined by the ops object's own classes, or declared in
    entry.reference_ops; raises BackendError naming the first one that is neither."""
    from .numpy.ops import NumpyOps
    cls = type(ops)
    for attr in ATTRIBUTES:
        if not hasattr(ops, attr):
            raise BackendError(f"backend {entry.name!r} lacks attribute {attr!r} of its ops")
    for op in OPERATIONS:
        owner = next((k for k in cls.__mro__ if op in vars(k)), None)
        if owner is None or not callable(getattr(ops, op, None)):
            raise BackendError(f"backend {entry.name!r} lacks operation {op!r}")
        inherited = owner is NumpyOps and cls is not NumpyOps
        if inherited and op not in entry.reference_ops:
            raise BackendError(f"backend {entry.name!r} lacks operation {op!r} (it would run the NumPy "
                               f"reference's; define it, or list it in the backend's reference_ops)")


def make_ops(entry: Backend, numerics: str):
    """The checked ops object of `entry` for `numerics`."""
    if numerics not in entry.numerics:
        raise BackendError(f"backend {entry.name!r} does not support numerics {numerics!r} "
                           f"(it has: {', '.join(entry.numerics)})")
    ops = entry.make_ops(numerics)
    check_ops(entry, ops)
    return ops
