// kernels/cuda/indexer.h: the compiled kernels' argument blocks and launchers. The blocks are the C
// interface's structs (dsaquant/abi.h, where their fields are listed and described), passed by value to
// the kernels; the launchers enqueue on `stream` on the current device (src/capi.cpp makes the struct's
// `device` current first) and return the launch's error code (0: launched).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "dsaquant/abi.h"

using RopeArgs = DsqRope;
using IndexerArgs = DsqIndexerArgs;
using KStoreArgs = DsqKStoreArgs;
using QPackArgs = DsqQPackArgs;

int dsq_indexer_launch(const IndexerArgs& a, cudaStream_t stream);
int dsq_kstore_launch(const KStoreArgs& a, cudaStream_t stream);
int dsq_qpack_launch(const QPackArgs& a, cudaStream_t stream);
int dsq_fp8_selfcheck_launch(uint64_t start, uint64_t count, unsigned long long* out, cudaStream_t stream);
int dsq_exp_ds_launch(const float* x, float* y, int64_t n, cudaStream_t stream);   // SPEC §0.7, elementwise
// The ptx/binary versions of a kernel built like all others (selfcheck.cu), on the current device: dsq_kernel_code.
int dsq_kernel_code_query(int* ptx, int* binary);
