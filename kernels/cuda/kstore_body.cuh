// kernels/cuda/kstore_body.cuh: SPEC §7.2's k writer (sglang-v41: index_k_norm_rope_pack_store, cache packed68)
// and §7.3 (aiter's DeepSeek-V4 k writer: rmsnorm_rope_rotate_fp4quant_kvcache, caches aiter_fp4 or dense).
// (§7.2's q writers: qpack.cu.)
//
// Layout ("split4"): a group of 4 lanes holds one 128-wide row, 32 rows per block of 128 threads. Lane l holds
// the sixteen values a = x[16l .. 16l+15] (dims 0..63, not rotated) and the sixteen b = x[64+16l .. 64+16l+15]
// (the tail RoPE dims), in v[0..15] and v[16..31]. So:
//   - every lane takes part in the tail RoPE: its interleaved pairs (2j, 2j+1) are in-lane, j = 8l .. 8l+7;
//   - an FP4 block of 32 is the a's (block l/2) or the b's (block 2 + l/2) of the lane pair l, l ^ 1: a block
//     amax is one shuffle, and each lane encodes and stores 8 + 8 packed bytes of its own;
//   - the canonical sum (SPEC §0.2) over partials i (elements 4i..4i+3; lane l holds 4l..4l+3 and 16+4l..16+4l+3)
//     has its levels in-lane (stride 16), between lanes l ^ 2 (stride 8) and l ^ 1 (stride 4), in-lane (2, 1);
//   - the Hadamard's strides 1..8 are in-lane in each half, 16 and 32 between lanes l ^ 1 and l ^ 2, and 64
//     between the lane's two halves.
// Few lanes per row keep the per-row work that does not scale with the values (the row's loads of its slot and
// position, offsets, exponents, shuffles, error checks) small against the per-value work, which is the
// shared header's: for bf16 rows of the v41 writer on NVIDIA the two stages run two values per operation
// (two_stage_x8.h, as the v41 q writer does), and the V4 writer encodes its fp32 values eight at a time
// (e2m1x8.h e2m1_encode8_f32_s).
//
// The row body (kstore_thread) is shared by the kernel (kstore_qpack.cu, hipified for AMD) and the host emulator of
// the tests (tests/cpp/kstore_host.cpp), which runs it unchanged on the CPU; kstore_dispatch maps a call's codes
// to the kernel instance both launch.
#pragma once

#include <type_traits>

#include "indexer.h"
#include "qrows.cuh"   // load8, lo_f32/hi_f32, kPackedFp4Native; row16.cuh (scalar loads, rope_load, dispatch)

namespace dsqk {
namespace {

constexpr int kRowLanes = 4;                                 // lanes per row
constexpr int kLaneVals = 32;                                // values per lane
constexpr int kRowsPerBlock = 32;
constexpr int kBlockThreads = kRowLanes * kRowsPerBlock;

// What a kernel instance does, from its template codes (IN_DT the row dtype, MODE the cache format): the v41
// writer (SPEC §7.2; else §7.3), and for its bf16 rows on NVIDIA sm_80+ the two stages on bf16x2 words
// (two_stage_x8.h; else on fp32 values).
template <int MODE>
constexpr bool kV41 = MODE == code(KStoreMode::packed68);
template <int IN_DT, int MODE>
constexpr bool kPackedV41 = kV41<MODE> && IN_DT == kBF16 && kPackedFp4Native;

// Sixteen consecutive values of element type DT, elements i0 .. i0+15 of `row`, as fp32 into v[o .. o+15]
// (16-byte loads when `vec`: the row, and so element i0, a multiple of 8 or 4, is 16-byte aligned).
template <int DT>
__device__ __forceinline__ void load16(const void* row, int i0, bool vec, float (&v)[kLaneVals], int o) {
  if constexpr (DT == kF32) {
    const float* p = static_cast<const float*>(row) + i0;
    if (vec) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 u = reinterpret_cast<const float4*>(p)[q];
        v[o + 4 * q] = u.x; v[o + 4 * q + 1] = u.y; v[o + 4 * q + 2] = u.z; v[o + 4 * q + 3] = u.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[o + i] = p[i];
    }
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(row) + i0;
    const uint4 u0 = load8(p, vec), u1 = load8(p + 8, vec);
    const uint32_t w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[o + 2 * i] = lo_f32<DT>(w[i]);
      v[o + 2 * i + 1] = hi_f32<DT>(w[i]);
    }
  }
}
// The lane's a and b values of a row (or of the norm weight) of element type DT.
template <int DT>
__device__ __forceinline__ void load_lane(const void* row, int lane, bool vec, float (&v)[kLaneVals]) {
  load16<DT>(row, 16 * lane, vec, v, 0);
  load16<DT>(row, 64 + 16 * lane, vec, v, 16);
}

