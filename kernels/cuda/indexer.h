// kernels/cuda/indexer.h: argument blocks of the compiled kernels (plain structs passed by value) and
// their launchers. Pointers are raw device pointers; strides are in elements; dtypes are row16.cuh's
// DType codes. The Python glue (python/dsaquant/backends/compiled.py) fills them.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

struct RopeArgs {            // cos/sin: two [max_pos, 32] tables, or `pairs`: one fp32 [max_pos, 64] (cos, sin)
  const void* cos;
  const void* sin;           // unused with pairs
  int64_t row_stride;        // elements between positions
  int64_t max_pos;
  int dtype;
  bool pairs;
  bool vec;                  // tables and row stride 16-byte aligned: vector loads
};

struct IndexerArgs {         // SPEC §7.1
  int64_t T, H, num_blocks, P;
  const void* q; int64_t q_st, q_sh; bool q_vec;
  const void* k; int64_t k_st; bool k_vec;
  int in_dt;                                   // q and k dtype (bf16 / fp16)
  const void* w; int64_t w_st, w_sh; int w_dt;
  void* w_out; int64_t w_out_st, w_out_sh; int w_out_dt;   // [T, H], any strides
  uint8_t* q_out;                              // [T, H, 128] fp8 codes or [T, H, 64] fp4 bytes
  uint8_t* q_scale_out;                        // FP4: [T, 1, 4, 16, qs_pad]
  uint8_t* kv_cache;
  uint8_t* kv_scale;                           // FP4 only
  const void* slots; int slots_dt;
  const void* positions; int pos_dt;
  const void* norm_w; int norm_w_dt;
  const void* norm_b; int norm_b_dt;
  RopeArgs rope;
  float eps, weights_scale;
  bool fp4, neox, compute_all, preshuffle, ue8m0;
  int rounding, flavour;
  int* err_flag;
};

struct KStoreArgs {          // SPEC §7.2 index_k_norm_rope_pack_store and §7.3 (aiter V4 k writer)
  int64_t T, num_blocks, P;
  const void* k; int64_t k_st; bool k_vec; int in_dt;
  const void* norm_w; int norm_w_dt;
  const void* positions; int pos_dt;
  const void* slots; int slots_dt;
  RopeArgs rope;
  int64_t compress_ratio;
  float eps;
  int rounding;
  int mode;                  // 0: sglang-v41 packed68 (§7.2); 1: aiter_fp4 (§7.3); 2: dense (§7.3)
  bool hadamard;
  uint8_t* cache;
  uint8_t* cache_scale;
  int* err_flag;
};

struct QPackArgs {           // SPEC §7.2 index_q_rope_pack_weights and rope_fake_quant_fp4
  int64_t T, H;
  const void* q; int64_t q_st, q_sh; bool q_vec; int in_dt;
  const void* positions; int pos_dt;
  RopeArgs rope;
  int64_t compress_ratio;
  int rounding;
  int mode;                  // 0: pack + weights; 1: fake quant ue8m0/32; 2: fake quant e4m3/16
  const void* w; int64_t w_st, w_sh; int w_dt;
  float weight_scale;
  uint8_t* payload;          // [T, H, 64]
  int32_t* exps;             // [T, H]
  float* w_out;              // [T, H]
  uint16_t* fq_out;          // fake quant: [T, H, 128] in in_dt
  int* err_flag;
};

int dsq_indexer_launch(const IndexerArgs& a, cudaStream_t stream);
int dsq_kstore_launch(const KStoreArgs& a, cudaStream_t stream);
int dsq_qpack_launch(const QPackArgs& a, cudaStream_t stream);
int dsq_fp8_selfcheck_launch(uint64_t start, uint64_t count, unsigned long long* out, cudaStream_t stream);
int dsq_exp_ds_launch(const float* x, float* y, int64_t n, cudaStream_t stream);   // SPEC §0.7, elementwise
