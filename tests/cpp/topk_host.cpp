// Host emulator of the top-k selection (kernels/cuda/topk_body.cuh), for tests only.
//
// The block bodies run unchanged on the CPU: every thread of a block is a cooperative fiber (ucontext), the
// block barrier and the 32-lane shuffles are rendezvous points of the fibers, atomic adds are plain adds (fibers
// switch only at those points), and the blocks of a grid run one after another in a chosen order (forward,
// reverse or shuffled), so that the written bytes must not depend on the order of blocks (the few-long-rows
// path fills its lists in that order). Shared memory starts as garbage (0xA5 bytes). A barrier or shuffle that
// not every thread reaches is reported as an error instead of hanging.
//
// It exports the C interface of kernels/cuda/topk.h (pointers are host pointers: CPU torch tensors), plus
// dsq_emu_set_order, dsq_emu_threads and dsq_error_string. Built by tests/test_topk_host.py with g++ -O2
// -std=c++17, once as the NVIDIA configuration and once with -DDSQ_TOPK_AMD=1 (256-thread blocks).
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "topk.h"

namespace emu {

constexpr int kMaxThreads = 1024;
constexpr size_t kStack = 64 * 1024;    // bytes of stack per fiber

struct Fiber {
  ucontext_t ctx;
  bool done = false;
  const int* wait_gen = nullptr;   // blocked until *wait_gen != wait_val
  int wait_val = 0;
};

struct Block {
  Fiber f[kMaxThreads];
  ucontext_t sched;
  int n = 0, cur = 0, alive = 0;
  int blk_count = 0, blk_gen = 0;
  int warp_count[kMaxThreads / 32] = {}, warp_gen[kMaxThreads / 32] = {};
  unsigned long long slot[kMaxThreads / 32][32] = {};
  std::function<void()> body;
};

std::vector<char>& stacks() {
  static std::vector<char> s(kStack * kMaxThreads);
  return s;
}
Block* g = nullptr;

void yield_until_changed(const int* gen) {
  Fiber& f = g->f[g->cur];
  f.wait_gen = gen;
  f.wait_val = *gen;
  swapcontext(&f.ctx, &g->sched);
}

void release_block_if_all_arrived() {
  if (g->blk_count > 0 && g->blk_count == g->alive) {
    g->blk_count = 0;
    ++g->blk_gen;
  }
}

void block_barrier() {
  ++g->blk_count;
  const int* gen = &g->blk_gen;
  const int my = *gen;
  release_block_if_all_arrived();
  if (*gen == my) yield_until_changed(gen);
}

void warp_barrier(int w) {
  const int my = g->warp_gen[w];
  if (++g->warp_count[w] == 32) {
    g->warp_count[w] = 0;
    ++g->warp_gen[w];
    return;
  }
  if (g->warp_gen[w] == my) yield_until_changed(&g->warp_gen[w]);
}

// 32-lane shuffle up: lane l gets lane l - off's value, its own for l < off.
unsigned long long shuffle_up(unsigned long long v, int off) {
  const int tid = g->cur, w = tid / 32, lane = tid % 32;
  g->slot[w][lane] = v;
  warp_barrier(w);                       // every lane has published
  const unsigned long long r = lane >= off ? g->slot[w][lane - off] : v;
  warp_barrier(w);                       // every lane has read
  return r;
}

// 32-lane shuffle xor: lane l gets lane l ^ m's value.
unsigned long long shuffle_xor(unsigned long long v, int m) {
  const int tid = g->cur, w = tid / 32, lane = tid % 32;
  g->slot[w][lane] = v;
  warp_barrier(w);
  const unsigned long long r = g->slot[w][lane ^ m];
  warp_barrier(w);
  return r;
}

void entry() {
  g->body();
  g->f[g->cur].done = true;
  --g->alive;
  release_block_if_all_arrived();        // exited threads no longer hold a block barrier
}

// Runs one block of n fibers until all return; throws on a deadlock (a divergent barrier or shuffle).
void run_block(int64_t bid, int n, const std::function<void()>& body) {
  Block& b = *g;
  b.n = n;
  b.alive = n;
  b.blk_count = 0;
  std::fill(std::begin(b.warp_count), std::end(b.warp_count), 0);
  b.body = body;
  for (int t = 0; t < n; ++t) {
    Fiber& f = b.f[t];
    f.done = false;
    f.wait_gen = nullptr;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks().data() + kStack * t;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &b.sched;
    makecontext(&f.ctx, entry, 0);
  }
  for (;;) {
    bool ran = false, all_done = true;
    for (int t = 0; t < n; ++t) {
      Fiber& f = b.f[t];
      if (f.done) continue;
      all_done = false;
      if (f.wait_gen && *f.wait_gen == f.wait_val) continue;
      f.wait_gen = nullptr;
      b.cur = t;
      ran = true;
      swapcontext(&b.sched, &f.ctx);
    }
    if (all_done) return;
    if (!ran) throw std::runtime_error("emulated block " + std::to_string(bid) +
                                       ": deadlock at a barrier or shuffle that some threads never reach");
  }
}

int g_order = 0;            // 0 forward, 1 reverse, 2 shuffled
uint64_t g_seed = 0;

// Runs blocks 0..n-1 in the chosen order, each with fresh garbage-filled shared memory of type S.
template <class S, class F>
void run_grid(int64_t n, int threads, F&& body) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), int64_t{0});
  if (g_order == 1) std::reverse(ids.begin(), ids.end());
  if (g_order == 2) {
    std::mt19937_64 rng(g_seed++);
    std::shuffle(ids.begin(), ids.end(), rng);
  }
  static Block blk;
  g = &blk;
  std::unique_ptr<S> sh(new S);
  for (int64_t id : ids) {
    std::memset(static_cast<void*>(sh.get()), 0xA5, sizeof(S));
    run_block(id, threads, [&] { body(id, *sh); });
  }
}

}  // namespace emu

