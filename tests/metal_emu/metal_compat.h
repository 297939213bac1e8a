// Host emulation of the part of the Metal Shading Language that our kernel bodies use, so that
// metal_kernels/*.metal compile as C++20 (g++ 12) and run on the CPU.
//
// Model: one threadgroup at a time; its threads are fibers (ucontext) run round-robin on one OS
// thread, first to last or (Runtime::reverse) last to first. A fiber runs until it reaches a threadgroup_barrier or a simdgroup collective
// (simd_sum, ...), then the next one runs. A barrier releases when every thread of the threadgroup
// waits at one; a collective releases when every lane of that simdgroup waits at one. Anything
// else (a barrier some threads skip, a simd_sum inside lane-divergent code) is reported as an error
// instead of hanging: the emulation is stricter than hardware there, never looser.
//
// Address spaces become nothing except `threadgroup`, which becomes `static`: the threads of the
// group (fibers of one process) then share the variable, and groups run one after another.
// Layout: runtime first (it uses std:: names such as `thread` that the macros below would break),
// then the Metal vocabulary, then (in the generated driver) common.metal and the kernel bodies.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include <ucontext.h>

namespace metal_emu {

struct u3 { unsigned x, y, z; };

enum State { READY, WAIT_SIMD, WAIT_TG, DONE };

struct Fiber {
  ucontext_t ctx;
  State state = READY;
  unsigned lin = 0;          // linear index in the threadgroup (Metal orders simdgroups by it)
  u3 tpig{}, tptg{};         // thread_position_in_grid / _in_threadgroup
  unsigned long gen = 0;     // collectives this lane has entered (selects the deposit buffer)
};

struct Runtime {
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;   // one per thread slot, kept across groups (not zeroed)
  ucontext_t sched;
  int current = -1;
  u3 tgpos{}, tgsize{};
  // deposits of the simdgroup collectives: [parity][linear thread]; parity = gen & 1, so a lane
  // that runs ahead to its next collective cannot overwrite a value another lane still reads
  std::vector<unsigned char> slots[2];
  std::string error;
  // run the ready threads last to first: a read of another thread's threadgroup write with no
  // barrier between them gets the other answer in one of the two orders
  bool reverse = false;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
};

inline Runtime& rt() { static Runtime r; return r; }
constexpr unsigned SIMD = 32;
constexpr size_t SLOT = 16;
constexpr size_t STACK = 128 * 1024;

inline void fail(const std::string& msg) {
  if (rt().error.empty()) rt().error = msg;
}

inline void trampoline() {
  Runtime& r = rt();
  r.body(r.arg);
  r.fibers[r.current].state = DONE;
  swapcontext(&r.fibers[r.current].ctx, &r.sched);
}

// the calling fiber waits in state s and hands control back to the scheduler
inline void block(State s) {
  Runtime& r = rt();
  Fiber& f = r.fibers[r.current];
  f.state = s;
  swapcontext(&f.ctx, &r.sched);
  if (!r.error.empty()) {   // the scheduler gave up: park this fiber for good
    f.state = DONE;
    swapcontext(&f.ctx, &r.sched);
  }
}

// the scheduler's release step: which blocked fibers may go on; false = nothing could (a deadlock)
inline bool release() {
  Runtime& r = rt();
  size_t n = r.fibers.size();
  bool any = false;
  size_t done = 0, at_tg = 0;
  for (auto& f : r.fibers) { done += f.state == DONE; at_tg += f.state == WAIT_TG; }
  for (size_t s0 = 0; s0 < n; s0 += SIMD) {
    size_t s1 = std::min(n, s0 + SIMD), wait = 0, fin = 0;
    for (size_t i = s0; i < s1; ++i) { wait += r.fibers[i].state == WAIT_SIMD; fin += r.fibers[i].state == DONE; }
    if (wait && fin) { fail("a simdgroup collective was reached by only some lanes (others returned)"); return false; }
    if (wait == s1 - s0) {
      for (size_t i = s0; i < s1; ++i) r.fibers[i].state = READY;
      any = true;
    }
  }
  if (any) return true;
  if (at_tg && at_tg + done == n) {
    if (done) { fail("threadgroup_barrier was reached by only some threads (others returned)"); return false; }
    for (auto& f : r.fibers) f.state = READY;
    return true;
  }
  fail("deadlock: threads wait at different barriers/collectives (divergent control flow)");
  return false;
}

// Runs fn(arg) as every thread of the grid (grid = threads per dimension, as MLX's `grid`;
// tg = threads per threadgroup). Returns "" or the error.
inline std::string launch(u3 grid, u3 tg, void (*fn)(void*), void* arg) {
  Runtime& r = rt();
  r.body = fn; r.arg = arg; r.error.clear();
  u3 ngroups{(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  size_t tgn = size_t(tg.x) * tg.y * tg.z;
  if (tgn == 0 || tgn > 1024) return "threadgroup size must be 1..1024";
  r.slots[0].assign(tgn * SLOT, 0); r.slots[1].assign(tgn * SLOT, 0);
  for (unsigned gz = 0; gz < ngroups.z; ++gz)
  for (unsigned gy = 0; gy < ngroups.y; ++gy)
  for (unsigned gx = 0; gx < ngroups.x; ++gx) {
    r.tgpos = {gx, gy, gz};
    r.tgsize = tg;
    r.fibers.clear();
    r.fibers.reserve(tgn);
    // threads outside the grid do not exist (the edge group is smaller, as with dispatchThreads)
    for (unsigned z = 0; z < tg.z; ++z) for (unsigned y = 0; y < tg.y; ++y) for (unsigned x = 0; x < tg.x; ++x) {
      u3 g{gx * tg.x + x, gy * tg.y + y, gz * tg.z + z};
      if (g.x >= grid.x || g.y >= grid.y || g.z >= grid.z) continue;
      Fiber& f = r.fibers.emplace_back();
      f.lin = (z * tg.y + y) * tg.x + x;
      f.tpig = g; f.tptg = {x, y, z};
    }
    while (r.stacks.size() < r.fibers.size()) r.stacks.emplace_back(new char[STACK]);
    for (size_t i = 0; i < r.fibers.size(); ++i) {
      Fiber& f = r.fibers[i];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = r.stacks[i].get();
      f.ctx.uc_stack.ss_size = STACK;
      f.ctx.uc_link = &r.sched;
      makecontext(&f.ctx, trampoline, 0);
    }
    for (;;) {
      for (size_t n = 0; n < r.fibers.size(); ++n) {
        size_t i = r.reverse ? r.fibers.size() - 1 - n : n;
        if (r.fibers[i].state != READY) continue;
        r.current = int(i);
        swapcontext(&r.sched, &r.fibers[i].ctx);
      }
      bool all_done = true;
      for (auto& f : r.fibers) all_done &= f.state == DONE;
      if (all_done) break;
      if (!r.error.empty() || !release()) {
        // let every parked fiber see the error and finish, so no stack is left mid-call
        for (size_t i = 0; i < r.fibers.size(); ++i) {
          if (r.fibers[i].state == DONE) continue;
          r.current = int(i);
          swapcontext(&r.sched, &r.fibers[i].ctx);
        }
        return r.error;
      }
    }
  }
  return r.error;
}

inline Fiber& me() { return rt().fibers[rt().current]; }
inline unsigned lane_of(const Fiber& f) { return f.lin % SIMD; }

// One simdgroup collective: deposit v, wait for the other lanes, return all lanes' values (lane order)
template <typename T> std::vector<T> exchange(T v) {
  static_assert(sizeof(T) <= SLOT);
  Runtime& r = rt();
  Fiber& f = me();
  unsigned parity = f.gen++ & 1;
  std::memcpy(&r.slots[parity][f.lin * SLOT], &v, sizeof(T));
  unsigned lin = f.lin;
  block(WAIT_SIMD);
  unsigned s0 = lin - lin % SIMD;
  unsigned s1 = std::min<unsigned>(unsigned(r.fibers.size()), s0 + SIMD);
  std::vector<T> all(s1 - s0);
  for (unsigned i = s0; i < s1; ++i) std::memcpy(&all[i - s0], &r.slots[parity][i * SLOT], sizeof(T));
  return all;
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
template <typename T> T simd_reduce(std::vector<T> v, T (*op)(T, T)) {
  size_t n = v.size();
  if (n == metal_emu::SIMD) {
    for (unsigned s = metal_emu::SIMD / 2; s; s >>= 1) {
      std::vector<T> w(v);
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
