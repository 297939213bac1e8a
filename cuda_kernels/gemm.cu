// Prefill: the routed experts' products with the pairs grouped by expert. The host sorts the
// (expert, token) pairs by expert and cuts each expert's run into chunks of at most TP pairs
// (perm, chunks: engine.backends.mlx.metal.batch_plan(experts, tile_pairs=16)). A block of 128
// threads takes TR = 64 rows of one expert and one chunk; for each group of 32 inputs, threads
// 0..63 dequantize the 64 x 32 weight tile into shared memory once (one row each) while threads
// 64..127 stage the chunk's 16 x 32 inputs, and every thread then adds 8 (row, pair) products
// from the tiles. FMA tiles, float32: docs/cuda.md says why not tensor cores (yet).
#include "common.cuh"

namespace {

constexpr int TR = 64, TP = 16, TK = 32;

template <int FMT> __device__ __forceinline__ void gemm_experts(
    const unsigned char* raw, const float* x, const int* experts, const int* toks, const int* perm,
    const int* chunks, float* out, int n_out, int n_in, int n_chunks) {
  __shared__ float wt[TR][TK + 1];       // +1: rows fall in different banks
  __shared__ float xt[TP][TK];
  const int c = blockIdx.y;
  if (c >= n_chunks) return;             // (the whole block: no barrier is left half-reached)
  const int start = chunks[2 * c], count = chunks[2 * c + 1];
  const int e = experts[perm[start]];
  const int row0 = blockIdx.x * TR;
  const int tid = threadIdx.x;
  const int r = tid & (TR - 1), ph = tid >> 6;          // this thread's row and half of the pairs
  const long long rb = ds4::row_bytes<FMT>(n_in);
  const unsigned char* wrow = raw + ((long long)e * n_out + (row0 + r)) * rb;
  const bool row_ok = row0 + r < n_out;
  float acc[TP / 2];
#pragma unroll
  for (int j = 0; j < TP / 2; ++j) acc[j] = 0.0f;
  for (int g = 0; g < n_in / TK; ++g) {
    if (ph == 0) {                       // the weight tile: row r's group g
      if (row_ok) ds4::Fmt<FMT>::group(wrow, g, [&](int i, float v) { wt[r][i] = v; });
      else for (int i = 0; i < TK; ++i) wt[r][i] = 0.0f;
    } else {                             // the input tile: 16 pairs x 32 values, 8 a thread
      for (int j = 0; j < TP * TK / 64; ++j) {
        const int idx = r + 64 * j, pi = idx / TK, col = idx % TK;
        xt[pi][col] = pi < count ? x[(long long)toks[perm[start + pi]] * n_in + TK * g + col] : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < TK; ++k) {
      const float w = wt[r][k];
#pragma unroll
      for (int j = 0; j < TP / 2; ++j) acc[j] += w * xt[ph * (TP / 2) + j][k];
    }
    __syncthreads();                     // the tiles are rewritten by the next group
  }
  if (!row_ok) return;
#pragma unroll
  for (int j = 0; j < TP / 2; ++j) {
    const int pi = ph * (TP / 2) + j;
    if (pi < count) out[(long long)perm[start + pi] * n_out + row0 + r] = acc[j];
  }
}

}  // namespace

#define DS4_GEMM_EXPERTS(name, FMT)                                                                    \
  extern "C" __global__ void __launch_bounds__(128) gemm_experts_##name(                               \
      const unsigned char* __restrict__ raw, const float* __restrict__ x, const int* __restrict__ experts, \
      const int* __restrict__ toks, const int* __restrict__ perm, const int* __restrict__ chunks,      \
      float* __restrict__ out, int n_out, int n_in, int n_chunks) {                                    \
    gemm_experts<FMT>(raw, x, experts, toks, perm, chunks, out, n_out, n_in, n_chunks);                \
  }

DS4_GEMM_EXPERTS(q8_0, ds4::FMT_Q8_0)
DS4_GEMM_EXPERTS(f16, ds4::FMT_F16)
DS4_GEMM_EXPERTS(iq2_xxs, ds4::FMT_IQ2_XXS)
DS4_GEMM_EXPERTS(q2_k, ds4::FMT_Q2_K)
DS4_GEMM_EXPERTS(q4_k, ds4::FMT_Q4_K)
DS4_GEMM_EXPERTS(mxfp4, ds4::FMT_MXFP4)
