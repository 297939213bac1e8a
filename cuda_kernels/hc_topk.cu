// The HC Sinkhorn split, the top-k selection (router and indexer) and the indexer's scores.
#include "common.cuh"

// NumpyOps.hc_split, one thread per token, n <= 8. mix [T, 2n + n*n], scale [3], base [2n + n*n];
// pre [T, n] = sigmoid(mix[:n] * s0 + base[:n]) + eps, post [T, n] = 2 sigmoid(mix[n:2n] * s1 +
// base[n:2n]), C [T, n, n] = the row softmax of mix[2n:] * s2 + base[2n:] (+ eps), columns
// normalised (x / (sum + eps)), then iters - 1 rounds of rows and columns. Products and sums
// rounded one at a time (_rn: no fma), sums in index order, as NumPy's; expf may differ from
// NumPy's float32 exp by an ulp.
extern "C" __global__ void __launch_bounds__(128) hc_split(
    const float* __restrict__ mix, const float* __restrict__ scale, const float* __restrict__ base,
    float* __restrict__ pre, float* __restrict__ post, float* __restrict__ C, int T, int n, float eps, int iters) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T || n > 8 || n < 1) return;
  const int W = 2 * n + n * n;
  const float* m = mix + (long long)t * W;
  for (int i = 0; i < n; ++i) {
    const float a = __fadd_rn(__fmul_rn(m[i], scale[0]), base[i]);
    pre[(long long)t * n + i] = __fadd_rn(1.0f / __fadd_rn(1.0f, expf(-a)), eps);
    const float b = __fadd_rn(__fmul_rn(m[n + i], scale[1]), base[n + i]);
    post[(long long)t * n + i] = 2.0f * (1.0f / __fadd_rn(1.0f, expf(-b)));
  }
  float c[64];
  for (int i = 0; i < n; ++i) {
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
      c[i * n + j] = __fadd_rn(__fmul_rn(m[2 * n + i * n + j], scale[2]), base[2 * n + i * n + j]);
      mx = fmaxf(mx, c[i * n + j]);
    }
    if (!(mx > -INFINITY && mx < INFINITY)) mx = 0.0f;   // as NumPy's softmax: a non-finite max is 0
    float s = 0.0f;
    for (int j = 0; j < n; ++j) { c[i * n + j] = expf(__fsub_rn(c[i * n + j], mx)); s = __fadd_rn(s, c[i * n + j]); }
    for (int j = 0; j < n; ++j) c[i * n + j] = __fadd_rn(c[i * n + j] / s, eps);
  }
  const int rounds = iters > 1 ? iters : 1;    // iters <= 1: the column pass only
  for (int r = 0; r < rounds; ++r) {
    if (r > 0) {                                  // rows (not in the first round: columns come first)
      for (int i = 0; i < n; ++i) {
        float s = 0.0f;
        for (int j = 0; j < n; ++j) s = __fadd_rn(s, c[i * n + j]);
        for (int j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / __fadd_rn(s, eps);
      }
    }
    for (int j = 0; j < n; ++j) {                 // columns
      float s = 0.0f;
      for (int i = 0; i < n; ++i) s = __fadd_rn(s, c[i * n + j]);
      for (int i = 0; i < n; ++i) c[i * n + j] = c[i * n + j] / __fadd_rn(s, eps);
    }
  }
  for (int k = 0; k < n * n; ++k) C[(long long)t * n * n + k] = c[k];
}

namespace {
constexpr int TOPK_MAX = 1024, TOPK_THREADS = 512;

// an order-preserving uint key of a float: larger float -> larger key; -0 counts as +0 and NaN as
// below -inf (as NumPy's argsort of -x places them)
__device__ __forceinline__ unsigned topk_key(float v) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0u;
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned warp_prefix_exclusive(unsigned v) {
  const int lane = threadIdx.x & 31;
  unsigned s = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned y = __shfl_up_sync(0xFFFFFFFFu, s, o);
    if (lane >= o) s += y;
  }
  return s - v;
}
}  // namespace

