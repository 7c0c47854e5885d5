// kernels/cuda/compress_args.h: argument blocks of the DeepSeek-V4 kernels (SPEC §7.6 compress_kv, §7.7
// rope_rotate_quant): the C interface's structs (dsaquant/abi.h), with no CUDA types, so that the library
// (src/capi.cpp) and the host emulator of the kernels (tests/cpp/compress_host.cpp) take the same structs.
//
// Pointers are raw device pointers (host pointers under the emulator); strides are in elements; dtype and
// option fields hold dsaquant/codes.h codes.
#pragma once

#include <cstdint>

#include "dsaquant/abi.h"
#include "dsaquant/codes.h"

namespace dsqv4 {

using RopeTable = DsqRope;          // `vec` is not read here
using CompressArgs = DsqCompressArgs;
using RotateArgs = DsqRotateArgs;

// The compress_kv launch (one launch, 256 threads a block, see compress_body.cuh): B sequence blocks, then the
// token-range blocks for the ceil(T / ratio) ranges of `ratio` tokens. With few ranges each gets a block of its own
// (the whole block pools the range's boundary: the shortest latency a boundary); with many (K <= 8, D = 128) a
// block takes 8 ranges, one a warp (a warp pools and finishes its boundary alone: no idle warps, no barriers).
constexpr int64_t kCompressWarpRangesFrom = 512;   // ranges a call from which range blocks take one range a warp
constexpr int kCompressRangesPerWarpBlock = 8;     // = the warps of a 256-thread block
inline int64_t compress_ranges(const CompressArgs& a) { return (a.T + a.ratio - 1) / a.ratio; }
// force: 0 by the call's size, 1 one range a block, 2 one range a warp (where the geometry allows it; tests).
inline bool compress_warp_ranges(const CompressArgs& a, int force = 0) {
  if (a.K > 8 || a.D != 128) return false;
  return force ? force == 2 : compress_ranges(a) >= kCompressWarpRangesFrom;
}
// Windows of K >= 128 rows (ratio 128) are pooled by a cluster of blocks where the device has clusters (NVIDIA
// sm_90 on; compress_body.cuh kSplit4, kSplit8): every sequence and every range gets a cluster, of 8 blocks for calls
// of few windows (the shortest latency a window), of 4 from kCompressSplitFourFrom windows on (8 blocks a window
// there outnumber the SMs' block slots). Measured on an H100 (ratio 128, one prompt): T = 1024 7.5 µs with 8 blocks
// against 10.9 with 4, T = 8192 23.3 against 23.5, T = 32768 86.3 against 67.6.
constexpr int64_t kCompressSplitFourFrom = 129;   // windows (sequences + ranges) a call from which clusters have 4
inline bool compress_split_windows(const CompressArgs& a) { return a.K >= 128; }
inline int compress_split_blocks(const CompressArgs& a) {
  return a.B + compress_ranges(a) >= kCompressSplitFourFrom ? 4 : 8;
}
// split: the blocks a cluster of the column-split mode, 0 without it.
inline int64_t compress_grid(const CompressArgs& a, bool warp_ranges, int split = 0) {
  const int64_t n = compress_ranges(a);
  if (split) return split * (a.B + n);
  return a.B + (warp_ranges ? (n + kCompressRangesPerWarpBlock - 1) / kCompressRangesPerWarpBlock : n);
}
// The rope_rotate_quant launch's shape: rotate_body.cuh (rot::rotate_values_per_lane, rot::rotate_run, rot::rotate_grid).

}  // namespace dsqv4
