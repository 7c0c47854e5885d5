// kernels/cuda/row16.cuh: one 128-wide row held by a group of 16 lanes, 8 consecutive values each.
//
// Lane l (0..15 within its half-warp) holds x[8l .. 8l+7]. The helpers below are the shared header's
// math (src/include/dsaquant) distributed over those lanes, nothing more; their cross-lane steps are
// lanes.cuh's, with LANES = kLanes = 16 (the indexer uses the same with 8):
//   - the canonical sum (SPEC §0.2): lane l owns partials 2l and 2l+1; the butterfly steps s = 16..2
//     pair partial i with i ^ s, i.e. lane l with lane l ^ (s/2); s = 1 pairs the lane's two partials.
//   - amax over the row (16 lanes) or over one block of 32 (4 lanes).
//   - RoPE (SPEC §5): neox partners (j, j+32) sit 4 lanes apart; interleaved pairs sit inside a lane.
//   - the 128-point Hadamard (SPEC §5): h = 1, 2, 4 inside a lane, h = 8..64 between lanes l, l ^ (h/8).
// Every lane of the 16-lane group must call these helpers together (they shuffle).
#pragma once

#include <cstdint>
#include <type_traits>

#include "dsaquant/dsaquant.h"
#include "dsaquant/fake_quant.h"
#include "indexer.h"
#include "lanes.cuh"

