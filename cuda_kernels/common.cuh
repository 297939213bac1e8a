// Shared device code of the CUDA kernels: GGUF block decoders (layouts: engine/gguf/quants.py),
// warp reductions. Included by the .cu files (NVRTC: -I to this folder; the host emulation adds it).
// No headers at all: NVRTC has no standard ones, and where CuPy finds <cuda_fp16.h> depends on the
// installation; f16 is decoded with integer ops here (exact, as the hardware's cvt).
//
// Decoders work a group of 32 consecutive values of a row at a time (group g = values 32g..32g+31)
// and hand each value to a functor f(i, v), so a matvec fuses the decode into its dot product and
// a dequantizer stores them. Every decoded value is an exact float32 product (an f16 or E8M0 scale
// times a few small integer bits; Q2_K/Q4_K: one exact product minus one rounded subtraction), so
// an fma the compiler forms cannot change it: the values match NumPy's decoders bit for bit.
#pragma once

#ifndef INFINITY            // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace ds4 {

enum { FMT_Q8_0 = 0, FMT_F16 = 1, FMT_IQ2_XXS = 2, FMT_Q2_K = 3, FMT_Q4_K = 4, FMT_MXFP4 = 5 };

__device__ __forceinline__ unsigned ld_u16(const unsigned char* p) { return unsigned(p[0]) | (unsigned(p[1]) << 8); }
__device__ __forceinline__ unsigned ld_u32(const unsigned char* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }
// IEEE half bits -> float32, exactly (normal, subnormal, zero, inf and NaN)
__device__ __forceinline__ float f16(unsigned h) {
  const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3FFu;
  if (e == 31u) return __uint_as_float(sign | 0x7F800000u | (m << 13));
  if (e == 0u) {                          // zero or subnormal: m * 2**-24, exact in float32
    const float v = float(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// E8M0 byte -> 2**(e - 128) (ggml_e8m0_to_fp32_half), exact for every e incl. the subnormal e < 2
__device__ __forceinline__ float e8m0_half(unsigned e) {
  return __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1u) << 23));
}

// MXFP4 E2M1 values doubled (the 0.5 is folded into the E8M0 scale), by nibble
__device__ __forceinline__ float mxfp4_value(unsigned nib) {
  const unsigned mag = nib & 7u;
  const float v = mag < 5u ? float(mag) : (mag == 5u ? 6.0f : (mag == 6u ? 8.0f : 12.0f));
  return (nib & 8u) && mag ? -v : v;     // nibble 8 is +0, as the table has it (not -0)
}

