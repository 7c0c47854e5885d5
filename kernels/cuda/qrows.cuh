// kernels/cuda/qrows.cuh: the q side shared by the fused indexer (indexer.cu, SPEC §7.1) and the sglang-v41
// q writers (qpack.cu, SPEC §7.2): 128-wide rows in 8-lane groups, a token's heads shared by the groups of
// a warp or of a block, and the loop over them (q_heads) with its cp.async row ring. What is done to a row
// (RoPE on one half, the quantizer, the outputs) is the caller's Row type (see q_heads).
//
// Lanes ("split8" layout): an 8-lane group holds one 128-wide row; lane l holds the eight values
// x[8l .. 8l+7] ("a", dims 0..63) and x[64+8l .. 64+8l+7] ("b", dims 64..127). So every lane takes part in
// a RoPE on either half (neox partners j, j+32 are 4 lanes apart; interleaved pairs are inside a lane), an
// FP4 block of 32 is the a's or the b's of 4 lanes, an FP8 row is the group, and the canonical sum's
// levels are: in-lane (partials i, i+16), lanes l ^ 4, l ^ 2, l ^ 1, in-lane (partials 2l, 2l+1).
// Eight values per lane (not four) halve the per-row work (scales, shuffles, stores, addresses) per value:
// faster on the H200 (dev/cuda_variants.sh builds and times such variants).
#pragma once

#include <atomic>
#include <type_traits>

#include "indexer.h"
#include "row16.cuh"   // DType codes, scalar loads, rope_load, with_* dispatch; lanes.cuh (group_*)
#if !defined(__HIP__)
#include "ptx.cuh"
#endif

