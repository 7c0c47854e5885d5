// Host emulator of the top-k selection (kernels/cuda/topk_body.cuh), for tests only.
//
// The block bodies run unchanged on the CPU under the block emulator of tests/cpp/fibers.h: every thread of a
// block is a cooperative fiber, the block barrier and the 32-lane shuffles are rendezvous points, atomic adds are
// plain adds (fibers switch only at those points), and the blocks of a grid run one after another in a chosen
// order (forward, reverse or shuffled), so that the written bytes must not depend on the order of blocks (the
// few-long-rows path fills its lists in that order). Shared memory starts as garbage (0xA5 bytes). A cluster of
// the cached-row path runs its blocks together (fibers.h: the threads of all its blocks, block and cluster
// barriers), each block with its own shared memory, which the others reach through cluster_peer.
//
// It exports the C interface of kernels/cuda/topk.h (pointers are host pointers: CPU torch tensors), plus
// dsq_emu_set_order, dsq_emu_threads and dsq_error_string. Built by tests/test_topk_host.py with g++ -O2
// -std=c++17, once as the NVIDIA configuration and once with -DDSQ_TOPK_AMD=1 (256-thread blocks).
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fibers.h"
#include "topk.h"

namespace {

// Runs blocks 0..n-1 of `threads` threads in emu::grid_order(), each with fresh shared memory of type S filled
// with garbage (0xA5 bytes).
template <class S, class F>
void run_grid(int64_t n, int threads, F&& body) {
  std::unique_ptr<S> sh(new S);
  emu::run_grid(n, [&](int64_t id) {
    std::memset(static_cast<void*>(sh.get()), 0xA5, sizeof(S));
    emu::run_block(id, threads, [&] { body(id, *sh); });
  });
}

}  // namespace

namespace dsqtopk {
#define TOPK_FN inline
inline int thread_id() { return emu::thread_id() % emu::current()->rank_size; }
inline void block_sync() { emu::block_barrier(); }
inline int shfl_up_i(int v, int off) { return emu::shuffle_up(v, off); }
inline unsigned long long shfl_up_u64(unsigned long long v, int off) { return emu::shuffle_up(v, off); }
inline unsigned long long shfl_xor_u64(unsigned long long v, int m) { return emu::shuffle_xor(v, m); }
inline int global_add(int* p, int v) {
  const int old = *p;
  *p += v;
  return old;
}
inline int shared_add(int* p, int v) { return global_add(p, v); }
inline void cluster_sync() { emu::cluster_barrier(); }
// The cluster's shared memories: `cluster_blocks` objects of `cluster_stride` bytes from `cluster_base`.
inline char* cluster_base = nullptr;
inline size_t cluster_stride = 0;
inline int cluster_blocks = 0;
// The address in block r's shared memory of the object at p in the caller's.
template <class T>
T* cluster_peer(T* p, int r) {
  return emu::cluster_peer_at(p, r, cluster_base, static_cast<ptrdiff_t>(cluster_stride), cluster_blocks);
}
}  // namespace dsqtopk

#include "topk_body.cuh"

namespace {


// The launches of topk_body.cuh run(), as grids of fibers.
struct Host {
  template <int DT>
  int row(const DsqTopkArgs& a) {
    run_grid<dsqtopk::Shared>(a.rows, dsqtopk::kThreads,
                                   [&](int64_t b, dsqtopk::Shared& sh) { dsqtopk::row_block<DT>(a, b, sh); });
    return 0;
  }
#if DSQ_TOPK_CACHE_KEYS > 0
  // Clusters of `blocks` blocks a row, each cluster's blocks run together.
  template <int DT>
  int cache(const DsqTopkArgs& a, int blocks) {
    using dsqtopk::CacheShared;
    std::unique_ptr<CacheShared[]> sh(new CacheShared[blocks]);
    dsqtopk::cluster_base = reinterpret_cast<char*>(sh.get());
    dsqtopk::cluster_stride = sizeof(CacheShared);
    dsqtopk::cluster_blocks = blocks;
    emu::run_grid(a.rows, [&](int64_t row) {
      std::memset(static_cast<void*>(sh.get()), 0xA5, sizeof(CacheShared) * blocks);
      emu::run_block(row, blocks * dsqtopk::kThreads, [&] {
        const int r = emu::cluster_rank();
        switch (dsqtopk::cache_collect(blocks)) {
          case dsqtopk::kCollectSum: return dsqtopk::cache_block<DT, dsqtopk::kCollectSum>(a, row, r, blocks, sh[r]);
          case dsqtopk::kCollectAdd: return dsqtopk::cache_block<DT, dsqtopk::kCollectAdd>(a, row, r, blocks, sh[r]);
          default: return dsqtopk::cache_block<DT, dsqtopk::kCollectStage>(a, row, r, blocks, sh[r]);
        }
      }, dsqtopk::kThreads);
    });
    return 0;
  }
#endif
  template <int DT>
  int finish(const DsqTopkArgs& a) {
    run_grid<dsqtopk::Shared>(a.rows * dsqtopk::kFinishGroups, dsqtopk::kThreads,
                                   [&](int64_t b, dsqtopk::Shared& sh) { dsqtopk::finish_block<DT>(a, b, sh); });
    return 0;
  }
  int memset(void* p, size_t bytes) {
    std::memset(p, 0, bytes);
    return 0;
  }
  template <int DT>
  int hist(const DsqTopkArgs& a, int32_t chunks) {
    run_grid<dsqtopk::ChunkShared>(a.rows * chunks, dsqtopk::kThreads, [&](int64_t b, dsqtopk::ChunkShared& sh) {
      dsqtopk::hist_block<DT>(a, chunks, b, sh);
    });
    return 0;
  }
  template <int DT>
  int scatter(const DsqTopkArgs& a, int32_t chunks) {
    run_grid<dsqtopk::ChunkShared>(a.rows * chunks, dsqtopk::kThreads, [&](int64_t b, dsqtopk::ChunkShared& sh) {
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
  return emu::guarded(2, [&] {
    Host dev;
    return dsqtopk::run(args, dev);
  });
}

const char* dsq_error_string(int) { return emu::last_error().c_str(); }

void dsq_emu_set_order(int order, uint64_t seed) { emu::set_grid_order(order, seed); }

int dsq_emu_threads() { return dsqtopk::kThreads; }

}  // extern "C"
