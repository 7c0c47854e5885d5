// tests/cpp/fibers.h: the host emulator of GPU thread blocks that the kernel-body tests share
// (tests/cpp/compress_host.cpp, tests/cpp/topk_host.cpp).
//
// Every thread of a block is a cooperative fiber (ucontext). The block barrier and the 32-lane shuffles are
// rendezvous points: a fiber runs until it reaches one, then the next fiber runs; fibers switch nowhere else,
// so an atomic read-modify-write is a plain one here. The blocks of a grid run one after another in a chosen
// order (forward, reverse or shuffled), so that results that depend on the order of blocks show. A barrier or
// shuffle that not every thread reaches (undefined on a GPU) is an error (a C++ exception) instead of a hang.
// A cluster of blocks (NVIDIA sm_90) runs as one emulated group of blocks: run_block with `rank_size` threads a
// block, block_barrier among the threads of the caller's block, cluster_barrier among all of them.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace emu {

constexpr int kMaxThreads = 16384;      // threads of a block, or of a cluster of blocks
constexpr int kMaxRanks = 16;           // blocks of a cluster
constexpr size_t kStacks = 64u << 20;   // bytes of fiber stacks, split evenly between a block's threads,
constexpr size_t kMinStack = 32u << 10;   // but at least this much a thread

struct Fiber {
  ucontext_t ctx;
  bool done = false;
  const int* wait_gen = nullptr;   // blocked until *wait_gen != wait_val
  int wait_val = 0;
};

struct Block {
  Fiber f[kMaxThreads];
  ucontext_t sched;
  int cur = 0;
  int64_t bid = 0;
  int alive = 0;
  int blk_count = 0, blk_gen = 0;         // the barrier of all the threads (a cluster's)
  int rank_size = 0;                      // threads of one block of the cluster
  int rank_alive[kMaxRanks] = {}, rank_count[kMaxRanks] = {}, rank_gen[kMaxRanks] = {};
  int warp_count[kMaxThreads / 32] = {}, warp_gen[kMaxThreads / 32] = {};
  int group_count[kMaxThreads / 32][32] = {}, group_gen[kMaxThreads / 32][32] = {};   // by the group's first lane
  uint64_t slot[kMaxThreads / 32][32] = {};
  std::function<void()> body;
};

// Stack memory, allocated once for the most threads (pages are touched only as the fibers use them).
inline char* stacks() {
  static char* s = new char[kMaxThreads * kMinStack > kStacks ? kMaxThreads * kMinStack : kStacks];
  return s;
}
inline Block*& current() {
  static Block* g = nullptr;
  return g;
}
inline int thread_id() { return current()->cur; }   // in the whole group (the cluster's threads)
inline int64_t block_id() { return current()->bid; }

inline void yield_until_changed(const int* gen) {
  Block* g = current();
  Fiber& f = g->f[g->cur];
  f.wait_gen = gen;
  f.wait_val = *gen;
  swapcontext(&f.ctx, &g->sched);
}

inline void release_block_if_all_arrived() {
  Block* g = current();
  if (g->blk_count > 0 && g->blk_count == g->alive) {
    g->blk_count = 0;
    ++g->blk_gen;
  }
}
inline void release_rank_if_all_arrived(int r) {
  Block* g = current();
  if (g->rank_count[r] > 0 && g->rank_count[r] == g->rank_alive[r]) {
    g->rank_count[r] = 0;
    ++g->rank_gen[r];
  }
}

// The barrier of the caller's block (its rank's threads).
inline void block_barrier() {
  Block* g = current();
  const int r = g->cur / g->rank_size;
  ++g->rank_count[r];
  const int* gen = &g->rank_gen[r];
  const int my = *gen;
  release_rank_if_all_arrived(r);
  if (*gen == my) yield_until_changed(gen);
}

// The barrier of every thread of the group (a cluster barrier).
inline void cluster_barrier() {
  Block* g = current();
  ++g->blk_count;
  const int* gen = &g->blk_gen;
  const int my = *gen;
  release_block_if_all_arrived();
  if (*gen == my) yield_until_changed(gen);
}
inline int cluster_rank() { return current()->cur / current()->rank_size; }

// Distributed shared memory: the cluster's blocks keep their shared memories as `blocks` objects of `stride` bytes
// from `base`; the address in block r's of the object at p in the caller's (an error for another block's address
// or a rank outside the cluster).
template <class T>
T* cluster_peer_at(T* p, int r, char* base, ptrdiff_t stride, int blocks) {
  const int me = cluster_rank();
  char* const c = reinterpret_cast<char*>(const_cast<std::remove_cv_t<T>*>(p));
  if (r < 0 || r >= blocks || c < base + me * stride || c + sizeof(T) > base + (me + 1) * stride)
    throw std::runtime_error("cluster_peer: block " + std::to_string(r) + " or an address outside the caller's "
                             "shared memory");
  return reinterpret_cast<T*>(c + (static_cast<ptrdiff_t>(r) - me) * stride);
}

inline void warp_barrier(int w) {
  Block* g = current();
  const int my = g->warp_gen[w];
  if (++g->warp_count[w] == 32) {
    g->warp_count[w] = 0;
    ++g->warp_gen[w];
    return;
  }
  if (g->warp_gen[w] == my) yield_until_changed(&g->warp_gen[w]);
}

