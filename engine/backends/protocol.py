"""The operations a compute backend provides: everything `Model.forward` and `Session` ask of it.

`Ops` is the contract, as a `typing.Protocol`; `OPERATIONS` is its list of names, which the
registry checks at open (registry.check_ops): a backend's ops object must define each one in its
own class body, or its registration must say it takes the op from the NumPy reference on purpose
(`reference_ops`). An op neither defined nor declared is a BackendError naming it, so a new
backend that forgets one never runs it silently in host NumPy.

Arrays: the model hands ops "arrays" of the backend's own kind (NumPy for numpy and cpu) and does
its small index glue (arange, where, sort, take_along_axis, ...) through `ops.xp`, the backend's
NumPy-compatible namespace. Host copies happen in three places only: `logits_to_host` (what
sampling reads), and the KV state's snapshot and restore (`state_to_host`, `state_from_host`
around engine/model/snapshot.py, which reads and fills host KVState rings).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class BindReport:
    """What binding the weights cost at open: seconds, and bytes the backend copied or uploaded
    (0 where it reads the file's map in place)."""
    time_s: float
    bytes: int


@runtime_checkable
class Ops(Protocol):
    name: str          # the registry name of the backend these ops belong to
    numerics: str      # "exact" or "ds4" (engine/model/numerics.py)
    xp: Any            # the array namespace of the model's glue (numpy for the host backends)

    # -- set-up and hand-offs --------------------------------------------------------------------
    def bind_weights(self, model_file) -> tuple[Any, BindReport]:
        """The model's weights (engine.model.weights.ModelWeights) bound to this backend: the
        upload/repack hook, run once at open. Returns the weights and what it cost."""

    def new_state(self, config, ctx: int, rewind_cap: int):
        """A fresh KV state for a timeline of `ctx` tokens, owned by the backend (its device)."""

    def state_to_host(self, state):
        """The KV state as a host KVState (engine.model.kv_state), what a snapshot reads: the
        state itself where it lives in host memory, a copy from the device elsewhere."""

    def state_from_host(self, host):
        """The backend's KV state made from a host KVState that a restore filled (the same
        object where the state lives in host memory, an upload elsewhere)."""

    def embed(self, embd, tokens):
        """The embedding rows of `tokens` (int64 [T]) from the table `embd` (a QTensor): [T, E]."""

    def logits_to_host(self, logits):
        """The logits sampling reads, as a host float32 NumPy array (no copy where they are one)."""

    # -- matmuls -------------------------------------------------------------------------------
    def linear(self, w, x, rows=None): ...
    def linears(self, ws, x): ...
    def grouped_linear(self, w, x, groups): ...

    # -- norms and elementwise -----------------------------------------------------------------
    def rmsnorm(self, x, w, eps): ...
    def sigmoid(self, x): ...
    def softplus(self, x): ...
    def softmax(self, x, axis=-1): ...

    # -- KV-row numerics -----------------------------------------------------------------------
    def store_kv(self, rows, n_nope): ...
    def store_index(self, rows): ...
    def index_qat(self, rows): ...

    # -- RoPE: the backend builds the angle tables and may keep what it derives from them --------
    def rope_thetas(self, pos, n_rot, base, yarn, query=False): ...   # query: a query's rotation
    def rope(self, x, thetas, inverse=False, inplace=False): ...

    # -- attention, indexer, hyper-connections, experts ------------------------------------------
    def attention(self, q, segments, sinks, scale): ...
    def indexer_scores(self, qi, keys, wts): ...
    def topk_lowest_index(self, scores, k): ...
    def hc_split(self, mix, n, scale, base, eps, iters): ...
    def hc_pre_mix(self, pre, X): ...
    def hc_post(self, y, X, post, C): ...
    def moe(self, lw, u, sel, wsel, limit): ...


def _operations() -> tuple[str, ...]:
    names = [k for k, v in vars(Ops).items() if callable(v) and not k.startswith("_")]
    return tuple(names)


OPERATIONS: tuple[str, ...] = _operations()
ATTRIBUTES = ("name", "numerics", "xp")
