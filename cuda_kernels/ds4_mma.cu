// Prefill in `ds4` numerics on tensor cores: ds4's quantized dot products (engine/model/ds4_matmul.py;
// ds4_dot.cu is the one-pair-at-a-time form) for a chunk of up to 16 (expert, token) pairs of one
// expert at once, with the integer part on int8 tensor cores (mma.sync m16n8k32 .s8, sm_80+).
//
// Why int8 mma and not bf16/f16: the integer dots are exact, so a tensor core changes nothing in
// the result. Per 32 values the mma gives the exact int32 dot of the weight's integer parts with the
// activation's Q8 codes; the float32 steps then follow ds4's block order and roundings exactly as
// ds4_dot.cu does, so the output is the reference's bit for bit (a bf16 tile would round the
// activations to 8 bits, which neither `exact` nor `ds4` allows). The weight's integer parts fit int8:
//   Q8_0:    the codes; one mma per 32-block (C = 0), acc += (d_w * d_x) * (float)idot.
//   IQ2_XXS: grid * sign (|v| <= 43) per group of 32; bsum += (2s + 1) * idot (integer, exact);
//            per 256-block acc += (d_w * d_x) * (float)bsum; the result 0.125f * acc.
//   Q2_K:    (sc & 15) * q (<= 45) accumulated by the mma over the block's 8 groups (isum), and
//            sc >> 4 (<= 15) likewise (summs); per 256-block ds4's double-rounded FMA.
// Block: 128 threads = 4 warps; tile TR = 64 rows x TP = 32 pairs of one expert (the chunks of
// batch_plan(experts, 32)). Per group of 32 values every thread decodes half a row's integers into
// shared memory (thread t: row t % 64, values 16 (t / 64) ..) and stages 8 bytes of one pair's codes
// (pair t / 4); warp w then runs NT = 4 mma (pairs 8j..8j+7) over rows 16w..16w+15. A lane holds
// 16 (row, pair) sums (the D fragment: rows g, g + 8, pairs 8j + 2t, 8j + 2t + 1; g = lane / 4,
// t = lane % 4). Every decoded weight serves 32 pairs: a 2048-token prefill gives an expert about
// 48 (2048 x 6 / 256), so each weight is decoded twice, not three times as with 16.
// The host emulation runs cuda_emu::mma_m16n8k32_s8 (the PTX fragment layout, emu_support/cuda_emu.h).
// Below sm_80 the kernels trap: the backend uses ds4_matvec_* there (kernels.py checks the arch).
#include "common.cuh"

namespace {

constexpr int TR = 64, TP = 32, TK = 32, LD = TK + 4;   // LD: a row's stride in bytes (4-aligned)
constexpr int NT = TP / 8;                              // n-tiles of 8 pairs a warp covers

// D += A B: A 16 x 32 int8 (row-major fragment a[4]), B 32 x 8 int8 (column-major fragment b[2])
__device__ __forceinline__ void mma_s8(int d[4], const unsigned a[4], const unsigned b[2]) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
#else
  cuda_emu::mma_m16n8k32_s8(d, a, b, d);
#endif
}

__device__ __forceinline__ unsigned ld_s4(const signed char* p) {     // 4 bytes, 4-aligned in shared
  return *reinterpret_cast<const unsigned*>(p);
}

// A fragment of rows r0..r0+15 of tile t (row stride LD bytes)
__device__ __forceinline__ void frag_a(unsigned a[4], const signed char* t, int r0, int g, int tq) {
  a[0] = ld_s4(t + (r0 + g) * LD + 4 * tq);
  a[1] = ld_s4(t + (r0 + g + 8) * LD + 4 * tq);
  a[2] = ld_s4(t + (r0 + g) * LD + 16 + 4 * tq);
  a[3] = ld_s4(t + (r0 + g + 8) * LD + 16 + 4 * tq);
}

