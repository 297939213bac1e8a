// The fiber core of the host emulations of our GPU kernels: the Metal one (tests/metal_emu) and
// the CUDA one (engine/backends/cupy/emu.py). Both compile kernel sources as C++ (g++ 12, C++20)
// and run one thread group (threadgroup / block) at a time on one OS thread.
//
// Model: each thread of the group is a fiber (ucontext), run round-robin first to last or
// (Runtime::reverse) last to first. A fiber runs until it reaches a group barrier or a warp
// collective (simd_sum, __shfl_sync, ...), then the next one runs. A barrier releases when every
// thread of the group waits at one; a collective releases when every lane named by its mask waits
// at one with the same mask. Anything else (a barrier some threads skip, a collective whose mask
// names a lane that returned, lanes that wait with different masks, a lane outside the mask it
// passes) is reported as an error instead of hanging: the emulation is stricter than hardware
// there, never looser.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include <ucontext.h>
#include <sys/mman.h>
#include <unistd.h>

// Fiber switches: on x86-64 Linux a 6-register switch in assembly (ucontext's swapcontext makes
// a sigprocmask system call per switch, which made a barrier cost microseconds per thread);
// elsewhere, or with GPU_EMU_UCONTEXT defined, ucontext.
#if defined(__x86_64__) && defined(__linux__) && !defined(GPU_EMU_UCONTEXT)
#define GPU_EMU_ASM_SWITCH 1
extern "C" void gpu_emu_switch_ctx(void** save_sp, void* new_sp);
asm(R"(
.text
.globl gpu_emu_switch_ctx
.hidden gpu_emu_switch_ctx
.type gpu_emu_switch_ctx,@function
gpu_emu_switch_ctx:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size gpu_emu_switch_ctx, .-gpu_emu_switch_ctx
)");
#endif