// A 32-lane exchange: every lane publishes v, then reads the value of lane src(lane) (its own when src returns
// a negative lane). T: any trivially copyable type of at most 8 bytes.
template <class T, class Src>
T exchange(T v, Src src) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffled values are 8 bytes at most");
  Block* g = current();
  const int tid = g->cur, w = tid / 32, lane = tid % 32;
  std::memcpy(&g->slot[w][lane], &v, sizeof(T));
  warp_barrier(w);                       // every lane has published
  const int from = src(lane);
  T r = v;
  if (from >= 0) std::memcpy(&r, &g->slot[w][from], sizeof(T));
  warp_barrier(w);                       // every lane has read
  return r;
}
template <class T>
T shuffle_xor(T v, int m) { return exchange(v, [m](int lane) { return lane ^ m; }); }

// A shuffle among the lanes of `mask` only (CUDA's *_sync with a partial mask): every lane of the mask publishes
// v, then reads lane (l ^ m)'s value, which must be in the mask. Lanes outside the mask may have exited or be at
// other shuffles.
template <class T>
T shuffle_xor_in(unsigned mask, T v, int m) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffled values are 8 bytes at most");
  Block* g = current();
  const int tid = g->cur, w = tid / 32, lane = tid % 32;
  if (!(mask >> lane & 1u) || !(mask >> (lane ^ m) & 1u))
    throw std::runtime_error("emulated shuffle: lane " + std::to_string(lane) + " ^ " + std::to_string(m) +
                             " outside the mask " + std::to_string(mask));
  const int first = __builtin_ctz(mask), n = __builtin_popcount(mask);
  auto barrier = [&] {
    int& count = g->group_count[w][first];
    int& gen = g->group_gen[w][first];
    const int my = gen;
    if (++count == n) {
      count = 0;
      ++gen;
      return;
    }
    if (gen == my) yield_until_changed(&gen);
  };
  std::memcpy(&g->slot[w][lane], &v, sizeof(T));
  barrier();
  T r;
  std::memcpy(&r, &g->slot[w][lane ^ m], sizeof(T));
  barrier();
  return r;
}
template <class T>
T shuffle_up(T v, int off) { return exchange(v, [off](int lane) { return lane >= off ? lane - off : -1; }); }

inline void entry() {
  Block* g = current();
  g->body();
  g->f[g->cur].done = true;
  --g->alive;
  const int r = g->cur / g->rank_size;
  --g->rank_alive[r];
  release_block_if_all_arrived();        // exited threads no longer hold a barrier
  release_rank_if_all_arrived(r);
}

// Runs one block of n threads (a multiple of 32, at most kMaxThreads) until all return; throws on a deadlock.
// rank_size < n: a cluster of n / rank_size blocks of rank_size threads each (thread t in block t / rank_size).
inline void run_block(int64_t bid, int n, const std::function<void()>& body, int rank_size = 0) {
  if (rank_size == 0) rank_size = n;
  if (n <= 0 || n % 32 || n > kMaxThreads || rank_size % 32 || n % rank_size || n / rank_size > kMaxRanks)
    throw std::invalid_argument("emulated block size " + std::to_string(n) + " / " + std::to_string(rank_size));
  Block& b = *current();
  const size_t stack = std::max(kStacks / static_cast<size_t>(n), kMinStack);
  b.bid = bid;
  b.alive = n;
  b.blk_count = 0;
  b.rank_size = rank_size;
  for (int r = 0; r < kMaxRanks; ++r) {
    b.rank_alive[r] = r < n / rank_size ? rank_size : 0;
    b.rank_count[r] = 0;
  }
  std::fill(std::begin(b.warp_count), std::end(b.warp_count), 0);
  std::memset(b.group_count, 0, sizeof(b.group_count));
  b.body = body;
  for (int t = 0; t < n; ++t) {
    Fiber& f = b.f[t];
    f.done = false;
    f.wait_gen = nullptr;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks() + stack * t;
    f.ctx.uc_stack.ss_size = stack;
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
    if (!ran) {
      int waiting = 0;
      for (int t = 0; t < n; ++t) waiting += !b.f[t].done;
      throw std::runtime_error("emulated block " + std::to_string(bid) + ": deadlock, " + std::to_string(waiting) +
                               " threads wait at a barrier or shuffle that the others never reach");
    }
  }
}

// The order of blocks in run_grid: 0 forward, 1 reverse, 2 shuffled (seeded; the seed advances per grid).
inline int& grid_order() {
  static int order = 0;
  return order;
}
inline uint64_t& grid_seed() {
  static uint64_t seed = 0;
  return seed;
}

inline void set_grid_order(int order, uint64_t seed) {
  grid_order() = order;
  grid_seed() = seed;
}

// The message of the last emulation error (a C++ exception that guarded caught), for dsq_error_string.
inline std::string& last_error() {
  static std::string s;
  return s;
}

// Runs f() for a C entry point: its result (an int code; 0 when f returns nothing), or `code` when it throws,
// the message kept in last_error().
template <class F>
int guarded(int code, F&& f) {
  try {
    if constexpr (std::is_void<decltype(f())>::value) {
      f();
      return 0;
    } else {
      return f();
    }
  } catch (const std::exception& e) {
    last_error() = e.what();
    return code;
  }
}

// Calls block(id) for the ids 0..n-1 in the chosen order; block(id) runs the block (run_block).
inline void run_grid(int64_t n, const std::function<void(int64_t)>& block) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), int64_t{0});
  if (grid_order() == 1) std::reverse(ids.begin(), ids.end());
  if (grid_order() == 2) {
    std::mt19937_64 rng(grid_seed()++);
    std::shuffle(ids.begin(), ids.end(), rng);
  }
  static Block blk;
  current() = &blk;
  for (int64_t id : ids) block(id);
}

}  // namespace emu