// The lane's 32 norm weights (SPEC §5: the input dtype, or fp32), converted exactly to fp32.
__device__ __forceinline__ void load_norm_weights(const void* w, int dt, int lane, float (&wv)[kLaneVals]) {
  const bool vec = (reinterpret_cast<uintptr_t>(w) & 15u) == 0;
  if (dt == kF32) load_lane<kF32>(w, lane, vec, wv);
  else if (dt == kBF16) load_lane<kBF16>(w, lane, vec, wv);
  else load_lane<kF16>(w, lane, vec, wv);
}

// SPEC §0.2 canonical sum of the row whose lane holds the terms t[0..31] (partials 4l + m of t[4m .. 4m+3] and
// 16 + 4l + m of t[16+4m .. 16+4m+3]): the level of partial stride 16 pairs the lane's own two partials m, the
// levels 8 and 4 pair lane l with l ^ 2 and l ^ 1 (same m), the levels 2 and 1 pair m with m ^ 2, then m ^ 1.
// Every lane of the group gets the sum.
__device__ __forceinline__ float row_sum4(unsigned mask, const float (&t)[kLaneVals]) {
  float q[4];
#pragma unroll
  for (int m = 0; m < 4; ++m)
    q[m] = fadd(canonical_partial(t[4 * m], t[4 * m + 1], t[4 * m + 2], t[4 * m + 3]),
                canonical_partial(t[16 + 4 * m], t[17 + 4 * m], t[18 + 4 * m], t[19 + 4 * m]));
#pragma unroll
  for (int s = 2; s >= 1; s >>= 1)
#pragma unroll
    for (int m = 0; m < 4; ++m) q[m] = fadd(q[m], group_shfl_xor<kRowLanes>(mask, q[m], s));
  return fadd(fadd(q[0], q[2]), fadd(q[1], q[3]));
}

// SPEC §0.3 amax of one block of 32: the lane's values v[i0 .. i0+15] and its partner's (lane ^ 1).
__device__ __forceinline__ float block_amax(unsigned mask, const float (&v)[kLaneVals], int i0) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = fmax_nn(m, abs_f(v[i0 + i]));
  return group_max<kRowLanes>(mask, m, 2);
}

// SPEC §5 tail interleaved RoPE of the lane's b values: pairs (v[16+2i], v[17+2i]) = dims 64+16l+2i (+1), pair
// j = 8l + i of the table.
// The table values (c[i], s[i] of pair 8l + i) are loaded by the caller ahead of use (rope_load<8, CDT>).
__device__ __forceinline__ void rope_tail(const float (&c)[8], const float (&s)[8], float (&v)[kLaneVals]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) rope_pair(v[16 + 2 * i], v[17 + 2 * i], c[i], s[i]);
}

