// RMSNorm and RoPE, the NumPy reference's numerics (engine/backends/numpy/ops.py,
// engine/model/numerics.py apply_rope).
#include "common.cuh"

// NumpyOps.rmsnorm: the mean of squares in float64 (each square exact in float64, as
// np.square(x, dtype=float64)), scale = float32(1 / sqrt(ms + eps)) in float64, y = x * scale,
// then y * w, each product rounded to float32. One block of 256 threads per row; the float64 sum
// runs in another order than NumPy's, which almost never moves the float32 scale.
extern "C" __global__ void __launch_bounds__(256) rmsnorm(
    const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int rows, int n,
    double eps, int has_w) {
  __shared__ double part[8];
  __shared__ float sh_scale;
  const int r = blockIdx.x;
  if (r >= rows) return;
  const float* xr = x + (long long)r * n;
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { const double v = xr[i]; s += v * v; }
  s = ds4::warp_sum(s);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0.0;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) tot += part[i];
    sh_scale = (float)(1.0 / sqrt(tot / n + eps));
  }
  __syncthreads();
  const float sc = sh_scale;
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
