/* kernels/cuda/prefill.h: the C ABI of the CUDA ragged prefill logits (docs/prefill.md `mqa_logits`, FP8 layout),
 * kernels/cuda/prefill.cu.
 *
 * Plain C, includable by a host compiler: the Python mirror (python/dsaquant/backends/prefill_abi.py) and a host
 * test (tests/test_prefill_host.py) hold the field offsets equal; the host emulator of the kernel body
 * (tests/cpp/prefill_host.cpp) exports the same entry point. Pointers are raw device pointers; dtype codes are
 * dsaquant/codes.h DType (0 fp32, 1 bf16). */
#ifndef DSQ_PREFILL_H
#define DSQ_PREFILL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSQ_PREFILL_TILE = 64 };   /* keys per tile (the wgmma M side) */

typedef struct DsqMqaLogitsArgs {
  const void* q;          /* e4m3fn [S, H, 128], or packed E2M1 [S, H, 64] with q_scale; contiguous, 16-byte aligned */
  const void* k;          /* e4m3fn [SKV, 128], contiguous, 16-byte aligned */
  const float* k_scale;   /* fp32 [SKV], 16-byte aligned */
  const void* weights;    /* fp32 or bf16, element (i, h) at i * w_row + h * w_head */
  const int32_t* lo;      /* [S]: row i scores the keys max(lo[i], 0) <= j < min(hi[i], SKV) (none where empty) */
  const int32_t* hi;      /* [S] */
  const int32_t* base;    /* [S]: compressed output: key j of row i goes to column j - base[i] if in [0, W) */
  const uint32_t* q_scale; /* NULL, or FP4 fold mode (docs/prefill.md): q packed E2M1 with these UE8M0 exponent
                               words [S * H] (block j in byte j), folded into e4m3 by the kernel (dsaquant/fp4_fold.h),
                               the keys folded by a pre-pass (k_scale[j] <= 0: key j does not fold). The logit of
                               (i, j) is written only where every head of query row i folds exactly with a normal
                               or zero weight product, and k_scale[j] > 0 (another launch writes the others); -inf
                               and the fills as without it */
  int32_t* fold_all;      /* FP4 fold mode: set to 0 when a query row of the call does not fold (else untouched) */
  void* out;              /* fp32 or bf16 [S, ld]; W columns */
  int64_t S, SKV, H, W, ld, w_row, w_head;
  int32_t w_dtype;        /* 0 fp32, 1 bf16 */
  int32_t out_dtype;      /* 0 fp32, 1 bf16 */
  int32_t clean;          /* nonzero: full output: every key that is not the row's gets -inf */
  int32_t compressed;     /* nonzero: the [S, W] form (columns relative to base; other entries untouched) */
  int32_t device;
  int32_t splits;         /* key splits per block of rows; 0: chosen from the SM count */
} DsqMqaLogitsArgs;

/* Launches on `stream` (a cudaStream_t) of device `args->device`. Returns a cudaError_t code: 0, 1
 * (cudaErrorInvalidValue: H not in {16, 32, 64, 128}, a dtype code, sizes past 2^31) checked before anything is
 * launched, or 801 (cudaErrorNotSupported: no sm_90a kernel for this device). */
int dsq_mqa_logits(const DsqMqaLogitsArgs* args, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* DSQ_PREFILL_H */
