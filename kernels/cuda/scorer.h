// scorer.h: the C ABI of the paged MQA logits scorer (SPEC §7.4), kernels/cuda/scorer.cu.
//
// Plain C, includable by a host compiler: python/dsaquant/backends/scorer.py mirrors the struct with
// ctypes and checks its layout against dsq_paged_mqa_logits_layout().
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Layout codes: dsaquant/codes.h Layout (asserted in scorer.cu); dtype fields hold dsaquant/codes.h DType codes.
enum { DSQ_SCORER_FP8_132 = 0, DSQ_SCORER_PACKED68 = 1, DSQ_SCORER_AITER_FP4 = 2 };

typedef struct DsqPagedLogitsArgs {
  const void* q;             // fp8_132: e4m3 [B, N, H, 128]; FP4 layouts: u8 [B, N, H, 64] (contiguous)
  const void* q_scale;       // packed68: u8 [B, N, H, 4]; aiter_fp4: u8 [B*N, 1, 4, 16, qs_pad]; else NULL
  const void* weights;       // fp32 or bf16, element (b*N + n, h) at row * w_row + h * w_head
  const void* context_lens;  // int32 or int64, element (b, n) at b * ctx_b + n * ctx_n (ctx_n = 0 for [B])
  const void* block_table;   // int32 or int64 [B, max_blocks], element (b, k) at b * bt_b + k * bt_k
  const uint8_t* kv_cache;   // SPEC §6 layout bytes
  const uint8_t* kv_scale;   // aiter_fp4: u8 [NB, 1, 4, P]; else NULL
  void* logits;              // fp32 or bf16 [B*N, ld]
  int32_t* err_flag;         // per-device error flag (python/dsaquant/errors.py)
  int64_t B, N, H, num_blocks, page_size, max_blocks, max_seq_len, ld;
  int64_t w_row, w_head, ctx_b, ctx_n, bt_b, bt_k;
  int32_t layout, preshuffle, w_dtype, ctx_dtype, bt_dtype, out_dtype, clean_logits, device;
  int32_t splits;            // context splits per sequence; 0 = chosen from the SM count
  float weight_scale;
} DsqPagedLogitsArgs;

// Launches on `stream` (a cudaStream_t) of device `args->device`. Returns a cudaError_t code (0 = ok;
// cudaErrorNotSupported where this build has no kernel for the device or the sizes).
__attribute__((visibility("default"))) int dsq_paged_mqa_logits(const DsqPagedLogitsArgs* args, void* stream);
// Writes sizeof(DsqPagedLogitsArgs) then the offset of each field in declaration order into out[0..n);
// returns the number of values it has (so a caller can check it asked for all of them).
__attribute__((visibility("default"))) int dsq_paged_mqa_logits_layout(int64_t* out, int n);

#ifdef __cplusplus
}
#endif
