// Host emulator of the CUDA paged MQA logits (kernels/cuda/scorer_body.cuh), for tests only.
//
// The block body runs unchanged on the CPU under the block emulator of tests/cpp/fibers.h (128 fibers a block,
// blocks in a chosen order), with the layer of tests/cpp/sm90_emu.h (asynchronous copies, the matrix unit, garbage
// shared memory, modelled on the hardware) plus a warp vote, byte permutes and the error flag's or.
// It exports dsq_paged_mqa_logits (kernels/cuda/scorer.h; pointers are host pointers: CPU torch tensors), plus
// dsq_emu_set_order, dsq_emu_set_slots, dsq_emu_set_prefetch (each block runs prefetch_block first, as a CTA of a
// dependent launch of a DSQ_SCORER_PREFETCH build does) and dsq_error_string. Built by tests/test_scorer_host.py.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "fibers.h"
#include "scorer.h"
#include "sm90_emu.h"

namespace dsqsc {
#define SC_FN inline
using namespace sm90emu;
inline bool any_sync(bool p) {
  int v = p ? 1 : 0;
  for (int m = 1; m < 32; m <<= 1) v |= emu::shuffle_xor(v, m);
  return v != 0;
}
inline void flag_or(int32_t* p, int v) { *p |= v; }
}  // namespace dsqsc

#include "scorer_body.cuh"

namespace {

int64_t slots = 8;   // resident blocks of the emulated device (the split plan's input)
bool prefetch = false;

template <int H, int NQ, int LAYOUT>
void run(const DsqPagedLogitsArgs& a) {
  const dsqsc::Plan p = dsqsc::plan(a, NQ, slots);
  const int bytes = dsqsc::smem_plan(H * NQ, LAYOUT != DSQ_SCORER_FP8_132, p.n_pages).total;
  std::vector<uint8_t> raw(bytes + 1024);
  uint8_t* smem = raw.data() + ((1024 - reinterpret_cast<uintptr_t>(raw.data()) % 1024) % 1024);
  const int64_t P = a.page_size;
  const int64_t page_bytes = P * dsqsc::kv_slot_bytes(LAYOUT);
  sm90emu::sources = {{a.kv_cache, a.kv_cache + a.num_blocks * page_bytes}};
  if (a.layout == DSQ_SCORER_AITER_FP4) sm90emu::sources.push_back({a.kv_scale, a.kv_scale + a.num_blocks * 4 * P});
  const uint8_t* q = static_cast<const uint8_t*>(a.q);
  sm90emu::prefetchable = sm90emu::sources;
  sm90emu::prefetchable.push_back({q, q + a.B * a.N * H * dsqsc::q_row_bytes(LAYOUT)});
  const int64_t per_b = static_cast<int64_t>(p.splits) * p.groups;
  emu::run_grid(per_b * a.B, [&](int64_t id) {
    sm90emu::begin_block(smem, bytes);
    const int split = static_cast<int>(id % p.splits), group = static_cast<int>(id / p.splits % p.groups);
    emu::run_block(id, dsqsc::kThreads, [&] {
      if (prefetch) dsqsc::prefetch_block<H, NQ, LAYOUT>(a, split, group, id / per_b, p.tiles_per_block, p.p_shift);
      dsqsc::paged_logits_block<H, NQ, LAYOUT>(a, split, group, id / per_b, p.tiles_per_block, p.n_pages, p.p_shift,
                                               smem);
    });
    sm90emu::end_block();
  });
}

template <int L>
void dispatch(const DsqPagedLogitsArgs& a) {
  const int nq = dsqsc::queries_per_block(a);
  switch (a.H) {
    case 16:
      if (nq == 1) return run<16, 1, L>(a);
      if (nq == 2) return run<16, 2, L>(a);
      if (nq == 4) return run<16, 4, L>(a);
      return run<16, 8, L>(a);
    case 32:
      if (nq == 1) return run<32, 1, L>(a);
      if (nq == 2) return run<32, 2, L>(a);
      return run<32, 4, L>(a);
    case 64:
      if (nq == 1) return run<64, 1, L>(a);
      return run<64, 2, L>(a);
    default:
      return run<128, 1, L>(a);
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
      dispatch<DSQ_SCORER_FP8_132>(a);
    else if (a.layout == DSQ_SCORER_PACKED68)
      dispatch<DSQ_SCORER_PACKED68>(a);
    else
      dispatch<DSQ_SCORER_AITER_FP4>(a);
    return 0;
  });
}

const char* dsq_error_string(int) { return emu::last_error().c_str(); }

void dsq_emu_set_order(int order, uint64_t seed) { emu::set_grid_order(order, seed); }

void dsq_emu_set_slots(int64_t n) { slots = n; }

void dsq_emu_set_prefetch(int on) { prefetch = on != 0; }

}  // extern "C"
