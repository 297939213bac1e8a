// The compressors' pooling on the device (Model._compress_store through ops.compress_pool): each
// closed window's rows are pooled column by column, a softmax of the scores over the window's rows
// weighting the rows' values, in the reference's float32 steps (NumpyOps.softmax over axis 1, then
// (a * kv).sum(axis=1)), each step rounded as NumPy rounds it (the _rn intrinsics: never fused):
//   m = max_k s_k (0 where not finite); e_k = expf(s_k - m); S = e_0 + e_1 + ... (in row order);
//   out = (e_0 / S) * v_0 + (e_1 / S) * v_1 + ...  (in row order, a product rounded, then a sum).
// Only expf can differ from the host's (the device's is within 2 ulp); everything else is the
// reference's bits.
// kv, sc [rows, w] float32: the frontier's projections (rows relative to its first position);
// win [n, 2] int32: (row of the window's first position, 1 if a previous window exists);
// out [n, hd] float32. overlap (ratio 4, w = 2 hd): a window pools the previous window's r rows,
// columns [0, hd) (score -inf and value 0 where there is none), then its own r rows, columns
// [hd, 2 hd); otherwise (w = hd) its own r rows.
// grid (n, ceil(hd / 128), 1), block (128, 1, 1).
#include "common.cuh"

namespace {

struct Window {
  const float* kv;
  const float* sc;
  int first, has_prev, r, w, hd, overlap, j;

  __device__ __forceinline__ int terms() const { return overlap ? 2 * r : r; }
  // term k's score and value (k < r with overlap: the previous window's first half)
  __device__ __forceinline__ void at(int k, float& s, float& v) const {
    if (overlap && k < r) {
      if (!has_prev) { s = -__int_as_float(0x7F800000); v = 0.0f; return; }
      const long long o = (long long)(first - r + k) * w + j;
      s = sc[o]; v = kv[o];
      return;
    }
    const int row = overlap ? first + k - r : first + k;
    const long long o = (long long)row * w + (overlap ? hd : 0) + j;
    s = sc[o]; v = kv[o];
  }
};

}  // namespace

extern "C" __global__ void __launch_bounds__(128) compress_pool(
    const float* kv, const float* sc, const int* win, float* out, int n, int w, int r, int hd, int overlap) {
  const int i = blockIdx.x, j = blockIdx.y * 128 + threadIdx.x;
  if (i >= n || j >= hd) return;
  const Window W{kv, sc, win[2 * i], win[2 * i + 1], r, w, hd, overlap, j};
  const int L = W.terms();
  float s, v, m = -__int_as_float(0x7F800000);
  for (int k = 0; k < L; ++k) { W.at(k, s, v); m = fmaxf(m, s); }
  if (!isfinite(m)) m = 0.0f;
  float S = 0.0f;
  for (int k = 0; k < L; ++k) {
    W.at(k, s, v);
    const float e = expf(__fsub_rn(s, m));
    S = k == 0 ? e : __fadd_rn(S, e);
  }
  float acc = 0.0f;
  for (int k = 0; k < L; ++k) {
    W.at(k, s, v);
    const float t = __fmul_rn(__fdiv_rn(expf(__fsub_rn(s, m)), S), v);
    acc = k == 0 ? t : __fadd_rn(acc, t);
  }
  out[(long long)i * hd + j] = acc;
}