// half h (values 16h..16h+15) of one row's group s (values 32s..32s+31) as int8 weight integers
// into wa (Q2_K also the min multipliers into wm); at a block's first group, half 0 also sets the
// row's scales (sd; Q2_K's dmin: sm), and IQ2_XXS's group multiplier (mul) at every group
template <int FMT> __device__ __forceinline__ void decode_half(
    const unsigned char* row, int s, int h, signed char* wa, signed char* wm, float& sd, float& sm, int& mul) {
  if (FMT == ds4::FMT_Q8_0) {
    const unsigned char* b = row + 34 * s;
    if (h == 0) sd = ds4::f16(ds4::ld_u16(b));
    for (int i = 0; i < 16; ++i) wa[16 * h + i] = (signed char)b[2 + 16 * h + i];
  } else if (FMT == ds4::FMT_IQ2_XXS) {
    const unsigned char* blk = row + 66 * (s >> 3);
    const unsigned char* q = blk + 2 + 8 * (s & 7);
    const unsigned a1 = ds4::ld_u32(q + 4);
    if (h == 0) {
      if ((s & 7) == 0) sd = ds4::f16(ds4::ld_u16(blk));
      mul = int(2 * (a1 >> 28) + 1);
    }
    for (int r = 2 * h; r < 2 * h + 2; ++r) {        // runs 2h and 2h + 1 of 8 values
      const unsigned entry = ds4::IQ2XXS_GRID2[q[r]];
      unsigned sg = (a1 >> (7 * r)) & 127u;
      sg |= (unsigned(__popc(sg)) & 1u) << 7;
      for (int i = 0; i < 8; ++i) {
        const unsigned c = (entry >> (2 * i)) & 3u;
        const int v = c == 0 ? 8 : (c == 1 ? 25 : 43);
        wa[8 * r + i] = (signed char)(((sg >> i) & 1u) ? -v : v);
      }
    }
  } else {                                          // Q2_K: group s & 7 = values 32u..32u+31
    const unsigned char* blk = row + 84 * (s >> 3);
    const int u = s & 7;
    if (h == 0 && u == 0) { sd = ds4::f16(ds4::ld_u16(blk + 80)); sm = ds4::f16(ds4::ld_u16(blk + 82)); }
    const unsigned char* qs = blk + 16 + 32 * (u >> 2);
    const int shift = 2 * (u & 3);
    const unsigned sc = blk[2 * u + h];              // the half is one sub-block of 16
    for (int l = 16 * h; l < 16 * h + 16; ++l) {
      wa[l] = (signed char)(int(sc & 15u) * int((qs[l] >> shift) & 3u));
      wm[l] = (signed char)(sc >> 4);
    }
  }
}

