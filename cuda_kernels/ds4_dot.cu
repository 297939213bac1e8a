// ds4's quantized dot products (engine/model/ds4_matmul.py, the reference of `ds4` numerics), bit
// for bit: the activation comes as Q8 codes and scales (xq int8 [T, n_in], xd float32 [T, n_in /
// block]: numerics.q8_0_quantize / q8_k_quantize), each block's integer dot is exact, and the
// blocks' float32 terms are summed in block order, each step rounded as ds4's build rounds it:
//   Q8_0:    acc += (d_w * d_x) * (float)idot                       (32-value blocks)
//   IQ2_XXS: acc += (d_w * d_x) * (float)bsum, result 0.125f * acc  (bsum over (2s+1) * grid * sign)
//   Q2_K:    acc += (float)((double)isum * (double)(d_x * d) - (double)(((float)summs * d_x) * dmin))
// One warp per (pair, row), 4 a block; out[p] = W[experts[p]] . x[toks[p]] (a dense weight: E = 1,
// experts 0, toks = arange). The integer dots are split over the lanes (integer sums: any order);
// the float32 sum over the blocks runs in order, the same on every lane.
#include "common.cuh"

namespace {

constexpr int ROWS_PER_BLOCK = 4;

__device__ __forceinline__ float dot_q8_0(const unsigned char* w, const signed char* xq, const float* xd, int n_in) {
  const int lane = threadIdx.x & 31, nb = n_in / 32;
  float acc = 0.0f;
  for (int c = 0; c < nb; c += 32) {                 // 32 blocks at a time: block c + lane on each lane
    float t = 0.0f;
    const int k = c + lane;
    if (k < nb) {
      const unsigned char* b = w + 34 * k;
      const signed char* x = xq + 32 * k;
      int idot = 0;
      for (int i = 0; i < 32; ++i) idot += int((signed char)b[2 + i]) * int(x[i]);
      t = __fmul_rn(__fmul_rn(ds4::f16(ds4::ld_u16(b)), xd[k]), float(idot));
    }
    const int n = min(32, nb - c);
    for (int l = 0; l < n; ++l) acc = __fadd_rn(acc, __shfl_sync(0xFFFFFFFFu, t, l));   // in block order
  }
  return acc;
}

// lane l's part of a 256-block's integer dot: IQ2_XXS's 8 values of group l / 4, run l % 4
__device__ __forceinline__ int idot_iq2_xxs(const unsigned char* blk, const signed char* x, int lane) {
  const int g = lane >> 2, r = lane & 3;
  const unsigned char* q = blk + 2 + 8 * g;
  const unsigned a1 = ds4::ld_u32(q + 4);
  const unsigned entry = ds4::IQ2XXS_GRID2[q[r]];
  unsigned s = (a1 >> (7 * r)) & 127u;
  s |= (unsigned(__popc(s)) & 1u) << 7;
  int sum = 0;
  for (int i = 0; i < 8; ++i) {
    const unsigned c = (entry >> (2 * i)) & 3u;
    const int v = c == 0 ? 8 : (c == 1 ? 25 : 43);
    sum += (((s >> i) & 1u) ? -v : v) * int(x[32 * g + 8 * r + i]);
  }
  return int(2 * (a1 >> 28) + 1) * sum;
}

__device__ __forceinline__ float dot_iq2_xxs(const unsigned char* w, const signed char* xq, const float* xd, int n_in) {
  const int lane = threadIdx.x & 31;
  float acc = 0.0f;
  for (int k = 0; k < n_in / 256; ++k) {
    const unsigned char* blk = w + 66 * k;
    const int bsum = ds4::warp_sum(idot_iq2_xxs(blk, xq + 256 * k, lane));
    acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(ds4::f16(ds4::ld_u16(blk)), xd[k]), float(bsum)));
  }
  return __fmul_rn(0.125f, acc);
}

__device__ __forceinline__ float dot_q2_k(const unsigned char* w, const signed char* xq, const float* xd, int n_in) {
  const int lane = threadIdx.x & 31;
  const int v0 = 8 * lane;                           // this lane's 8 values: one sub-block of 16 holds them
  const int h = v0 >> 7, j = (v0 >> 5) & 3, l0 = v0 & 31;
  float acc = 0.0f;
  for (int k = 0; k < n_in / 256; ++k) {
    const unsigned char* blk = w + 84 * k;
    const signed char* x = xq + 256 * k + v0;
    const unsigned sc = blk[v0 >> 4];
    const unsigned char* qs = blk + 16 + 32 * h + l0;
    int isum = 0, summs = 0;
    for (int i = 0; i < 8; ++i) {
      isum += int(sc & 15u) * int((qs[i] >> (2 * j)) & 3u) * int(x[i]);
      summs += int(sc >> 4) * int(x[i]);
    }
    isum = ds4::warp_sum(isum);
    summs = ds4::warp_sum(summs);
    const float dx = xd[k];
    const float dall = __fmul_rn(dx, ds4::f16(ds4::ld_u16(blk + 80)));
    const float mins = __fmul_rn(__fmul_rn(float(summs), dx), ds4::f16(ds4::ld_u16(blk + 82)));
    const double t = __dadd_rn(__dmul_rn(double(float(isum)), double(dall)), -double(mins));
    acc = __fadd_rn(acc, float(t));
  }
  return acc;
}

template <int FMT, int QK> __device__ __forceinline__ void ds4_matvec(
    const unsigned char* raw, const signed char* xq, const float* xd, const int* experts, const int* toks,
    float* out, int n_out, int n_in, int n_pairs) {
  const int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const int p = blockIdx.y;
  if (row >= n_out || p >= n_pairs) return;          // whole warps only
  const unsigned char* w = raw + ((long long)experts[p] * n_out + row) * ds4::row_bytes<FMT>(n_in);
  const long long t = toks[p];
  const signed char* x = xq + t * n_in;
  const float* d = xd + t * (n_in / QK);
  float s;
  if (FMT == ds4::FMT_Q8_0) s = dot_q8_0(w, x, d, n_in);
  else if (FMT == ds4::FMT_IQ2_XXS) s = dot_iq2_xxs(w, x, d, n_in);
  else s = dot_q2_k(w, x, d, n_in);
  if ((threadIdx.x & 31) == 0) out[(long long)p * n_out + row] = s;
}

}  // namespace

#define DS4_DOT(name, FMT, QK)                                                                         \
  extern "C" __global__ void __launch_bounds__(128) ds4_matvec_##name(                                 \
      const unsigned char* __restrict__ raw, const signed char* __restrict__ xq, const float* __restrict__ xd, \
      const int* __restrict__ experts, const int* __restrict__ toks, float* __restrict__ out, int n_out, \
      int n_in, int n_pairs) {                                                                         \
    ds4_matvec<FMT, QK>(raw, xq, xd, experts, toks, out, n_out, n_in, n_pairs);                        \
  }

DS4_DOT(q8_0, ds4::FMT_Q8_0, 32)
DS4_DOT(iq2_xxs, ds4::FMT_IQ2_XXS, 256)
DS4_DOT(q2_k, ds4::FMT_Q2_K, 256)
