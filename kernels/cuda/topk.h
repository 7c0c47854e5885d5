/* kernels/cuda/topk.h: the C ABI of the CUDA top-k selection (docs/topk.md), kernels/cuda/topk.cu.
 *
 * Plain C, includable by a host compiler: the Python mirror (python/dsaquant/backends/topk_abi.py) and a
 * host test (tests/test_topk_abi.py) hold the field offsets equal. Pointers are raw device pointers;
 * dtype codes are kernels/cuda/row16.cuh's DType (0 fp32, 1 bf16, 2 fp16, 3 int32, 4 int64). */
#ifndef DSQ_TOPK_H
#define DSQ_TOPK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSQ_TOPK_DECODE_1D = 0, DSQ_TOPK_DECODE_2D = 1, DSQ_TOPK_PREFILL = 2 };  /* span forms */
enum { DSQ_TOPK_MAX_SORT = 4096 };   /* largest min(k, L) rounded up to a power of two */

typedef struct DsqTopkArgs {
  const void* logits;        /* [rows, L], row stride `row_stride` elements, dtype `logits_dtype` (0, 1, 2) */
  const void* context_lens;  /* decode: [B] (form 0) or [B * next_n] (form 1), dtype `index_dtype`; else NULL */
  const void* ks;            /* prefill: [rows], dtype `index_dtype`; else NULL */
  const void* ke;            /* prefill: [rows]; else NULL */
  int32_t* out;              /* [rows, k], contiguous */
  void* workspace;           /* scratch of the few-long-rows path (dsq_topk_workspace_bytes); may be NULL */
  int64_t workspace_bytes;   /* bytes at `workspace` */
  int64_t rows;
  int64_t L;                 /* positions per row, < 2^31 */
  int64_t row_stride;        /* elements between rows */
  int64_t k;                 /* >= 1 */
  int32_t next_n;            /* >= 1 (decode) */
  int32_t form;              /* DSQ_TOPK_* */
  int32_t logits_dtype;
  int32_t index_dtype;       /* 3 int32, 4 int64 */
  int32_t relative;          /* nonzero: positions minus the row's clamped start */
  int32_t chunks;            /* blocks per row (dsq_topk_plan_chunks): 0 or 1 one block a row; > 1 the
                                few-long-rows path (histogram, scatter, finish), at most 1024; -C the
                                cached-row path in clusters of C blocks (C = 1, 2, 4 or 8 with C * 32768 >= L;
                                NVIDIA sm_90 on), one block a row where it cannot run */
} DsqTopkArgs;

/* Launches the selection on `stream` (a cudaStream_t). Returns a cudaError_t code: cudaSuccess (0), or
 * cudaErrorInvalidValue (1) for bad arguments (codes, sizes, min(k, L) > DSQ_TOPK_MAX_SORT), checked before
 * anything is launched. A few-long-rows plan whose workspace does not fit runs one block a row instead. */
int dsq_topk_indices(const DsqTopkArgs* a, void* stream);

/* Bytes of workspace the few-long-rows path needs (0 for chunks <= 1): per row a 4096-bin int histogram, two
 * int counters, then k + 8192 8-byte words. It is cleared by the call itself (an async memset on `stream`). */
int64_t dsq_topk_workspace_bytes(int64_t rows, int64_t L, int64_t k, int32_t chunks);

/* Blocks per row for a device with `sms` multiprocessors. NVIDIA build, L <= 262144: -C, the cached-row path in
 * clusters of the fewest C (1, 2, 4, 8) blocks whose 32768-key caches hold L. Otherwise 1 unless the rows are
 * fewer than the SMs and at least 8k long; then one block per SM in all, at least 4096 keys a block and at
 * least 2. Host only. */
int32_t dsq_topk_plan_chunks(int64_t rows, int64_t L, int64_t k, int32_t sms);

#ifdef __cplusplus
}
#endif

#endif /* DSQ_TOPK_H */
