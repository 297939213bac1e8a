"""Broken model files: each gives exit status 1 and one line naming the file and the problem.

Every command that loads a model (`ds4-gguf inspect`, `ds4 -m`, `ds4-agent -m`) goes through
`ModelFile.open`, so each case is checked on all three entry points in-process, and a few through a
real subprocess to prove no traceback and no signal (SIGBUS) reaches the user.
"""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType

from ds4agent.cli import main as agent_main
from engine import ModelFile, ModelFileError
from ds4agent.ds4_cli import main as ds4_main
from engine.gguf.gguf_cli import main as gguf_main

from gguf_edit import rewrite

HEADER = struct.calcsize("<4sIQQ")


def _data(p: Path) -> bytes:
    return p.read_bytes()


def _write(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p


def _last_tensor_end(src):
    from engine.gguf.gguf_file import GGUFFile
    g = GGUFFile(src)
    last = max(g.tensors.values(), key=lambda t: t.offset)
    return last.offset + last.nbytes, g.data_offset



# Each case: (id, builder(tmp, src) -> path, words the message must contain)
def _truncated_header(tmp, src):
    return _write(tmp, "hdr.gguf", _data(src)[:10])


def _truncated_metadata(tmp, src):
    return _write(tmp, "meta.gguf", _data(src)[:4000])  # inside the vocabulary strings


def _truncated_tensor_data(tmp, src):
    end, _ = _last_tensor_end(src)
    return _write(tmp, "data.gguf", _data(src)[:end - 100])  # last tensor cut short


def _wrong_magic(tmp, src):
    return _write(tmp, "magic.gguf", b"GGML" + _data(src)[4:])


def _bad_version(tmp, src):
    d = bytearray(_data(src))
    d[4:8] = struct.pack("<I", 7)
    return _write(tmp, "version.gguf", bytes(d))


def _absurd_tensor_count(tmp, src):
    d = bytearray(_data(src))
    d[8:16] = struct.pack("<Q", 10**12)
    return _write(tmp, "count.gguf", bytes(d))


def _absurd_kv_count(tmp, src):
    d = bytearray(_data(src))
    d[16:24] = struct.pack("<Q", 10**12)
    return _write(tmp, "kvcount.gguf", bytes(d))


def _missing_tensor(tmp, src):
    return rewrite(src, tmp / "missing.gguf", drop=["blk.3.attn_kv.weight"])


def _wrong_dtype(tmp, src):
    return rewrite(src, tmp / "dtype.gguf", retype={"blk.0.ffn_gate_tid2eid.weight": 0})  # F32 hash table


def _wrong_dtype_norm(tmp, src):
    return rewrite(src, tmp / "dtype2.gguf", retype={"blk.1.attn_norm.weight": 8})  # Q8_0 norm


def _wrong_shape(tmp, src):
    return rewrite(src, tmp / "shape.gguf", reshape={"blk.2.attn_q_b.weight": (128, 512)})


def _key_wrong_type(tmp, src):
    return rewrite(src, tmp / "keytype.gguf",
                   set_fields={"deepseek4.block_count": (6.0, GGUFValueType.FLOAT32, None)})


def _missing_key(tmp, src):
    return rewrite(src, tmp / "nokey.gguf", del_fields=["deepseek4.attention.q_lora_rank"])


def _foreign_arch(tmp, src):
    return rewrite(src, tmp / "llama.gguf", arch="llama")


def _bad_ratio(tmp, src):
    return rewrite(src, tmp / "ratio.gguf", set_fields={
        "deepseek4.attention.compress_ratios": ([0, 0, 4, 64, 4, 128], GGUFValueType.ARRAY, GGUFValueType.INT32)})


def _vocab_mismatch(tmp, src):
    return rewrite(src, tmp / "vocab.gguf", set_fields={
        "deepseek4.vocab_size": (4000, GGUFValueType.UINT32, None)})


def _directory(tmp, src):
    d = tmp / "a-directory.gguf"
    d.mkdir(exist_ok=True)
    return d


def _empty(tmp, src):
    return _write(tmp, "empty.gguf", b"")


def _nonexistent(tmp, src):
    return tmp / "does-not-exist.gguf"


def _variant(label):
    """A variant of scripts/gguf_corrupt.py (loaded with test_gguf_corruption.py) by its label."""
    def build(tmp, src):
        from test_gguf_corruption import gguf_corrupt
        name = "".join(ch if ch.isalnum() else "_" for ch in label)[:60] + ".gguf"
        return _write(tmp, name, dict(gguf_corrupt.variants(src))[label]())
    return build


CASES = [
    ("truncated header", _truncated_header, "truncated header"),
    ("truncated metadata", _truncated_metadata, "truncated metadata"),
    ("truncated tensor data", _truncated_tensor_data, "runs past the end of the file"),
    ("wrong magic", _wrong_magic, "not a GGUF file"),
    ("unsupported version", _bad_version, "unsupported GGUF version 7"),
    ("absurd tensor count", _absurd_tensor_count, "1000000000000 tensors"),
    ("absurd metadata count", _absurd_kv_count, "1000000000000 metadata entries"),
    ("missing tensor", _missing_tensor, "missing tensor 'blk.3.attn_kv.weight'"),
    ("wrong dtype (hash table)", _wrong_dtype, "'blk.0.ffn_gate_tid2eid.weight' has type F32, expected I32"),
    ("wrong dtype (norm)", _wrong_dtype_norm, "'blk.1.attn_norm.weight' has type Q8_0"),
    ("wrong shape", _wrong_shape, "'blk.2.attn_q_b.weight' has shape [128, 512], expected [128, 1024]"),
    ("metadata key of the wrong type", _key_wrong_type, "'deepseek4.block_count' is f32, expected u32"),
    ("missing metadata key", _missing_key, "missing metadata key 'deepseek4.attention.q_lora_rank'"),
    ("foreign architecture", _foreign_arch, "architecture is 'llama'"),
    ("impossible compress ratio", _bad_ratio, "compress_ratios[3] is 64"),
    ("vocab size disagrees with tokens", _vocab_mismatch, "tokenizer.ggml.tokens has 4096 entries"),
    ("directory", _directory, "is a directory"),
    ("empty file", _empty, "is empty"),
    ("no such file", _nonexistent, "no such file"),
    # values that used to pass validation and then break (ZeroDivisionError, complex powers, a hang,
    # the BPE library's own exceptions) or load silently as the wrong model
    ("rope base 0", _variant("deepseek4.rope.freq_base = 0"),
     "'deepseek4.rope.freq_base' is 0.0; it must be a finite number above 1"),
    ("rope base -1", _variant("deepseek4.rope.freq_base = i32 -1"), "'deepseek4.rope.freq_base' is -1.0"),
    ("compress rope base NaN", _variant("deepseek4.attention.compress_rope_freq_base = NaN"),
     "'deepseek4.attention.compress_rope_freq_base' is nan"),
    ("yarn beta 0", _variant("deepseek4.rope.scaling.yarn_beta_slow = 0"),
     "'deepseek4.rope.scaling.yarn_beta_slow' is 0.0; it must be in 0.001..10000"),
    ("yarn factor 0", _variant("deepseek4.rope.scaling.factor = 0"), "it must be a finite number of at least 1"),
    ("rms eps -1", _variant("deepseek4.attention.layer_norm_rms_epsilon = -1"),
     "'deepseek4.attention.layer_norm_rms_epsilon' is -1.0; it must be a finite number in (0, 1)"),
    ("hc eps inf", _variant("deepseek4.hyper_connection.epsilon = inf"), "'deepseek4.hyper_connection.epsilon' is inf"),
    ("expert weights scale 0", _variant("deepseek4.expert_weights_scale = 0"),
     "'deepseek4.expert_weights_scale' is 0.0"),
    ("swiglu clamp NaN", _variant("deepseek4.swiglu_clamp_exp entry NaN"), "'deepseek4.swiglu_clamp_exp'[3] is nan"),
    ("sinkhorn iterations 2^31-1", _variant("deepseek4.hyper_connection.sinkhorn_iterations = 2^31-1"),
     "'deepseek4.hyper_connection.sinkhorn_iterations' is 2147483647; it must be in 1..256"),
    ("merges flipped", _variant("merges: first pair flipped"), "tokenizer.ggml.merges[0]"),
    ("merge of garbage", _variant("merges: garbage pair 'Oy zz'"),
     "tokenizer.ggml.merges[5] 'Oy zz': 'Oy' is not in the vocabulary"),
    ("merge without a space", _variant("merges: pair without a space"),
     "tokenizer.ggml.merges[7] is 'abc', not two tokens separated by a space"),
    ("duplicate token", _variant("tokens: duplicate entry"), "tokenizer.ggml.tokens holds"),
    ("BOS marker missing", _variant("tokens: BOS marker renamed"), "lacks the marker '<｜begin▁of▁sentence｜>'"),
    ("bos id outside the vocabulary", _variant("tokenizer.ggml.bos_token_id = vocab size"),
     "'tokenizer.ggml.bos_token_id' is 4096, outside the vocabulary (0..4095)"),
    ("eos id of the wrong type", _variant("tokenizer.ggml.eos_token_id as a string"),
     "'tokenizer.ggml.eos_token_id' is string, expected an integer"),
    ("token types short", _variant("token_type: three short"), "tokenizer.ggml.token_type has 4093 entries"),
    ("overlapping tensor offsets", _variant("tensor: offset of the one before (overlap)"),
     "'blk.2.attn_q_b.weight' data"),
    ("F16 re-typed as F32", _variant("tensor: F16 HC fn re-typed F32"), "overlaps tensor 'blk.0.hc_attn_fn.weight'"),
    ("F16 re-typed as Q8_0", _variant("tensor: F16 embedding re-typed Q8_0"),
     "unused bytes between the end of tensor 'token_embd.weight' and tensor"),
    ("last tensor re-typed smaller", _variant("tensor: Q8_0 output re-typed Q4_K"),
     "bytes after the last tensor 'output.weight'"),
]


@pytest.fixture(scope="module")
def broken(tiny_q2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broken")
    return {cid: (build(tmp, tiny_q2), words) for cid, build, words in CASES}


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_every_loader_rejects_with_one_clear_line(cid, broken, capsys):
    path, words = broken[cid]
    with pytest.raises(ModelFileError) as ei:
        ModelFile.open(path)
    assert str(path) in str(ei.value) and words in str(ei.value)
    for entry, argv in ((gguf_main, ["inspect", str(path)]), (ds4_main, ["-m", str(path), "-p", "hi"]),
                        (agent_main, ["-m", str(path)])):
        assert entry(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {ei.value}"], (entry, err)


@pytest.mark.parametrize("cid", ["truncated tensor data", "absurd tensor count", "foreign architecture",
                                 "directory"])
def test_subprocess_exit_1_without_traceback(cid, broken):
    path, words = broken[cid]
    p = subprocess.run([sys.executable, "-m", "engine.gguf.gguf_cli", "inspect", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1  # not -SIGBUS, not a traceback's exit
    assert "Traceback" not in p.stderr and words in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_unknown_extra_tensor_is_reported_and_ignored(tiny_q2, tmp_path, capsys):
    path = rewrite(tiny_q2, tmp_path / "extra.gguf",
                   add_tensors={"blk.2.attn_mystery.weight": (0, (256, 4)), "mtp.0.e_proj.weight": (8, (256, 256))})
    with ModelFile.open(path) as m:
        assert m.layout.extra == ["blk.2.attn_mystery.weight", "mtp.0.e_proj.weight"]
    assert gguf_main(["inspect", str(path)]) == 0
    assert "ignored tensors not in the layout (2): blk.2.attn_mystery.weight" in capsys.readouterr().out


def test_first_problem_names_how_many_more(tiny_q2, tmp_path):
    path = rewrite(tiny_q2, tmp_path / "many.gguf", drop=["blk.0.attn_kv.weight", "blk.1.attn_kv.weight",
                                                          "blk.2.attn_kv.weight"])
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk.0.attn_kv.weight' \(and 2 more problems"):
        ModelFile.open(path)


def test_bad_hash_table_is_caught_at_load(tiny_q2, tmp_path, capsys):
    """Expert ids outside the range, or twice for one token, would fail (or mis-route) in the middle
    of a forward pass; Engine.open refuses them with the tensor named."""
    from engine import Engine
    from engine.gguf.gguf_file import GGUFFile
    g = GGUFFile(tiny_q2)
    t = g.tensors["blk.1.ffn_gate_tid2eid.weight"]
    g.close()
    data = bytearray(tiny_q2.read_bytes())
    for value, words in ((99, "outside 0..7"), (None, "same expert twice")):
        d = bytearray(data)
        first, second = struct.unpack_from("<ii", d, t.offset)
        struct.pack_into("<ii", d, t.offset, 99 if value else first, second if value else first)
        p = _write(tmp_path, f"hash-{words.split()[0]}.gguf", bytes(d))
        with pytest.raises(ModelFileError, match=words):
            Engine.open(p)
        assert gguf_main(["inspect", str(p)]) == 1      # inspect checks what the loaders check
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0]
