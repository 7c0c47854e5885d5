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

// Grid of the compress_kv launch (one launch, 256 threads a block, see compress_body.cuh): B sequence blocks, then
// ceil(T / ratio) token-range blocks.
inline int64_t compress_grid(const CompressArgs& a) { return a.B + (a.T + a.ratio - 1) / a.ratio; }
// The rope_rotate_quant launch's shape: rotate_body.cuh (rot::rotate_values_per_lane, rot::rotate_run, rot::rotate_grid).

}  // namespace dsqv4