// SPEC §5 Hadamard of the row (Sylvester order: strides h = 1, 2, ..., 64 in turn), then times fl(128^-0.5).
__device__ __forceinline__ void hadamard_split4(unsigned mask, int lane, float (&v)[kLaneVals]) {
  hadamard_butterflies<16>(v);        // h = 1..8 in the a values
  hadamard_butterflies<16>(v + 16);   // and in the b values
  // h = 16 s: lanes l and l ^ s; the lower lane holds a pair's first value x, the upper its second y, and they
  // become x + y and x - y: each lane adds its own value times +1 (lower) or -1 (upper) to its partner's.
#pragma unroll
  for (int s = 1; s <= 2; s <<= 1) {
    const float sign = (lane & s) ? -1.0f : 1.0f;
#pragma unroll
    for (int e = 0; e < kLaneVals; ++e) v[e] = fadd_signed(v[e], sign, group_shfl_xor<kRowLanes>(mask, v[e], s));
  }
#pragma unroll
  for (int e = 0; e < 16; ++e) {      // h = 64: a value with the b value of the same lane
    const float x = v[e], y = v[16 + e];
    v[e] = fadd(x, y);
    v[16 + e] = fsub(x, y);
  }
  const float c = hadamard_scale(128);
#pragma unroll
  for (int e = 0; e < kLaneVals; ++e) v[e] = fmul(v[e], c);
}

// FP4 of the lane's fp32 values (policy R) as 4 words of packed bytes: word q holds values v[8q .. 8q+7]; the a
// words (q = 0, 1) in a block of exponent ea, the b words in one of exponent eb.
template <Rounding R>
__device__ __forceinline__ void encode_f32(const float (&v)[kLaneVals], int ea, int eb, uint32_t (&w)[4]) {
  const uint32_t sa = bf16x2_inv_pow2(ea), sb = bf16x2_inv_pow2(eb);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = v[8 * q + i];
    w[q] = q < 2 ? e2m1_encode8_f32_s<R>(x, ea, sa, ea == 255) : e2m1_encode8_f32_s<R>(x, eb, sb, eb == 255);
  }
}
__device__ __forceinline__ void encode_f32(const float (&v)[kLaneVals], int ea, int eb, Rounding r,
                                           uint32_t (&w)[4]) {
  if (r == Rounding::threshold) encode_f32<Rounding::threshold>(v, ea, eb, w);
  else if (r == Rounding::rne) encode_f32<Rounding::rne>(v, ea, eb, w);
  else encode_f32<Rounding::hardware>(v, ea, eb, w);
}

// SPEC §7.2 on bf16 words (two_stage_x8.h): the lane's values after the norm (a, rounded here) and after the
// RoPE of the b values rounded to bf16 (b), both stages -> 4 words of packed bytes (as encode_f32) and stage 2's
// exponents of the a block (bits 0..7) and the b block (bits 16..23).
[[maybe_unused]] __device__ __forceinline__ uint32_t two_stage_split4(unsigned mask, const float (&v)[kLaneVals], Rounding r,
                                                     uint32_t (&w)[4]) {
  uint32_t x[4][4], ax[4][4];   // word q: values 8q + j and 8q + j + 4 in word j, as the encoder pairs them
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[q][j] = round_pair_any_nan(v[8 * q + j], v[8 * q + j + 4], true);
      ax[q][j] = bf16x2_abs(x[q][j]);
    }
  // The two blocks' amax (bf16 bits; a in the low half, b in the high half): a NaN is ignored, an all-NaN block
  // gives 0.
  uint32_t ma = bf16x2_max_nn(bf16x2_max_nn(ax[0][0], ax[0][1]), bf16x2_max_nn(ax[0][2], ax[0][3]));
  uint32_t mb = bf16x2_max_nn(bf16x2_max_nn(ax[2][0], ax[2][1]), bf16x2_max_nn(ax[2][2], ax[2][3]));
  ma = bf16x2_max_nn(ma, bf16x2_max_nn(bf16x2_max_nn(ax[1][0], ax[1][1]), bf16x2_max_nn(ax[1][2], ax[1][3])));
  mb = bf16x2_max_nn(mb, bf16x2_max_nn(bf16x2_max_nn(ax[3][0], ax[3][1]), bf16x2_max_nn(ax[3][2], ax[3][3])));
  uint32_t m = bf16x2_max_nn(byte_perm(ma, mb, 0x5410u), byte_perm(ma, mb, 0x7632u));
  m = bf16x2_max_nn(bf16x2_max_nn(m, group_shfl_xor<kRowLanes>(mask, m, 1)), 0u);
  const TwoStageBf16x2 p = two_stage_params_bf16x2(m);
