// kernels/cuda/v4_args.h: argument blocks of the DeepSeek-V4 kernels (SPEC §7.6 compress_kv, §7.7
// rope_rotate_quant), plain C++ with no CUDA types, so that the same structs are filled by the pybind11
// module (src/bindings.cpp) and by the host emulator of the kernels (tests/cpp/v4_host.cpp).
//
// Pointers are raw device pointers (host pointers under the emulator); strides are in elements; dtype codes
// are python/dsaquant/backends/compiled.py's DTYPE (the same numbers as row16.cuh's DType).
#pragma once

#include <cstdint>

namespace dsqv4 {

enum DTypeCode : int { kF32 = 0, kBF16 = 1, kF16 = 2, kI32 = 3, kI64 = 4 };

// cos/sin: two [max_pos, 32] tables of dtype `dtype`, or `pairs`: one fp32 [max_pos, 64] table of (cos, sin).
struct RopeTable {
  const void* cos;
  const void* sin;           // unused with pairs
  int64_t row_stride;        // elements between positions
  int64_t max_pos;
  int dtype;
  bool pairs;
};

// bf16_after bits (SPEC §7.6 steps 3-6).
enum RoundPoint : int { kAfterPool = 1, kAfterNorm = 2, kAfterRope = 4, kAfterHadamard = 8 };
// quant_mode codes.
enum QuantMode : int { kNone = 0, kFp4 = 1, kFp4Sim = 2, kFp8 = 3 };

struct CompressArgs {        // SPEC §7.6
  int64_t T, B, ratio, R, n_ring;
  int D, K;                  // D = head_dim (128 | 512), K = (1 + overlap) * ratio window rows
  bool overlap;
  const void* kv; int64_t kv_st;          // [T, C] rows strided, fp32 or bf16 (in_dt)
  const void* score; int64_t sc_st;       // [T, C], same dtype
  int in_dt;
  const float* ape; int64_t ape_st;       // [ratio, C]
  float* state_kv; int64_t skv_s0, skv_s1;       // [N_ring, R, C]
  float* state_score; int64_t ssc_s0, ssc_s1;    // [N_ring, R, C]
  const int32_t* state_slot;              // [B]
  const int32_t* cu_seqlens;              // [B+1]
  const int64_t* start_pos;               // [B]
  const void* norm_w; int norm_w_dt;      // [D] fp32 or bf16
  float eps;
  RopeTable rope;
  const int64_t* out_slots;               // [T]
  uint8_t* cache;                         // by quant_mode (SPEC §7.6 Outputs)
  uint8_t* cache_scale;                   // aiter_fp4 only
  int64_t num_blocks, P;
  int quant_mode;                         // QuantMode
  bool aiter_layout;                      // fp4: aiter_fp4 (else packed68)
  int scale_rule, rounding;               // dsq::ScaleRule, dsq::Rounding codes
  bool ue8m0; int flavour; bool preshuffle;   // fp8
  bool hadamard;
  int bf16_after;                         // RoundPoint bits
  bool update_state;
  int* err_flag;                          // errors.py codes OR-ed in
};

enum OutKind : int { kOutFp4 = 0, kOutFp8 = 1, kOutHalf = 2 };

struct RotateArgs {          // SPEC §7.7
  int64_t T, H;
  int D;                                   // 128 | 256 | 512 | 1024
  const void* x; int64_t x_st, x_sh; int in_dt;   // [T, H, D], last dim contiguous
  RopeTable rope;
  const void* positions; int pos_dt;      // [T] int32 | int64
  int out_kind;                            // OutKind
  uint8_t* out; int64_t out_st, out_sh;   // fp4 [T, H, D/2] / fp8 [T, H, D] contiguous; half: strides in elements
  uint8_t* out_scale;                      // fp4: u8 shuffled [T, D/128, 4, 16, qs_pad] or dense [T, H, D/g];
                                           // fp8: fp32 [T, H, D/g]
  int group;                               // group_size g (fp4 / fp8)
  bool shuffle, hadamard;
  int rounding, flavour;
  int* err_flag;
};

// Fill the structs from a key-value source `d` providing i64(key), f64(key), flag(key) and ptr(key)
// (src/bindings.cpp wraps a Python dict; the host emulator does the same). One definition of the keys,
// which python/dsaquant/backends/compiled.py writes.
template <class Src>
RopeTable rope_from(const Src& d) {
  RopeTable r{};
  r.cos = d.ptr("rope_cos");
  r.sin = d.ptr("rope_sin");
  r.row_stride = d.i64("rope_stride");
  r.max_pos = d.i64("rope_max_pos");
  r.dtype = static_cast<int>(d.i64("rope_dt"));
  r.pairs = d.flag("rope_pairs");
  return r;
}

template <class Src>
CompressArgs compress_args_from(const Src& d) {
  CompressArgs a{};
  a.T = d.i64("T"); a.B = d.i64("B"); a.ratio = d.i64("ratio"); a.R = d.i64("R"); a.n_ring = d.i64("n_ring");
  a.D = static_cast<int>(d.i64("D")); a.K = static_cast<int>(d.i64("K")); a.overlap = d.flag("overlap");
  a.kv = d.ptr("kv"); a.kv_st = d.i64("kv_st");
  a.score = d.ptr("score"); a.sc_st = d.i64("sc_st");
  a.in_dt = static_cast<int>(d.i64("in_dt"));
  a.ape = static_cast<const float*>(d.ptr("ape")); a.ape_st = d.i64("ape_st");
  a.state_kv = static_cast<float*>(d.ptr("state_kv")); a.skv_s0 = d.i64("skv_s0"); a.skv_s1 = d.i64("skv_s1");
  a.state_score = static_cast<float*>(d.ptr("state_score")); a.ssc_s0 = d.i64("ssc_s0"); a.ssc_s1 = d.i64("ssc_s1");
  a.state_slot = static_cast<const int32_t*>(d.ptr("state_slot"));
  a.cu_seqlens = static_cast<const int32_t*>(d.ptr("cu_seqlens"));
  a.start_pos = static_cast<const int64_t*>(d.ptr("start_pos"));
  a.norm_w = d.ptr("norm_w"); a.norm_w_dt = static_cast<int>(d.i64("norm_w_dt"));
  a.eps = static_cast<float>(d.f64("eps"));
  a.rope = rope_from(d);
  a.out_slots = static_cast<const int64_t*>(d.ptr("out_slots"));
  a.cache = static_cast<uint8_t*>(d.ptr("cache")); a.cache_scale = static_cast<uint8_t*>(d.ptr("cache_scale"));
  a.num_blocks = d.i64("num_blocks"); a.P = d.i64("P");
  a.quant_mode = static_cast<int>(d.i64("quant_mode")); a.aiter_layout = d.flag("aiter_layout");
  a.scale_rule = static_cast<int>(d.i64("scale_rule")); a.rounding = static_cast<int>(d.i64("rounding"));
  a.ue8m0 = d.flag("ue8m0"); a.flavour = static_cast<int>(d.i64("flavour")); a.preshuffle = d.flag("preshuffle");
  a.hadamard = d.flag("hadamard"); a.bf16_after = static_cast<int>(d.i64("bf16_after"));
  a.update_state = d.flag("update_state");
  a.err_flag = static_cast<int*>(d.ptr("err_flag"));
  return a;
}

template <class Src>
RotateArgs rotate_args_from(const Src& d) {
  RotateArgs a{};
  a.T = d.i64("T"); a.H = d.i64("H"); a.D = static_cast<int>(d.i64("D"));
  a.x = d.ptr("x"); a.x_st = d.i64("x_st"); a.x_sh = d.i64("x_sh"); a.in_dt = static_cast<int>(d.i64("in_dt"));
  a.rope = rope_from(d);
  a.positions = d.ptr("positions"); a.pos_dt = static_cast<int>(d.i64("pos_dt"));
  a.out_kind = static_cast<int>(d.i64("out_kind"));
  a.out = static_cast<uint8_t*>(d.ptr("out")); a.out_st = d.i64("out_st"); a.out_sh = d.i64("out_sh");
  a.out_scale = static_cast<uint8_t*>(d.ptr("out_scale"));
  a.group = static_cast<int>(d.i64("group"));
  a.shuffle = d.flag("shuffle"); a.hadamard = d.flag("hadamard");
  a.rounding = static_cast<int>(d.i64("rounding")); a.flavour = static_cast<int>(d.i64("flavour"));
  a.err_flag = static_cast<int*>(d.ptr("err_flag"));
  return a;
}

// Grid of the compress_kv launch (one launch, 256 threads a block, see v4_body.cuh): B sequence blocks, then
// ceil(T / ratio) token-range blocks.
inline int64_t compress_grid(const CompressArgs& a) { return a.B + (a.T + a.ratio - 1) / a.ratio; }
// Grid of the rope_rotate_quant launch: one 32-lane warp per (t, h) row, 8 rows a block.
inline int64_t rotate_grid(const RotateArgs& a) { return (a.T * a.H + 7) / 8; }

}  // namespace dsqv4