namespace dsqk {

using namespace dsq;

constexpr int kLanes = 16;   // lanes per row
constexpr int kVals = 8;     // values per lane

// Element types of the inputs, by a runtime code: dsaquant/codes.h DType (kF32 .. kI64). kPairs, outside that
// range, is this file's own template code of a RoPE table of fp32 (cos, sin) pairs (RopeArgs::pairs).
constexpr int kPairs = 5;
static_assert(kPairs > kI64, "kPairs must not collide with a DType code");

__device__ __forceinline__ float load_f(const void* p, int64_t i, int dt) {
  if (dt == kF32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dt == kBF16 ? bf16_to_f32(h) : fp16_to_f32(h);
}
__device__ __forceinline__ int64_t load_i(const void* p, int64_t i, int dt) {
  return dt == kI64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}
template <int DT>
__device__ __forceinline__ float round_to(float x) {
  if (DT == kBF16) return round_to_bf16(x);
  if (DT == kF16) return round_to_fp16(x);
  return canon_nan(x);
}
template <int DT>
__device__ __forceinline__ uint16_t to_half_bits(float x) {
  return DT == kBF16 ? round_bf16(x) : round_fp16(x);
}
__device__ __forceinline__ uint16_t to_half_bits(float x, int dt) {
  return dt == kBF16 ? round_bf16(x) : round_fp16(x);
}
__device__ __forceinline__ float canon(float x) { return canon_nan(x); }

// Load the lane's 8 values of a 16-bit (bf16/fp16) or fp32 row starting at `row` (element pointer).
template <int DT>
__device__ __forceinline__ void load_row8(const void* row, int lane, bool vec, float (&v)[kVals]) {
  if (DT == kF32) {
    const float* r = static_cast<const float*>(row) + kVals * lane;
    if (vec) {
      const float4 a = reinterpret_cast<const float4*>(r)[0], b = reinterpret_cast<const float4*>(r)[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
      for (int e = 0; e < kVals; ++e) v[e] = r[e];
    }
    return;
  }
  const uint16_t* r = static_cast<const uint16_t*>(row) + kVals * lane;
  uint16_t h[kVals];
  if (vec) {
    const uint4 u = *reinterpret_cast<const uint4*>(r);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) { h[2 * e] = w[e] & 0xFFFFu; h[2 * e + 1] = w[e] >> 16; }
  } else {
#pragma unroll
    for (int e = 0; e < kVals; ++e) h[e] = r[e];
  }
#pragma unroll
  for (int e = 0; e < kVals; ++e) v[e] = DT == kBF16 ? bf16_to_f32(h[e]) : fp16_to_f32(h[e]);
}

// SPEC §0.2 canonical sum of a row of 128 whose lane holds terms t[0..7]; every lane gets the sum.
__device__ __forceinline__ float row_sum(unsigned mask, const float (&t)[kVals]) {
  return group_sum<kLanes>(mask, canonical_partial(t[0], t[1], t[2], t[3]), canonical_partial(t[4], t[5], t[6], t[7]));
}

// SPEC §0.3 amax of the lane's values, then over `lanes` lanes (16: the row; 4: a block of 32).
__device__ __forceinline__ float group_amax(unsigned mask, const float (&v)[kVals], int lanes) {
  float a = 0.0f;
#pragma unroll
  for (int e = 0; e < kVals; ++e) a = fmax_nn(a, abs_f(v[e]));
  return group_max<kLanes>(mask, a, lanes);
}

// N consecutive (cos, sin) pairs j0 .. j0+N-1 (N = 4 or 8, j0 a multiple of N) of a table (indexer.h
// RopeArgs) at position p; vector loads when the table is aligned.
template <int N, int CDT>
__device__ __forceinline__ void rope_load(const RopeArgs& t, int64_t p, int j0, float (&c)[N], float (&s)[N]) {
  if (CDT == kPairs) {   // fp32 (cos, sin) pairs
    const float* f = static_cast<const float*>(t.cos) + p * t.row_stride + 2 * j0;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float4 u = t.vec ? reinterpret_cast<const float4*>(f)[i] : make_float4(f[4 * i], f[4 * i + 1], f[4 * i + 2], f[4 * i + 3]);
      c[2 * i] = u.x; s[2 * i] = u.y; c[2 * i + 1] = u.z; s[2 * i + 1] = u.w;
    }
    return;
  }
  const int64_t off = p * t.row_stride + j0;
  if (CDT == kF32) {
    const float* cp = static_cast<const float*>(t.cos) + off;
    const float* sp = static_cast<const float*>(t.sin) + off;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 a = t.vec ? reinterpret_cast<const float4*>(cp)[i] : make_float4(cp[4 * i], cp[4 * i + 1], cp[4 * i + 2], cp[4 * i + 3]);
      const float4 b = t.vec ? reinterpret_cast<const float4*>(sp)[i] : make_float4(sp[4 * i], sp[4 * i + 1], sp[4 * i + 2], sp[4 * i + 3]);
      c[4 * i] = a.x; c[4 * i + 1] = a.y; c[4 * i + 2] = a.z; c[4 * i + 3] = a.w;
      s[4 * i] = b.x; s[4 * i + 1] = b.y; s[4 * i + 2] = b.z; s[4 * i + 3] = b.w;
    }
    return;
  }
  const uint16_t* cp = static_cast<const uint16_t*>(t.cos) + off;
  const uint16_t* sp = static_cast<const uint16_t*>(t.sin) + off;
  uint16_t hc[N], hs[N];
  if (t.vec && N == 8) {
    const uint4 a = *reinterpret_cast<const uint4*>(cp), b = *reinterpret_cast<const uint4*>(sp);
    const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      hc[2 * i] = wa[i] & 0xFFFFu; hc[2 * i + 1] = wa[i] >> 16;
      hs[2 * i] = wb[i] & 0xFFFFu; hs[2 * i + 1] = wb[i] >> 16;
    }
  } else if (t.vec && N == 4) {
    const uint2 a = *reinterpret_cast<const uint2*>(cp), b = *reinterpret_cast<const uint2*>(sp);
    const uint32_t wa[2] = {a.x, a.y}, wb[2] = {b.x, b.y};
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      hc[2 * i] = wa[i] & 0xFFFFu; hc[2 * i + 1] = wa[i] >> 16;
      hs[2 * i] = wb[i] & 0xFFFFu; hs[2 * i + 1] = wb[i] >> 16;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) { hc[i] = cp[i]; hs[i] = sp[i]; }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    c[i] = CDT == kBF16 ? bf16_to_f32(hc[i]) : fp16_to_f32(hc[i]);
    s[i] = CDT == kBF16 ? bf16_to_f32(hs[i]) : fp16_to_f32(hs[i]);
  }
}

