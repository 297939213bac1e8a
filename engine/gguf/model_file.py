"""Opening a DeepSeek V4 GGUF: container + config + layout check, then weights as views of the map.

`ModelFile.open(path)` is what every command that loads a model calls. It costs O(metadata): the
tensor bytes stay in the page cache / on disk until a kernel reads the rows it needs.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from . import quants as Q
from .config import ModelConfig, read_tokenizer_metadata
from .gguf_file import GGUFFile, TensorInfo
from .layout import LayoutReport, check_layout, raise_on_problems, recipe_name


@dataclass(frozen=True)
class QTensor:
    """A weight as it lies in the map: `data` is uint8 [n_rows, row_bytes] (rows = output units).

    A 3-D expert tensor [in, out, n_expert] is n_expert consecutive [out, in] matrices; `expert(e)`
    returns one of them without touching the others.
    """
    name: str
    type_id: int
    dims: tuple[int, ...]
    data: np.ndarray

    @property
    def n_in(self) -> int:
        return self.dims[0]

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    @property
    def type_name(self) -> str:
        return Q.type_name(self.type_id)

    def expert(self, e: int) -> "QTensor":
        return QTensor(f"{self.name}[{e}]", self.type_id, self.dims[:2], self.expert_data(e))

    def expert_data(self, e: int) -> np.ndarray:
        """expert(e).data without building the QTensor (decode asks for 18-24 a layer)."""
        if len(self.dims) != 3:
            raise ValueError(f"{self.name} is not an expert tensor")
        n_out = self.dims[1]
        return self.data[e * n_out:(e + 1) * n_out]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """float32 [stop-start, n_in], decoding only those rows."""
        return Q.dequantize_rows(self.type_id, self.data, start, stop)

    def matvec(self, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        return Q.matvec(self.type_id, self.data, x, rows)

    def vector(self) -> np.ndarray:
        """A 1-D float tensor (norm weights, biases, sinks) as float32."""
        return Q.dequantize(self.type_id, self.data.reshape(-1))

    def _rebase(self, data: np.ndarray) -> None:
        """Point this weight at the same bytes in another place (the resident copy, when the
        background copy has filled it; only ModelFile calls this). One attribute store, atomic
        under the GIL: an op reads `.data` before it or after it; a C call already holding the
        old address reads the map, which stays mapped until the file is closed."""
        if data.shape != self.data.shape or data.dtype != self.data.dtype:
            raise ValueError(f"{self.name}: a rebase must keep shape {self.data.shape} and dtype {self.data.dtype}")
        object.__setattr__(self, "data", data)

    def int32(self) -> np.ndarray:
        """An I32 tensor (the hash table) as int32 [n_rows, n_in]."""
        if self.type_id != Q.I32:
            raise ValueError(f"{self.name} is {self.type_name}, not I32")
        return self.data.view(np.int32)


class MappedGGUF:
    """A checked GGUF held open (self.gguf): closing it unmaps the file; a context manager closes
    it. ModelFile and the MTP file (mtp_file.MTPFile) are both this."""
    gguf: GGUFFile

    def close(self):
        self.gguf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ModelFile(MappedGGUF):
    def __init__(self, g: GGUFFile, config: ModelConfig, layout: LayoutReport, tokenizer: dict):
        self.gguf, self.config, self.layout, self.tokenizer = g, config, layout, tokenizer
        self.path = g.path
        # the weights handed out on the map, by name (weak references), to be switched to a
        # resident copy as their bytes arrive there (the lock orders a hand-out against a switch:
        # a weight is either made after its tensor is ready or registered before the switch looks)
        self._lock = threading.Lock()
        self._on_map: dict[str, list] = {}

    @classmethod
    def open(cls, path, *, check_merges: bool = True) -> "ModelFile":
        """check_merges=False: the caller builds the tokenizer before it hands the file on, and
        that build checks the merge table (read_tokenizer_metadata; Engine.open does this)."""
        g = GGUFFile(path)
        try:
            config = ModelConfig.from_gguf(g)
            tok = read_tokenizer_metadata(g, config.n_vocab, check_merges=check_merges)
            layout = check_layout(g, config)
            raise_on_problems(g.path, layout)
        except BaseException:
            g.close()
            raise
        return cls(g, config, layout, tok)

    @property
    def recipe(self) -> str:
        return recipe_name(self.gguf, self.config)

    def has(self, name: str) -> bool:
        return name in self.layout.present

    def tensor(self, name: str) -> QTensor:
        ti: TensorInfo | None = self.layout.present.get(name)
        if ti is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        n_rows = 1
        for d in ti.dims[1:]:
            n_rows *= d
        with self._lock:
            raw = self.gguf.tensor_bytes(name)
            qt = QTensor(name, ti.type_id, ti.dims, raw.reshape(n_rows, ti.nbytes // n_rows))
            if not self.gguf.tensor_ready(name):
                refs = [r for r in self._on_map.get(name, ()) if r() is not None]
                self._on_map[name] = refs + [weakref.ref(qt)]
        return qt

    def start_resident(self, threads: int = 1, drop_cache: bool = False, skip=frozenset()) -> None:
        """GGUFFile.start_resident, switching every weight this file has handed out (and hands
        out until its tensor is ready) to the copy when its tensor is ready; `skip`: tensors
        left out of the copy (the routed experts, under the expert cache)."""
        self.gguf.start_resident(threads, drop_cache, on_ready=self._switch, skip=skip)

    def _switch(self, names) -> None:
        with self._lock:
            for name in names:
                for ref in self._on_map.pop(name, ()):
                    qt = ref()
                    if qt is not None:
                        qt._rebase(self.gguf.tensor_bytes(name).reshape(qt.data.shape))