template <int FMT, int QK> __device__ __forceinline__ void ds4_gemm(
    const unsigned char* raw, const signed char* xq, const float* xd, const int* experts, const int* toks,
    const int* perm, const int* chunks, float* out, int n_out, int n_in, int n_chunks) {
  __shared__ __align__(16) signed char wa[TR * LD];     // weight integers of the group
  __shared__ __align__(16) signed char wm[TR * LD];     // Q2_K: the min multipliers (sc >> 4)
  __shared__ __align__(16) signed char xb[TP * LD];     // the pairs' activation codes of the group
  __shared__ float sd[TR], sm[TR], sx[TP];              // scales of the current block
  __shared__ int smul[TR];                              // IQ2_XXS: (2s + 1) of the group
  const int c = blockIdx.y;
  if (c >= n_chunks) return;                            // (the whole block)
  const int start = chunks[2 * c], count = chunks[2 * c + 1];
  const int e = experts[perm[start]];
  const int row0 = blockIdx.x * TR, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int r = tid & (TR - 1), h = tid >> 6;           // the row and half this thread decodes
  const long long rb = ds4::row_bytes<FMT>(n_in);
  const bool row_ok = row0 + r < n_out;
  const unsigned char* wrow = raw + ((long long)e * n_out + (row_ok ? row0 + r : 0)) * rb;
  const int xp = tid >> 2, xpart = tid & 3;             // the pair and 8-byte part this thread stages
  const bool x_ok = xp < count;
  const long long xt = x_ok ? toks[perm[start + xp]] : 0;
  const int groups_per_block = QK / TK;
  float acc[NT][4];
  int isum[NT][4], summ[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) { acc[j][i] = 0.0f; isum[j][i] = 0; summ[j][i] = 0; }
  for (int s = 0; s < n_in / TK; ++s) {
    const bool first = s % groups_per_block == 0;
    if (row_ok) {
      decode_half<FMT>(wrow, s, h, wa + r * LD, wm + r * LD, sd[r], sm[r], smul[r]);
    } else {
      for (int i = 16 * h; i < 16 * h + 16; ++i) { wa[r * LD + i] = 0; wm[r * LD + i] = 0; }
      if (h == 0) { sd[r] = 0.0f; sm[r] = 0.0f; smul[r] = 0; }
    }
    for (int i = 0; i < 8; ++i)
      xb[xp * LD + 8 * xpart + i] = x_ok ? xq[xt * n_in + TK * s + 8 * xpart + i] : (signed char)0;
    if (first && xpart == 0) sx[xp] = x_ok ? xd[xt * (n_in / QK) + s / groups_per_block] : 0.0f;
    __syncthreads();
    unsigned a[4], am[4];
    frag_a(a, wa, 16 * warp, g, tq);
    if (FMT == ds4::FMT_Q2_K) frag_a(am, wm, 16 * warp, g, tq);
    const bool last = s % groups_per_block == groups_per_block - 1;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const unsigned b[2] = {ld_s4(xb + (8 * j + g) * LD + 4 * tq), ld_s4(xb + (8 * j + g) * LD + 16 + 4 * tq)};
      if (FMT == ds4::FMT_Q2_K) {
        mma_s8(isum[j], a, b);                          // integer sums over the block's 8 groups
        mma_s8(summ[j], am, b);
      } else {
        int d[4] = {0, 0, 0, 0};
        mma_s8(d, a, b);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          isum[j][i] += FMT == ds4::FMT_IQ2_XXS ? smul[16 * warp + g + 8 * (i >> 1)] * d[i] : d[i];
      }
      if (!last) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {                     // the block's float32 term, in block order
        const int rr = 16 * warp + g + 8 * (i >> 1), p = 8 * j + 2 * tq + (i & 1);
        const float dx = sx[p];
        float term;
        if (FMT == ds4::FMT_Q2_K) {
          const float dall = __fmul_rn(dx, sd[rr]);
          const float mins = __fmul_rn(__fmul_rn(float(summ[j][i]), dx), sm[rr]);
          term = float(__dadd_rn(__dmul_rn(double(float(isum[j][i])), double(dall)), -double(mins)));
        } else {
          term = __fmul_rn(__fmul_rn(sd[rr], dx), float(isum[j][i]));
        }
        acc[j][i] = __fadd_rn(acc[j][i], term);
        isum[j][i] = 0;
        summ[j][i] = 0;
      }
    }
    __syncthreads();                                    // the tiles are rewritten by the next group
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rr = row0 + 16 * warp + g + 8 * (i >> 1), p = 8 * j + 2 * tq + (i & 1);
      if (rr < n_out && p < count)
        out[(long long)perm[start + p] * n_out + rr] = FMT == ds4::FMT_IQ2_XXS ? __fmul_rn(0.125f, acc[j][i]) : acc[j][i];
    }
}

}  // namespace

#define DS4_MMA(name, FMT, QK)                                                                         \
  extern "C" __global__ void __launch_bounds__(128, 4) ds4_gemm_##name(                                   \
      const unsigned char* __restrict__ raw, const signed char* __restrict__ xq, const float* __restrict__ xd, \
      const int* __restrict__ experts, const int* __restrict__ toks, const int* __restrict__ perm,     \
      const int* __restrict__ chunks, float* __restrict__ out, int n_out, int n_in, int n_chunks) {    \
    ds4_gemm<FMT, QK>(raw, xq, xd, experts, toks, perm, chunks, out, n_out, n_in, n_chunks);           \
  }

DS4_MMA(q8_0, ds4::FMT_Q8_0, 32)
DS4_MMA(iq2_xxs, ds4::FMT_IQ2_XXS, 256)
DS4_MMA(q2_k, ds4::FMT_Q2_K, 256)
