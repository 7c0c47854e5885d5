// Host emulator of the CUDA prefill logits (kernels/cuda/prefill_body.cuh), for tests only.
//
// The block body runs unchanged on the CPU under the block emulator of tests/cpp/fibers.h (128 fibers a block,
// blocks in a chosen order). The layer is modelled on the hardware, not on the body:
//   * cp16 only records a copy; the copies land when cp_wait retires their group (all groups but the newest N of
//     the thread), so a body that reads a stage before waiting for it reads stale bytes;
//   * an MMA (mma_start) runs when mma_wait retires it: it computes each thread's accumulator fragment from the
//     operands as they are then, as the matrix unit addresses them:
//     byte k of row r of a K-major tile with the 128-byte swizzle at address A (1024-aligned) is at
//     x ^ (((x >> 7) & 7) << 4), x = A + (r / 8) * 1024 + (r % 8) * 128 + k; thread t (warp w, lane l) gets row
//     16 w + l / 4 + 8 i, column 8 c + 2 (l % 4) + j in acc[4 c + 2 i + j]; products of e4m3fn values summed in
//     fp32 in the order of k;
//   * shared memory starts as garbage (0xA5 bytes) in every block.
// It exports dsq_mqa_logits (kernels/cuda/prefill.h; pointers are host pointers: CPU torch tensors), plus
// dsq_emu_set_order, dsq_emu_set_slots and dsq_error_string. Built by tests/test_prefill_host.py.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dsaquant/dsaquant.h"
#include "fibers.h"
#include "prefill.h"

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
std::vector<std::pair<const uint8_t*, const uint8_t*>> sources;   // the byte ranges cp16 may read
std::string fault;   // the first fault seen inside a block (fibers cannot throw: reported after the block)
inline void report(const char* what) {
  if (fault.empty()) fault = what;
}

}  // namespace

int dsqpf_smem_bytes();

namespace dsqpf {
#define PF_FN inline
inline int thread_id() { return emu::thread_id(); }
inline void block_sync() { emu::block_barrier(); }
inline float shfl_xor(float v, int m) { return emu::shuffle_xor(v, m); }
inline void cp16(void* dst, const void* src) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  bool inside = false;
  for (const auto& r : sources) inside = inside || (p >= r.first && p + 16 <= r.second);
  if (!inside) return report("emulated cp.async: 16 bytes outside the inputs");
  const uint8_t* d = static_cast<const uint8_t*>(dst);
  if (d < smem_base || d + 16 > smem_base + dsqpf_smem_bytes()) return report("emulated cp.async: outside shared memory");
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

// Byte k of row r of a K-major 128-byte-swizzled tile at `tile`, as the matrix unit reads it.
inline uint8_t operand_byte(const uint8_t* tile, int r, int k) {
  const uint64_t x = static_cast<uint64_t>(tile - smem_base) + static_cast<uint64_t>(r / 8) * 1024 + (r % 8) * 128 + k;
  if ((tile - smem_base) % 1024 != 0) report("emulated MMA: operand tile not 1024-aligned");
  return smem_base[x ^ (((x >> 7) & 7) << 4)];
}
// The thread's fragment of acc = K . Q^T, computed from the operands as they are now.
inline void mma_compute(float* acc, const uint8_t* k_tile, const uint8_t* q_rows) {
  static const std::vector<float> value = [] {   // e4m3fn code -> value
    std::vector<float> v(256);
    for (int c = 0; c < 256; ++c) v[c] = dsq::fp8_decode(static_cast<uint8_t>(c), dsq::Fp8Flavour::e4m3fn);
    return v;
  }();
  const int t = emu::thread_id(), w = t / 32, l = t % 32;
  for (int c = 0; c < 16; ++c)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const int row = 16 * w + l / 4 + 8 * i, col = 8 * c + 2 * (l % 4) + j;
        float s = 0.0f;
        for (int k = 0; k < 128; ++k) s += value[operand_byte(k_tile, row, k)] * value[operand_byte(q_rows, col, k)];
        acc[4 * c + 2 * i + j] = s;
      }
}
// Started MMAs run when they are waited for (so a body that reads acc, or refills an operand, before the wait
// shows); until then acc holds garbage.
struct Mma {
  float* acc;
  const uint8_t* k_tile;
  const uint8_t* q_rows;
};
std::vector<Mma> mmas[128];
inline void mma_start(float (&acc)[64], const uint8_t* k_tile, const uint8_t* q_rows) {
  for (float& x : acc) x = dsq::u2f(0x7FC0DEADu);
  mmas[emu::thread_id()].push_back(Mma{acc, k_tile, q_rows});
}
template <int N>
inline void mma_wait(float (&)[64]) {
  std::vector<Mma>& m = mmas[emu::thread_id()];
  while (static_cast<int>(m.size()) > N) {
    mma_compute(m.front().acc, m.front().k_tile, m.front().q_rows);
    m.erase(m.begin());
  }
}
}  // namespace dsqpf

#include "prefill_body.cuh"

int dsqpf_smem_bytes() { return dsqpf::kSmemBytes; }

namespace {

int64_t slots = 8;   // resident blocks of the emulated device (the split plan's input)

template <int H>
void run(const DsqMqaLogitsArgs& a) {
  const dsqpf::Plan p = dsqpf::plan(a, slots);
  std::vector<uint8_t> raw(dsqpf::kSmemBytes + 1024);
  uint8_t* smem = raw.data() + ((1024 - reinterpret_cast<uintptr_t>(raw.data()) % 1024) % 1024);
  smem_base = smem;
  const uint8_t* k = static_cast<const uint8_t*>(a.k);
  const uint8_t* ks = reinterpret_cast<const uint8_t*>(a.k_scale);
  sources = {{k, k + a.SKV * 128}, {ks, ks + a.SKV * 4}};
  emu::run_grid(p.row_blocks * p.splits, [&](int64_t id) {
    std::memset(smem, 0xA5, dsqpf::kSmemBytes);
    for (Pending& q : pending) q = Pending{};
    emu::run_block(id, dsqpf::kThreads,
                   [&] { dsqpf::mqa_logits_block<H>(a, id % p.row_blocks, id / p.row_blocks, p.tpc, smem); });
    for (const Pending& q : pending)
      if (!q.groups.empty() || !q.open.empty()) report("emulated block exited with copies in flight");
    for (std::vector<dsqpf::Mma>& m : dsqpf::mmas)
      if (!m.empty()) {
        report("emulated block exited with an MMA in flight");
        m.clear();
      }
    if (!fault.empty()) {
      const std::string f = fault;
      fault.clear();
      throw std::runtime_error(f);
    }
  });
}

}  // namespace

extern "C" {

// 0 on success, 1 for bad arguments (as the CUDA library), 2 for an emulation error (dsq_error_string).
int dsq_mqa_logits(const DsqMqaLogitsArgs* args, void*) {
  return emu::guarded(2, [&]() -> int {
    const DsqMqaLogitsArgs& a = *args;
    if (dsqpf::check(a) != 0) return 1;
    if (a.S == 0 || a.SKV == 0 || (a.compressed && a.W == 0)) return 0;
    switch (a.H) {
      case 16: run<16>(a); break;
      case 32: run<32>(a); break;
      case 64: run<64>(a); break;
      default: run<128>(a); break;
    }
    return 0;
  });
}

const char* dsq_error_string(int) { return emu::last_error().c_str(); }

void dsq_emu_set_order(int order, uint64_t seed) { emu::set_grid_order(order, seed); }

void dsq_emu_set_slots(int64_t n) { slots = n; }

}  // extern "C"