namespace gpu_emu {

struct Ctx {
#ifdef GPU_EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

inline void ctx_switch(Ctx& from, Ctx& to) {
#ifdef GPU_EMU_ASM_SWITCH
  gpu_emu_switch_ctx(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

// a fresh context that starts entry() on the stack [stack, stack + size); entry never returns
inline void ctx_init(Ctx& c, char* stack, size_t size, void (*entry)(), Ctx& link) {
#ifdef GPU_EMU_ASM_SWITCH
  (void)link;
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top - 16);   // the return slot, 16-aligned: entry starts as if called
  sp[1] = nullptr;                                   // entry's own return address (it never returns)
  sp[0] = reinterpret_cast<void*>(entry);
  sp -= 6;                                           // rbp rbx r12 r13 r14 r15, popped by the first switch
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  c.sp = sp;
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = &link.uc;
  makecontext(&c.uc, entry, 0);
#endif
}

struct u3 { unsigned x, y, z; };

enum State { READY, WAIT_SIMD, WAIT_TG, DONE };

constexpr unsigned SIMD = 32;                 // lanes of a warp / simdgroup
constexpr uint32_t FULL = 0xFFFFFFFFu;        // every lane that exists (Metal's collectives)
constexpr size_t SLOT = 16;
constexpr size_t STACK = 128 * 1024;

struct Fiber {
  Ctx ctx;
  State state = READY;
  unsigned lin = 0;          // linear index in the group (x fastest; warps are runs of 32)
  u3 tpig{}, tptg{};         // position in the grid (threads) / in the group
  uint32_t mask = FULL;      // the mask of the collective it waits at
  int site = 0;              // the source line of the group barrier it waits at (0: not told)
};

struct Runtime {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;   // one per thread slot, kept across groups (not zeroed; never freed)
  Ctx sched;
  int current = -1;
  u3 tgpos{}, tgsize{}, ngroups{};
  // warp collectives: each lane's deposit [linear thread], and at release a snapshot of the
  // released lanes' deposits [linear thread]. Every released lane reads the snapshot in the
  // scheduler pass that follows, before any release can rewrite it (a rewrite of those lanes
  // needs all of them to wait again); a lane that runs ahead deposits into dep, not the snapshot.
  std::vector<unsigned char> dep, snap;
  std::string error;
  // run the ready threads last to first: a read of another thread's group-shared write with no
  // barrier between them gets the other answer in one of the two orders
  bool reverse = false;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  void (*on_group)() = nullptr;   // called before each group runs (the CUDA emulation poisons shared memory)
};

inline Runtime& rt() { static Runtime r; return r; }

// a fiber stack of STACK bytes above a PROT_NONE page: a kernel that overflows it faults instead
// of writing over the heap
inline char* new_stack() {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  char* base = static_cast<char*>(mmap(nullptr, STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  mprotect(base, page, PROT_NONE);
  return base + page;
}

inline void fail(const std::string& msg) {
  if (rt().error.empty()) rt().error = msg;
}

inline void trampoline() {
  Runtime& r = rt();
  r.body(r.arg);
  r.fibers[r.current].state = DONE;
  ctx_switch(r.fibers[r.current].ctx, r.sched);   // never resumed
}

// the calling fiber waits in state s and hands control back to the scheduler
inline void block(State s) {
  Runtime& r = rt();
  Fiber& f = r.fibers[r.current];
  f.state = s;
  ctx_switch(f.ctx, r.sched);
  if (!r.error.empty()) {   // the scheduler gave up: park this fiber for good
    f.state = DONE;
    ctx_switch(f.ctx, r.sched);
  }
}

// one warp's collectives: 1 = some lanes released, 0 = none could go on yet, -1 = an error (set).
// Lanes may wait on disjoint masks at once (independent halves of a warp); overlapping masks
// that differ are an error.
inline int release_warp(size_t s0, size_t s1) {
  Runtime& r = rt();
  const uint32_t exist = s1 - s0 == SIMD ? FULL : ((1u << (s1 - s0)) - 1u);
  int got = 0;
  for (size_t first = s0; first < s1; ++first) {
    if (r.fibers[first].state != WAIT_SIMD) continue;
    const uint32_t mask = r.fibers[first].mask, need = mask & exist;
    bool ready = true;
    for (size_t i = s0; i < s1; ++i) {
      const Fiber& f = r.fibers[i];
      if (!((need >> (i - s0)) & 1u)) continue;
      if (f.state == DONE) {
        fail(mask == FULL ? "a simdgroup collective was reached by only some lanes (others returned)"
                          : "a warp collective's mask names a lane that returned");
        return -1;
      }
      if (f.state == WAIT_SIMD && f.mask != mask) {
        fail("warp lanes wait at collectives with different, overlapping masks (divergent control flow)");
        return -1;
      }
      ready &= f.state == WAIT_SIMD;
    }
    if (!ready) continue;
    for (size_t i = s0; i < s1; ++i) {
      if (!((need >> (i - s0)) & 1u)) continue;
      r.fibers[i].state = READY;
      std::memcpy(&r.snap[i * SLOT], &r.dep[i * SLOT], SLOT);
    }
    got = 1;
  }
  return got;
}

// the scheduler's release step: which blocked fibers may go on; false = nothing could (an error)
inline bool release() {
  Runtime& r = rt();
  size_t n = r.fibers.size();
  bool any = false;
  size_t done = 0, at_tg = 0;
  for (auto& f : r.fibers) { done += f.state == DONE; at_tg += f.state == WAIT_TG; }
  for (size_t s0 = 0; s0 < n; s0 += SIMD) {
    int got = release_warp(s0, std::min(n, s0 + SIMD));
    if (got < 0) return false;
    any |= got > 0;
  }
  if (any) return true;
  if (at_tg && at_tg + done == n) {
    const Fiber* first = nullptr;
    for (auto& f : r.fibers) {
      if (f.state != WAIT_TG) continue;
      if (!first) first = &f;
      if (f.site != first->site) {
        fail("threads wait at different group barriers (lines " + std::to_string(first->site) + " and " +
             std::to_string(f.site) + "): a barrier in divergent code");
        return false;
      }
    }
    if (done) { fail("a group barrier (threadgroup_barrier / __syncthreads) was reached by only some threads (others returned)"); return false; }
    for (auto& f : r.fibers) f.state = READY;
    return true;
  }
  fail("deadlock: threads wait at different barriers/collectives (divergent control flow)");
  return false;
}

// Runs fn(arg) as every thread of ngroups groups of tg threads; a thread whose grid position is
// outside `limit` (threads per dimension) does not exist (Metal's dispatchThreads edge groups;
// CUDA passes ngroups * tg). Returns "" or the error.
inline std::string launch_groups(u3 ngroups, u3 tg, u3 limit, void (*fn)(void*), void* arg) {
  Runtime& r = rt();
  r.body = fn; r.arg = arg; r.error.clear();
  r.ngroups = ngroups;
  size_t tgn = size_t(tg.x) * tg.y * tg.z;
  if (tgn == 0 || tgn > 1024) return "group size must be 1..1024 threads";
  r.dep.assign(tgn * SLOT, 0); r.snap.assign(tgn * SLOT, 0);
  for (unsigned gz = 0; gz < ngroups.z; ++gz)
  for (unsigned gy = 0; gy < ngroups.y; ++gy)
  for (unsigned gx = 0; gx < ngroups.x; ++gx) {
    r.tgpos = {gx, gy, gz};
    r.tgsize = tg;
    if (r.on_group) r.on_group();
    r.fibers.clear();
    r.fibers.reserve(tgn);
    for (unsigned z = 0; z < tg.z; ++z) for (unsigned y = 0; y < tg.y; ++y) for (unsigned x = 0; x < tg.x; ++x) {
      u3 g{gx * tg.x + x, gy * tg.y + y, gz * tg.z + z};
      if (g.x >= limit.x || g.y >= limit.y || g.z >= limit.z) continue;
      Fiber& f = r.fibers.emplace_back();
      f.lin = (z * tg.y + y) * tg.x + x;
      f.tpig = g; f.tptg = {x, y, z};
    }
    while (r.stacks.size() < r.fibers.size()) {
      char* st = new_stack();
      if (!st) return "cannot map a fiber stack";
      r.stacks.push_back(st);
    }
    for (size_t i = 0; i < r.fibers.size(); ++i) ctx_init(r.fibers[i].ctx, r.stacks[i], STACK, trampoline, r.sched);
    for (;;) {
      for (size_t n = 0; n < r.fibers.size(); ++n) {
        size_t i = r.reverse ? r.fibers.size() - 1 - n : n;
        if (r.fibers[i].state != READY) continue;
        r.current = int(i);
        ctx_switch(r.sched, r.fibers[i].ctx);
      }
      bool all_done = true;
      for (auto& f : r.fibers) all_done &= f.state == DONE;
      if (all_done) break;
      if (!r.error.empty() || !release()) {
        // let every parked fiber see the error and finish, so no stack is left mid-call
        for (size_t i = 0; i < r.fibers.size(); ++i) {
          if (r.fibers[i].state == DONE) continue;
          r.current = int(i);
          ctx_switch(r.sched, r.fibers[i].ctx);
        }
        return r.error;
      }
    }
  }
  return r.error;
}

inline Fiber& me() { return rt().fibers[rt().current]; }

// a group barrier at source line `site`: every thread must wait at the same one
inline void barrier(int site) {
  me().site = site;
  block(WAIT_TG);
}
inline unsigned lane_of(const Fiber& f) { return f.lin % SIMD; }

// every lane's value at one warp collective (lane order); lanes outside the mask hold the
// values of their last collective: the callers read only lanes of the mask
template <typename T> struct Lanes {
  T v[SIMD];
  unsigned n = 0;
  size_t size() const { return n; }
  T& operator[](size_t i) { return v[i]; }
  const T& operator[](size_t i) const { return v[i]; }
  T at(size_t i) const {
    if (i >= n) { fail("a warp collective read a lane past the warp"); return T{}; }
    return v[i];
  }
};

// One warp collective over the lanes of `mask` (FULL: all lanes that exist): deposit v, wait for
// them, return every lane's deposit
template <typename T> Lanes<T> exchange(T v, uint32_t mask = FULL) {
  static_assert(sizeof(T) <= SLOT);
  Runtime& r = rt();
  Fiber& f = me();
  if (!((mask >> lane_of(f)) & 1u)) fail("a lane passed a warp collective a mask without itself");
  f.mask = mask;
  std::memcpy(&r.dep[f.lin * SLOT], &v, sizeof(T));
  unsigned lin = f.lin;
  block(WAIT_SIMD);
  unsigned s0 = lin - lin % SIMD;
  unsigned s1 = std::min<unsigned>(unsigned(r.fibers.size()), s0 + SIMD);
  Lanes<T> all;
  all.n = s1 - s0;
  for (unsigned i = 0; i < all.n; ++i) std::memcpy(&all.v[i], &r.snap[(s0 + i) * SLOT], sizeof(T));
  return all;
}

}  // namespace gpu_emu
