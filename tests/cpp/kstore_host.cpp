// Host emulator of the k writers (kernels/cuda/kstore_body.cuh: SPEC §7.2 index_k_norm_rope_pack_store and §7.3
// rmsnorm_rope_rotate_fp4quant_kvcache), for tests only.
//
// The row body runs unchanged on the CPU under the block emulator of tests/cpp/fibers.h, with the CUDA names it
// uses supplied by tests/cpp/host_cuda/cuda_runtime.h: every thread of a block is a cooperative fiber, the row
// group's shuffles are rendezvous points of its 8 lanes, and blocks run in a chosen order. Built by
// tests/test_kstore_host.py with g++, twice: as is (the scalar two stages, as on AMD) and with
// -DDSQ_HOST_BF16X2_PATH (NVIDIA's path for bf16 rows of the v41 writer: the two stages on bf16x2 words, here on
// e2m1x8.h's exact emulation of those operations). It exports the C interface of the compiled library for this
// op (dsq_kstore, dsq_error_string), so the backends' own ctypes glue (dsaquant.backends.compiled.make_ops)
// drives it with CPU tensors, and dsq_emu_set_block_order.
#include "fibers.h"
#include "kstore_body.cuh"

extern "C" {

int dsq_kstore(const DsqKStoreArgs* a, void*) {
  return emu::guarded(2, [&] {
    const int64_t blocks = (a->T + dsqk::kRowsPerBlock - 1) / dsqk::kRowsPerBlock;
    dsqk::kstore_dispatch(*a, [&](auto in_dt, auto cdt, auto mode) {
      emu::run_grid(blocks, [&](int64_t b) {
        emu::run_block(b, dsqk::kBlockThreads, [&] {
          dsqk::kstore_thread<decltype(in_dt)::value, decltype(cdt)::value, decltype(mode)::value>(
              *a, b, emu::thread_id());
        });
      });
    });
  });
}

const char* dsq_error_string(int) { return emu::last_error().c_str(); }

void dsq_emu_set_block_order(int order, uint64_t seed) { emu::set_grid_order(order, seed); }

int dsq_emu_packed_path() { return dsqk::kPackedFp4Native ? 1 : 0; }

}  // extern "C"