// iq2xxs grid entry i: 8 values, value j = {8, 25, 43}[(entry >> 2j) & 3]. In global memory, not
// __constant__: the 32 lanes of a warp look up 32 different entries, which the constant cache
// would serve one address at a time; L1 serves the 512 bytes in a few wavefronts.
__device__ const unsigned short IQ2XXS_GRID2[256] = {
    0x0000, 0x0002, 0x0005, 0x0008, 0x000a, 0x0011, 0x0014, 0x0020, 0x0022, 0x0028, 0x002a, 0x0041,
    0x0044, 0x0050, 0x0058, 0x0061, 0x0064, 0x0080, 0x0082, 0x008a, 0x00a2, 0x0101, 0x0104, 0x0110,
    0x0115, 0x0140, 0x0184, 0x0198, 0x0200, 0x0202, 0x0222, 0x0282, 0x0401, 0x0404, 0x0410, 0x0421,
    0x0424, 0x0440, 0x0442, 0x0448, 0x0460, 0x0481, 0x0484, 0x0490, 0x04a4, 0x0500, 0x0502, 0x0508,
    0x0520, 0x0546, 0x0569, 0x0580, 0x0591, 0x0609, 0x0610, 0x0640, 0x0684, 0x06a4, 0x0800, 0x0805,
    0x0808, 0x0814, 0x0828, 0x0841, 0x0844, 0x0850, 0x0852, 0x0888, 0x0904, 0x0940, 0x0a02, 0x0a14,
    0x1001, 0x1004, 0x1010, 0x1021, 0x1040, 0x1060, 0x1084, 0x1090, 0x1095, 0x1100, 0x1108, 0x1120,
    0x1150, 0x115a, 0x1180, 0x1224, 0x1245, 0x1400, 0x1408, 0x1420, 0x1425, 0x1449, 0x1480, 0x1518,
    0x1562, 0x1600, 0x1616, 0x1801, 0x1804, 0x1810, 0x1840, 0x1881, 0x1900, 0x1905, 0x19a0, 0x1a51,
    0x2000, 0x2002, 0x200a, 0x2044, 0x2061, 0x2080, 0x2082, 0x2129, 0x2148, 0x2200, 0x2202, 0x2401,
    0x2404, 0x2410, 0x2440, 0x2456, 0x2500, 0x2541, 0x2564, 0x2690, 0x2808, 0x2820, 0x2894, 0x2a44,
    0x4001, 0x4004, 0x4010, 0x4018, 0x4021, 0x4024, 0x4040, 0x4048, 0x4056, 0x4060, 0x4081, 0x4084,
    0x4090, 0x4100, 0x4120, 0x4161, 0x4180, 0x4185, 0x4201, 0x4210, 0x4248, 0x4256, 0x4268, 0x4400,
    0x4408, 0x4420, 0x4480, 0x4499, 0x4512, 0x4524, 0x4600, 0x4801, 0x4804, 0x4810, 0x4840, 0x4845,
    0x4900, 0x4958, 0x4961, 0x4982, 0x4a45, 0x4a90, 0x5000, 0x5008, 0x5011, 0x5019, 0x5020, 0x5080,
    0x5088, 0x5104, 0x5142, 0x51a4, 0x5291, 0x5490, 0x5492, 0x550a, 0x5601, 0x5654, 0x5800, 0x5811,
    0x5819, 0x5864, 0x5940, 0x5a08, 0x6004, 0x6010, 0x6040, 0x6068, 0x6100, 0x6155, 0x6218, 0x6260,
    0x6400, 0x6405, 0x6510, 0x6512, 0x6584, 0x6842, 0x8000, 0x8002, 0x800a, 0x8041, 0x8082, 0x8104,
    0x8118, 0x8140, 0x8211, 0x8401, 0x8404, 0x8410, 0x8415, 0x8440, 0x8460, 0x8500, 0x8546, 0x8594,
    0x8609, 0x8640, 0x8660, 0x8802, 0x8904, 0x8a11, 0x9004, 0x9010, 0x9024, 0x9040, 0x90a1, 0x9116,
    0x9180, 0x9245, 0x9400, 0x9422, 0x9444, 0x9551, 0x9881, 0x9920, 0xa002, 0xa050, 0xa085, 0xa109,
    0xa200, 0xa418, 0xa850, 0xa904,
};
template <int FMT> struct Fmt;

template <> struct Fmt<FMT_Q8_0> {       // 32 values in 34 bytes: f16 d, int8 q[32]; v = q * d
  static constexpr int VALUES = 32, BYTES = 34;
  template <class F> __device__ __forceinline__ static void group(const unsigned char* row, int g, F&& f) {
    const unsigned char* b = row + 34 * g;
    const float d = f16(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 32; ++i) f(i, float((signed char)b[2 + i]) * d);
  }
};

template <> struct Fmt<FMT_F16> {        // plain f16 values; a "block" of 32 is 64 bytes
  static constexpr int VALUES = 32, BYTES = 64;
  template <class F> __device__ __forceinline__ static void group(const unsigned char* row, int g, F&& f) {
    const unsigned char* b = row + 64 * g;
#pragma unroll
    for (int i = 0; i < 32; ++i) f(i, f16(ld_u16(b + 2 * i)));
  }
};

template <> struct Fmt<FMT_MXFP4> {      // 32 values in 17 bytes: E8M0 e, then 16 bytes of nibbles
  static constexpr int VALUES = 32, BYTES = 17;
  template <class F> __device__ __forceinline__ static void group(const unsigned char* row, int g, F&& f) {
    const unsigned char* b = row + 17 * g;
    const float d = e8m0_half(b[0]);
#pragma unroll
    for (int i = 0; i < 16; ++i) {      // value i: low nibble of byte i; value 16 + i: its high nibble
      const unsigned q = b[1 + i];
      f(i, d * mxfp4_value(q & 15u));
      f(16 + i, d * mxfp4_value(q >> 4));
    }
  }
};