#pragma unroll
  for (int q = 0; q < 4; ++q)
    w[q] = q < 2 ? two_stage8_bf16_fast(x[q], ax[q], p.inv_a, p.clamp_a, p.kr_a, p.thr_a, r)
                 : two_stage8_bf16_fast(x[q], ax[q], p.inv_b, p.clamp_b, p.kr_b, p.thr_b, r);
  uint32_t e2 = p.e2;
  if (!p.fast_a) {   // the same on the block's two lanes; no shuffle inside
    int e;
    w[0] = two_stage8_bf16(x[0], ax[0], m & 0xFFFFu, r, e);
    w[1] = two_stage8_bf16(x[1], ax[1], m & 0xFFFFu, r, e);
    e2 = (e2 & 0xFFFF0000u) | static_cast<uint32_t>(e);
  }
  if (!p.fast_b) {
    int e;
    w[2] = two_stage8_bf16(x[2], ax[2], m >> 16, r, e);
    w[3] = two_stage8_bf16(x[3], ax[3], m >> 16, r, e);
    e2 = (e2 & 0xFFFFu) | (static_cast<uint32_t>(e) << 16);
  }
  return e2;
}

// SPEC §7.2 on fp32 values (fp16 rows, or no bf16x2 arithmetic): stage 1 (rule recip, the fake-quant values
// rounded to bf16), then stage 2 (rule pack, codes by r). Same results as two_stage_split4.
__device__ __forceinline__ uint32_t two_stage_scalar(unsigned mask, float (&v)[kLaneVals], Rounding r,
                                                     uint32_t (&w)[4]) {
  const int e1a = ue8m0_exponent(block_amax(mask, v, 0), ScaleRule::recip);
  const int e1b = ue8m0_exponent(block_amax(mask, v, 16), ScaleRule::recip);
#pragma unroll
  for (int i = 0; i < kLaneVals; ++i) v[i] = round_to_bf16(fp4_fake_quant_value_e(canon(v[i]), i < 16 ? e1a : e1b));
  const int e2a = ue8m0_exponent(block_amax(mask, v, 0), ScaleRule::pack);
  const int e2b = ue8m0_exponent(block_amax(mask, v, 16), ScaleRule::pack);
  encode_f32(v, e2a, e2b, r, w);
  return static_cast<uint32_t>(e2a) | (static_cast<uint32_t>(e2b) << 16);
}

// The lane's payload: w[0..1] (its a values) at `pa`, w[2..3] (its b values) at `pb`; 8-byte stores when `st8`
// (both 8-byte aligned), else 4-byte ones.
__device__ __forceinline__ void store_payload(uint8_t* pa, uint8_t* pb, const uint32_t (&w)[4], bool st8) {
  if (st8) {
    *reinterpret_cast<uint2*>(pa) = make_uint2(w[0], w[1]);
    *reinterpret_cast<uint2*>(pb) = make_uint2(w[2], w[3]);
  } else {
    reinterpret_cast<uint32_t*>(pa)[0] = w[0];
    reinterpret_cast<uint32_t*>(pa)[1] = w[1];
    reinterpret_cast<uint32_t*>(pb)[0] = w[2];
    reinterpret_cast<uint32_t*>(pb)[1] = w[3];
  }
}

