// Host emulator of the CUDA paged MQA logits (kernels/cuda/scorer_body.cuh), for tests only.
//
// The block body runs unchanged on the CPU under the block emulator of tests/cpp/fibers.h (128 fibers a block,
// blocks in a chosen order). The layer is modelled on the hardware, not on the body:
//   * cp16 only records a copy (of bytes inside the cache's tensors, into the block's shared memory); the copies
//     land when cp_wait retires their group (all groups but the newest N of the thread), so a body that reads a
//     stage before waiting for it reads stale bytes;
//   * a product (mma_ss, mma_rs) runs when mma_wait retires it: it computes each thread's accumulator fragment
//     from the operands as they are then, as the matrix unit addresses them: byte k of row r of a K-major tile
//     with the 128-byte swizzle at address A (1024-aligned) is at x ^ (((x >> 7) & 7) << 4), x = A + (r / 8) *
//     1024 + (r % 8) * 128 + k; a register operand (mma_rs) is the fragments the 128 threads passed to the call
//     (its rows gathered across the four lanes that share them); products of e4m3fn values summed in fp32 in the
//     order of k. Until then the accumulators hold NaN;
//   * shared memory starts as garbage (0xA5 bytes) in every block.
// It exports dsq_paged_mqa_logits (kernels/cuda/scorer.h; pointers are host pointers: CPU torch tensors), plus
// dsq_emu_set_order, dsq_emu_set_slots and dsq_error_string. Built by tests/test_scorer_host.py.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dsaquant/fp8.h"
#include "fibers.h"
#include "scorer.h"

namespace {

struct Copy {
  void* dst;
  const void* src;
};
struct Pending {
  std::vector<std::vector<Copy>> groups;   // committed groups, oldest first
  std::vector<Copy> open;                  // copies since the last commit
};
Pending pending[128];
const uint8_t* smem_base = nullptr;        // the block's shared memory (1024-aligned)
int smem_bytes = 0;
std::vector<std::pair<const uint8_t*, const uint8_t*>> sources;   // the byte ranges cp16 may read
std::string fault;   // the first fault seen inside a block (fibers cannot throw: reported after the block)
inline void report(const char* what) {
  if (fault.empty()) fault = what;
}

}  // namespace