namespace dsqk {
namespace {

constexpr int kGroupLanes = 8;                 // lanes per row
constexpr int kGroups = 256 / kGroupLanes;     // rows per block of 256 threads

// Eight consecutive 16-bit values at p, one at a time (rows that are not 16-byte aligned). Not inlined on
// NVIDIA: inlined, its loads were predicated into the vector path and issued (switched off) for every row.
// Inlined on AMD, where a call costs SGPR spills (tests/test_hip_build.py allows neither calls nor spills).
#if defined(__HIP__)
#define DSQ_OUT_OF_LINE __forceinline__
#else
#define DSQ_OUT_OF_LINE __noinline__
#endif
__device__ DSQ_OUT_OF_LINE uint4 load8_scalar(const uint16_t* p) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = p[2 * i] | (static_cast<uint32_t>(p[2 * i + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// Eight consecutive 16-bit values at p (one 16-byte load when `vec`: p is then 16-byte aligned).
__device__ __forceinline__ uint4 load8(const uint16_t* p, bool vec) {
  return vec ? *reinterpret_cast<const uint4*>(p) : load8_scalar(p);
}

#if !defined(__HIP__)
using dsq_ptx::cp_async16;   // ptx.cuh: asynchronous copies into shared memory
using dsq_ptx::cp_async4;
using dsq_ptx::cp_async_commit;
using dsq_ptx::cp_async_wait;
#endif

// A row's raw 16-bit values for this lane: a = x[8l..8l+7], b = x[64+8l..64+8l+7].
struct Raw {
  uint4 a, b;
};
__device__ __forceinline__ Raw load_raw(const uint16_t* row, int lane, bool vec) {
  return Raw{load8(row + 8 * lane, vec), load8(row + 64 + 8 * lane, vec)};
}

// The low / high 16-bit value of a word as fp32 (bf16: a shift or a mask; fp16: arith.h's decode).
template <int DT>
__device__ __forceinline__ float lo_f32(uint32_t w) {
  return DT == kBF16 ? u2f(w << 16) : fp16_to_f32(static_cast<uint16_t>(w & 0xFFFFu));
}
template <int DT>
__device__ __forceinline__ float hi_f32(uint32_t w) {
  return DT == kBF16 ? u2f(w & 0xFFFF0000u) : fp16_to_f32(static_cast<uint16_t>(w >> 16));
}
// The first n (8: the a values only, or 16) values of a row as fp32.
template <int DT>
__device__ __forceinline__ void unpack(const Raw& r, float (&v)[16], int n = 16) {
  const uint32_t w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
  for (int i = 0; i < n / 2; ++i) {
    v[2 * i] = lo_f32<DT>(w[i]);
    v[2 * i + 1] = hi_f32<DT>(w[i]);
  }
}

// The b values (x[64+8l .. 64+8l+7]) of a row as fp32, into v[8..15].
template <int DT>
__device__ __forceinline__ void unpack_b(const Raw& r, float (&v)[16]) {
  const uint32_t w[4] = {r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[8 + 2 * i] = lo_f32<DT>(w[i]);
    v[9 + 2 * i] = hi_f32<DT>(w[i]);
  }
}

// Values i..i+7 rounded to the input dtype (SPEC §5, §7.1, §7.2: after RoPE, after the norm). Only quantizers read
// them, which treat every NaN alike, so the pair rounding's unspecified NaN payload is harmless.
template <int DT>
__device__ __forceinline__ void round8(float (&v)[16], int i0) {
#pragma unroll
  for (int i = i0; i < i0 + 8; i += 2) {
    const uint32_t w = round_pair_any_nan(v[i], v[i + 1], DT == kBF16);
    v[i] = lo_f32<DT>(w);
    v[i + 1] = hi_f32<DT>(w);
  }
}

// The lane's RoPE table entries (SPEC §5) at position p: neox: pairs j = 8(l&3) .. +7 (lane l < 4 holds
// their first elements, lane l+4 their second), in c/s[0..7], the sines negated on lanes 0..3 (see rope8);
// interleaved: pairs 4l .. 4l+3, in c/s[0..3].
template <bool NEOX, int CDT>
__device__ __forceinline__ void rope_entries(const RopeArgs& tab, int64_t p, int lane, float (&c)[8], float (&s)[8]) {
  if (NEOX) {
    rope_load<8, CDT>(tab, p, 8 * (lane & 3), c, s);
    if (lane < 4)
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = -s[i];
  } else {
    float c4[4], s4[4];
    rope_load<4, CDT>(tab, p, 4 * lane, c4, s4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      c[i] = c4[i];
      s[i] = s4[i];
      c[4 + i] = s[4 + i] = 0.0f;
    }
  }
}

// SPEC §5 RoPE of the lane's eight values v[OFF .. OFF+7] of one half, in fp32: the a values (OFF = 0, head
// RoPE: dims 0..63) or the b values (OFF = 8, tail RoPE: dims 64..127); the lane's pairs and table entries
// are the same for either half (rope_entries). Callers round the results to the input dtype (SPEC §5).
// neox: a' = fl(fl(a*c) - fl(b*s)) on lanes 0..3, b' = fl(fl(b*c) + fl(a*s)) on lanes 4..7, both as
// fl(fl(x*c) + fl(y*s')) with s' = -s on lanes 0..3 (rope_entries): fl(y*(-s)) = -fl(y*s) and x - y is
// x + (-y), exactly.
template <bool NEOX, int OFF = 0>
__device__ __forceinline__ void rope8(unsigned mask, int lane, float (&v)[16], const float (&c)[8],
                                      const float (&s)[8]) {
  if (NEOX) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[OFF + i] = fadd(fmul(v[OFF + i], c[i]), fmul(group_shfl_xor<kGroupLanes>(mask, v[OFF + i], 4), s[i]));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) rope_pair(v[OFF + 2 * i], v[OFF + 2 * i + 1], c[i], s[i]);
  }
}

// NaN-ignoring max |x| of the lane's a values (h = 0), b values (h = 1) or all 16 (h = 2), then over
// `lanes` lanes (SPEC §0.3: an all-NaN range gives 0).
__device__ __forceinline__ float amax_lanes(unsigned mask, const float (&v)[16], int h, int lanes) {
  const int i0 = h == 1 ? 8 : 0, i1 = h == 0 ? 8 : 16;
  float m = 0.0f;
#pragma unroll
  for (int i = i0; i < i1; ++i) m = fmax_nn(m, abs_f(v[i]));
  return group_max<kGroupLanes>(mask, m, lanes);
}

// FP4 (SPEC §2-§3, rule recip): the two blocks this lane takes part in (a: block lane/4, b: block
// 2 + lane/4), their exponents and the lane's 4 + 4 packed bytes.
template <Rounding R>
__device__ __forceinline__ void fp4_quant(unsigned mask, const float (&v)[16], uint32_t& bytes_a, uint32_t& bytes_b,
                                          int& e_a, int& e_b) {
  e_a = ue8m0_exponent(amax_lanes(mask, v, 0, 4), ScaleRule::recip);
  e_b = ue8m0_exponent(amax_lanes(mask, v, 1, 4), ScaleRule::recip);
  // A NaN input counts as the canonical (positive) NaN; only `hardware` reads a NaN's sign, and under
  // threshold/rne a NaN gives 0x7 either way (e2m1.h), so only hardware pays for the canonicalisation.
  auto in = [&](int i) { return R == Rounding::hardware ? canon(v[i]) : v[i]; };
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int e = h ? e_b : e_a;
    w[h] = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[h] |= static_cast<uint32_t>(e2m1_encode_pair(in(8 * h + 2 * i), in(8 * h + 2 * i + 1), e, R)) << (8 * i);
  }
  bytes_a = w[0];
  bytes_b = w[1];
}

// The same for bf16 inputs on NVIDIA (sm_80+), two values per operation (e2m1x8.h): xa[j] holds the
// lane's a values j and j + 4 (xb: its b values), bf16. The block amax is a bf16x2 max (exact; a NaN
// is ignored, an all-NaN block gives 0), the a and b blocks' in one word through the shuffles.
#if defined(DSQ_BF16X2_NATIVE) || defined(DSQ_HOST_BF16X2_PATH)   // (the tests' host emulator: on e2m1x8.h's exact
constexpr bool kPackedFp4Native = true;                           // emulation of the bf16x2 operations)
#else
constexpr bool kPackedFp4Native = false;
#endif
// The amax of the lane's two blocks (bf16 bits: a in the low half, b in the high half), from the lane's
// words of |x| (aa: the a values, ab: the b values; any pairing of a half's values).
[[maybe_unused]] __device__ __forceinline__ uint32_t block_amax_bf16(unsigned mask, const uint32_t (&aa)[4],
                                                                     const uint32_t (&ab)[4]) {
  const uint32_t ma = bf16x2_max_nn(bf16x2_max_nn(aa[0], aa[1]), bf16x2_max_nn(aa[2], aa[3]));
  const uint32_t mb = bf16x2_max_nn(bf16x2_max_nn(ab[0], ab[1]), bf16x2_max_nn(ab[2], ab[3]));
  uint32_t m = bf16x2_max_nn(byte_perm(ma, mb, 0x5410u), byte_perm(ma, mb, 0x7632u));   // (a, b)
  m = bf16x2_max_nn(m, group_shfl_xor<kGroupLanes>(mask, m, 2));
  return bf16x2_max_nn(bf16x2_max_nn(m, group_shfl_xor<kGroupLanes>(mask, m, 1)), 0u);   // an all-NaN block: 0
}
// The same from the lane's words of x (xa, xb), which also leaves |x| in aa and ab.
[[maybe_unused]] __device__ __forceinline__ uint32_t block_abs_amax_bf16(unsigned mask, const uint32_t (&xa)[4],
                                                                         const uint32_t (&xb)[4], uint32_t (&aa)[4],
                                                                         uint32_t (&ab)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    aa[j] = bf16x2_abs(xa[j]);
    ab[j] = bf16x2_abs(xb[j]);
  }
  return block_amax_bf16(mask, aa, ab);
}
template <Rounding R>
__device__ __forceinline__ void fp4_quant_bf16(unsigned mask, const uint32_t (&xa)[4], const uint32_t (&xb)[4],
                                               uint32_t& bytes_a, uint32_t& bytes_b, int& e_a, int& e_b) {
  uint32_t aa[4], ab[4];
  const uint32_t m = block_abs_amax_bf16(mask, xa, xb, aa, ab);
  const Bf16x2Scales sc = ue8m0_recip_scales_bf16x2(m);
  e_a = sc.e_a;
  e_b = sc.e_b;
  bytes_a = e2m1_encode8_bf16_s<R>(xa, aa, sc.s_a, sc.nan_a);
  bytes_b = e2m1_encode8_bf16_s<R>(xb, ab, sc.s_b, sc.nan_b);
}

// Eight consecutive bf16 values (x0|x1, x2|x3, x4|x5, x6|x7) -> the encoder's pairs (xj | x(j+4)).
[[maybe_unused]] __device__ __forceinline__ void pair_j_j4(const uint4& w, uint32_t (&x)[4]) {
  x[0] = byte_perm(w.x, w.z, 0x5410u);
  x[1] = byte_perm(w.x, w.z, 0x7632u);
  x[2] = byte_perm(w.y, w.w, 0x5410u);
  x[3] = byte_perm(w.y, w.w, 0x7632u);
}
// Values v[i0 + j] and v[i0 + j + 4] rounded to bf16 (SPEC §5) as the encoder's pairs.
[[maybe_unused]] __device__ __forceinline__ void round_j_j4(const float (&v)[16], int i0, uint32_t (&x)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = round_pair_any_nan(v[i0 + j], v[i0 + j + 4], true);
}

// SPEC §0.2 canonical sum of the row whose lane holds the terms x[0..15] (its a and b values' terms): partials
// 2l, 2l+1 (x[0..7]) and 16+2l, 17+2l (x[8..15]); level 16 in-lane, levels 8, 4, 2 lanes l ^ 4, 2, 1, level 1
// in-lane. Every lane of the group gets the sum.
__device__ __forceinline__ float row_sum8(unsigned mask, const float (&x)[16]) {
  return group_sum<kGroupLanes>(
      mask, fadd(canonical_partial(x[0], x[1], x[2], x[3]), canonical_partial(x[8], x[9], x[10], x[11])),
      fadd(canonical_partial(x[4], x[5], x[6], x[7]), canonical_partial(x[12], x[13], x[14], x[15])));
}

// SPEC §7.2's two stages of the lane's a and b values (stage 1: rule recip, the fake-quant values rounded to
// bf16; stage 2: rule pack, codes by r): the lane's 4 + 4 packed bytes in ba and bb, and stage 2's exponents of
// the a block (bits 0..7) and of the b block (bits 16..23) returned.
// On bf16x2 words (NVIDIA sm_80+, two_stage_x8.h): xa / xb hold the lane's a / b values j and j + 4 a word
// (pair_j_j4, round_j_j4), bf16. A block outside the fast path's conditions takes the general form, uniformly
// over its 4 lanes (no shuffle inside).
[[maybe_unused]] __device__ __forceinline__ uint32_t two_stage_bf16x2(unsigned mask, const uint32_t (&xa)[4],
                                                                      const uint32_t (&xb)[4], Rounding r,
                                                                      uint32_t& ba, uint32_t& bb) {
  uint32_t aa[4], ab[4];
  const uint32_t m = block_abs_amax_bf16(mask, xa, xb, aa, ab);
  const TwoStageBf16x2 p = two_stage_params_bf16x2(m);
  ba = two_stage8_bf16_fast(xa, aa, p.inv_a, p.clamp_a, p.kr_a, p.thr_a, r);
  bb = two_stage8_bf16_fast(xb, ab, p.inv_b, p.clamp_b, p.kr_b, p.thr_b, r);
  uint32_t e2 = p.e2;
  if (!p.fast_a) {
    int e;
    ba = two_stage8_bf16(xa, aa, m & 0xFFFFu, r, e);
    e2 = (e2 & 0xFFFF0000u) | static_cast<uint32_t>(e);
  }
  if (!p.fast_b) {
    int e;
    bb = two_stage8_bf16(xb, ab, m >> 16, r, e);
    e2 = (e2 & 0xFFFFu) | (static_cast<uint32_t>(e) << 16);
  }
  return e2;
}
// On fp32 values v[0..15] (the a values, then the b values; stage 1 leaves its bf16 values in v).
__device__ __forceinline__ uint32_t two_stage_f32(unsigned mask, float (&v)[16], Rounding r, uint32_t& ba,
                                                  uint32_t& bb) {
  const int e1a = ue8m0_exponent(amax_lanes(mask, v, 0, 4), ScaleRule::recip);
  const int e1b = ue8m0_exponent(amax_lanes(mask, v, 1, 4), ScaleRule::recip);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = round_to_bf16(fp4_fake_quant_value_e(canon(v[i]), i < 8 ? e1a : e1b));
  const int e2a = ue8m0_exponent(amax_lanes(mask, v, 0, 4), ScaleRule::pack);
  const int e2b = ue8m0_exponent(amax_lanes(mask, v, 1, 4), ScaleRule::pack);
  auto encode = [&](auto rr) {   // the policy as a constant: one encoder per policy, no test per pair
    constexpr Rounding R = decltype(rr)::value;
    ba = bb = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      ba |= static_cast<uint32_t>(e2m1_encode_pair(canon(v[2 * i]), canon(v[2 * i + 1]), e2a, R)) << (8 * i);
      bb |= static_cast<uint32_t>(e2m1_encode_pair(canon(v[8 + 2 * i]), canon(v[9 + 2 * i]), e2b, R)) << (8 * i);
    }
  };
  if (r == Rounding::threshold) encode(std::integral_constant<Rounding, Rounding::threshold>{});
  else if (r == Rounding::rne) encode(std::integral_constant<Rounding, Rounding::rne>{});
  else encode(std::integral_constant<Rounding, Rounding::hardware>{});
  return static_cast<uint32_t>(e2a) | (static_cast<uint32_t>(e2b) << 16);
}

