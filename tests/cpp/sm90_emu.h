// tests/cpp/sm90_emu.h: the host side of the layer of the sm_90a block bodies (kernels/cuda/sm90_layer.cuh is the
// GPU side), for their emulators (tests/cpp/prefill_host.cpp, tests/cpp/scorer_host.cpp) under the block emulator
// of tests/cpp/fibers.h. Modelled on the hardware, not on the bodies:
//   * cp16 only records a copy (of bytes inside `sources`, into the block's shared memory, both 16-byte aligned);
//     the copies land when cp_wait retires their group (all groups but the newest N of the thread), so a body that
//     reads a stage before waiting for it reads stale bytes;
//   * an MMA (mma_ss, mma_rs) runs when mma_wait retires it: it computes each thread's accumulator fragment from the
//     operands as they are then, as the matrix unit addresses them: byte k of row r of a K-major tile with the
//     128-byte swizzle at address A (1024-aligned) is at x ^ (((x >> 7) & 7) << 4), x = A + (r / 8) * 1024 +
//     (r % 8) * 128 + k; a register operand (mma_rs) is the fragments the 128 threads passed to the call (each row
//     gathered from the four lanes that hold it); thread t (warp w, lane l) gets row 16 w + l / 4 + 8 i, column
//     8 c + 2 (l % 4) + j in acc[4 c + 2 i + j]; products of e4m3fn values summed in fp32 in the order of k. Until
//     then the accumulators hold NaN;
//   * bulk_copy records a copy against a shared-memory barrier's current phase; it lands when a thread's bar_wait
//     retires that phase (bar_arrive completes it: one arrival a phase);
//   * prefetch_l2 only checks that its bytes lie inside `prefetchable` (the ranges the body may read), 16-byte
//     aligned, a positive multiple of 16;
//   * shared memory starts as garbage (0xA5 bytes) in every block (begin_block).
// Faults inside a block (fibers cannot throw) are kept and thrown by end_block.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dsaquant/fp8.h"
#include "fibers.h"