// NumpyOps.topk_lowest_index: the k largest scores of each row, descending, ties to the lowest
// index. One block of 512 threads per row (the Metal kernel's three steps):
//  1. radix select on topk_key (4 passes of 8 bits, shared-memory histograms): the k-th largest
//     key thr, and need = how many keys equal to thr belong to the top k;
//  2. ordered compaction: keys > thr and the first `need` keys == thr, in index order (warp
//     prefix sums, then across the warps);
//  3. bitonic sort of the <= 1024 (key, index) pairs: key descending, index ascending.
extern "C" __global__ void __launch_bounds__(512) topk(
    const float* __restrict__ scores, int* __restrict__ out, int T, int C, int k) {
  __shared__ unsigned hist[256];
  __shared__ unsigned sh[2];
  __shared__ unsigned sg_gt[TOPK_THREADS / 32], sg_eq[TOPK_THREADS / 32];
  __shared__ unsigned sel_key[TOPK_MAX], sel_idx[TOPK_MAX];
  const int row = blockIdx.x;
  if (row >= T || k < 1 || k > TOPK_MAX || k > C) return;
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  const unsigned sg = tid >> 5, lane = tid & 31;
  const float* s = scores + (long long)row * C;
  unsigned prefix = 0, pmask = 0, need = (unsigned)k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (unsigned b = tid; b < 256; b += nt) hist[b] = 0u;
    __syncthreads();
    for (unsigned c = tid; c < (unsigned)C; c += nt) {
      const unsigned key = topk_key(s[c]);
      if ((key & pmask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {                       // the digit of the need-th largest among the candidates
      unsigned above = 0, b = 255;
      for (; b > 0; --b) {
        if (above + hist[b] >= need) break;
        above += hist[b];
      }
      sh[0] = prefix | (b << shift);
      sh[1] = need - above;
    }
    __syncthreads();
    prefix = sh[0];
    need = sh[1];
    pmask |= 255u << shift;
    __syncthreads();                      // sh and hist are rewritten by the next pass
  }
  const unsigned thr = prefix;
  unsigned gt_base = 0, eq_base = 0;
  for (unsigned c0 = 0; c0 < (unsigned)C; c0 += nt) {
    const unsigned c = c0 + tid;
    const unsigned key = c < (unsigned)C ? topk_key(s[c]) : 0u;
    const unsigned gt = (c < (unsigned)C && key > thr) ? 1u : 0u;
    const unsigned eq = (c < (unsigned)C && key == thr) ? 1u : 0u;
    const unsigned gt_ex = warp_prefix_exclusive(gt), eq_ex = warp_prefix_exclusive(eq);
    const unsigned gt_sum = ds4::warp_sum(gt), eq_sum = ds4::warp_sum(eq);
    if (lane == 0) { sg_gt[sg] = gt_sum; sg_eq[sg] = eq_sum; }
    __syncthreads();
    unsigned gt_before = gt_base + gt_ex, eq_before = eq_base + eq_ex;
    for (unsigned j = 0; j < nt / 32; ++j) {
      if (j < sg) { gt_before += sg_gt[j]; eq_before += sg_eq[j]; }
      gt_base += sg_gt[j];
      eq_base += sg_eq[j];
    }
    if (gt != 0 || (eq != 0 && eq_before < need)) {
      const unsigned slot = gt_before + min(eq_before, need);
      sel_key[slot] = key;
      sel_idx[slot] = c;
    }
    __syncthreads();                      // sg_gt / sg_eq are rewritten next chunk
  }
  unsigned n2 = 1;
  while (n2 < (unsigned)k) n2 <<= 1;
  for (unsigned i = k + tid; i < n2; i += nt) { sel_key[i] = 0u; sel_idx[i] = 0xFFFFFFFFu; }
  __syncthreads();
  for (unsigned size = 2; size <= n2; size <<= 1) {
    for (unsigned stride = size >> 1; stride > 0; stride >>= 1) {
      for (unsigned i = tid; i < n2; i += nt) {
        const unsigned j = i ^ stride;
        if (j <= i) continue;
        const unsigned ka = sel_key[i], kb = sel_key[j], ia = sel_idx[i], ib = sel_idx[j];
        const bool b_first = kb > ka || (kb == ka && ib < ia);
        const bool ascending = (i & size) == 0;
        if (ascending == b_first) { sel_key[i] = kb; sel_key[j] = ka; sel_idx[i] = ib; sel_idx[j] = ia; }
      }
      __syncthreads();
    }
  }
  for (unsigned i = tid; i < (unsigned)k; i += nt) out[(long long)row * k + i] = (int)sel_idx[i];
}

// NumpyOps.indexer_scores: out[t, c] = sum_h wts[t, h] * relu(qi[t, h] . keys[c]), in float64,
// stored as float32. One warp per (t, c), 4 a block; lanes share out the D dims.
extern "C" __global__ void __launch_bounds__(128) indexer_scores(
    const float* __restrict__ qi, const float* __restrict__ keys, const float* __restrict__ wts,
    float* __restrict__ out, int T, int H, int D, int C) {
  const int c = blockIdx.x * 4 + (threadIdx.x >> 5), t = blockIdx.y;
  if (c >= C || t >= T) return;
  const int lane = threadIdx.x & 31;
  const float* kr = keys + (long long)c * D;
  double total = 0.0;
  for (int h = 0; h < H; ++h) {
    const float* qr = qi + ((long long)t * H + h) * D;
    double s = 0.0;
    for (int d = lane; d < D; d += 32) s += (double)qr[d] * (double)kr[d];
    s = ds4::warp_sum(s);
    total += (double)wts[(long long)t * H + h] * (s > 0.0 ? s : 0.0);
  }
  if (lane == 0) out[(long long)t * C + c] = (float)total;
}
