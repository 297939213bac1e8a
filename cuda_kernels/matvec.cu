// Decode matvecs: the routed experts' products over the selected (expert, token) pairs only, the
// dense non-expert products, and the row dequantizer (embedding lookup). They read the GGUF blocks
// in place. One warp per output row, 4 rows a block of 128 threads: lane l takes groups of 32
// values l, l + 32, ... of the row (for the 32-value formats a lane's group is one block, so a
// warp reads 32 consecutive blocks), decodes them in registers and adds value * x; the warp sums
// its lanes in a butterfly. Accumulation in float32. Launch shapes: cuda_kernels/README.md.
#include "common.cuh"

namespace {

constexpr int ROWS_PER_BLOCK = 4;

// one warp's product of the row at w with x (n_in values); every lane returns the sum
template <int FMT> __device__ __forceinline__ float row_dot(const unsigned char* w, const float* x, int n_in) {
  const int lane = threadIdx.x & 31;
  const int groups = n_in / 32;
  float acc = 0.0f;
  for (int g = lane; g < groups; g += 32) {
    const float* xg = x + 32 * g;
    ds4::Fmt<FMT>::group(w, g, [&](int i, float v) { acc += v * xg[i]; });
  }
  return ds4::warp_sum(acc);
}

template <int FMT> __device__ __forceinline__ void matvec_experts(
    const unsigned char* raw, const float* x, const int* experts, const int* toks, float* out,
    int n_out, int n_in, int n_pairs) {
  const int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const int p = blockIdx.y;
  if (row >= n_out || p >= n_pairs) return;          // whole warps only: the shuffles stay full
  const long long rb = ds4::row_bytes<FMT>(n_in);
  const unsigned char* w = raw + ((long long)experts[p] * n_out + row) * rb;
  const float s = row_dot<FMT>(w, x + (long long)toks[p] * n_in, n_in);
  if ((threadIdx.x & 31) == 0) out[(long long)p * n_out + row] = s;
}

template <int FMT> __device__ __forceinline__ void matvec_dense(
    const unsigned char* raw, const float* x, float* out, int n_out, int n_in, int T) {
  const int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const int t = blockIdx.y;
  if (row >= n_out || t >= T) return;
  const float s = row_dot<FMT>(raw + row * ds4::row_bytes<FMT>(n_in), x + (long long)t * n_in, n_in);
  if ((threadIdx.x & 31) == 0) out[(long long)t * n_out + row] = s;
}

template <int FMT> __device__ __forceinline__ void dequant_rows(
    const unsigned char* raw, const int* rows, float* out, int n_rows, int n_in) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (g >= n_in / 32 || r >= n_rows) return;
  const unsigned char* w = raw + (long long)rows[r] * ds4::row_bytes<FMT>(n_in);
  float* o = out + (long long)r * n_in + 32 * g;
  ds4::Fmt<FMT>::group(w, g, [&](int i, float v) { o[i] = v; });
}

}  // namespace

#define DS4_MATVEC_EXPERTS(name, FMT)                                                                  \
  extern "C" __global__ void __launch_bounds__(128) matvec_experts_##name(                             \
      const unsigned char* __restrict__ raw, const float* __restrict__ x, const int* __restrict__ experts, \
      const int* __restrict__ toks, float* __restrict__ out, int n_out, int n_in, int n_pairs) {       \
    matvec_experts<FMT>(raw, x, experts, toks, out, n_out, n_in, n_pairs);                             \
  }
#define DS4_DEQUANT_ROWS(name, FMT)                                                                    \
  extern "C" __global__ void __launch_bounds__(128) dequant_rows_##name(                               \
      const unsigned char* __restrict__ raw, const int* __restrict__ rows, float* __restrict__ out,    \
      int n_rows, int n_in) {                                                                          \
    dequant_rows<FMT>(raw, rows, out, n_rows, n_in);                                                   \
  }
#define DS4_MATVEC_DENSE(name, FMT)                                                                    \
  extern "C" __global__ void __launch_bounds__(128) matvec_dense_##name(                               \
      const unsigned char* __restrict__ raw, const float* __restrict__ x, float* __restrict__ out,     \
      int n_out, int n_in, int T) {                                                                    \
    matvec_dense<FMT>(raw, x, out, n_out, n_in, T);                                                    \
  }

DS4_MATVEC_EXPERTS(q8_0, ds4::FMT_Q8_0)
DS4_MATVEC_EXPERTS(f16, ds4::FMT_F16)
DS4_MATVEC_EXPERTS(iq2_xxs, ds4::FMT_IQ2_XXS)
DS4_MATVEC_EXPERTS(q2_k, ds4::FMT_Q2_K)
DS4_MATVEC_EXPERTS(q4_k, ds4::FMT_Q4_K)
DS4_MATVEC_EXPERTS(mxfp4, ds4::FMT_MXFP4)
DS4_MATVEC_DENSE(q8_0, ds4::FMT_Q8_0)
DS4_MATVEC_DENSE(f16, ds4::FMT_F16)
DS4_DEQUANT_ROWS(q8_0, ds4::FMT_Q8_0)
DS4_DEQUANT_ROWS(f16, ds4::FMT_F16)
DS4_DEQUANT_ROWS(iq2_xxs, ds4::FMT_IQ2_XXS)
DS4_DEQUANT_ROWS(q2_k, ds4::FMT_Q2_K)
DS4_DEQUANT_ROWS(q4_k, ds4::FMT_Q4_K)
DS4_DEQUANT_ROWS(mxfp4, ds4::FMT_MXFP4)