namespace dsqsc {
#define SC_FN inline
inline int thread_id() { return emu::thread_id(); }
inline void block_sync() { emu::block_barrier(); }
inline float shfl_xor(float v, int m) { return emu::shuffle_xor(v, m); }
inline bool any_sync(bool p) {
  int v = p ? 1 : 0;
  for (int m = 1; m < 32; m <<= 1) v |= emu::shuffle_xor(v, m);
  return v != 0;
}
inline void flag_or(int32_t* p, int v) { *p |= v; }
inline void cp16(void* dst, const void* src) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  bool inside = false;
  for (const auto& r : sources) inside = inside || (p >= r.first && p + 16 <= r.second);
  if (!inside) return report("emulated cp.async: 16 bytes outside the cache");
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
inline float relu_nan(float x) { return x != x ? x : (x > 0.0f ? x : 0.0f); }
inline uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t both = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((both >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
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

// A started product: the thread's accumulators, the operands, and for mma_rs the K rows of the thread's two
// accumulator rows (the fragments of its quad at the call).
struct Mma {
  float* acc;
  int nt;
  const uint8_t* k_tile;   // null: K from a_rows
  const uint8_t* q_rows;
  uint8_t a_rows[2][128];
};
std::vector<Mma> mmas[128];
uint32_t frag_board[128][4][4];   // the fragments every thread passes to the current mma_rs

// The thread's fragment of acc = K . Q^T, computed from the operands as they are now.
inline void mma_compute(const Mma& m) {
  const int t = emu::thread_id(), w = t / 32, l = t % 32;
  for (int c = 0; c < m.nt / 8; ++c)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const int row = 16 * w + l / 4 + 8 * i, col = 8 * c + 2 * (l % 4) + j;
        float s = 0.0f;
        for (int k = 0; k < 128; ++k) {
          const uint8_t a = m.k_tile ? operand_byte(m.k_tile, row, k) : m.a_rows[i][k];
          s += e4m3(a) * e4m3(operand_byte(m.q_rows, col, k));
        }
        m.acc[4 * c + 2 * i + j] = s;
      }
}
template <int NT>
inline void mma_begin(float (&acc)[NT / 2], const uint8_t* k_tile, const uint8_t* q_rows, Mma& m) {
  for (float& x : acc) x = dsq::u2f(0x7FC0DEADu);
  m.acc = acc;
  m.nt = NT;
  m.k_tile = k_tile;
  m.q_rows = q_rows;
}
template <int NT>
inline void mma_ss(float (&acc)[NT / 2], const uint8_t* k_tile, const uint8_t* q_rows) {
  Mma m{};
  mma_begin<NT>(acc, k_tile, q_rows, m);
  mmas[emu::thread_id()].push_back(m);
}
// The 128 threads issue the instruction together: each posts its fragments, then gathers its rows' K bytes from
// its quad (a[s][2h + i] of lane 4 (l / 4) + q holds k = 32 s + 16 h + 4 q + 0..3 of row 16 w + l / 4 + 8 i).
template <int NT>
inline void mma_rs(float (&acc)[NT / 2], const uint32_t (&a)[4][4], const uint8_t* q_rows) {
  const int t = emu::thread_id();
  std::memcpy(frag_board[t], a, sizeof(frag_board[t]));
  emu::block_barrier();
  Mma m{};
  mma_begin<NT>(acc, nullptr, q_rows, m);
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
}  // namespace dsqsc

#include "scorer_body.cuh"

namespace {

int64_t slots = 8;   // resident blocks of the emulated device (the split plan's input)

template <int H, int NQ, bool FP4>
void run(const DsqPagedLogitsArgs& a) {
  const dsqsc::Plan p = dsqsc::plan(a, NQ, slots);
  smem_bytes = dsqsc::smem_plan(H * NQ, FP4, p.n_pages).total;
  std::vector<uint8_t> raw(smem_bytes + 1024);
  uint8_t* smem = raw.data() + ((1024 - reinterpret_cast<uintptr_t>(raw.data()) % 1024) % 1024);
  smem_base = smem;
  const int64_t P = a.page_size;
  const int64_t page_bytes = a.layout == DSQ_SCORER_FP8_132 ? P * 132 : a.layout == DSQ_SCORER_PACKED68 ? P * 68 : P * 64;
  sources = {{a.kv_cache, a.kv_cache + a.num_blocks * page_bytes}};
  if (a.layout == DSQ_SCORER_AITER_FP4) sources.push_back({a.kv_scale, a.kv_scale + a.num_blocks * 4 * P});
  const int64_t per_b = static_cast<int64_t>(p.splits) * p.groups;
  emu::run_grid(per_b * a.B, [&](int64_t id) {
    std::memset(smem, 0xA5, smem_bytes);
    for (Pending& q : pending) q = Pending{};
    const int split = static_cast<int>(id % p.splits), group = static_cast<int>(id / p.splits % p.groups);
    emu::run_block(id, dsqsc::kThreads, [&] {
      dsqsc::paged_logits_block<H, NQ, FP4>(a, split, group, id / per_b, p.tiles_per_block, p.n_pages, p.p_shift,
                                            smem);
    });
    for (const Pending& q : pending)
      if (!q.groups.empty() || !q.open.empty()) report("emulated block exited with copies in flight");
    for (std::vector<dsqsc::Mma>& m : dsqsc::mmas)
      if (!m.empty()) {
        report("emulated block exited with a product in flight");
        m.clear();
      }
    if (!fault.empty()) {
      const std::string f = fault;
      fault.clear();
      throw std::runtime_error(f);
    }
  });
}

template <bool FP4>
void dispatch(const DsqPagedLogitsArgs& a) {
  const int nq = dsqsc::queries_per_block(a);
  switch (a.H) {
    case 16:
      if (nq == 1) return run<16, 1, FP4>(a);
      if (nq == 2) return run<16, 2, FP4>(a);
      if (nq == 4) return run<16, 4, FP4>(a);
      return run<16, 8, FP4>(a);
    case 32:
      if (nq == 1) return run<32, 1, FP4>(a);
      if (nq == 2) return run<32, 2, FP4>(a);
      return run<32, 4, FP4>(a);
    case 64:
      if (nq == 1) return run<64, 1, FP4>(a);
      return run<64, 2, FP4>(a);
    default:
      return run<128, 1, FP4>(a);
  }
}

constexpr int kNotSupported = 801;   // cudaErrorNotSupported, as the CUDA library returns it

}  // namespace

extern "C" {

// 0 on success, 801 where the CUDA library does not take the sizes, 2 for an emulation error (dsq_error_string).
int dsq_paged_mqa_logits(const DsqPagedLogitsArgs* args, void*) {
  return emu::guarded(2, [&]() -> int {
    const DsqPagedLogitsArgs& a = *args;
    if (!dsqsc::supported(a)) return kNotSupported;
    if (a.B == 0 || a.N == 0 || a.max_seq_len == 0) return 0;
    if (a.layout == DSQ_SCORER_FP8_132)
      dispatch<false>(a);
    else
      dispatch<true>(a);
    return 0;
  });
}

const char* dsq_error_string(int) { return emu::last_error().c_str(); }

void dsq_emu_set_order(int order, uint64_t seed) { emu::set_grid_order(order, seed); }

void dsq_emu_set_slots(int64_t n) { slots = n; }

}  // extern "C"
