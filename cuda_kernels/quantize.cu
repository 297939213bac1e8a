// ds4's activation quantizers on the device, bit for bit with engine/model/numerics.py
// q8_0_quantize / q8_k_quantize (their docstrings give ds4's source lines and the fast-math forms):
//   Q8_0, per 32 values:  d = amax * fl(1/127);  id = amax != 0 ? 127 / amax : 0
//   Q8_K, per 256 values: m = the signed value of largest |x| (the first on ties);
//                         iscale = m != 0 ? -127 / m : 0;  d = m != 0 ? m * fl(-1/127) : 0
//   codes: rint(x * scale) (round half to even), NaN -> 0, clamped to [-127, 127].
// A NaN in a block makes amax (Q8_0) or m (Q8_K, argmax takes the first NaN) NaN, as NumPy's max /
// argmax do. x [rows, n] float32; q [rows, n] int8; d [rows, n / block]. n % block == 0.
// One warp per block of values, 8 warps a thread block: grid (ceil(n / block / 8), rows).
#include "common.cuh"

namespace {

__device__ __forceinline__ signed char code(float x, float scale) {
  float v = rintf(__fmul_rn(x, scale));
  if (v != v) v = 0.0f;                                 // NaN -> 0
  return (signed char)(int)fminf(fmaxf(v, -127.0f), 127.0f);
}

__device__ __forceinline__ float nanmax(float a, float b) {     // NumPy's max: NaN wins
  return a != a ? a : (b != b ? b : fmaxf(a, b));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256) q8_0_quantize(
    const float* __restrict__ x, signed char* __restrict__ q, float* __restrict__ d, int rows, int n) {
  const int nb = n / 32, b = blockIdx.x * 8 + (threadIdx.x >> 5), r = blockIdx.y, lane = threadIdx.x & 31;
  if (b >= nb || r >= rows) return;                     // whole warps only
  const long long at = (long long)r * n + 32 * b + lane;
  const float v = x[at];
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = nanmax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  q[at] = code(v, id);
  if (lane == 0) d[(long long)r * nb + b] = __fmul_rn(amax, __fdiv_rn(1.0f, 127.0f));
}

extern "C" __global__ void __launch_bounds__(256) q8_k_quantize(
    const float* __restrict__ x, signed char* __restrict__ q, float* __restrict__ d, int rows, int n) {
  const int nb = n / 256, b = blockIdx.x * 8 + (threadIdx.x >> 5), r = blockIdx.y, lane = threadIdx.x & 31;
  if (b >= nb || r >= rows) return;
  const long long base = (long long)r * n + 256 * b;
  // the first position of the largest |x| (a NaN counts as the largest), lane l: values 8l..8l+7
  float best = -1.0f;
  int bi = 256;
  for (int i = 8 * lane; i < 8 * lane + 8; ++i) {
    const float a = fabsf(x[base + i]);
    if (!(best != best) && (a != a || a > best)) { best = a; bi = i; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, o);
    const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
    const bool on = ob != ob, mn = best != best;
    if ((on && (!mn || oi < bi)) || (!on && !mn && (ob > best || (ob == best && oi < bi)))) { best = ob; bi = oi; }
  }
  const float m = x[base + bi];
  const float iscale = m != 0.0f ? __fdiv_rn(-127.0f, m) : 0.0f;
  for (int i = 8 * lane; i < 8 * lane + 8; ++i) q[base + i] = code(x[base + i], iscale);
  if (lane == 0) d[(long long)r * nb + b] = m != 0.0f ? __fmul_rn(m, __fdiv_rn(-1.0f, 127.0f)) : 0.0f;
}
