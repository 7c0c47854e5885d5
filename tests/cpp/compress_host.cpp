// Host emulator of the DeepSeek-V4 kernels (kernels/cuda/compress_body.cuh), for tests only.
//
// The kernel bodies run unchanged on the CPU under the block emulator of tests/cpp/fibers.h: every thread of a
// block is a cooperative fiber, the block barrier and the 32-lane warp shuffles are rendezvous points, and the
// blocks of a grid run one after another in a chosen order (forward, reverse or shuffled), so that results must
// not depend on the order of blocks. A shuffle that not every lane of its warp reaches (undefined on a GPU) is
// reported as an error instead of hanging. Pointers are host pointers (CPU torch tensors): the Python glue
// (python/dsaquant/backends/compiled.py make_ops) drives this library through the same C interface as
// libdsaquant_cuda.so (dsaquant/abi.h: dsq_compress_kv, dsq_rope_rotate_quant, dsq_error_string), plus the
// dsq_emu_* entry points below for the tests. An error (a C++ exception) returns 1; dsq_error_string(1) names it.
// Built by tests/test_compress_host.py with g++ -O2 -std=c++17 -ffp-contract=off -fno-fast-math (SPEC §0).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "compress_args.h"
#include "fibers.h"

namespace dsqv4 {
#define V4_FN inline
#define V4_UNROLL
#define V4_NO_UNROLL
inline int thread_id() { return emu::thread_id() % emu::current()->rank_size; }   // in its own block
inline int64_t block_id() { return emu::block_id(); }
inline void block_sync() { emu::block_barrier(); }
inline float shfl_xor(float v, int s) { return emu::shuffle_xor(v, s); }
inline int shfl_xor_i(int v, int s) { return emu::shuffle_xor(v, s); }
inline void atomic_or(int* p, int v) { *p |= v; }
inline void prefetch_l1(const void*) {}
inline void ld16(const void* p, uint32_t (&w)[4]) { std::memcpy(w, p, 16); }
inline void ld8(const void* p, uint32_t (&w)[2]) { std::memcpy(w, p, 8); }
inline void st16(void* p, const uint32_t (&w)[4]) { std::memcpy(p, w, 16); }
inline void st8(void* p, uint32_t w0, uint32_t w1) {
  const uint32_t w[2] = {w0, w1};
  std::memcpy(p, w, 8);
}
inline void st4(void* p, uint32_t w) { std::memcpy(p, &w, 4); }
// The cluster layer of the column-split mode: a cluster's blocks run together (fibers.h), each with its own
// CompressSmem of `g_cluster_smem`, which the others reach through cluster_peer.
#define DSQ_V4_CLUSTERS 1
struct CompressSmem;
inline CompressSmem* g_cluster_smem = nullptr;
inline int g_cluster_blocks = 0;
inline void cluster_sync() { emu::cluster_barrier(); }
inline int cluster_rank() { return emu::cluster_rank(); }
template <class T>
T* cluster_peer(T* p, int r);
}  // namespace dsqv4

#include "compress_body.cuh"
#include "rotate_body.cuh"

namespace dsqv4 {
// The address in block r's CompressSmem of the object at p in the caller's (an error outside the caller's).
template <class T>
T* cluster_peer(T* p, int r) {
  return emu::cluster_peer_at(p, r, reinterpret_cast<char*>(g_cluster_smem), sizeof(CompressSmem), g_cluster_blocks);
}
}  // namespace dsqv4