namespace sm90emu {

struct Copy {
  void* dst;
  const void* src;
};
struct Pending {
  std::vector<std::vector<Copy>> groups;   // committed groups, oldest first
  std::vector<Copy> open;                  // copies since the last commit
};
// A started MMA: the thread's accumulators, the operands, and for mma_rs the K bytes of the thread's two rows.
struct Mma {
  float* acc;
  int nt;
  const uint8_t* a_tile;   // null: A from a_rows
  const uint8_t* b_rows;
  uint8_t a_rows[2][128];
};

// A bulk copy, and a shared-memory barrier of one arrival a phase with the copies that complete on it.
struct Bulk {
  void* dst;
  const void* src;
  int bytes, phase;
};
struct Barrier {
  int phase = 0;              // phases completed (arrivals)
  int waited[128] = {};       // per thread: phases waited for
  std::vector<Bulk> copies;   // not landed yet
};

inline Pending pending[128];
inline std::vector<std::pair<const void*, Barrier>> barriers;
inline std::vector<Mma> mmas[128];
inline uint32_t frag_board[128][4][4];       // the fragments every thread passes to the current mma_rs
inline uint8_t* smem_base = nullptr;         // the block's shared memory (1024-aligned)
inline int smem_bytes = 0;
inline std::vector<std::pair<const uint8_t*, const uint8_t*>> sources;   // the byte ranges cp16 may read
inline std::vector<std::pair<const uint8_t*, const uint8_t*>> prefetchable;   // the byte ranges prefetch_l2 may name
inline std::string fault;

inline void report(const char* what) {
  if (fault.empty()) fault = what;
}

inline int thread_id() { return emu::thread_id(); }
inline void block_sync() { emu::block_barrier(); }
inline float shfl_xor(float v, int m) { return emu::shuffle_xor(v, m); }
inline void cp16(void* dst, const void* src) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  bool inside = false;
  for (const auto& r : sources) inside = inside || (p >= r.first && p + 16 <= r.second);
  if (!inside) return report("emulated cp.async: 16 bytes outside the inputs");
  const uint8_t* d = static_cast<const uint8_t*>(dst);
  if (d < smem_base || d + 16 > smem_base + smem_bytes) return report("emulated cp.async: outside shared memory");
  if ((d - smem_base) % 16 != 0 || reinterpret_cast<uintptr_t>(p) % 16 != 0)
    return report("emulated cp.async: a 16-byte copy not 16-byte aligned");
  pending[emu::thread_id()].open.push_back(Copy{dst, src});
}
inline void cp_commit() {
  Pending& p = pending[emu::thread_id()];
  p.groups.push_back(std::move(p.open));
  p.open.clear();
}
template <int N>
inline void cp_wait() {
  Pending& p = pending[emu::thread_id()];
  while (static_cast<int>(p.groups.size()) > N) {
    for (const Copy& c : p.groups.front()) std::memcpy(c.dst, c.src, 16);
    p.groups.erase(p.groups.begin());
  }
}
inline void async_fence() {}
inline Barrier* barrier_at(uint64_t* bar) {
  for (auto& b : barriers)
    if (b.first == bar) return &b.second;
  report("emulated barrier: not initialised");
  return nullptr;
}
inline void bar_init(uint64_t* bar) {
  const uint8_t* d = reinterpret_cast<const uint8_t*>(bar);
  if (d < smem_base || d + 8 > smem_base + smem_bytes || (d - smem_base) % 8 != 0)
    return report("emulated barrier: not 8 aligned bytes of shared memory");
  for (auto& b : barriers)
    if (b.first == bar) {
      b.second = Barrier{};
      return;
    }
  barriers.emplace_back(bar, Barrier{});
}
inline void bulk_copy(void* dst, const void* src, int bytes, uint64_t* bar) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  const uint8_t* d = static_cast<const uint8_t*>(dst);
  bool inside = false;
  for (const auto& r : sources) inside = inside || (p >= r.first && p + bytes <= r.second);
  if (!inside) return report("emulated bulk copy: bytes outside the inputs");
  if (bytes <= 0 || bytes % 16 != 0 || d < smem_base || d + bytes > smem_base + smem_bytes)
    return report("emulated bulk copy: not a multiple of 16 bytes inside shared memory");
  if ((d - smem_base) % 16 != 0 || reinterpret_cast<uintptr_t>(p) % 16 != 0)
    return report("emulated bulk copy: not 16-byte aligned");
  if (Barrier* b = barrier_at(bar)) b->copies.push_back(Bulk{dst, src, bytes, b->phase});
}
inline void bar_arrive(uint64_t* bar) {
  if (Barrier* b = barrier_at(bar)) ++b->phase;
}
// Waits for the next phase this thread has not waited for: its parity must be `parity`, and it must have completed
// (a thread of a fiber cannot spin: waiting for a phase nobody arrived on is a fault). Its copies land.
inline void bar_wait(uint64_t* bar, int parity) {
  Barrier* b = barrier_at(bar);
  if (!b) return;
  int& w = b->waited[emu::thread_id()];
  if ((w & 1) != parity) return report("emulated barrier: waits with the parity of another phase");
  if (b->phase <= w) return report("emulated barrier: waits for a phase no thread arrived on");
  for (auto it = b->copies.begin(); it != b->copies.end();)
    if (it->phase <= w) {
      std::memcpy(it->dst, it->src, it->bytes);
      it = b->copies.erase(it);
    } else {
      ++it;
    }
  ++w;
}
inline float relu_nan(float x) { return x != x ? x : (x > 0.0f ? x : 0.0f); }
inline void prefetch_l2(const void* src, int bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  bool inside = false;
  for (const auto& r : prefetchable) inside = inside || (p >= r.first && p + bytes <= r.second);
  if (!inside) return report("emulated prefetch: bytes outside the inputs");
  if (bytes <= 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(p) % 16 != 0)
    return report("emulated prefetch: not a multiple of 16 bytes, 16-byte aligned");
}
inline int64_t peek_index(const void* p, int64_t i, bool i64) {
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Byte k of row r of a K-major 128-byte-swizzled tile at `tile`, as the matrix unit reads it.
inline uint8_t operand_byte(const uint8_t* tile, int r, int k) {
  const uint64_t x = static_cast<uint64_t>(tile - smem_base) + static_cast<uint64_t>(r / 8) * 1024 + (r % 8) * 128 + k;
  if ((tile - smem_base) % 1024 != 0) report("emulated MMA: operand tile not 1024-aligned");
  if (x >= static_cast<uint64_t>(smem_bytes)) {
    report("emulated MMA: operand outside shared memory");
    return 0;
  }
  return smem_base[x ^ (((x >> 7) & 7) << 4)];
}
inline float e4m3(uint8_t c) {
  static const std::vector<float> value = [] {   // e4m3fn code -> value
    std::vector<float> v(256);
    for (int i = 0; i < 256; ++i) v[i] = dsq::fp8_decode(static_cast<uint8_t>(i), dsq::Fp8Flavour::e4m3fn);
    return v;
  }();
  return value[c];
}

// The thread's fragment of acc = A . B^T, computed from the operands as they are now.
inline void mma_compute(const Mma& m) {
  const int t = emu::thread_id(), w = t / 32, l = t % 32;
  for (int c = 0; c < m.nt / 8; ++c)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const int row = 16 * w + l / 4 + 8 * i, col = 8 * c + 2 * (l % 4) + j;
        float s = 0.0f;
        for (int k = 0; k < 128; ++k) {
          const uint8_t a = m.a_tile ? operand_byte(m.a_tile, row, k) : m.a_rows[i][k];
          s += e4m3(a) * e4m3(operand_byte(m.b_rows, col, k));
        }
        m.acc[4 * c + 2 * i + j] = s;
      }
}
template <int NT>
inline Mma mma_begin(float (&acc)[NT / 2], const uint8_t* a_tile, const uint8_t* b_rows) {
  for (float& x : acc) x = dsq::u2f(0x7FC0DEADu);
  Mma m{};
  m.acc = acc;
  m.nt = NT;
  m.a_tile = a_tile;
  m.b_rows = b_rows;
  return m;
}
template <int NT>
inline void mma_ss(float (&acc)[NT / 2], const uint8_t* a_tile, const uint8_t* b_rows) {
  mmas[emu::thread_id()].push_back(mma_begin<NT>(acc, a_tile, b_rows));
}
// The 128 threads issue the instruction together: each posts its fragments, then gathers its rows' K bytes from
// its quad (frag[s][2h + i] of lane 4 (l / 4) + q holds k = 32 s + 16 h + 4 q + 0..3 of row 16 w + l / 4 + 8 i).
template <int NT>
inline void mma_rs(float (&acc)[NT / 2], const uint32_t (&frag)[4][4], const uint8_t* b_rows) {
  const int t = emu::thread_id();
  std::memcpy(frag_board[t], frag, sizeof(frag_board[t]));
  emu::block_barrier();
  Mma m = mma_begin<NT>(acc, nullptr, b_rows);
  for (int i = 0; i < 2; ++i)
    for (int s = 0; s < 4; ++s)
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 4; ++q)
          std::memcpy(&m.a_rows[i][32 * s + 16 * h + 4 * q], &frag_board[(t & ~3) + q][s][2 * h + i], 4);
  emu::block_barrier();   // every thread has read the board before the next call rewrites it
  mmas[t].push_back(m);
}
template <int N>
inline void mma_wait() {
  std::vector<Mma>& m = mmas[emu::thread_id()];
  while (static_cast<int>(m.size()) > N) {
    mma_compute(m.front());
    m.erase(m.begin());
  }
}
template <int NT>
inline void mma_done(float (&)[NT / 2]) {}
inline void frag_done(uint32_t (&)[4][4]) {}

// Before a block: shared memory (bytes at a 1024-aligned smem) filled with garbage, no copy or MMA pending.
inline void begin_block(uint8_t* smem, int bytes) {
  smem_base = smem;
  smem_bytes = bytes;
  std::memset(smem, 0xA5, bytes);
  for (Pending& q : pending) q = Pending{};
  for (std::vector<Mma>& m : mmas) m.clear();
  barriers.clear();
}
// After a block: what it left in flight, and the first fault seen inside it, thrown.
inline void end_block() {
  for (const Pending& q : pending)
    if (!q.groups.empty() || !q.open.empty()) report("emulated block exited with copies in flight");
  for (const auto& b : barriers)
    if (!b.second.copies.empty()) report("emulated block exited with bulk copies in flight");
  for (std::vector<Mma>& m : mmas)
    if (!m.empty()) {
      report("emulated block exited with an MMA in flight");
      m.clear();
    }
  if (!fault.empty()) {
    const std::string f = fault;
    fault.clear();
    throw std::runtime_error(f);
  }
}

}  // namespace sm90emu
