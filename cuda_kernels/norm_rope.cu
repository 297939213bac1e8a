// RMSNorm and RoPE, the NumPy reference's numerics (engine/backends/numpy/ops.py,
// engine/model/numerics.py apply_rope).
#include "common.cuh"

// The two RMSNorms: one block of 256 threads per row; the sum of squares in float64 (each square
// exact in float64, as np.square(x, dtype=float64)); the float64 sum runs in another order than
// NumPy's, which almost never moves the float32 result. x, out [rows, n], w [n] (has_w = 0: any).
//   rmsnorm      (NumpyOps.rmsnorm, exact numerics): scale = float32(1 / sqrt(ss / n + eps)) in
//                float64, y = x * scale, then y * w;
//   rmsnorm_ds4  (numerics.rmsnorm_ds4, ds4's): scale = 1.0f / sqrtf((float)(ss / n) + (float)eps)
//                in float32, y = (x * w) * scale.
// Every float32 product, quotient and root is IEEE-rounded (_rn), as NumPy's.
namespace {
__device__ __forceinline__ double row_sum_squares(const float* xr, int n, double* part) {
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { const double v = xr[i]; s += v * v; }
  s = ds4::warp_sum(s);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  double tot = 0.0;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) tot += part[i];
  return tot;                             // (every thread sums the parts in the same order)
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256) rmsnorm_ds4(
    const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int rows, int n,
    double eps, int has_w) {
  __shared__ double part[8];
  const int r = blockIdx.x;
  if (r >= rows) return;
  const float* xr = x + (long long)r * n;
  const float ms = (float)(row_sum_squares(xr, n, part) / n);
  const float sc = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, (float)eps)));
  float* o = out + (long long)r * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    o[i] = has_w ? __fmul_rn(__fmul_rn(xr[i], w[i]), sc) : __fmul_rn(xr[i], sc);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm(
    const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int rows, int n,
    double eps, int has_w) {
  __shared__ double part[8];
  const int r = blockIdx.x;
  if (r >= rows) return;
  const float* xr = x + (long long)r * n;
  const float sc = (float)(1.0 / __dsqrt_rn(row_sum_squares(xr, n, part) / n + eps));
  float* o = out + (long long)r * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float y = __fmul_rn(xr[i], sc);
    o[i] = has_w ? __fmul_rn(y, w[i]) : y;
  }
}

// apply_rope in place: x [rows, heads, width]; the last 2 * n_pairs dims of each head rotated in
// interleaved pairs by row r's angles (thetas + r * theta_stride): c = float32(cos(theta)),
// s = float32(sin(theta)) from float64 (-s when inverse); t0' = t0*c - t1*s, t1' = t0*s + t1*c,
// each product and sum rounded to float32 (the _rn intrinsics: never fused into an fma).
// One thread per (head, pair).
extern "C" __global__ void __launch_bounds__(128) rope(
    float* __restrict__ x, const float* __restrict__ thetas, int rows, int heads, int width, int n_pairs,
    int theta_stride, int inverse) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (i >= heads * n_pairs || r >= rows) return;
  const int h = i / n_pairs, p = i % n_pairs;
  const double th = thetas[(long long)r * theta_stride + p];
  const float c = (float)cos(th);
  const float s0 = (float)sin(th);
  const float s = inverse ? -s0 : s0;
  float* t = x + ((long long)r * heads + h) * width + (width - 2 * n_pairs) + 2 * p;
  const float x0 = t[0], x1 = t[1];
  t[0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  t[1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}
