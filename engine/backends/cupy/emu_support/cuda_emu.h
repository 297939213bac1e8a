// Host emulation of the part of CUDA C++ that cuda_kernels/*.cu use, so that they compile as C++20
// (g++) and run on the CPU on the fiber core (fibers.h): one block at a time, a fiber per thread.
// Force-included before a kernel file (g++ -include); engine/backends/cupy/emu.py generates the
// launch entries after it. Stricter than hardware where it can be:
//  - __syncthreads() that only some threads of the block reach is an error, not a hang, and so
//    are threads waiting at different __syncthreads (by source line);
//  - a warp shuffle/vote whose mask names a lane that returned, lanes at one collective with
//    overlapping but different masks, a lane outside the mask it passes, or a shuffle that reads
//    a lane outside the mask: errors;
//  - __shared__ becomes `static` (the fibers of a block share it; blocks run one after another),
//    filled with 0xFF bytes before every block: a read before any write gives NaN / -1.
//  - the int8 tensor-core mma (mma_m16n8k32_s8 below: the PTX fragment layout) needs all 32 lanes
//    of the warp; a lane that returned is an error.
// Not emulated: dynamic shared memory (extern __shared__), other mma shapes, cooperative groups.
#pragma once
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <bit>
#include "fibers.h"

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

namespace cuda_emu {
using namespace gpu_emu;
inline uint3 thread_idx() { auto p = me().tptg; return {p.x, p.y, p.z}; }
inline uint3 block_idx() { auto p = rt().tgpos; return {p.x, p.y, p.z}; }
inline uint3 block_dim() { auto p = rt().tgsize; return {p.x, p.y, p.z}; }
inline uint3 grid_dim() { auto p = rt().ngroups; return {p.x, p.y, p.z}; }
inline unsigned lane() { return me().lin % SIMD; }

// a warp collective over `mask`: every lane's value (reading a lane outside the mask is an error)
template <typename T> struct Warp {
  Lanes<T> v;
  uint32_t mask;
  T at(int src) const {
    if (src < 0 || src >= int(v.size()) || !((mask >> src) & 1u)) {
      fail("a warp shuffle read a lane outside its mask (or past the warp)");
      return T{};
    }
    return v[size_t(src)];
  }
};
template <typename T> Warp<T> warp(T x, uint32_t mask) { return {exchange<T>(x, mask), mask}; }

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32: D = A B + C over the warp, as PTX lays out the
// fragments (lane l: group g = l / 4, t = l % 4; 4 int8 values a register, lowest byte first):
//   A 16 x 32: a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..], a[2] = A[g][16+4t..], a[3] = A[g+8][16+4t..]
//   B 32 x 8:  b[0] = B[4t..4t+3][g], b[1] = B[16+4t..16+4t+3][g]
//   C, D 16 x 8: c[0] = C[g][2t], c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1]
// (the real instruction runs on sm_80+: the kernels' tests run the same source on a device too)
struct Frag4 { unsigned v[4]; };
struct Frag2 { unsigned v[2]; };
inline void mma_m16n8k32_s8(int d[4], const unsigned a[4], const unsigned b[2], const int c[4]) {
  Frag4 fa; Frag2 fb;
  for (int i = 0; i < 4; ++i) fa.v[i] = a[i];
  for (int i = 0; i < 2; ++i) fb.v[i] = b[i];
  const Lanes<Frag4> A = exchange<Frag4>(fa, FULL);
  const Lanes<Frag2> B = exchange<Frag2>(fb, FULL);
  if (A.size() != 32) { fail("mma.sync needs a whole warp of 32 lanes"); return; }
  auto byte = [](unsigned reg, int k) { return int((signed char)((reg >> (8 * (k & 3))) & 0xFFu)); };
  auto a_at = [&](int row, int k) { return byte(A[size_t(4 * (row & 7) + ((k & 15) >> 2))].v[(row >> 3) + 2 * (k >> 4)], k); };
  auto b_at = [&](int k, int n) { return byte(B[size_t(4 * n + ((k & 15) >> 2))].v[k >> 4], k); };
  const int l = int(lane()), g = l >> 2, t = l & 3;
  int r[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    long long s = c[i];
    for (int k = 0; k < 32; ++k) s += (long long)a_at(row, k) * b_at(k, col);
    r[i] = int((unsigned)s);                          // s32 wraps, as the hardware's accumulator
  }
  for (int i = 0; i < 4; ++i) d[i] = r[i];
}
}  // namespace cuda_emu