// One row t of the call, by its group's 4 lanes (lane = 0..3; they return together).
template <int IN_DT, int CDT, int MODE>
__device__ __forceinline__ void kstore_row(const KStoreArgs& a, int64_t t, int lane) {
  const unsigned mask = group_mask<kRowLanes>();
  // Every load that does not depend on another is issued first (the row and the norm weights exist whatever the
  // slot says), so that a row waits for memory twice: for these, then for its RoPE table values.
  const int64_t slot = load_i(a.slots, t, a.slots_dt);
  const int64_t pos_in = load_i(a.positions, t, a.pos_dt);
  float v[kLaneVals], wv[kLaneVals];
  load_lane<IN_DT>(static_cast<const char*>(a.k) + t * a.k_st * (IN_DT == kF32 ? 4 : 2), lane, a.k_vec, v);
  load_norm_weights(a.norm_w, a.norm_w_dt, lane, wv);
  if (lane == 0 && (pos_in < 0 || pos_in >= a.rope.max_pos)) atomicOr(a.err_flag, code(ErrFlag::position_out_of_range));   // SPEC §7.5
  if (slot < (kV41<MODE> ? 1 : 0)) return;            // §7.2: slot 0 reserved; negative slots skipped
  const int64_t capacity = MODE == code(KStoreMode::dense) ? a.num_blocks : a.num_blocks * a.P;
  if (slot >= capacity) {
    if (lane == 0) atomicOr(a.err_flag, code(ErrFlag::slot_out_of_range));
    return;
  }
  float rc[8], rs[8];
  rope_load<8, CDT>(a.rope, rope_position(pos_in, a.rope.max_pos, a.compress_ratio), 8 * lane, rc, rs);
  // RMSNorm (SPEC §5): inv = 1/sqrt(S(x*x)/128 + eps), y = fl(w * fl(x*inv)).
  float sq[kLaneVals];
#pragma unroll
  for (int e = 0; e < kLaneVals; ++e) sq[e] = fmul(v[e], v[e]);
  const float inv = inv_sqrt_eps(div128(row_sum4(mask, sq)), a.eps);
#pragma unroll
  for (int e = 0; e < kLaneVals; ++e) v[e] = rms_norm_apply(v[e], inv, wv[e]);
  const Rounding r = static_cast<Rounding>(a.rounding);
  uint32_t w[4];
  int ea, eb;   // the exponents stored for the lane's a block (l / 2) and b block (2 + l / 2)
  if constexpr (kV41<MODE>) {
    // §7.2: the norm's output and the RoPE's rounded to the input dtype, then the two stages.
    if constexpr (kPackedV41<IN_DT, MODE>) {
#pragma unroll
      for (int i = 16; i < kLaneVals; i += 2) {   // the b values to bf16 before the RoPE (the a values: below)
        const uint32_t h = round_pair_any_nan(v[i], v[i + 1], true);
        v[i] = lo_f32<kBF16>(h);
        v[i + 1] = hi_f32<kBF16>(h);
      }
      rope_tail(rc, rs, v);
      const uint32_t e2 = two_stage_split4(mask, v, r, w);
      ea = static_cast<int>(e2 & 0xFFu);
      eb = static_cast<int>((e2 >> 16) & 0xFFu);
    } else {
#pragma unroll
      for (int i = 0; i < kLaneVals; ++i) v[i] = round_to<IN_DT>(v[i]);
      rope_tail(rc, rs, v);
#pragma unroll
      for (int i = 16; i < kLaneVals; ++i) v[i] = round_to<IN_DT>(v[i]);
      const uint32_t e2 = two_stage_scalar(mask, v, r, w);
      ea = static_cast<int>(e2 & 0xFFu);
      eb = static_cast<int>(e2 >> 16);
    }
  } else {
    // §7.3: fp32 throughout (no rounding after the norm or the RoPE), optional Hadamard, FP4 with rule recip.
    rope_tail(rc, rs, v);
    if (a.hadamard) hadamard_split4(mask, lane, v);
    ea = ue8m0_exponent(block_amax(mask, v, 0), ScaleRule::recip);
    eb = ue8m0_exponent(block_amax(mask, v, 16), ScaleRule::recip);
    encode_f32(v, ea, eb, r, w);
  }
  // Stores: the lane's 8 + 8 payload bytes (a: bytes 8l .. 8l+7 of the row, b: 32 + 8l ..), and the exponents
  // of its two blocks by the even lane of each pair.
  const bool st8 = ((reinterpret_cast<uintptr_t>(a.cache) | static_cast<uintptr_t>(kV41<MODE> ? a.P * 68 : 0)) & 7u) == 0;
  const bool first = (lane & 1) == 0;
  const int ga = lane >> 1, gb = 2 + (lane >> 1);
  if constexpr (MODE == code(KStoreMode::packed68)) {
    const SlotPos sp = slot_pos(slot, a.P);
    uint8_t* row = a.cache + packed68_payload_offset_at(sp, a.P, 0);
    store_payload(row + 8 * lane, row + 32 + 8 * lane, w, st8);
    if (first) {
      uint8_t* e = a.cache + packed68_scale_offset_at(sp, a.P, 0);
      e[ga] = static_cast<uint8_t>(ea);
      e[gb] = static_cast<uint8_t>(eb);
    }
  } else if constexpr (MODE == code(KStoreMode::aiter_fp4)) {
    const SlotPos sp = slot_pos(slot, a.P);
    store_payload(a.cache + aiter_fp4_data_offset_at(sp, a.P, 8 * lane),
                  a.cache + aiter_fp4_data_offset_at(sp, a.P, 32 + 8 * lane), w, st8);
    if (first) {
      a.cache_scale[aiter_fp4_scale_offset_at(sp, a.P, ga)] = static_cast<uint8_t>(ea);
      a.cache_scale[aiter_fp4_scale_offset_at(sp, a.P, gb)] = static_cast<uint8_t>(eb);
    }
  } else {
    uint8_t* row = a.cache + slot * 64;
    store_payload(row + 8 * lane, row + 32 + 8 * lane, w, st8);
    if (first) {
      a.cache_scale[slot * 4 + ga] = static_cast<uint8_t>(ea);
      a.cache_scale[slot * 4 + gb] = static_cast<uint8_t>(eb);
    }
  }
}

