// Host emulation of the part of the Metal Shading Language that our kernel bodies use, so that
// metal_kernels/*.metal compile as C++20 (g++ 12) and run on the CPU.
//
// The fiber core (one threadgroup at a time, a fiber per thread, strict barriers and collectives,
// two thread orders) is shared with the CUDA emulation: engine/backends/cupy/emu_support/fibers.h.
// Here: the Metal vocabulary on top of it.
//
// Address spaces become nothing except `threadgroup`, which becomes `static`: the threads of the
// group (fibers of one process) then share the variable, and groups run one after another.
// Layout: runtime first (it uses std:: names such as `thread` that the macros below would break),
// then the Metal vocabulary, then (in the generated driver) common.metal and the kernel bodies.
#pragma once
#include <bit>
#include <cmath>
#include "fibers.h"

namespace metal_emu {
using namespace gpu_emu;

// Runs fn(arg) as every thread of the grid (grid = threads per dimension, as MLX's `grid`;
// tg = threads per threadgroup; the edge groups are smaller, as with dispatchThreads).
inline std::string launch(u3 grid, u3 tg, void (*fn)(void*), void* arg) {
  if (!tg.x || !tg.y || !tg.z) return "threadgroup size must be 1..1024";
  u3 ngroups{(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  return launch_groups(ngroups, tg, grid, fn, arg);
}
}  // namespace metal_emu

// ---------------------------------------------------------------------------------------------
// Metal vocabulary
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float4 operator+(float4 a, float4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }
inline float4 operator*(float4 a, float b) { return {a.x * b, a.y * b, a.z * b, a.w * b}; }

namespace metal {
using std::exp; using std::log; using std::sqrt; using std::fabs; using std::isnan; using std::isinf;
using std::fma; using std::floor; using std::ceil;
template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
inline float abs(float a) { return std::fabs(a); }
inline int abs(int a) { return a < 0 ? -a : a; }
inline uint popcount(uint v) { return uint(__builtin_popcount(v)); }
template <typename To, typename From> To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  return std::bit_cast<To>(v);
}
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
enum memory_order { memory_order_relaxed };
struct atomic_uint { uint v; };
inline void atomic_store_explicit(atomic_uint* a, uint v, memory_order) { a->v = v; }
inline uint atomic_load_explicit(atomic_uint* a, memory_order) { return a->v; }
// fibers never interleave inside a call, so a plain read-modify-write is atomic here
inline uint atomic_fetch_add_explicit(atomic_uint* a, uint v, memory_order) { uint o = a->v; a->v += v; return o; }
inline void threadgroup_barrier(mem_flags) { metal_emu::block(metal_emu::WAIT_TG); }
inline void simdgroup_barrier(mem_flags) { metal_emu::exchange<int>(0); }

// the hardware reduces in a butterfly; doing the same keeps every lane's result identical
template <typename T> T simd_reduce(metal_emu::Lanes<T> v, T (*op)(T, T)) {
  size_t n = v.size();
  if (n == metal_emu::SIMD) {
    for (unsigned s = metal_emu::SIMD / 2; s; s >>= 1) {
      metal_emu::Lanes<T> w(v);
      for (unsigned l = 0; l < n; ++l) w[l] = op(v[l], v[l ^ s]);
      v = w;
    }
    return v[0];
  }
  T acc = v[0];                        // a partial simdgroup (edge of the grid): in lane order
  for (size_t l = 1; l < n; ++l) acc = op(acc, v[l]);
  return acc;
}
template <typename T> T simd_sum(T x) { return simd_reduce<T>(metal_emu::exchange<T>(x), [](T a, T b) { return T(a + b); }); }
template <typename T> T simd_max(T x) { return simd_reduce<T>(metal_emu::exchange<T>(x), [](T a, T b) { return a > b ? a : b; }); }
template <typename T> T simd_min(T x) { return simd_reduce<T>(metal_emu::exchange<T>(x), [](T a, T b) { return a < b ? a : b; }); }
template <typename T> T simd_prefix_exclusive_sum(T x) {
  auto v = metal_emu::exchange<T>(x);
  T acc = T(0);
  for (unsigned l = 0; l < metal_emu::lane_of(metal_emu::me()); ++l) acc = T(acc + v[l]);
  return acc;
}
template <typename T> T simd_shuffle(T x, ushort lane) { return metal_emu::exchange<T>(x).at(lane); }
template <typename T> T simd_shuffle_xor(T x, ushort mask) {
  auto v = metal_emu::exchange<T>(x);
  return v.at(metal_emu::lane_of(metal_emu::me()) ^ mask);
}
template <typename T> T simd_broadcast(T x, ushort lane) { return simd_shuffle(x, lane); }
}  // namespace metal
using namespace metal;

// the thread-position attributes, read from the running fiber
namespace metal_emu {
inline uint3 pos_in_grid() { auto p = me().tpig; return {p.x, p.y, p.z}; }
inline uint3 pos_in_tg() { auto p = me().tptg; return {p.x, p.y, p.z}; }
inline uint3 tg_in_grid() { auto p = rt().tgpos; return {p.x, p.y, p.z}; }
inline uint3 tg_size() { auto p = rt().tgsize; return {p.x, p.y, p.z}; }
inline uint index_in_tg() { return me().lin; }
inline uint lane() { return me().lin % SIMD; }
inline uint simdgroup() { return me().lin / SIMD; }
}  // namespace metal_emu

// address spaces (last: they would break std::thread and friends above)
#define device
#define constant
#define thread
#define threadgroup static