// The shared memory of q_heads' ring, in 16-byte units: the row slots ([slot][a / b][thread] uint4), then the
// per-head weights ([slot][group] float, Row::kHeadWeights), then the RoPE entries ([c0-3, c4-7, s0-3,
// s4-7][thread] float4, Row::kTableInSmem). kRingVec4: up to the RoPE entries; kQSmemVec4: all of it (0
// without a ring: Row::kStages < 2).
template <class Row>
constexpr int kRingVec4 = Row::kStages * (2 * 256 + (Row::kHeadWeights ? kGroups / 4 : 0));
template <class Row>
constexpr int kQSmemVec4 = Row::kStages >= 2 ? kRingVec4<Row> + (Row::kTableInSmem ? 4 * 256 : 0) : 0;

// ---- q rows: `ngroups` groups (a warp's 4, or a block's 32) share one token's heads ----------------
// Group g takes the heads h_begin + g, h_begin + g + ngroups, ... below h_end. The loop is the warp's:
// iteration i is the warp's 4 heads h_begin + (g & ~3) + i * ngroups + 0..3, run while the first is below
// h_end, so that every lane of the warp shuffles together (full-mask shuffles, no divergence checks); a
// group whose head is past h_end computes on a valid row (its loads are clamped) and stores nothing.
// Rows come either straight into registers (Row::kHeadsInFlight heads loaded, then processed), or, with
// Row::kStages >= 2 (CUDA), through a per-thread ring of kStages row slots in shared memory filled by
// cp.async: kStages - 1 heads are in flight while one is processed, and they hold no registers.
// NG > 0: ngroups is the compile-time NG (its loop steps are constants).
// Row: what is done to the rows of one token, constructed per token as Row(a, t, h_begin, g, lane) (the
// token's own loads go first there: its position, the indexer's slot):
//   Args                    the argument struct (its fields q_sh, q_vec, w, w_st, w_sh, w_dt, rope are read here)
//   kStages, kHeadsInFlight the two loading paths' sizes (above); kTableInSmem: the ring path keeps the RoPE
//                           entries in shared memory (read again per head) instead of registers
//   kRowBytes               a head's output bytes: head() gets its row at out_t + h * kRowBytes
//   kHeadWeights            the head's weight is loaded with its row (lane 0; through the ring on CUDA)
//   kWeightsAfter           weight(h, w) is called for every head after the heads, a head per thread
//   kNeox, kCdt             the RoPE pairs and the table's element type (rope_entries)
//   q_t, out_t              the token's q rows (a.q + t * a.q_st) and first output row
//   writes()                false: the token's rows are skipped (warp-uniform)
//   position()              the token's table row (SPEC §5, §7.5: clamped; an out-of-range one reported)
//   head(mask, lane, raw, c, s, h, w, act, out_h), weight(h, w): see below.
template <class Row, int NG>
__device__ __forceinline__ void q_heads(const typename Row::Args& a, int64_t t, int h_begin, int h_end, int g,
                                        int ngroups_rt, uint4* smem) {
  const int ngroups = NG > 0 ? NG : ngroups_rt;
  const int lane = threadIdx.x & 7;
  constexpr unsigned mask = 0xFFFFFFFFu;   // the whole warp runs every iteration (above)
  const int gw = g & 3, hw0 = h_begin + (g & ~3);   // group in warp; the warp's first head
  // The token's loads (Row's constructor) and the first heads' rows are issued together (none depends on
  // another): at small T this dependent-load chain is most of the call. Rows of a skipped token are read
  // and dropped (in bounds either way).
  const Row row(a, t, h_begin, g, lane);
  const uint16_t* q_t = row.q_t;
  constexpr int kRowBytes = Row::kRowBytes;   // a q row's output bytes
  const bool skip = !row.writes();             // q rows of a skipped token: not written (warp-uniform)
  // Row::kWeightsAfter: the token's weights_out are written by the whole team after its heads, a head per
  // thread; the first is loaded now (at small T its latency would otherwise come after the heads').
  const int hw_first = h_begin + g * kGroupLanes + lane;
  const float w_first =
      Row::kWeightsAfter && hw_first < h_end ? load_f(a.w, t * a.w_st + hw_first * a.w_sh, a.w_dt) : 0.0f;
  float c[8], s[8];
  // Head h from its raw row; w: its weight (Row::kHeadWeights: lane 0's); act: h < h_end (else nothing is
  // stored); out_h: the head's output row, row.out_t + h * Row::kRowBytes.
  auto head = [&](const Raw& raw, int h, float w, bool act, uint8_t* out_h) {
    row.head(mask, lane, raw, c, s, h, w, act, out_h);
  };
#if !defined(__HIP__)
  constexpr int kSlots = NG == 4 ? Row::kStages : 0;   // the ring pays at many heads per group (large T) only
  if constexpr (kSlots >= 2) {
    auto rows = reinterpret_cast<uint4(*)[2][256]>(smem);                        // [slot][a / b values][thread]
    auto wts = reinterpret_cast<float(*)[kGroups]>(smem + kSlots * 2 * 256);    // [slot][group] head weight
    const int tid = threadIdx.x, grp = tid >> 3;
    // The next iteration to stage: the warp's head hn (uniform), this group's row rn and weight index
    // wn, each advanced by a fixed step; a group past h_end stages the last head's row instead.
    int hn = hw0;
    const int hl = (hw0 + gw < h_end ? hw0 + gw : h_end - 1);
    const uint16_t* rn = q_t + hl * a.q_sh + 8 * lane;
    int64_t wn = t * a.w_st + hl * a.w_sh;
    const int64_t rstep = hw0 + gw < h_end ? ngroups * a.q_sh : 0, wstep = hw0 + gw < h_end ? ngroups * a.w_sh : 0;
    auto stage = [&](int sl) {   // iteration hn's row (and weight) into slot sl, then on to the next
      if (hn < h_end) {
        if (hn + gw >= h_end) {   // this group's head is past the end from here on: the last head's row
          rn = q_t + (h_end - 1) * a.q_sh + 8 * lane;
          wn = t * a.w_st + (h_end - 1) * a.w_sh;
        }
        if (a.q_vec) {
          cp_async16(&rows[sl][0][tid], rn);
          cp_async16(&rows[sl][1][tid], rn + 64);
        } else {
          rows[sl][0][tid] = load8_scalar(rn);
          rows[sl][1][tid] = load8_scalar(rn + 64);
        }
        if (Row::kHeadWeights && lane == 0) {
          if (a.w_dt == kF32)
            cp_async4(&wts[sl][grp], static_cast<const float*>(a.w) + wn);
          else
            wts[sl][grp] = load_f(a.w, wn, a.w_dt);
        }
      }
      cp_async_commit();   // one group per slot, empty or not: wait_group counts groups
      hn += ngroups;
      rn += rstep;
      wn += wstep;
    };
#pragma unroll
    for (int sl = 0; sl < kSlots - 1; ++sl) stage(sl);
    if (skip) {
      cp_async_wait<0>();   // nothing may land in the block's shared memory after it exits
      return;
    }
    rope_entries<Row::kNeox, Row::kCdt>(a.rope, row.position(), lane, c, s);
    // The RoPE entries wait in shared memory (each thread reads back only its own) and are read again in every
    // iteration: 4 shared-memory loads free 16 registers, with which the output addresses stay in registers
    // instead of being recomputed from t in every iteration.
    auto cs = reinterpret_cast<float4(*)[256]>(smem + kRingVec4<Row>);   // [c0-3, c4-7, s0-3, s4-7][thread]
    if constexpr (Row::kTableInSmem) {
      cs[0][tid] = make_float4(c[0], c[1], c[2], c[3]);
      cs[1][tid] = make_float4(c[4], c[5], c[6], c[7]);
      cs[2][tid] = make_float4(s[0], s[1], s[2], s[3]);
      cs[3][tid] = make_float4(s[4], s[5], s[6], s[7]);
    }
    // Iteration i reads slot i % kSlots (a mask for the default 4 slots) and refills slot (i - 1) % kSlots.
    unsigned it = 0;
    uint8_t* out_h = row.out_t + (hw0 + gw) * kRowBytes;
    for (int hw = hw0; hw < h_end; hw += ngroups, ++it) {
      cp_async_wait<kSlots - 2>();   // this iteration's group (the oldest) has landed
      const int sl = static_cast<int>(it % kSlots);
      const Raw raw{rows[sl][0][tid], rows[sl][1][tid]};
      if constexpr (Row::kTableInSmem) {
        const float4 c0 = cs[0][tid], c1 = cs[1][tid], s0 = cs[2][tid], s1 = cs[3][tid];
        c[0] = c0.x; c[1] = c0.y; c[2] = c0.z; c[3] = c0.w; c[4] = c1.x; c[5] = c1.y; c[6] = c1.z; c[7] = c1.w;
        s[0] = s0.x; s[1] = s0.y; s[2] = s0.z; s[3] = s0.w; s[4] = s1.x; s[5] = s1.y; s[6] = s1.z; s[7] = s1.w;
      }
      const float w = Row::kHeadWeights ? wts[sl][grp] : 0.0f;
      // Refill the slot read in the previous iteration: its values have been used (this thread's own
      // shared-memory reads are ordered before its later cp.async).
      stage(static_cast<int>((it + kSlots - 1) % kSlots));
      head(raw, hw + gw, w, hw + gw < h_end, out_h);
      out_h += ngroups * kRowBytes;   // carried: not recomputed from t in every iteration
    }
  } else
#endif
  {
    constexpr int kHeadsInFlight = Row::kHeadsInFlight;
    bool have_table = false;
    for (int hw = hw0; hw < h_end; hw += ngroups * kHeadsInFlight) {
      Raw raw[kHeadsInFlight];
      float w[kHeadsInFlight];
#pragma unroll
      for (int i = 0; i < kHeadsInFlight; ++i) {
        int h = hw + ngroups * i + gw;
        h = h < h_end ? h : h_end - 1;   // past the end: the last head's row (loaded, not stored)
        if (hw + ngroups * i < h_end) {
          raw[i] = load_raw(q_t + h * a.q_sh, lane, a.q_vec);
          w[i] = Row::kHeadWeights && lane == 0 ? load_f(a.w, t * a.w_st + h * a.w_sh, a.w_dt) : 0.0f;
        }
      }
      if (skip) return;
      if (!have_table) {   // after the first q loads are issued: their latency overlaps the table's
        rope_entries<Row::kNeox, Row::kCdt>(a.rope, row.position(), lane, c, s);
        have_table = true;
      }
#pragma unroll
      for (int i = 0; i < kHeadsInFlight; ++i) {
        const int h = hw + ngroups * i + gw;
        if (hw + ngroups * i >= h_end) break;   // warp-uniform
        head(raw[i], h, w[i], h < h_end, row.out_t + h * kRowBytes);
      }
    }
  }
  if (Row::kWeightsAfter && !skip && hw_first < h_end) {   // the weights (above), the rest after the heads
    row.weight(hw_first, w_first);
    for (int h = hw_first + ngroups * kGroupLanes; h < h_end; h += ngroups * kGroupLanes)
      row.weight(h, load_f(a.w, t * a.w_st + h * a.w_sh, a.w_dt));
  }
}