namespace dsqtopk {
#define TOPK_FN inline
inline int thread_id() { return emu::g->cur; }
inline void block_sync() { emu::block_barrier(); }
inline int shfl_up_i(int v, int off) {
  return static_cast<int>(static_cast<uint32_t>(emu::shuffle_up(static_cast<uint32_t>(v), off)));
}
inline unsigned long long shfl_up_u64(unsigned long long v, int off) { return emu::shuffle_up(v, off); }
inline unsigned long long shfl_xor_u64(unsigned long long v, int m) { return emu::shuffle_xor(v, m); }
inline void shared_add(int* p, int v) { *p += v; }
inline int global_add(int* p, int v) {
  const int old = *p;
  *p += v;
  return old;
}
}  // namespace dsqtopk

#include "topk_body.cuh"

namespace {

std::string g_error;   // the last error's message (dsq_error_string)

// The launches of topk_body.cuh run(), as grids of fibers.
struct Host {
  template <int DT>
  int row(const DsqTopkArgs& a) {
    emu::run_grid<dsqtopk::Shared>(a.rows, dsqtopk::kThreads,
                                   [&](int64_t b, dsqtopk::Shared& sh) { dsqtopk::row_block<DT>(a, b, sh); });
    return 0;
  }
  template <int DT>
  int finish(const DsqTopkArgs& a) {
    emu::run_grid<dsqtopk::Shared>(a.rows, dsqtopk::kThreads,
                                   [&](int64_t b, dsqtopk::Shared& sh) { dsqtopk::finish_block<DT>(a, b, sh); });
    return 0;
  }
  int memset(void* p, size_t bytes) {
    std::memset(p, 0, bytes);
    return 0;
  }
  template <int DT>
  int hist(const DsqTopkArgs& a, int32_t chunks) {
    emu::run_grid<dsqtopk::ChunkShared>(a.rows * chunks, dsqtopk::kThreads, [&](int64_t b, dsqtopk::ChunkShared& sh) {
      dsqtopk::hist_block<DT>(a, chunks, b, sh);
    });
    return 0;
  }
  template <int DT>
  int scatter(const DsqTopkArgs& a, int32_t chunks) {
    emu::run_grid<dsqtopk::ChunkShared>(a.rows * chunks, dsqtopk::kThreads, [&](int64_t b, dsqtopk::ChunkShared& sh) {
      dsqtopk::scatter_block<DT>(a, chunks, b, sh);
    });
    return 0;
  }
};

}  // namespace

extern "C" {

int32_t dsq_topk_plan_chunks(int64_t rows, int64_t L, int64_t k, int32_t sms) {
  return dsqtopk::plan_chunks(rows, L, k, sms);
}

int64_t dsq_topk_workspace_bytes(int64_t rows, int64_t L, int64_t k, int32_t chunks) {
  return dsqtopk::workspace_bytes(rows, L, k, chunks);
}

// 0 on success, 1 for bad arguments (as the CUDA library), 2 for an emulation error (dsq_error_string).
int dsq_topk_indices(const DsqTopkArgs* args, void*) {
  try {
    Host dev;
    return dsqtopk::run(args, dev);
  } catch (const std::exception& e) {
    g_error = e.what();
    return 2;
  }
}

const char* dsq_error_string(int) { return g_error.c_str(); }

void dsq_emu_set_order(int order, uint64_t seed) {
  emu::g_order = order;
  emu::g_seed = seed;
}

int dsq_emu_threads() { return dsqtopk::kThreads; }

}  // extern "C"
