"""Test helper: copy a GGUF with one thing changed (a tensor dropped, retyped or reshaped, a key
changed or removed, another architecture), written with the `gguf` package's own writer so the
broken files are well-formed GGUF apart from the one planted problem."""
from __future__ import annotations

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.gguf.gguf_file import T_ARRAY, GGUFFile


def rewrite(src, dst, *, arch=None, drop=(), retype=None, reshape=None, set_fields=None, del_fields=(),
            add_tensors=None):
    retype, reshape, set_fields, add_tensors = retype or {}, reshape or {}, set_fields or {}, add_tensors or {}
    g = GGUFFile(src)
    w = GGUFWriter(dst, arch or g.get("general.architecture"))
    for key, f in g.fields.items():
        if key == "general.architecture" or key in del_fields:
            continue
        if key in set_fields:
            continue
        val = f.value.tolist() if f.type == T_ARRAY and isinstance(f.value, np.ndarray) else f.value
        w.add_key_value(key, val, GGUFValueType(f.type), GGUFValueType(f.elem_type) if f.elem_type is not None else None)
    for key, (val, vtype, sub) in set_fields.items():
        w.add_key_value(key, val, vtype, sub)
    tensors = []
    for name, t in g.tensors.items():
        if name in drop:
            continue
        ty = retype.get(name, t.type_id)
        dims = reshape.get(name, t.dims)
        if ty == t.type_id and dims == t.dims:
            data = g.tensor_bytes(name)
        else:
            data = np.zeros(_nbytes(ty, dims), np.uint8)
        tensors.append((name, ty, dims, data))
    for name, (ty, dims) in add_tensors.items():
        tensors.append((name, ty, dims, np.zeros(_nbytes(ty, dims), np.uint8)))
    for name, ty, dims, data in tensors:
        w.add_tensor_info(name, tuple(reversed(dims)), np.dtype(np.float32), data.nbytes,
                          raw_dtype=GGMLQuantizationType(ty))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    for _, _, _, data in tensors:
        f.write(b"\0" * (-f.tell() % 32))
        f.write(np.ascontiguousarray(data).tobytes())
    f.write(b"\0" * (-f.tell() % 32))
    w.close()
    g.close()
    return dst


def _nbytes(ty, dims):
    be, bb = GGML_QUANT_SIZES[GGMLQuantizationType(ty)]
    return int(np.prod(dims)) // be * bb
