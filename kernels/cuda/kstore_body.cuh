// kernels/cuda/kstore_body.cuh: SPEC §7.2's k writer (sglang-v41: index_k_norm_rope_pack_store, cache packed68)
// and §7.3 (aiter's DeepSeek-V4 k writer: rmsnorm_rope_rotate_fp4quant_kvcache, caches aiter_fp4 or dense).
// (§7.2's q writers: qpack.cu.)
//
// Layout: the q side's "split8" (qrows.cuh): a group of 8 lanes holds one 128-wide row, 16 rows per block of 128
// threads. Lane l holds the eight values a = x[8l .. 8l+7] (dims 0..63, not rotated) and the eight b =
// x[64+8l .. 64+8l+7] (the tail RoPE dims), in v[0..7] and v[8..15]. So:
//   - every lane takes part in the tail RoPE: its interleaved pairs (2j, 2j+1), j = 4l .. 4l+3, are in-lane;
//   - an FP4 block of 32 is the a's (block l/4) or the b's (block 2 + l/4) of 4 lanes: a block amax is two
//     shuffles, and each lane encodes and stores 4 + 4 packed bytes of its own;
//   - the canonical sum (SPEC §0.2) is qrows.cuh's row_sum8;
//   - the Hadamard's strides 1..4 are in-lane in each half, 8, 16 and 32 between lanes l ^ 1, l ^ 2 and l ^ 4,
//     and 64 between the lane's two halves.
// A row's chain of dependent instructions is what bounds these kernels (a few thousand rows, too few warps to
// hide it): eight lanes a row halve that chain against four lanes of 32 values, and give twice the warps.
// The per-value work is the shared header's: for bf16 rows of the v41 writer on NVIDIA the two stages run two
// values per operation (two_stage_x8.h, as the v41 q writer does), and the V4 writer encodes its fp32 values
// eight at a time (e2m1x8.h e2m1_encode8_f32).
//
// The row body (kstore_thread) is shared by the kernel (kstore_qpack.cu, hipified for AMD) and the host emulator of
// the tests (tests/cpp/kstore_host.cpp), which runs it unchanged on the CPU; kstore_dispatch maps a call's codes
// to the kernel instance both launch.
#pragma once

#include <type_traits>

#include "indexer.h"
#include "qrows.cuh"   // the split8 steps (row_sum8, amax_lanes, rope8, two stages); row16.cuh (loads, dispatch)

namespace dsqk {
namespace {

constexpr int kRowLanes = kGroupLanes;                       // lanes per row (8)
constexpr int kLaneVals = 16;                                // values per lane
constexpr int kRowsPerBlock = 16;
constexpr int kBlockThreads = kRowLanes * kRowsPerBlock;

// What a kernel instance does, from its template codes (IN_DT the row dtype, MODE the cache format): the v41
// writer (SPEC §7.2; else §7.3), and for its bf16 rows on NVIDIA sm_80+ the two stages on bf16x2 words
// (two_stage_x8.h; else on fp32 values).
template <int MODE>
constexpr bool kV41 = MODE == code(KStoreMode::packed68);
template <int IN_DT, int MODE>
constexpr bool kPackedV41 = kV41<MODE> && IN_DT == kBF16 && kPackedFp4Native;

// Eight consecutive values of element type DT, elements i0 .. i0+7 of `row`, as fp32 into v[o .. o+7] (16-byte
// loads when `vec`: the row, and so element i0, a multiple of 8, is 16-byte aligned).
template <int DT>
__device__ __forceinline__ void load8_f32(const void* row, int i0, bool vec, float (&v)[kLaneVals], int o) {
  if constexpr (DT == kF32) {
    const float* p = static_cast<const float*>(row) + i0;
    if (vec) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float4 u = reinterpret_cast<const float4*>(p)[q];
        v[o + 4 * q] = u.x; v[o + 4 * q + 1] = u.y; v[o + 4 * q + 2] = u.z; v[o + 4 * q + 3] = u.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[o + i] = p[i];
    }
  } else {
    const uint4 u = load8(static_cast<const uint16_t*>(row) + i0, vec);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[o + 2 * i] = lo_f32<DT>(w[i]);
      v[o + 2 * i + 1] = hi_f32<DT>(w[i]);
    }
  }
}
// The lane's a and b values of a row (or of the norm weight) of element type DT.
template <int DT>
__device__ __forceinline__ void load_lane(const void* row, int lane, bool vec, float (&v)[kLaneVals]) {
  load8_f32<DT>(row, 8 * lane, vec, v, 0);
  load8_f32<DT>(row, 64 + 8 * lane, vec, v, 8);
}