// IQ2_XXS, 256 values in 66 bytes: f16 d, then 8 groups of (u8 a0[4], u32 a1); group u holds
// values 32u..32u+31: four runs of 8, run r = grid entry a0[r] with the signs of
// ksigns((a1 >> 7r) & 127), scaled by d * (0.5 + (a1 >> 28)) * 0.25.
template <> struct Fmt<FMT_IQ2_XXS> {
  static constexpr int VALUES = 256, BYTES = 66;
  template <class F> __device__ __forceinline__ static void group(const unsigned char* row, int g, F&& f) {
    const unsigned char* blk = row + 66 * (g >> 3);
    const unsigned char* q = blk + 2 + 8 * (g & 7);
    const unsigned a1 = ld_u32(q + 4);
    const float db = f16(ld_u16(blk)) * (0.5f + float(a1 >> 28)) * 0.25f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const unsigned entry = IQ2XXS_GRID2[q[r]];
      unsigned s = (a1 >> (7 * r)) & 127u;
      s |= (unsigned(__popc(s)) & 1u) << 7;       // ksigns: bit 7 makes the parity even
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const unsigned c = (entry >> (2 * i)) & 3u;
        const float v = c == 0 ? 8.0f : (c == 1 ? 25.0f : 43.0f);
        f(8 * r + i, db * (((s >> i) & 1u) ? -v : v));
      }
    }
  }
};

// Q2_K, 256 values in 84 bytes: u8 scales[16], u8 qs[64], f16 d, f16 dmin; value 128h + 32j + l is
// (qs[32h + l] >> 2j) & 3, in sub-block (value / 16) with scale byte s: d*(s & 15)*q - dmin*(s >> 4).
template <> struct Fmt<FMT_Q2_K> {
  static constexpr int VALUES = 256, BYTES = 84;
  template <class F> __device__ __forceinline__ static void group(const unsigned char* row, int g, F&& f) {
    const unsigned char* blk = row + 84 * (g >> 3);
    const int u = g & 7;
    const float d = f16(ld_u16(blk + 80)), dmin = f16(ld_u16(blk + 82));
    const unsigned char* qs = blk + 16 + 32 * (u >> 2);
    const int shift = 2 * (u & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned sc = blk[2 * u + h];
      const float dl = d * float(sc & 15u), ml = dmin * float(sc >> 4);
#pragma unroll
      for (int l = 0; l < 16; ++l) f(16 * h + l, dl * float((qs[16 * h + l] >> shift) & 3u) - ml);
    }
  }
};

// Q4_K, 256 values in 144 bytes: f16 d, f16 dmin, u8 scales[12] (8 six-bit scales and mins),
// u8 qs[128]; value 64p + 32h + l is (qs[32p + l] >> 4h) & 15 in sub-block 2p + h.
template <> struct Fmt<FMT_Q4_K> {
  static constexpr int VALUES = 256, BYTES = 144;
  template <class F> __device__ __forceinline__ static void group(const unsigned char* row, int g, F&& f) {
    const unsigned char* blk = row + 144 * (g >> 3);
    const int j = g & 7;                  // the sub-block of 32 values
    const unsigned char* s = blk + 4;
    unsigned sc, mn;
    if (j < 4) {
      sc = s[j] & 63u;
      mn = s[j + 4] & 63u;
    } else {
      sc = (s[j + 4] & 15u) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    const float dl = f16(ld_u16(blk)) * float(sc), ml = f16(ld_u16(blk + 2)) * float(mn);
    const unsigned char* qs = blk + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) f(l, dl * float((qs[l] >> shift) & 15u) - ml);
  }
};

template <int FMT> __device__ __forceinline__ long long row_bytes(int n_in) {
  return (long long)(n_in / Fmt<FMT>::VALUES) * Fmt<FMT>::BYTES;
}

// the sum over the 32 lanes of a warp, in a butterfly: every lane gets the same value
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
template <typename T> __device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) { const T w = __shfl_xor_sync(0xFFFFFFFFu, v, o); v = w > v ? w : v; }
  return v;
}

}  // namespace ds4