// SPEC §5 RoPE on the row's rope dims (head: 0..63 = lanes 0..7; tail: 64..127 = lanes 8..15).
template <bool NEOX, bool TAIL, int CDT>
__device__ __forceinline__ void rope_row(unsigned mask, int lane, float (&v)[kVals], const RopeArgs& tab, int64_t pos) {
  constexpr bool neox = NEOX, tail = TAIL;
  const int base = tail ? 8 : 0;
  const bool mine = lane >= base && lane < base + 8;
  const int rl = lane - base;   // lane within the rope dims (0..7 when mine)
  if constexpr (neox) {
    // Partner lane holds dims +-32: lanes rl and rl ^ 4. Every lane shuffles (uniform control flow).
    float other[kVals];
#pragma unroll
    for (int e = 0; e < kVals; ++e) other[e] = group_shfl_xor<kLanes>(mask, v[e], 4);
    if (!mine) return;
    const bool first = rl < 4;   // holds a = x[j], partner holds b = x[j + 32]
    float c[kVals], s[kVals];
    rope_load<kVals, CDT>(tab, pos, 8 * (rl & 3), c, s);
#pragma unroll
    for (int e = 0; e < kVals; ++e) {
      float a = first ? v[e] : other[e], b = first ? other[e] : v[e];
      rope_pair(a, b, c[e], s[e]);
      v[e] = first ? a : b;
    }
  } else {
    if (!mine) return;
    float c[kVals / 2], s[kVals / 2];
    rope_load<kVals / 2, CDT>(tab, pos, 4 * rl, c, s);
#pragma unroll
    for (int e = 0; e < kVals; e += 2) rope_pair(v[e], v[e + 1], c[e / 2], s[e / 2]);
  }
}

// SPEC §5 Hadamard over the 128 row (Sylvester order), then times fl(128^-0.5).
__device__ __forceinline__ void hadamard_row(unsigned mask, int lane, float (&v)[kVals]) {
#pragma unroll
  for (int h = 1; h < kVals; h <<= 1) {
#pragma unroll
    for (int e = 0; e < kVals; ++e) {
      if (e & h) continue;
      const float a = v[e], b = v[e + h];
      v[e] = fadd(a, b);
      v[e + h] = fsub(a, b);
    }
  }
#pragma unroll
  for (int s = 1; s < kLanes; s <<= 1) {   // element stride h = 8 * s
    const bool upper = lane & s;
#pragma unroll
    for (int e = 0; e < kVals; ++e) {
      const float o = group_shfl_xor<kLanes>(mask, v[e], s);
      v[e] = upper ? fsub(o, v[e]) : fadd(v[e], o);
    }
  }
  const float c = hadamard_scale(128);
#pragma unroll
  for (int e = 0; e < kVals; ++e) v[e] = fmul(v[e], c);
}

// FP4 (SPEC §2-§3) of the lane's 8 values, a quarter of one block of 32: returns the block's exponent
// (same on the block's 4 lanes) and the 4 packed bytes as one little-endian word.
__device__ __forceinline__ uint32_t fp4_quant8(unsigned mask, const float (&v)[kVals], ScaleRule rule, Rounding r,
                                               int& e_out) {
  const int e = ue8m0_exponent(group_amax(mask, v, 4), rule);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    word |= static_cast<uint32_t>(e2m1_encode_pair(canon(v[2 * i]), canon(v[2 * i + 1]), e, r)) << (8 * i);
  e_out = e;
  return word;
}

}  // namespace dsqk

namespace dsqk {

// Host-side dispatch of runtime codes to template parameters: f(std::integral_constant<...>{}...).
template <int V>
using IC = std::integral_constant<int, V>;

template <class F>
void with_half(int dt, F&& f) {   // bf16 or fp16 input rows
  if (dt == kBF16) f(IC<kBF16>{}); else f(IC<kF16>{});
}
template <class F>
void with_float(int dt, F&& f) {  // bf16, fp16 or fp32 input rows
  if (dt == kBF16) f(IC<kBF16>{}); else if (dt == kF16) f(IC<kF16>{}); else f(IC<kF32>{});
}
template <class F>
void with_table(const RopeArgs& r, F&& f) {   // cos/sin table kind
  if (r.pairs) f(IC<kPairs>{}); else with_float(r.dtype, f);
}
template <class F>
void with_bool(bool b, F&& f) {
  if (b) f(std::true_type{}); else f(std::false_type{});
}

}  // namespace dsqk