// The lane's 16 norm weights (SPEC §5: the input dtype, or fp32), converted exactly to fp32.
__device__ __forceinline__ void load_norm_weights(const void* w, int dt, int lane, float (&wv)[kLaneVals]) {
  const bool vec = (reinterpret_cast<uintptr_t>(w) & 15u) == 0;
  if (dt == kF32) load_lane<kF32>(w, lane, vec, wv);
  else if (dt == kBF16) load_lane<kBF16>(w, lane, vec, wv);
  else load_lane<kF16>(w, lane, vec, wv);
}

// SPEC §5 Hadamard of the row (Sylvester order: strides h = 1, 2, ..., 64 in turn), then times fl(128^-0.5).
__device__ __forceinline__ void hadamard_split8(unsigned mask, int lane, float (&v)[kLaneVals]) {
  hadamard_butterflies<8>(v);         // h = 1..4 in the a values
  hadamard_butterflies<8>(v + 8);     // and in the b values
  // h = 8 s: lanes l and l ^ s; the lower lane holds a pair's first value x, the upper its second y, and they
  // become x + y and x - y: each lane adds its own value times +1 (lower) or -1 (upper) to its partner's.
#pragma unroll
  for (int s = 1; s <= 4; s <<= 1) {
    const float sign = (lane & s) ? -1.0f : 1.0f;
#pragma unroll
    for (int e = 0; e < kLaneVals; ++e) v[e] = fadd_signed(v[e], sign, group_shfl_xor<kRowLanes>(mask, v[e], s));
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {       // h = 64: a value with the b value of the same lane
    const float x = v[e], y = v[8 + e];
    v[e] = fadd(x, y);
    v[8 + e] = fsub(x, y);
  }
  const float c = hadamard_scale(128);
#pragma unroll
  for (int e = 0; e < kLaneVals; ++e) v[e] = fmul(v[e], c);
}

// FP4 of the lane's fp32 values v[o .. o+7] (policy r) in a block of exponent e: 4 packed bytes.
__device__ __forceinline__ uint32_t encode8(const float (&v)[kLaneVals], int o, int e, Rounding r) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = v[o + i];
  if (r == Rounding::threshold) return e2m1_encode8_f32<Rounding::threshold>(x, e);
  if (r == Rounding::rne) return e2m1_encode8_f32<Rounding::rne>(x, e);
  return e2m1_encode8_f32<Rounding::hardware>(x, e);
}

// The lane's payload: wa (its a values) at `pa`, wb (its b values) at `pb`; word stores when `al4` (both 4-byte
// aligned), else byte stores.
__device__ __forceinline__ void store_payload(uint8_t* pa, uint8_t* pb, uint32_t wa, uint32_t wb, bool al4) {
  if (al4) {
    *reinterpret_cast<uint32_t*>(pa) = wa;
    *reinterpret_cast<uint32_t*>(pb) = wb;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pa[i] = static_cast<uint8_t>(wa >> (8 * i));
      pb[i] = static_cast<uint8_t>(wb >> (8 * i));
    }
  }
}

// One row t of the call, by its group's 8 lanes (lane = 0..7; they return together).
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
  rope_entries</*NEOX=*/false, CDT>(a.rope, rope_position(pos_in, a.rope.max_pos, a.compress_ratio), lane, rc, rs);
  // RMSNorm (SPEC §5): inv = 1/sqrt(S(x*x)/128 + eps), y = fl(w * fl(x*inv)).
  float sq[kLaneVals];
#pragma unroll
  for (int e = 0; e < kLaneVals; ++e) sq[e] = fmul(v[e], v[e]);
  const float inv = inv_sqrt_eps(div128(row_sum8(mask, sq)), a.eps);