namespace {

// compress_kv's range mode: 0 the launcher's choice by call size (on sm_90: clusters for K >= 128, of 8 blocks for
// calls of few windows, else 4), 1 one range a block (and one block a window: the mode of devices without clusters),
// 2 one range a warp (where K <= 8 and D = 128; elsewhere one a block, as the launcher does), 3 clusters of 4 blocks
// whatever the call's size.
int g_compress_force = 0;

template <int K, int D, int MODE>
void compress_grid_run(const dsqv4::CompressArgs& a) {
  emu::run_grid(dsqv4::compress_grid(a, MODE == dsqv4::kRangeWarp), [&](int64_t bid) {
    dsqv4::CompressSmem sm;
    emu::run_block(bid, dsqv4::kThreads, [&] { dsqv4::compress_block<K, D, MODE>(a, sm); });
  });
}

// The column-split mode: clusters of S blocks, each cluster's blocks run together.
template <int K, int D, int MODE>
void compress_split_run(const dsqv4::CompressArgs& a) {
  constexpr int S = dsqv4::kSplitOf<MODE>;
  std::unique_ptr<dsqv4::CompressSmem[]> sms(new dsqv4::CompressSmem[S]);
  dsqv4::g_cluster_smem = sms.get();
  dsqv4::g_cluster_blocks = S;
  emu::run_grid(dsqv4::compress_grid(a, false, S) / S, [&](int64_t cluster) {
    std::memset(static_cast<void*>(sms.get()), 0xA5, sizeof(dsqv4::CompressSmem) * S);
    emu::run_block(cluster * S, S * dsqv4::kThreads, [&] {
      dsqv4::compress_block<K, D, MODE>(a, sms[emu::cluster_rank()]);
    }, dsqv4::kThreads);
  });
}

template <int K>
void compress_k(const dsqv4::CompressArgs& a) {
  if constexpr (K >= 128) {
    if ((g_compress_force == 0 || g_compress_force == 3) && dsqv4::compress_split_windows(a)) {
      const bool four = g_compress_force == 3 || dsqv4::compress_split_blocks(a) == 4;
      using namespace dsqv4;
      if (a.D == 128) return four ? compress_split_run<K, 128, kSplit4>(a) : compress_split_run<K, 128, kSplit8>(a);
      if (a.D == 512) return four ? compress_split_run<K, 512, kSplit4>(a) : compress_split_run<K, 512, kSplit8>(a);
    }
  }
  if constexpr (K <= 8) {
    if (dsqv4::compress_warp_ranges(a, g_compress_force)) return compress_grid_run<K, 128, dsqv4::kRangeWarp>(a);
  }
  if (a.D == 128) compress_grid_run<K, 128, dsqv4::kRangeBlock>(a);
  else if (a.D == 512) compress_grid_run<K, 512, dsqv4::kRangeBlock>(a);
  else throw std::invalid_argument("D must be 128 or 512");
}

void compress_kv(const dsqv4::CompressArgs& a) {
  if (a.T == 0 || a.B == 0) return;
  switch (a.K) {
    case 4: compress_k<4>(a); break;
    case 8: compress_k<8>(a); break;
    case 128: compress_k<128>(a); break;
    case 256: compress_k<256>(a); break;
    default: throw std::invalid_argument("K must be 4, 8, 128 or 256");
  }
}

// The distributed pool alone (compress_body.cuh pool_row, or pool_warp when the range mode is forced to `warp` and
// K <= 8, D = 128: SPEC §7.6 step 2 over all D columns) for the boundaries
// (i, p, b) given: returns their pooled rows [N, D] in fp32, before any rounding point.
// bs: n boundaries (i, p, b) as int64 triples; out: n rows of D fp32 values.
template <int K, int D>
void pool_rows_run(const dsqv4::CompressArgs& a, const int64_t* bs, int64_t n, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = bs[3 * r], p = bs[3 * r + 1], b = bs[3 * r + 2];
    dsqv4::CompressSmem sm;
    emu::run_grid(1, [&](int64_t) {
      emu::run_block(0, dsqv4::kThreads, [&] {
        const dsqv4::Seq q = dsqv4::seq_of(a, b);
        if constexpr (K <= 8 && D == 128) {
          if (g_compress_force == 2) {   // the warp pool (range mode `warp`) on warp 0
            const int tid = dsqv4::thread_id();
            if (tid >= 32) return;
            float y[4];
            dsqv4::pool_warp<K>(a, dsqv4::window_of<K>(a, q, i, p), tid, y);
            for (int e = 0; e < 4; ++e) sm.y[4 * tid + e] = y[e];
            return;
          }
        }
        dsqv4::pool_row<K, D>(a, sm, q, i, p);
      });
    });
    for (int c = 0; c < D; ++c) out[r * D + c] = sm.y[c];
  }
}

void pool_rows(const dsqv4::CompressArgs& a, const int64_t* bs, int64_t n, float* out) {
  auto by_d = [&](auto k) {
    constexpr int K = decltype(k)::value;
    if (a.D == 128) return pool_rows_run<K, 128>(a, bs, n, out);
    if (a.D == 512) return pool_rows_run<K, 512>(a, bs, n, out);
    throw std::invalid_argument("D must be 128 or 512");
  };
  switch (a.K) {
    case 4: return by_d(std::integral_constant<int, 4>{});
    case 8: return by_d(std::integral_constant<int, 8>{});
    case 128: return by_d(std::integral_constant<int, 128>{});
    case 256: return by_d(std::integral_constant<int, 256>{});
    default: throw std::invalid_argument("K must be 4, 8, 128 or 256");
  }
}