// Thread `thread` of block `block` (kBlockThreads threads a block): lane thread & 3 of row block * kRowsPerBlock +
// thread / 4, if that row exists.
template <int IN_DT, int CDT, int MODE>
__device__ __forceinline__ void kstore_thread(const KStoreArgs& a, int64_t block, int thread) {
  const int64_t t = block * kRowsPerBlock + (thread >> 2);
  if (t < a.T) kstore_row<IN_DT, CDT, MODE>(a, t, thread & 3);
}

}  // namespace

// Calls launch(in_dt, cdt, mode) with the std::integral_constant codes of the kernel instance for `a`.
template <class Launch>
void kstore_dispatch(const KStoreArgs& a, Launch&& launch) {
  constexpr int kPacked68 = code(KStoreMode::packed68), kAiter = code(KStoreMode::aiter_fp4),
                kDense = code(KStoreMode::dense);
  if (a.mode == kPacked68) {
    with_half(a.in_dt, [&](auto in_dt) {
      launch(in_dt, std::integral_constant<int, kPairs>{}, std::integral_constant<int, kPacked68>{});
    });
  } else {
    with_float(a.in_dt, [&](auto in_dt) {
      with_table(a.rope, [&](auto cdt) {
        if (a.mode == kAiter)
          launch(in_dt, cdt, std::integral_constant<int, kAiter>{});
        else
          launch(in_dt, cdt, std::integral_constant<int, kDense>{});
      });
    });
  }
}

}  // namespace dsqk