#pragma unroll
  for (int e = 0; e < kLaneVals; ++e) v[e] = rms_norm_apply(v[e], inv, wv[e]);
  const Rounding r = static_cast<Rounding>(a.rounding);
  uint32_t wa, wb;
  int ea, eb;   // the exponents stored for the lane's a block (l / 4) and b block (2 + l / 4)
  if constexpr (kV41<MODE>) {
    // §7.2: the norm's output and the RoPE's rounded to the input dtype, then the two stages.
    uint32_t e2;
    if constexpr (kPackedV41<IN_DT, MODE>) {
#pragma unroll
      for (int i = 8; i < kLaneVals; i += 2) {   // the b values to bf16 before the RoPE (the a values: below)
        const uint32_t h = round_pair_any_nan(v[i], v[i + 1], true);
        v[i] = lo_f32<kBF16>(h);
        v[i + 1] = hi_f32<kBF16>(h);
      }
      rope8</*NEOX=*/false, /*OFF=*/8>(mask, lane, v, rc, rs);
      uint32_t xa[4], xb[4];
      round_j_j4(v, 0, xa);
      round_j_j4(v, 8, xb);
      e2 = two_stage_bf16x2(mask, xa, xb, r, wa, wb);
    } else {
#pragma unroll
      for (int i = 0; i < kLaneVals; ++i) v[i] = round_to<IN_DT>(v[i]);
      rope8</*NEOX=*/false, /*OFF=*/8>(mask, lane, v, rc, rs);
#pragma unroll
      for (int i = 8; i < kLaneVals; ++i) v[i] = round_to<IN_DT>(v[i]);
      e2 = two_stage_f32(mask, v, r, wa, wb);
    }
    ea = static_cast<int>(e2 & 0xFFu);
    eb = static_cast<int>((e2 >> 16) & 0xFFu);
  } else {
    // §7.3: fp32 throughout (no rounding after the norm or the RoPE), optional Hadamard, FP4 with rule recip.
    rope8</*NEOX=*/false, /*OFF=*/8>(mask, lane, v, rc, rs);
    if (a.hadamard) hadamard_split8(mask, lane, v);
    ea = ue8m0_exponent(amax_lanes(mask, v, 0, 4), ScaleRule::recip);
    eb = ue8m0_exponent(amax_lanes(mask, v, 1, 4), ScaleRule::recip);
    wa = encode8(v, 0, ea, r);
    wb = encode8(v, 8, eb, r);
  }
  // Stores: the lane's 4 + 4 payload bytes (a: bytes 4l .. 4l+3 of the row, b: 32 + 4l ..), and the exponents
  // of its two blocks by the first lane of each block (lanes 0 and 4).
  const bool al4 = (reinterpret_cast<uintptr_t>(a.cache) & 3u) == 0;   // every layout's rows: 4-byte multiples
  const bool first = (lane & 3) == 0;
  const int ga = lane >> 2, gb = 2 + (lane >> 2);
  if constexpr (MODE == code(KStoreMode::packed68)) {
    const SlotPos sp = slot_pos(slot, a.P);
    uint8_t* row = a.cache + packed68_payload_offset_at(sp, a.P, 0);
    store_payload(row + 4 * lane, row + 32 + 4 * lane, wa, wb, al4);
    if (first) {
      uint8_t* e = a.cache + packed68_scale_offset_at(sp, a.P, 0);
      e[ga] = static_cast<uint8_t>(ea);
      e[gb] = static_cast<uint8_t>(eb);
    }
  } else if constexpr (MODE == code(KStoreMode::aiter_fp4)) {
    const SlotPos sp = slot_pos(slot, a.P);
    store_payload(a.cache + aiter_fp4_data_offset_at(sp, a.P, 4 * lane),
                  a.cache + aiter_fp4_data_offset_at(sp, a.P, 32 + 4 * lane), wa, wb, al4);
    if (first) {
      a.cache_scale[aiter_fp4_scale_offset_at(sp, a.P, ga)] = static_cast<uint8_t>(ea);
      a.cache_scale[aiter_fp4_scale_offset_at(sp, a.P, gb)] = static_cast<uint8_t>(eb);
    }
  } else {
    uint8_t* row = a.cache + slot * 64;
    store_payload(row + 4 * lane, row + 32 + 4 * lane, wa, wb, al4);
    if (first) {
      a.cache_scale[slot * 4 + ga] = static_cast<uint8_t>(ea);
      a.cache_scale[slot * 4 + gb] = static_cast<uint8_t>(eb);
    }
  }
}

// Thread `thread` of block `block` (kBlockThreads threads a block): lane thread & 7 of row block * kRowsPerBlock +
// thread / 8, if that row exists.
template <int IN_DT, int CDT, int MODE>
__device__ __forceinline__ void kstore_thread(const KStoreArgs& a, int64_t block, int thread) {
  const int64_t t = block * kRowsPerBlock + thread / kRowLanes;
  if (t < a.T) kstore_row<IN_DT, CDT, MODE>(a, t, thread % kRowLanes);
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
