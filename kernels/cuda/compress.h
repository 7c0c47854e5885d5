// kernels/cuda/compress.h: launchers of the DeepSeek-V4 kernels (kernels/cuda/compress.cu): SPEC §7.6 compress_kv and
// §7.7 rope_rotate_quant. The argument blocks are plain structs (compress_args.h). Each launcher enqueues its
// work on `stream` (one kernel launch; no host sync, no allocation: CUDA-graph capturable) and returns
// cudaGetLastError() as an int (0: launched).
#pragma once

#include <cuda_runtime.h>

#include "compress_args.h"

int dsq_compress_kv_launch(const dsqv4::CompressArgs& a, cudaStream_t stream);
int dsq_rope_rotate_launch(const dsqv4::RotateArgs& a, cudaStream_t stream);