// One q block of a writer kernel (indexer.cu's q blocks, qpack.cu). Whole-token mode (chunks == 0): block b's warp w
// takes token 8b + w (its 4 groups share the token's heads); else block b takes `chunk_heads` heads of token
// b / chunks, one group per head (latency: a small call's heads spread over SMs). NVIDIA: a call site per mode, each
// with its team size fixed (H200: FP8 indexer 55 us against 60 us with one call site). AMD: one call site (two
// inlined copies spill SGPRs on gfx942); smem may be null there (q_heads reads it only through the CUDA ring).
template <class Row>
__device__ __forceinline__ void q_block(const typename Row::Args& a, int64_t b, int chunks, int chunk_heads,
                                        uint4* smem) {
#if !defined(__HIP__)
  if (chunks == 0) {
    const int64_t t = b * (kGroups / 4) + (threadIdx.x >> 5);
    if (t < a.T) q_heads<Row, 4>(a, t, 0, static_cast<int>(a.H), (threadIdx.x >> 3) & 3, 4, smem);
    return;
  }
#endif
  int64_t t;
  int h_begin = 0, h_end = static_cast<int>(a.H), g, ngroups;
  if (chunks == 0) {
    t = b * (kGroups / 4) + (threadIdx.x >> 5);
    g = (threadIdx.x >> 3) & 3;
    ngroups = 4;
  } else {
    // b < 2^31 (a block index): a 32-bit division (a 64-bit one is a call on the small-T critical path)
    const uint32_t ub = static_cast<uint32_t>(b), uc = static_cast<uint32_t>(chunks);
    t = ub / uc;
    h_begin = static_cast<int>(ub % uc) * chunk_heads;
    h_end = h_begin + chunk_heads < h_end ? h_begin + chunk_heads : h_end;
    g = threadIdx.x >> 3;
    ngroups = kGroups;
  }
#if defined(__HIP__)
  if (t < a.T) q_heads<Row, 0>(a, t, h_begin, h_end, g, ngroups, smem);
#else
  if (t < a.T) q_heads<Row, kGroups>(a, t, h_begin, h_end, g, ngroups, smem);
#endif
}

#if !defined(__HIP__)
// A kernel with a shared-memory row ring (4 blocks of 33-48 KB per SM) asks for the largest shared-memory
// carveout: once per kernel and device, and never during stream capture (it is not a stream operation).
template <auto Kernel>
void prefer_shared_memory(cudaStream_t stream) {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64 || (done.load(std::memory_order_relaxed) >> dev & 1)) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return;
  if (cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared) ==
      cudaSuccess)
    done.fetch_or(uint64_t{1} << dev);
}
#endif

}  // namespace
}  // namespace dsqk