#define threadIdx (cuda_emu::thread_idx())
#define blockIdx (cuda_emu::block_idx())
#define blockDim (cuda_emu::block_dim())
#define gridDim (cuda_emu::grid_dim())
#define warpSize 32
#define __global__
#define __device__ inline
#define __host__
#define __forceinline__
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// __shared__ variables are statics in one section, which the launch fills with 0xFF bytes (NaN,
// -1) before every block: a block that reads shared memory it did not write reads poison, not
// the previous block's values
#define __shared__ static __attribute__((section("emu_shared"), used))
static __attribute__((section("emu_shared"), used)) char emu_shared_anchor[16];   // the section exists
extern "C" __attribute__((visibility("hidden"))) char __start_emu_shared[], __stop_emu_shared[];
#define __constant__ const

// the line of each __syncthreads: threads of a block that wait at different ones are an error
#define __syncthreads() cuda_emu::barrier(__LINE__)
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) { cuda_emu::exchange<int>(0, mask); }
inline void __threadfence_block() {}
inline void __threadfence() {}

template <typename T> T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  auto w = cuda_emu::warp(v, mask);
  int l = int(cuda_emu::lane());
  return w.at((l & ~(width - 1)) + (src & (width - 1)));
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int lm, int width = 32) {
  auto w = cuda_emu::warp(v, mask);
  int l = int(cuda_emu::lane()), s = l ^ lm;
  return (s & ~(width - 1)) == (l & ~(width - 1)) ? w.at(s) : v;
}
template <typename T> T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  auto w = cuda_emu::warp(v, mask);
  int l = int(cuda_emu::lane()), s = l + int(d);
  return (s & ~(width - 1)) == (l & ~(width - 1)) ? w.at(s) : v;
}
template <typename T> T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  auto w = cuda_emu::warp(v, mask);
  int l = int(cuda_emu::lane()), s = l - int(d);
  return s >= (l & ~(width - 1)) ? w.at(s) : v;
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  auto w = cuda_emu::warp(pred ? 1 : 0, mask);
  unsigned b = 0;
  for (size_t i = 0; i < w.v.size(); ++i) if (((mask >> i) & 1u) && w.v[i]) b |= 1u << i;
  return b;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) {
  unsigned b = __ballot_sync(mask, pred), n = cuda_emu::rt().fibers.size();
  unsigned lane0 = cuda_emu::me().lin - cuda_emu::lane();
  unsigned exist = n - lane0 >= 32 ? 0xFFFFFFFFu : ((1u << (n - lane0)) - 1u);
  return (b & mask & exist) == (mask & exist);
}
inline unsigned __activemask() { return 0xFFFFFFFFu; }

// atomics: fibers never interleave inside a call, so a plain read-modify-write is atomic here
template <typename T> T atomicAdd(T* a, T v) { T o = *a; *a = T(o + v); return o; }
template <typename T> T atomicSub(T* a, T v) { T o = *a; *a = T(o - v); return o; }
template <typename T> T atomicMax(T* a, T v) { T o = *a; if (v > o) *a = v; return o; }
template <typename T> T atomicMin(T* a, T v) { T o = *a; if (v < o) *a = v; return o; }
template <typename T> T atomicExch(T* a, T v) { T o = *a; *a = v; return o; }
template <typename T> T atomicCAS(T* a, T cmp, T v) { T o = *a; if (o == cmp) *a = v; return o; }
template <typename T> T atomicOr(T* a, T v) { T o = *a; *a = o | v; return o; }

// intrinsics (the _rn forms round each operation: never contracted into an fma, here or on device)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float __expf(float a) { return std::exp(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline unsigned __float_as_uint(float v) { return std::bit_cast<unsigned>(v); }
inline float __uint_as_float(unsigned v) { return std::bit_cast<float>(v); }
inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline long long __double_as_longlong(double v) { return std::bit_cast<long long>(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __ffs(unsigned v) { return __builtin_ffs(int(v)); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
template <typename T> T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
// expf, sqrtf, fabsf, fmaxf, ... : the C library's (math.h), as CUDA names them
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
