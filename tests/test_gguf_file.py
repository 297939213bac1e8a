"""The container reader against the `gguf` package's own reader, on ds4's file and on ours."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGUFValueType

from engine.gguf.gguf_file import T_ARRAY, T_STRING, GGUFFile


def _reader_value(field):
    """A GGUFReader field's value in the shape our reader returns."""
    t = field.types[0]
    if t == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode() for i in field.data]
        return np.array([field.parts[i][0] for i in field.data])
    if t == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]][0]


@pytest.mark.parametrize("which", ["oracle", "synth"])
def test_matches_gguf_reader(which, request):
    path = request.getfixturevalue("oracle_gguf" if which == "oracle" else "tiny_q2")
    ours, ref = GGUFFile(path), GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, f in ours.fields.items():
        rv = _reader_value(ref_fields[key])
        assert int(ref_fields[key].types[0]) == f.type, key
        if f.type == T_ARRAY and f.elem_type != T_STRING:
            np.testing.assert_array_equal(f.value, rv, err_msg=key)
        else:
            assert f.value == rv, key
    assert ours.data_offset == ref.data_offset
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for rt in ref.tensors:
        t = ours.tensors[rt.name]
        assert t.type_id == int(rt.tensor_type)
        assert t.dims == tuple(int(d) for d in rt.shape)
        assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes
        assert np.array_equal(ours.tensor_bytes(rt.name), np.asarray(rt.data).view(np.uint8).reshape(-1))


def test_tensor_bytes_are_views_of_the_map(tiny_q2):
    g = GGUFFile(tiny_q2)
    t = g.tensors["blk.0.ffn_gate_exps.weight"]
    view = g.tensor_bytes(t.name)
    assert view.base is not None and not view.flags.owndata  # no copy
    with open(tiny_q2, "rb") as f:
        f.seek(t.offset)
        assert f.read(64) == view[:64].tobytes()


def test_full_vocabulary_metadata(flash_q2_sparse):
    g = GGUFFile(flash_q2_sparse)
    toks = g.get("tokenizer.ggml.tokens")
    assert len(toks) == 129280 and toks[0] == "<｜begin▁of▁sentence｜>" and toks[128803] == "<｜User｜>"
    assert len(g.get("tokenizer.ggml.merges")) == 127741
