// main() of the emulation driver. The generated translation unit (tests/metal_emu/gen.py) includes
// metal_compat.h, common.metal, every kernel body wrapped as `void NAME(void** bufs)`, a table
// `ENTRIES` of them, and then this file.
//
// Usage: [METAL_EMU_REVERSE=1] driver ENTRY DIR. DIR/spec.txt holds "gx gy gz tx ty tz n_in n_out" and then the byte size
// of each buffer (inputs, then outputs); DIR/in<i>.bin the inputs. Writes DIR/out<i>.bin.
// Every buffer ends at a PROT_NONE page, so reading or writing past its end kills the process
// (the test reports the signal) instead of reading a neighbour; outputs start as 0xFF bytes
// (NaN / -1), so an element the kernel never writes shows up in the comparison.
#include <sys/mman.h>
#include <unistd.h>

static void* guarded(size_t size) {
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  size_t body = (size + 15) / 16 * 16;
  size_t span = (body + page - 1) / page * page;
  char* base = static_cast<char*>(mmap(nullptr, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) { perror("mmap"); std::exit(3); }
  mprotect(base + span, page, PROT_NONE);
  return base + span - body;   // 16-byte aligned, at most 15 bytes short of the guard page
}

int main(int argc, char** argv) {
  if (argc != 3) { std::fprintf(stderr, "usage: driver ENTRY DIR\n"); return 2; }
  std::string dir = argv[2];
  void (*fn)(void**) = nullptr;
  for (const auto& e : ENTRIES) if (std::strcmp(e.name, argv[1]) == 0) fn = e.fn;
  if (!fn) { std::fprintf(stderr, "no entry %s\n", argv[1]); return 2; }
  FILE* f = std::fopen((dir + "/spec.txt").c_str(), "r");
  if (!f) { perror("spec.txt"); return 2; }
  unsigned g[3], t[3], nin, nout;
  if (std::fscanf(f, "%u %u %u %u %u %u %u %u", &g[0], &g[1], &g[2], &t[0], &t[1], &t[2], &nin, &nout) != 8) return 2;
  std::vector<void*> bufs(nin + nout);
  std::vector<size_t> sizes(nin + nout);
  for (unsigned i = 0; i < nin + nout; ++i) {
    if (std::fscanf(f, "%zu", &sizes[i]) != 1) return 2;
    bufs[i] = guarded(sizes[i]);
    if (i < nin) {
      FILE* b = std::fopen((dir + "/in" + std::to_string(i) + ".bin").c_str(), "rb");
      if (!b || std::fread(bufs[i], 1, sizes[i], b) != sizes[i]) { std::fprintf(stderr, "bad input %u\n", i); return 2; }
      std::fclose(b);
    } else {
      std::memset(bufs[i], 0xFF, sizes[i]);
    }
  }
  std::fclose(f);
  metal_emu::rt().reverse = std::getenv("METAL_EMU_REVERSE") != nullptr;
  struct Call { void (*fn)(void**); void** bufs; } call{fn, bufs.data()};
  std::string err = metal_emu::launch({g[0], g[1], g[2]}, {t[0], t[1], t[2]},
                                      [](void* c) { auto* k = static_cast<Call*>(c); k->fn(k->bufs); }, &call);
  if (!err.empty()) { std::fprintf(stderr, "emulation error: %s\n", err.c_str()); return 1; }
  for (unsigned i = nin; i < nin + nout; ++i) {
    FILE* b = std::fopen((dir + "/out" + std::to_string(i - nin) + ".bin").c_str(), "wb");
    std::fwrite(bufs[i], 1, sizes[i], b);
    std::fclose(b);
  }
  return 0;
}