// The warp primitives alone on rows of n = 32*V fp32 values (8 rows a block, one per warp): op 0 warp_sum (the
// SPEC §0.2 canonical sum, returned in element 0 of each row), op 1 warp_hadamard (SPEC §5).
template <int V>
void warp_op_run(float* x, int64_t count, int op) {
  const int64_t rows = count / (32 * V);
  emu::run_grid((rows + 7) / 8, [&](int64_t bid) {
    emu::run_block(bid, dsqv4::kThreads, [&] {
      const int tid = dsqv4::thread_id(), lane = tid & 31;
      const int64_t r = bid * 8 + (tid >> 5);
      if (r >= rows) return;
      float* row = x + r * 32 * V + V * lane;
      float v[V];
      for (int e = 0; e < V; ++e) v[e] = row[e];
      if (op == 0) {
        const float s = dsqv4::warp_sum(v);
        dsqv4::block_sync();   // (every lane reads its own values before lane 0 writes)
        if (lane == 0) row[0] = s;
      } else {
        dsqv4::warp_hadamard(v, lane);
        for (int e = 0; e < V; ++e) row[e] = v[e];
      }
    });
  });
}

void warp_op(float* x, int64_t count, int n, int op) {
  switch (n) {
    case 128: warp_op_run<4>(x, count, op); break;
    case 256: warp_op_run<8>(x, count, op); break;
    case 512: warp_op_run<16>(x, count, op); break;
    case 1024: warp_op_run<32>(x, count, op); break;
    default: throw std::invalid_argument("n must be 128, 256, 512 or 1024");
  }
}

// SPEC §7.7 with V values a lane (0: the launcher's choice, rot::rotate_values_per_lane), the output mode chosen at
// run time (the CUDA launcher's per-mode instances run the same code with the mode fixed).
int g_rotate_v = 0;

template <int D, int V>
void rotate_grid_run(const dsqv4::RotateArgs& a) {
  namespace rot = dsqv4::rot;
  const rot::Run run = rot::rotate_run(a, V);
  emu::run_grid(rot::rotate_grid(a, V), [&](int64_t bid) {
    rot::RotateSmem sm;
    emu::run_block(bid, rot::kThreads, [&] { rot::rotate_block<D, V, rot::kAnyMode>(a, run, sm); });
  });
}

template <int D>
void rotate_d(const dsqv4::RotateArgs& a) {
  using I = dsqv4::rot::Instances<D>;
  const int v = g_rotate_v ? g_rotate_v : dsqv4::rot::rotate_values_per_lane(a, I::kSmall, I::kLarge);
  if (v == 16 && D <= 512) return rotate_grid_run<D, (D <= 512 ? 16 : 32)>(a);
  if (v == 32) return rotate_grid_run<D, 32>(a);
  if (v == 64) return rotate_grid_run<D, 64>(a);
  if (v == 128) return rotate_grid_run<D, 128>(a);
  throw std::invalid_argument("values a lane: 16 (D <= 512), 32, 64 or 128");
}

void rope_rotate_quant(const dsqv4::RotateArgs& a) {
  if (a.T == 0 || a.H == 0) return;
  switch (a.D) {
    case 128: rotate_d<128>(a); break;
    case 256: rotate_d<256>(a); break;
    case 512: rotate_d<512>(a); break;
    case 1024: rotate_d<1024>(a); break;
    default: throw std::invalid_argument("D must be 128, 256, 512 or 1024");
  }
}

}  // namespace

extern "C" {

int dsq_compress_kv(const DsqCompressArgs* a, void* /*stream*/) {
  return emu::guarded(1, [&] { compress_kv(*a); });
}
int dsq_rope_rotate_quant(const DsqRotateArgs* a, void* /*stream*/) {
  return emu::guarded(1, [&] { rope_rotate_quant(*a); });
}
const char* dsq_error_string(int code) { return code == 0 ? "no error" : emu::last_error().c_str(); }

// pool_row alone for the n boundaries bs[n][3] = (i, p, b): their fp32 rows out[n][D].
DSQ_API int dsq_emu_pool_rows(const DsqCompressArgs* a, const int64_t* bs, int64_t n, float* out) {
  return emu::guarded(1, [&] { pool_rows(*a, bs, n, out); });
}
// warp_sum (op 0, into element 0 of each row) / warp_hadamard (op 1) on x[count], rows of n values, in place.
DSQ_API int dsq_emu_warp_op(float* x, int64_t count, int n, int op) {
  return emu::guarded(1, [&] { warp_op(x, count, n, op); });
}
// The values a lane of the emulated rope_rotate_quant (0: the launcher's choice; 16, 32, 64 or 128).
DSQ_API void dsq_emu_set_rotate_v(int v) { g_rotate_v = v; }
// compress_kv's range mode (g_compress_force): 0 by call size, 1 one range a block, 2 one range a warp, 3 clusters of
// 4 blocks for the windows of K >= 128 rows.
DSQ_API void dsq_emu_set_compress_mode(int force) { g_compress_force = force; }
// The order of the blocks of a grid: 0 in order, 1 reversed, 2 shuffled (seeded).
DSQ_API void dsq_emu_set_block_order(int order, uint64_t seed) { emu::set_grid_order(order, seed); }

}  // extern "C"
