// Host emulator of the CUDA prefill logits (kernels/cuda/prefill_body.cuh), for tests only.
//
// The block body runs unchanged on the CPU under the block emulator of tests/cpp/fibers.h (128 fibers a block,
// blocks in a chosen order), with the layer of tests/cpp/sm90_emu.h (asynchronous copies, the matrix unit, garbage
// shared memory, modelled on the hardware).
// It exports dsq_mqa_logits (kernels/cuda/prefill.h; pointers are host pointers: CPU torch tensors), plus
// dsq_emu_set_order, dsq_emu_set_slots and dsq_error_string. Built by tests/test_prefill_host.py.
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "dsaquant/dsaquant.h"
#include "fibers.h"
#include "prefill.h"
#include "sm90_emu.h"

namespace dsqpf {
#define PF_FN inline
using namespace sm90emu;
}  // namespace dsqpf

#include "prefill_body.cuh"

namespace {

int64_t slots = 8;   // resident blocks of the emulated device (the split plan's input)

template <int H>
void run(const DsqMqaLogitsArgs& a) {
  const dsqpf::Plan p = dsqpf::plan(a, slots);
  std::vector<uint8_t> raw(dsqpf::kSmemBytes + 1024);
  uint8_t* smem = raw.data() + ((1024 - reinterpret_cast<uintptr_t>(raw.data()) % 1024) % 1024);
  const uint8_t* k = static_cast<const uint8_t*>(a.k);
  const uint8_t* ks = reinterpret_cast<const uint8_t*>(a.k_scale);
  sm90emu::sources = {{k, k + a.SKV * 128}, {ks, ks + a.SKV * 4}};
  emu::run_grid(p.row_blocks * p.splits, [&](int64_t id) {
    sm90emu::begin_block(smem, dsqpf::kSmemBytes);
    emu::run_block(id, dsqpf::kThreads,
                   [&] { dsqpf::mqa_logits_block<H>(a, id % p.row_blocks, id / p.row_blocks, p.tpc, smem); });
    sm90emu::end_block();
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
