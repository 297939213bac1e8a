// ds4's KV-row storage rounding on the device (`ds4` numerics), bit for bit with
// NumpyOps.store_kv = numerics.f16_round(numerics.fp8_e4m3_roundtrip(rows, n_nope)) for finite rows:
//   per block of 64 of the first n_nope values: amax = max(max|x|, 1e-4);
//   scale = 2^ceil(log2f(amax * fl(1/448))) (log2 in float64, rounded once to float32, as the
//   reference); v = clamp(x / scale, -448, 448); x = e4m3(v) * scale (nearest E4M3FN value, ties
//   to the even mantissa; sign as ds4 writes it: v < 0 ? -q : q);
//   then every value (the RoPE tail too) rounded to float16 and back (RNE, gradual underflow,
//   overflow to inf), with integer ops: the kernels include no header.
// x, out [rows, n] float32 (out may be x); n_nope % 64 == 0. grid (rows, 1, 1), block (64, 1, 1).
#include "common.cuh"

namespace {

__device__ __forceinline__ float f16_round(float f) {
  const unsigned x = __float_as_uint(f), sign = x & 0x80000000u, a = x & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return f;                               // inf, NaN
  if (a >= 0x477FF000u) return __uint_as_float(sign | 0x7F800000u);     // >= 65520: inf
  if (a < 0x38800000u) {                                        // below 2^-14: steps of 2^-24
    const float v = __fmul_rn(rintf(__fmul_rn(__uint_as_float(a), 16777216.0f)), 5.9604644775390625e-8f);
    return __uint_as_float(sign | __float_as_uint(v));
  }
  return __uint_as_float(sign | ((a + 0xFFFu + ((a >> 13) & 1u)) & 0xFFFFE000u));   // 10 bits, RNE
}

__device__ __forceinline__ float e4m3(float v) {
  const float av = fminf(fabsf(v), 448.0f);
  int ex;
  frexpf(av, &ex);                                              // av = f * 2^ex, f in [0.5, 1)
  const int step = max(ex - 1, -6) - 3;                          // grid spacing 2^step
  const float q = ldexpf(rintf(ldexpf(av, -step)), step);
  return v < 0.0f ? -q : q;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(64) kv_store_ds4(
    const float* x, float* out, int rows, int n, int n_nope) {
  __shared__ float wmax[2];
  const int r = blockIdx.x, t = threadIdx.x;
  if (r >= rows) return;
  const float* xr = x + (long long)r * n;
  float* o = out + (long long)r * n;
  for (int b = 0; b < n_nope; b += 64) {
    const float v = xr[b + t];
    float m = fabsf(v);
    for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
    if ((t & 31) == 0) wmax[t >> 5] = m;
    __syncthreads();
    const float amax = fmaxf(fmaxf(wmax[0], wmax[1]), 1.0e-4f);
    __syncthreads();                                            // (wmax is rewritten by the next block)
    const float ratio = __fmul_rn(amax, __fdiv_rn(1.0f, 448.0f));
    const int e = (int)ceilf((float)log2((double)ratio));
    const float scale = ldexpf(1.0f, e);
    const float y = fminf(fmaxf(__fdiv_rn(v, scale), -448.0f), 448.0f);
    o[b + t] = f16_round(__fmul_rn(e4m3(y), scale));
  }
  for (int i = n_nope + t; i < n; i += 64) o[i] = f16_round(xr[i]);
}
