"""Tests for engine.gguf.quants: bit-exactness with gguf-py, hand-worked blocks, streaming helpers."""

import struct

import numpy as np
import pytest

import gguf.quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.gguf import quants as q

FLOAT_TYPES = [q.F32, q.F16, q.BF16, q.Q8_0, q.Q2_K, q.Q4_K, q.IQ2_XXS, q.MXFP4]


def f16b(x: float) -> bytes:
    return np.float16(x).tobytes()


def finite_f16_bits(rng, n):
    """n random f16 bit patterns (both signs, subnormals, large values) that are finite."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    inf_nan = ((bits >> 10) & 31) == 31
    bits[inf_nan] ^= np.uint16(0x4000)  # clear top exponent bit -> finite
    return bits.view(np.uint8).reshape(n, 2)


def random_raw(t, rng, n_blocks):
    """Uniform random bytes with the scale fields made finite / sane. uint8 [n_blocks*block_bytes]."""
    bs = q.FORMATS[t].block_bytes
    raw = rng.integers(0, 256, size=n_blocks * bs, dtype=np.uint8)
    b = raw.reshape(n_blocks, bs)
    if t == q.F32:
        b[:] = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    elif t == q.F16:
        b[:] = finite_f16_bits(rng, n_blocks)
    elif t == q.BF16:
        b[:, 1] &= np.uint8(0xBF)  # exponent never all ones -> finite
    elif t in (q.Q8_0, q.IQ2_XXS):
        b[:, 0:2] = finite_f16_bits(rng, n_blocks)
    elif t == q.Q2_K:
        b[:, 80:82] = finite_f16_bits(rng, n_blocks)
        b[:, 82:84] = finite_f16_bits(rng, n_blocks)
    elif t == q.Q4_K:
        b[:, 0:2] = finite_f16_bits(rng, n_blocks)
        b[:, 2:4] = finite_f16_bits(rng, n_blocks)
    elif t == q.MXFP4:
        b[:, 0] = rng.integers(100, 156, size=n_blocks, dtype=np.uint8)
    return raw


def gguf_deq(t, raw):
    return gq.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(t))


def assert_bits_equal(a, b):
    assert a.dtype == np.float32 and b.dtype == np.float32
    assert a.shape == b.shape
    assert np.array_equal(a, b)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------
# formats


def test_formats_match_gguf():
    assert set(q.FORMATS) == {0, 1, 30, 8, 10, 12, 16, 39, 26}
    ids = dict(F32=q.F32, F16=q.F16, BF16=q.BF16, Q8_0=q.Q8_0, Q2_K=q.Q2_K, Q4_K=q.Q4_K,
               IQ2_XXS=q.IQ2_XXS, MXFP4=q.MXFP4, I32=q.I32)
    assert ids == dict(F32=0, F16=1, BF16=30, Q8_0=8, Q2_K=10, Q4_K=12, IQ2_XXS=16, MXFP4=39, I32=26)
    for t, f in q.FORMATS.items():
        gt = GGMLQuantizationType(t)
        assert f.type_id == t and f.name == gt.name == q.type_name(t)
        assert (f.block_elems, f.block_bytes) == tuple(GGML_QUANT_SIZES[gt])
    assert q.type_name(13) == "type 13"


def test_row_bytes():
    assert q.row_bytes(q.Q2_K, 4096) == 16 * 84
    assert q.row_bytes(q.Q8_0, 64) == 68
    assert q.row_bytes(q.F32, 3) == 12
    assert q.row_bytes(q.BF16, 5) == 10
    assert q.row_bytes(q.MXFP4, 64) == 34
    with pytest.raises(ValueError):
        q.row_bytes(q.Q4_K, 300)
    with pytest.raises(ValueError):
        q.row_bytes(q.Q8_0, 33)
    with pytest.raises(ValueError):
        q.row_bytes(99, 256)


def test_dequantize_errors():
    with pytest.raises(ValueError):
        q.dequantize(q.I32, np.zeros(16, np.uint8))
    with pytest.raises(ValueError):
        q.dequantize(q.Q8_0, np.zeros(35, np.uint8))
    with pytest.raises(ValueError):
        q.random_blocks(q.I32, np.random.default_rng(0), 4, 1.0)


# ---------------------------------------------------------------------------
# bit-exactness with gguf


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=q.type_name)
def test_dequantize_matches_gguf(t):
    rng = np.random.default_rng(1000 + t)
    bs, be = q.FORMATS[t].block_bytes, q.FORMATS[t].block_elems
    # 1-D
    raw = random_raw(t, rng, 37)
    assert_bits_equal(q.dequantize(t, raw), gguf_deq(t, raw))
    # 2-D, several rows
    raw2 = random_raw(t, rng, 6 * 5).reshape(6, 5 * bs)
    out = q.dequantize(t, raw2)
    assert out.shape == (6, 5 * be)
    assert_bits_equal(out, gguf_deq(t, raw2))
    # 3-D
    raw3 = random_raw(t, rng, 2 * 3 * 2).reshape(2, 3, 2 * bs)
    assert_bits_equal(q.dequantize(t, raw3), gguf_deq(t, raw3))
    # non-contiguous view: a column range of every other row
    wide = random_raw(t, rng, 8 * 4).reshape(8, 4 * bs)
    view = wide[::2, bs:3 * bs]
    assert_bits_equal(q.dequantize(t, view), gguf_deq(t, view))


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=q.type_name)
def test_dequantize_chunked_paths(t, monkeypatch):
    """Force tiny decode chunks so the multi-chunk and split-row code paths run."""
    monkeypatch.setattr(q, "_CHUNK_ELEMS", 1024)
    rng = np.random.default_rng(2000 + t)
    bs, be = q.FORMATS[t].block_bytes, q.FORMATS[t].block_elems
    raw = random_raw(t, rng, 4096 // be * 3 + 1)  # one long row, split into several chunks
    assert_bits_equal(q.dequantize(t, raw), gguf_deq(t, raw))
    raw2 = random_raw(t, rng, 3 * (4096 // be) + 1).reshape(-1, bs)  # short rows, grouped per chunk
    assert_bits_equal(q.dequantize(t, raw2), gguf_deq(t, raw2))
    raw3 = random_raw(t, rng, 9 * 4).reshape(9, 4 * bs)[:, bs:3 * bs]  # non-contiguous rows
    assert_bits_equal(q.dequantize(t, raw3), gguf_deq(t, raw3))


def test_mxfp4_extreme_exponents_match_gguf():
    rng = np.random.default_rng(5)
    exps = np.array([0, 1, 2, 3, 126, 127, 128, 129, 200, 253, 254], dtype=np.uint8)
    raw = rng.integers(0, 256, size=(len(exps), 17), dtype=np.uint8)
    raw[:, 0] = exps
    with np.errstate(over="ignore"):  # e >= 254 overflows to inf for |k| >= 8, in both
        ref = gguf_deq(q.MXFP4, raw)
        ours = q.dequantize(q.MXFP4, raw)
    assert_bits_equal(ours, ref)


def test_tables_match_gguf():
    gq.IQ2_XXS.init_grid()
    ggrid = gq.IQ2_XXS.grid.reshape(256, 8)
    assert np.array_equal(q.IQ2XXS_GRID_BYTES.astype(np.float32), ggrid)
    # uint64 form: byte j = element j (ggml-common.h layout)
    assert q.IQ2XXS_GRID.dtype == np.uint64 and q.IQ2XXS_GRID.shape == (256,)
    as_bytes = q.IQ2XXS_GRID.astype("<u8").view(np.uint8).reshape(256, 8)
    assert np.array_equal(as_bytes.astype(np.float32), ggrid)
    assert int(q.IQ2XXS_GRID[0]) == 0x0808080808080808
    assert int(q.IQ2XXS_GRID[1]) == 0x080808080808082B
    assert np.array_equal(q.KSIGNS_IQ2XS, np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8))
    assert q.KSIGNS_IQ2XS[1] == 0x81 and q.KSIGNS_IQ2XS[3] == 0x03 and q.KSIGNS_IQ2XS[127] == 0xFF
    assert np.array_equal(q.MXFP4_KVALUES, np.array(gq.MXFP4.kvalues, dtype=np.int8))


# ---------------------------------------------------------------------------
# hand-worked blocks


def test_q8_0_hand():
    qs = [0, 1, -1, 127, -128, 5] + [0] * 26
    blk = f16b(0.5) + struct.pack("<32b", *qs)
    y = q.dequantize(q.Q8_0, np.frombuffer(blk, np.uint8))
    assert y.shape == (32,)
    assert y[:6].tolist() == [0.0, 0.5, -0.5, 63.5, -64.0, 2.5]
    assert not y[6:].any()


def test_q2_k_hand():
    scales = bytearray(16)
    scales[0] = 0x23   # elements 0..15:    scale 3, min 2
    scales[1] = 0x14   # elements 16..31:   scale 4, min 1
    scales[2] = 0x05   # elements 32..47:   scale 5, min 0
    scales[6] = 0x31   # elements 96..111:  scale 1, min 3
    scales[8] = 0x72   # elements 128..143: scale 2, min 7
    qs = bytearray(64)
    qs[0] = 0b11_10_01_00   # q for shifts 0,2,4,6 -> 0,1,2,3 (elements 0, 32, 64, 96)
    qs[1] = 0b00_00_00_11   # element 1: q=3
    qs[16] = 0b00_00_00_10  # element 16: q=2
    qs[32] = 0b00_00_00_01  # element 128: q=1
    blk = bytes(scales) + bytes(qs) + f16b(1.0) + f16b(0.5)
    assert len(blk) == 84
    y = q.dequantize(q.Q2_K, np.frombuffer(blk, np.uint8))
    assert y.shape == (256,)
    assert y[0] == 3 * 0 - 0.5 * 2       # -1.0
    assert y[1] == 3 * 3 - 0.5 * 2       # 8.0
    assert y[2] == -1.0                  # q=0
    assert y[16] == 4 * 2 - 0.5 * 1      # 7.5
    assert y[17] == -0.5
    assert y[32] == 5 * 1 - 0.0          # 5.0
    assert y[64] == 0.0                  # scales[4] = 0
    assert y[96] == 1 * 3 - 0.5 * 3      # 1.5
    assert y[97] == -1.5
    assert y[128] == 2 * 1 - 0.5 * 7     # -1.5
    assert y[129] == -3.5


def test_q4_k_hand():
    S = bytearray(12)
    S[0] = 0b01_000001   # sc0 = 1, top bits -> sc4 high = 1
    S[1] = 4             # sc1 = 4
    S[4] = 0b10_000011   # m0 = 3, top bits -> m4 high = 2
    S[5] = 0             # m1 = 0
    S[8] = 0x27          # sc4 = 7 | 1<<4 = 23, m4 = 2 | 2<<4 = 34
    qs = bytearray(128)
    qs[0] = 0xA5         # element 0: q=5 (sc0/m0), element 32: q=10 (sc1/m1)
    qs[64] = 0x03        # element 128: q=3 (sc4/m4), element 160: q=0 (sc5=0, m5=0)
    blk = f16b(2.0) + f16b(1.0) + bytes(S) + bytes(qs)
    assert len(blk) == 144
    y = q.dequantize(q.Q4_K, np.frombuffer(blk, np.uint8))
    assert y[0] == 2 * 1 * 5 - 1 * 3     # 7
    assert y[1] == -3.0
    assert y[32] == 2 * 4 * 10 - 0       # 80
    assert y[128] == 2 * 23 * 3 - 1 * 34  # 104
    assert y[129] == -34.0
    assert y[160] == 0.0


def test_iq2_xxs_hand():
    # sub-block 0: groups use grid entries 1, 0, 2, 0; signs 1, 0, 0, 127; scale nibble 3
    a0 = bytes([1, 0, 2, 0])
    a1 = 1 | (0 << 7) | (0 << 14) | (127 << 21) | (3 << 28)
    # sub-block 1: grid entry 0 everywhere, no signs, scale nibble 0
    blk = f16b(1.0) + a0 + struct.pack("<I", a1) + bytes(4) + struct.pack("<I", 0) + bytes(48)
    assert len(blk) == 66
    y = q.dequantize(q.IQ2_XXS, np.frombuffer(blk, np.uint8))
    db = 1.0 * (0.5 + 3) * 0.25          # 0.875
    # grid[1] = 0x080808080808082b: element 0 = 43, rest 8; ksigns[1] = 0x81: elements 0 and 7 negative
    assert y[0:8].tolist() == [-db * 43] + [db * 8] * 6 + [-db * 8]
    assert y[8:16].tolist() == [db * 8] * 8
    # grid[2] = 0x0808080808081919 (packed "0500": 0x05 -> indices 1,1,0,0); sign idx 0 -> all positive
    g2 = [(int(q.IQ2XXS_GRID[2]) >> (8 * j)) & 255 for j in range(8)]
    assert g2 == [25, 25, 8, 8, 8, 8, 8, 8]
    assert y[16:24].tolist() == [db * g for g in g2]
    # ksigns[127] = 0xff: all eight negative
    assert y[24:32].tolist() == [-db * 8] * 8
    # all other sub-blocks: a0 = a1 = 0 -> grid entry 0, no signs, db = 0.5 * 0.25 -> 0.125 * 8 = 1
    assert y[32:].tolist() == [1.0 * 0.5 * 0.25 * 8] * 224


def test_mxfp4_hand():
    qs = bytearray(16)
    qs[0] = 0x9F   # element 0: nibble 15 -> -12, element 16: nibble 9 -> -1
    qs[1] = 0x05   # element 1: nibble 5 -> 6, element 17: 0
    qs[15] = 0x71  # element 15: 1, element 31: 12
    blk = bytes([130]) + bytes(qs) + bytes([0]) + bytes([0x11]) + bytes(15)
    y = q.dequantize(q.MXFP4, np.frombuffer(blk, np.uint8))
    assert y.shape == (64,)
    s = 2.0 ** (130 - 128)  # 4
    assert y[0] == -12 * s and y[16] == -1 * s and y[1] == 6 * s and y[17] == 0
    assert y[15] == 1 * s and y[31] == 12 * s
    # second block: e = 0 -> scale 2^-128 (subnormal float32), nibble 1 -> value 1
    assert y[32] == np.float32(2.0 ** -128) and y[48] == np.float32(2.0 ** -128)
    assert y[32] > 0


# ---------------------------------------------------------------------------
# rows / memmap / matvec


@pytest.mark.parametrize("t", [q.Q2_K, q.IQ2_XXS, q.Q8_0, q.BF16])
def test_dequantize_rows_memmap(t, tmp_path):
    rng = np.random.default_rng(77)
    n_rows, n_elems = 40, 512
    rb = q.row_bytes(t, n_elems)
    raw = random_raw(t, rng, n_rows * rb // q.FORMATS[t].block_bytes).reshape(n_rows, rb)
    path = tmp_path / "w.bin"
    header = b"\x00" * 21  # tensor at an odd file offset: unaligned views
    path.write_bytes(header + raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=len(header), shape=(n_rows, rb))
    full = q.dequantize(t, raw)
    part = q.dequantize_rows(t, mm, 13, 29)
    assert part.shape == (16, n_elems) and part.dtype == np.float32
    assert_bits_equal(part, full[13:29])
    assert q.dequantize_rows(t, mm, 5, 5).shape == (0, n_elems)
    with pytest.raises(ValueError):
        q.dequantize_rows(t, mm, 30, 41)


@pytest.mark.parametrize("t", [q.Q8_0, q.Q2_K, q.Q4_K, q.IQ2_XXS, q.MXFP4, q.F16])
def test_matvec(t):
    rng = np.random.default_rng(9)
    n_rows, n_elems = 103, 512
    raw = q.random_blocks(t, rng, n_rows * n_elems // q.FORMATS[t].block_elems, 0.05)
    w2d = raw.reshape(n_rows, q.row_bytes(t, n_elems))
    W = q.dequantize(t, w2d).astype(np.float64)
    x1 = rng.standard_normal(n_elems).astype(np.float32)
    x2 = rng.standard_normal((n_elems, 3)).astype(np.float32)

    def close(y, ref):
        assert y.dtype == np.float32 and y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    close(q.matvec(t, w2d, x1, chunk_rows=16), W @ x1)
    close(q.matvec(t, w2d, x2, chunk_rows=16), W @ x2)
    close(q.matvec(t, w2d, x1), W @ x1)
    sl = slice(17, 90)
    close(q.matvec(t, w2d, x1, rows=sl, chunk_rows=10), W[sl] @ x1)
    close(q.matvec(t, w2d, x2, rows=sl, chunk_rows=7), W[sl] @ x2)
    with pytest.raises(ValueError):
        q.matvec(t, w2d, x1[:-32])


# ---------------------------------------------------------------------------
# random_blocks


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=q.type_name)
@pytest.mark.parametrize("std", [0.02, 1.5])
def test_random_blocks(t, std):
    f = q.FORMATS[t]
    n_blocks = 200_000 // f.block_elems
    raw = q.random_blocks(t, np.random.default_rng(3), n_blocks, std)
    assert raw.dtype == np.uint8 and raw.shape == (n_blocks * f.block_bytes,)
    y = q.dequantize(t, raw)
    assert np.all(np.isfinite(y))
    assert abs(y.mean()) < 0.1 * std
    assert 0.8 * std < y.std() < 1.2 * std
    # bit-exact with gguf as well (valid blocks)
    assert_bits_equal(y[:4096], gguf_deq(t, raw[:4096 // f.block_elems * f.block_bytes]))
    again = q.random_blocks(t, np.random.default_rng(3), n_blocks, std)
    assert np.array_equal(raw, again)
    other = q.random_blocks(t, np.random.default_rng(4), n_blocks, std)
    assert not np.array_equal(raw, other)


def test_random_blocks_scale_fields_sane():
    rng = np.random.default_rng(0)
    b = q.random_blocks(q.Q2_K, rng, 1000, 0.02).reshape(1000, 84)
    assert np.all(np.isfinite(b[:, 80:84].copy().view(np.float16)))
    b = q.random_blocks(q.Q4_K, rng, 1000, 0.02).reshape(1000, 144)
    assert np.all(np.isfinite(b[:, 0:4].copy().view(np.float16)))
    b = q.random_blocks(q.MXFP4, rng, 1000, 0.02).reshape(1000, 17)
    assert b[:, 0].min() >= 100 and b[:, 0].max() <= 130
