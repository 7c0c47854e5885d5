// kernels/cuda/indexer.cu: SPEC §7.1 indexer_qk_rope_quant_and_cache, FP8 and FP4 modes, one launch.
//
// Lanes ("split8" layout): an 8-lane group holds one 128-wide row; lane l holds the eight values
// x[8l .. 8l+7] ("a", all in the RoPE half, dims 0..63) and x[64+8l .. 64+8l+7] ("b"). So every lane
// takes part in RoPE (neox partners j, j+32 are 4 lanes apart; interleaved pairs are inside a lane), an
// FP4 block of 32 is the a's or the b's of 4 lanes, the FP8 row is the group, and the canonical sum's
// levels are: in-lane (partials i, i+16), lanes l ^ 4, l ^ 2, l ^ 1, in-lane (partials 2l, 2l+1).
// Eight values per lane (not four) halve the per-row work (scales, shuffles, stores, addresses) per value:
// faster on the H200 (dev/indexer_variants.sh builds and times such variants).
//
// Blocks of 256 threads (32 groups). The q blocks come first. At large T (whole-token mode) warp w of q
// block b takes token 8b + w: its 4 groups share the token's heads (H/4 each at most), so the per-token
// work (slot, position, RoPE entries, the division into tokens) is paid once per warp and token. At small
// T, block b takes 32 heads of token b / ceil(H/32), one head per group, so that a call's heads spread
// over several SMs (latency). q rows arrive either through registers (kHeadsInFlight heads loaded before
// any is processed: FP8, AMD, small T) or, for FP4 at large T on NVIDIA, through a per-thread cp.async ring
// in shared memory (kStages - 1 heads in flight, no registers held: q_heads), where the warp's RoPE entries
// also wait (read again per head: the 16 registers they free keep the output addresses in registers; H200:
// 51.2 -> 49.0 us at T=8192). The last ceil(T/32) blocks
// are k blocks, one k row per group; a k block shares the norm weights through shared memory, loaded with
// the rows (at small T the k row is the call's critical path). 1-D grid (no 65535 limit).
// Template parameters: MODE kModeFp8 = FP8, kModeFp4<r> = FP4 with rounding policy r (SPEC §2); IN_DT the
// q/k dtype; CDT the cos/sin table dtype; NEOX the RoPE style.
#include <atomic>

#include "indexer.h"

#include "row16.cuh"   // DType codes, scalar loads, rope_load, with_* dispatch; lanes.cuh (group_*)

namespace dsqk {
namespace {

// The kernel's MODE template parameter folds the FP8/FP4 choice and the FP4 rounding policy into one int.
constexpr int kModeFp8 = 0;
template <Rounding R>
constexpr int kModeFp4 = 1 + code(R);
template <int MODE>
constexpr Rounding mode_rounding = static_cast<Rounding>(MODE - 1);

// Tuning (the values below were the fastest on the H200, dev/indexer_variants.sh); macros so that a
// variant can be built for a comparison (tools/build_native.py DSAQUANT_NVCC_EXTRA).
#ifndef DSQ_INDEXER_HEADS_IN_FLIGHT_FP8   // q rows a group loads before processing them
#if defined(__HIP__)
#define DSQ_INDEXER_HEADS_IN_FLIGHT_FP8 1   // AMD: 2 spills SGPRs on gfx942 (not measured on AMD silicon)
#else
#define DSQ_INDEXER_HEADS_IN_FLIGHT_FP8 2   // H200: 54.8 us against 61.3 with 1
#endif
#endif
#ifndef DSQ_INDEXER_HEADS_IN_FLIGHT_FP4   // FP4 is bound by instruction issue, not by loads in flight
#define DSQ_INDEXER_HEADS_IN_FLIGHT_FP4 1
#endif
// Shared-memory row slots per thread for the q rows (CUDA; >= 2 turns the cp.async ring on, 0 loads into
// registers). HIP has no cp.async: always 0 there.
#if defined(__HIP__)
#undef DSQ_INDEXER_STAGES_FP8
#undef DSQ_INDEXER_STAGES_FP4
#define DSQ_INDEXER_STAGES_FP8 0
#define DSQ_INDEXER_STAGES_FP4 0
#endif
#ifndef DSQ_INDEXER_STAGES_FP8
#define DSQ_INDEXER_STAGES_FP8 0   // H200: 66-71 us with 3-6 slots against 60 from registers
#endif
#ifndef DSQ_INDEXER_STAGES_FP4
#define DSQ_INDEXER_STAGES_FP4 4   // H200: 57.4 us against 63.0 from registers
#endif
#ifndef DSQ_INDEXER_MIN_BLOCKS_FP8       // resident blocks per SM asked of the register allocator
#define DSQ_INDEXER_MIN_BLOCKS_FP8 4
#endif
#ifndef DSQ_INDEXER_MIN_BLOCKS_FP4
#define DSQ_INDEXER_MIN_BLOCKS_FP4 4
#endif
// T * ceil(H/32) from which a q warp takes a whole token (H200, H = 64: FP8 T=1024 12.07 us
// in chunks against 15.48 whole, T=2048 19.13 whole against 21.31; FP4 T=1024 11.62 whole against 11.93).
#ifndef DSQ_INDEXER_WHOLE_TOKEN_UNITS_FP8
#define DSQ_INDEXER_WHOLE_TOKEN_UNITS_FP8 4096
#endif
#ifndef DSQ_INDEXER_WHOLE_TOKEN_UNITS_FP4
#define DSQ_INDEXER_WHOLE_TOKEN_UNITS_FP4 2048
#endif
constexpr int kGroupLanes = 8;                 // lanes per row
constexpr int kGroups = 256 / kGroupLanes;     // rows per block
template <int MODE>
constexpr int kStages = MODE == kModeFp8 ? DSQ_INDEXER_STAGES_FP8 : DSQ_INDEXER_STAGES_FP4;
// The block's shared memory, in 16-byte units: a q block's row ring ([slot][a / b][thread] uint4, then the
// FP8 weights [slot][group] float, then the RoPE entries [c0-3, c4-7, s0-3, s4-7][thread] float4), or a
// k block's norm weights and biases (256 floats).
template <int MODE>
constexpr int kRingVec4 = kStages<MODE> * (2 * 256 + (MODE == kModeFp8 ? kGroups / 4 : 0));
#ifndef DSQ_INDEXER_TABLE_IN_SMEM   // ring path: the thread's RoPE entries in shared memory, not registers
#define DSQ_INDEXER_TABLE_IN_SMEM 1
#endif
constexpr bool kTableInSmem = DSQ_INDEXER_TABLE_IN_SMEM;
template <int MODE>
constexpr int kSmemVec4 = kStages<MODE> >= 2 ? kRingVec4<MODE> + (kTableInSmem ? 4 * 256 : 0) : 256 / 4;

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
// cp.async (sm_80+): 16 or 4 bytes from global into shared memory without passing through registers.
// Committed groups complete in order; cp_async_wait<N> returns when at most N are still in flight.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
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

// Values i..i+7 rounded to the input dtype (SPEC §7.1: after RoPE, after the norm). Only quantizers read
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

// The lane's RoPE table entries (SPEC §5, head RoPE on dims 0..63) at position p: neox: pairs
// j = 8(l&3) .. +7 (lane l < 4 holds their first elements, lane l+4 their second), in c/s[0..7], the
// sines negated on lanes 0..3 (see rope_a); interleaved: pairs 4l .. 4l+3, in c/s[0..3].
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

// SPEC §5 RoPE of the a values v[0..7] (dims 0..63), in fp32; callers round them to the input dtype
// (SPEC §7.1). neox: a' = fl(fl(a*c) - fl(b*s)) on lanes 0..3, b' = fl(fl(b*c) + fl(a*s)) on lanes 4..7,
// both as fl(fl(x*c) + fl(y*s')) with s' = -s on lanes 0..3 (rope_entries): fl(y*(-s)) = -fl(y*s) and
// x - y is x + (-y), exactly.
template <bool NEOX>
__device__ __forceinline__ void rope_a(unsigned mask, int lane, float (&v)[16], const float (&c)[8], const float (&s)[8]) {
  if (NEOX) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = fadd(fmul(v[i], c[i]), fmul(group_shfl_xor<kGroupLanes>(mask, v[i], 4), s[i]));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) rope_pair(v[2 * i], v[2 * i + 1], c[i], s[i]);
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
#if defined(DSQ_BF16X2_NATIVE)
constexpr bool kPackedFp4Native = true;
#else
constexpr bool kPackedFp4Native = false;
#endif
template <Rounding R>
__device__ __forceinline__ void fp4_quant_bf16(unsigned mask, const uint32_t (&xa)[4], const uint32_t (&xb)[4],
                                               uint32_t& bytes_a, uint32_t& bytes_b, int& e_a, int& e_b) {
  uint32_t aa[4], ab[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    aa[j] = bf16x2_abs(xa[j]);
    ab[j] = bf16x2_abs(xb[j]);
  }
  const uint32_t ma = bf16x2_max_nn(bf16x2_max_nn(aa[0], aa[1]), bf16x2_max_nn(aa[2], aa[3]));
  const uint32_t mb = bf16x2_max_nn(bf16x2_max_nn(ab[0], ab[1]), bf16x2_max_nn(ab[2], ab[3]));
  uint32_t m = bf16x2_max_nn(byte_perm(ma, mb, 0x5410u), byte_perm(ma, mb, 0x7632u));   // (a, b)
  m = bf16x2_max_nn(m, group_shfl_xor<kGroupLanes>(mask, m, 2));
  m = bf16x2_max_nn(bf16x2_max_nn(m, group_shfl_xor<kGroupLanes>(mask, m, 1)), 0u);   // an all-NaN block: 0
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
// Values v[i0 + j] and v[i0 + j + 4] rounded to bf16 (SPEC §7.1) as the encoder's pairs.
[[maybe_unused]] __device__ __forceinline__ void round_j_j4(const float (&v)[16], int i0, uint32_t (&x)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = round_pair_any_nan(v[i0 + j], v[i0 + j + 4], true);
}

// FP8 (SPEC §4): the row's scale and the lane's 8 + 8 codes (codes[0..1]: a, codes[2..3]: b).
template <Fp8Flavour FL>
__device__ __forceinline__ void fp8_encode16(const float (&v)[16], float inv, uint32_t (&codes)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = fp8_encode2(fmul(v[4 * i], inv), fmul(v[4 * i + 1], inv), FL);
    const uint32_t hi = fp8_encode2(fmul(v[4 * i + 2], inv), fmul(v[4 * i + 3], inv), FL);
    codes[i] = lo | (hi << 16);
  }
}
__device__ __forceinline__ float fp8_quant(unsigned mask, const float (&v)[16], Fp8Flavour fl, Fp8Role role, bool ue8m0,
                                           uint32_t (&codes)[4]) {
  const float s = fp8_row_scale(amax_lanes(mask, v, 2, 8), fl, role, ue8m0);
  const float inv = fp8_inv_scale(s);   // once per row (the flavour branch comes after it)
  if (fl == Fp8Flavour::e4m3fn)
    fp8_encode16<Fp8Flavour::e4m3fn>(v, inv, codes);
  else
    fp8_encode16<Fp8Flavour::e4m3fnuz>(v, inv, codes);
  return s;
}

// weights_out[t, h] in its dtype (fp32, or rounded to bf16/fp16); NaN weights: the canonical NaN.
__device__ __forceinline__ void store_weight(const IndexerArgs& a, int64_t t, int64_t h, float w) {
  const int64_t i = t * a.w_out_st + h * a.w_out_sh;
  if (a.w_out_dt == kF32)
    static_cast<float*>(a.w_out)[i] = canon_nan(w);
  else
    static_cast<uint16_t*>(a.w_out)[i] = to_half_bits(w, a.w_out_dt);
}

// ---- q rows: `ngroups` groups (a warp's 4, or a block's 32) share one token's heads ----------------
// Group g takes the heads h_begin + g, h_begin + g + ngroups, ... below h_end. The loop is the warp's:
// iteration i is the warp's 4 heads h_begin + (g & ~3) + i * ngroups + 0..3, run while the first is below
// h_end, so that every lane of the warp shuffles together (full-mask shuffles, no divergence checks); a
// group whose head is past h_end computes on a valid row (its loads are clamped) and stores nothing.
// Rows come either straight into registers (kHeadsInFlight heads loaded, then processed), or, with
// kStages >= 2 (CUDA), through a per-thread ring of kStages row slots in shared memory filled by
// cp.async: kStages - 1 heads are in flight while one is processed, and they hold no registers.
// NG > 0: ngroups is the compile-time NG (its loop steps are constants).
template <int MODE, int IN_DT, int CDT, bool NEOX, int NG>
__device__ __forceinline__ void q_heads(const IndexerArgs& a, int64_t t, int h_begin, int h_end, int g, int ngroups_rt,
                                        uint4* smem) {
  const int ngroups = NG > 0 ? NG : ngroups_rt;
  const int lane = threadIdx.x & 7;
  constexpr unsigned mask = 0xFFFFFFFFu;   // the whole warp runs every iteration (above)
  const int gw = g & 3, hw0 = h_begin + (g & ~3);   // group in warp; the warp's first head
  // The slot, the position and the first heads' rows are loaded together (none depends on another):
  // at small T this dependent-load chain is most of the call. Rows of a skipped token are read and
  // dropped (in bounds either way).
  const int64_t slot = load_i(a.slots, t, a.slots_dt);
  const int64_t pos_in = load_i(a.positions, t, a.pos_dt);     // flagged by the token's k row if out of range
  const uint16_t* q_t = static_cast<const uint16_t*>(a.q) + t * a.q_st;
  // The token's outputs: per-head offsets from these bases are 32-bit (a token's part is small).
  const int H = static_cast<int>(a.H);
  constexpr int kRowBytes = MODE == kModeFp8 ? 128 : 64;   // a q row's output bytes
  uint8_t* q_out_t = a.q_out + t * H * kRowBytes;
  const int qs_pad = static_cast<int>(aiter_q_scale_pad(H));
  // FP4 exponents: lane 0 of a group stores blocks 0 and 2, lane 4 blocks 1 and 3 (layouts.h: a block's
  // part plus a head's part); q_scale_l holds the token's base plus this lane's first block's part.
  const int blk = (lane >> 2) & 1, scale_2 = aiter_q_scale_group_part(2, qs_pad);
  uint8_t* q_scale_l =
      MODE == kModeFp8 ? nullptr : a.q_scale_out + aiter_q_scale_offset(t, 0, 0, H) + aiter_q_scale_group_part(blk, qs_pad);
  const bool skip = !a.compute_all && slot < 0;   // q rows of a skipped token: not written (warp-uniform)
  // FP4: weights_out = the weights, unchanged (SPEC §7.1), copied by the whole team, a head per thread; the
  // first is loaded now (at small T its latency would otherwise come after the heads').
  const int hw_first = h_begin + g * kGroupLanes + lane;
  const float w_first = MODE != kModeFp8 && hw_first < h_end ? load_f(a.w, t * a.w_st + hw_first * a.w_sh, a.w_dt) : 0.0f;
  float c[8], s[8];
  // Head h from its raw row; w: its weight (FP8, lane 0); act: h < h_end (else nothing is stored);
  // out_h: the head's output row, q_out_t + h * kRowBytes.
  auto head = [&](const Raw& raw, int h, float w, bool act, uint8_t* out_h) {
    float v[16];
    constexpr bool packed = MODE != kModeFp8 && IN_DT == kBF16 && kPackedFp4Native;
    unpack<IN_DT>(raw, v, packed ? 8 : 16);   // packed FP4: the b values stay bf16 pairs
    rope_a<NEOX>(mask, lane, v, c, s);
    if constexpr (!packed) round8<IN_DT>(v, 0);
    if constexpr (MODE == kModeFp8) {
      uint32_t codes[4];
      const float sc = fp8_quant(mask, v, static_cast<Fp8Flavour>(a.flavour), Fp8Role::q, a.ue8m0, codes);
      if (!act) return;
      uint2* out = reinterpret_cast<uint2*>(out_h);
      out[lane] = make_uint2(codes[0], codes[1]);
      out[8 + lane] = make_uint2(codes[2], codes[3]);
      if (lane == 0) store_weight(a, t, h, fmul(fmul(w, sc), a.weights_scale));
    } else {
      uint32_t ba, bb;
      int ea, eb;
      if constexpr (packed) {
        uint32_t xa[4], xb[4];
        round_j_j4(v, 0, xa);
        pair_j_j4(raw.b, xb);
        fp4_quant_bf16<mode_rounding<MODE>>(mask, xa, xb, ba, bb, ea, eb);
      } else {
        fp4_quant<mode_rounding<MODE>>(mask, v, ba, bb, ea, eb);
      }
      if (!act) return;
      uint32_t* out = reinterpret_cast<uint32_t*>(out_h);
      out[lane] = ba;
      out[8 + lane] = bb;
      if ((lane & 3) == 0) {   // lane 0: blocks 0 and 2; lane 4: blocks 1 and 3 (block 2 + blk: + scale_2)
        uint8_t* sp = q_scale_l + aiter_q_scale_head_part(h, qs_pad);
        sp[0] = static_cast<uint8_t>(ea);
        sp[scale_2] = static_cast<uint8_t>(eb);
        if (h < 16)   // pad entries h/16 >= H/16 of this (t, block, h % 16) are written 0
          for (int hp = H; hp < qs_pad * 16; hp += 16) {
            q_scale_l[aiter_q_scale_head_part(hp + h, qs_pad)] = 0;
            q_scale_l[aiter_q_scale_head_part(hp + h, qs_pad) + scale_2] = 0;
          }
      }
    }
  };
#if !defined(__HIP__)
  constexpr int kSlots = NG == 4 ? kStages<MODE> : 0;   // the ring pays at many heads per group (large T) only
  if constexpr (kSlots >= 2) {
    auto rows = reinterpret_cast<uint4(*)[2][256]>(smem);                        // [slot][a / b values][thread]
    auto wts = reinterpret_cast<float(*)[kGroups]>(smem + kSlots * 2 * 256);    // FP8: [slot][group] weight
    const int tid = threadIdx.x, grp = tid >> 3;
    // The next iteration to stage: the warp's head hn (uniform), this group's row rn and weight index
    // wn, each advanced by a fixed step; a group past h_end stages the last head's row instead.
    int hn = hw0;
    const int hl = (hw0 + gw < h_end ? hw0 + gw : h_end - 1);
    const uint16_t* rn = q_t + hl * a.q_sh + 8 * lane;
    int64_t wn = t * a.w_st + hl * a.w_sh;
    const int64_t rstep = hw0 + gw < h_end ? ngroups * a.q_sh : 0, wstep = hw0 + gw < h_end ? ngroups * a.w_sh : 0;
    auto stage = [&](int sl) {   // iteration hn's row (and FP8 weight) into slot sl, then on to the next
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
        if (MODE == kModeFp8 && lane == 0) {
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
    rope_entries<NEOX, CDT>(a.rope, rope_position(pos_in, a.rope.max_pos, 1), lane, c, s);
    // The RoPE entries wait in shared memory (each thread reads back only its own) and are read again in every
    // iteration: 4 shared-memory loads free 16 registers, with which the output addresses stay in registers
    // instead of being recomputed from t in every iteration.
    auto cs = reinterpret_cast<float4(*)[256]>(smem + kRingVec4<MODE>);   // [c0-3, c4-7, s0-3, s4-7][thread]
    if constexpr (kTableInSmem) {
      cs[0][tid] = make_float4(c[0], c[1], c[2], c[3]);
      cs[1][tid] = make_float4(c[4], c[5], c[6], c[7]);
      cs[2][tid] = make_float4(s[0], s[1], s[2], s[3]);
      cs[3][tid] = make_float4(s[4], s[5], s[6], s[7]);
    }
    // Iteration i reads slot i % kSlots (a mask for the default 4 slots) and refills slot (i - 1) % kSlots.
    unsigned it = 0;
    uint8_t* out_h = q_out_t + (hw0 + gw) * kRowBytes;
    for (int hw = hw0; hw < h_end; hw += ngroups, ++it) {
      cp_async_wait<kSlots - 2>();   // this iteration's group (the oldest) has landed
      const int sl = static_cast<int>(it % kSlots);
      const Raw raw{rows[sl][0][tid], rows[sl][1][tid]};
      if constexpr (kTableInSmem) {
        const float4 c0 = cs[0][tid], c1 = cs[1][tid], s0 = cs[2][tid], s1 = cs[3][tid];
        c[0] = c0.x; c[1] = c0.y; c[2] = c0.z; c[3] = c0.w; c[4] = c1.x; c[5] = c1.y; c[6] = c1.z; c[7] = c1.w;
        s[0] = s0.x; s[1] = s0.y; s[2] = s0.z; s[3] = s0.w; s[4] = s1.x; s[5] = s1.y; s[6] = s1.z; s[7] = s1.w;
      }
      const float w = MODE == kModeFp8 ? wts[sl][grp] : 0.0f;
      // Refill the slot read in the previous iteration: its values have been used (this thread's own
      // shared-memory reads are ordered before its later cp.async).
      stage(static_cast<int>((it + kSlots - 1) % kSlots));
      head(raw, hw + gw, w, hw + gw < h_end, out_h);
      out_h += ngroups * kRowBytes;   // carried: not recomputed from t in every iteration
    }
  } else
#endif
  {
    constexpr int kHeadsInFlight = MODE == kModeFp8 ? DSQ_INDEXER_HEADS_IN_FLIGHT_FP8 : DSQ_INDEXER_HEADS_IN_FLIGHT_FP4;
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
          w[i] = MODE == kModeFp8 && lane == 0 ? load_f(a.w, t * a.w_st + h * a.w_sh, a.w_dt) : 0.0f;
        }
      }
      if (skip) return;
      if (!have_table) {   // after the first q loads are issued: their latency overlaps the table's
        rope_entries<NEOX, CDT>(a.rope, rope_position(pos_in, a.rope.max_pos, 1), lane, c, s);
        have_table = true;
      }
#pragma unroll
      for (int i = 0; i < kHeadsInFlight; ++i) {
        const int h = hw + ngroups * i + gw;
        if (hw + ngroups * i >= h_end) break;   // warp-uniform
        head(raw[i], h, w[i], h < h_end, q_out_t + h * kRowBytes);
      }
    }
  }
  if (MODE != kModeFp8 && !skip && hw_first < h_end) {   // FP4: the weights (above), the rest after the heads
    store_weight(a, t, hw_first, w_first);
    for (int h = hw_first + ngroups * kGroupLanes; h < h_end; h += ngroups * kGroupLanes)
      store_weight(a, t, h, load_f(a.w, t * a.w_st + h * a.w_sh, a.w_dt));
  }
}

// ---- k blocks: one k row per group ----------------------------------------------------------------
// Every thread of the block calls it (a barrier inside); a row t_in >= T loads row T - 1 and writes nothing.
// norm: the block's shared memory for the norm weights and biases (256 floats).
template <int MODE, int IN_DT, int CDT, bool NEOX>
__device__ __forceinline__ void k_row(const IndexerArgs& a, int64_t t_in, float* norm) {
  const bool valid = t_in < a.T;
  const int64_t t = valid ? t_in : a.T - 1;
  const int lane = threadIdx.x & 7;
  const unsigned mask = group_mask<kGroupLanes>();
  // The loads that do not depend on another are issued first (small T: the call is this chain).
  const int64_t slot = load_i(a.slots, t, a.slots_dt);
  const int64_t pos_in = load_i(a.positions, t, a.pos_dt);
  const Raw raw = load_raw(static_cast<const uint16_t*>(a.k) + t * a.k_st, lane, a.k_vec);
  // The norm weights and biases (any dtype) as fp32, one per thread, loaded with the rows: the barrier
  // comes before any group leaves. The RoPE entries are loaded before the slot checks, so that their
  // latency (after the position's) overlaps the barrier and the LayerNorm.
  const int i = threadIdx.x;
  const float nv = i < 128 ? load_f(a.norm_w, i, a.norm_w_dt) : load_f(a.norm_b, i - 128, a.norm_b_dt);
  float c[8], s[8];
  rope_entries<NEOX, CDT>(a.rope, rope_position(pos_in, a.rope.max_pos, 1), lane, c, s);
  norm[i] = nv;
  __syncthreads();
  if (!valid) return;
  // SPEC §7.5: an out-of-range position is clamped and reported (once per token: here).
  if (lane == 0 && (pos_in < 0 || pos_in >= a.rope.max_pos)) atomicOr(a.err_flag, code(ErrFlag::position_out_of_range));
  if (slot < 0) return;
  if (slot >= a.num_blocks * a.P) {
    if (lane == 0) atomicOr(a.err_flag, code(ErrFlag::slot_out_of_range));
    return;
  }
  const SlotPos sp = slot_pos(slot, a.P);   // the slot's page and place, once (it overlaps the LayerNorm)
  float v[16];
  unpack<IN_DT>(raw, v);
  // LayerNorm (SPEC §5): mean = S(x)/128, d = x - mean, var = S(d*d)/128, y = fl(fl(d*inv)*w) + b,
  // rounded to the input dtype. S is the canonical sum: lane l holds partials 2l, 2l+1 (a) and
  // 16+2l, 17+2l (b); level 16 is in-lane, levels 8, 4, 2 are lanes l ^ 4, 2, 1, level 1 in-lane.
  auto row_sum = [&](const float (&x)[16]) {
    return group_sum<kGroupLanes>(
        mask, fadd(canonical_partial(x[0], x[1], x[2], x[3]), canonical_partial(x[8], x[9], x[10], x[11])),
        fadd(canonical_partial(x[4], x[5], x[6], x[7]), canonical_partial(x[12], x[13], x[14], x[15])));
  };
  const float mean = div128(row_sum(v));   // S / 128 without a division (rope.h)
  float d2[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = fsub(v[i], mean);
    d2[i] = fmul(v[i], v[i]);
  }
  const float inv = inv_sqrt_eps(div128(row_sum(d2)), a.eps);
#pragma unroll
  for (int q = 0; q < 4; ++q) {   // values 4q .. 4q+3: dims (q < 2 ? 0 : 64) + 8 lane + 4 (q & 1) + 0..3
    const int d4 = ((q < 2 ? 0 : 64) + 8 * lane + 4 * (q & 1)) / 4;
    const float4 w = reinterpret_cast<const float4*>(norm)[d4], b = reinterpret_cast<const float4*>(norm)[32 + d4];
    v[4 * q] = layer_norm_apply(v[4 * q], inv, w.x, b.x);
    v[4 * q + 1] = layer_norm_apply(v[4 * q + 1], inv, w.y, b.y);
    v[4 * q + 2] = layer_norm_apply(v[4 * q + 2], inv, w.z, b.z);
    v[4 * q + 3] = layer_norm_apply(v[4 * q + 3], inv, w.w, b.w);
  }
  round8<IN_DT>(v, 0);
  round8<IN_DT>(v, 8);
  rope_a<NEOX>(mask, lane, v, c, s);
  constexpr bool packed = MODE != kModeFp8 && IN_DT == kBF16 && kPackedFp4Native;
  if constexpr (!packed) round8<IN_DT>(v, 0);
  if constexpr (MODE == kModeFp8) {
    uint32_t codes[4];
    const float sc = fp8_quant(mask, v, static_cast<Fp8Flavour>(a.flavour), Fp8Role::k, a.ue8m0, codes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {   // 4-byte stores: a page's base is only 4-byte aligned for odd P
      uint32_t* d = reinterpret_cast<uint32_t*>(a.kv_cache + fp8_132_data_offset_at(sp, a.P, 64 * h + 8 * lane, a.preshuffle));
      d[0] = codes[2 * h];
      d[1] = codes[2 * h + 1];
    }
    if (lane == 0) *reinterpret_cast<float*>(a.kv_cache + fp8_132_scale_offset_at(sp, a.P)) = sc;
  } else {
    uint32_t ba, bb;
    int ea, eb;
    if constexpr (packed) {
      uint32_t xa[4], xb[4];
      round_j_j4(v, 0, xa);   // the RoPE'd values' rounding
      round_j_j4(v, 8, xb);   // exact (rounded after the norm)
      fp4_quant_bf16<mode_rounding<MODE>>(mask, xa, xb, ba, bb, ea, eb);
    } else {
      fp4_quant<mode_rounding<MODE>>(mask, v, ba, bb, ea, eb);
    }
    *reinterpret_cast<uint32_t*>(a.kv_cache + aiter_fp4_data_offset_at(sp, a.P, 4 * lane)) = ba;
    *reinterpret_cast<uint32_t*>(a.kv_cache + aiter_fp4_data_offset_at(sp, a.P, 32 + 4 * lane)) = bb;
    if ((lane & 3) == 0) {
      const int blk = lane >> 2;
      a.kv_scale[aiter_fp4_scale_offset_at(sp, a.P, blk)] = static_cast<uint8_t>(ea);
      a.kv_scale[aiter_fp4_scale_offset_at(sp, a.P, 2 + blk)] = static_cast<uint8_t>(eb);
    }
  }
}

// q blocks and k blocks. Whole-token mode (chunks == 0): block b's warp w takes token 8b + w (its 4
// groups share the token's heads); else block b takes `chunk_heads` heads of token b / chunks, one group
// per head (latency: a small call's heads spread over SMs).
template <int MODE, int IN_DT, int CDT, bool NEOX>
__global__ void __launch_bounds__(256, MODE == kModeFp8 ? DSQ_INDEXER_MIN_BLOCKS_FP8 : DSQ_INDEXER_MIN_BLOCKS_FP4)
    indexer_kernel(IndexerArgs a, int64_t nk_first, int64_t nq, int chunks, int chunk_heads) {
  __shared__ uint4 smem[kSmemVec4<MODE>];
  // Blocks [0, nk_first) are k blocks, then nq q blocks, then the other k blocks (host: below).
  const int64_t b = static_cast<int64_t>(blockIdx.x) - nk_first;
  if (b >= 0 && b < nq) {
#if !defined(__HIP__)
    // NVIDIA: a call site per mode, each with its team size fixed (H200: FP8 55 us against
    // 60 us with one call site). AMD: one call site (two inlined copies spill SGPRs on gfx942).
    if (chunks == 0) {
      const int64_t t = b * (kGroups / 4) + (threadIdx.x >> 5);
      if (t < a.T) q_heads<MODE, IN_DT, CDT, NEOX, 4>(a, t, 0, static_cast<int>(a.H), (threadIdx.x >> 3) & 3, 4, smem);
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
    if (t < a.T) q_heads<MODE, IN_DT, CDT, NEOX, 0>(a, t, h_begin, h_end, g, ngroups, smem);
#else
    if (t < a.T) q_heads<MODE, IN_DT, CDT, NEOX, kGroups>(a, t, h_begin, h_end, g, ngroups, smem);
#endif
  } else {
    k_row<MODE, IN_DT, CDT, NEOX>(a, (b < 0 ? b + nk_first : b - nq) * kGroups + (threadIdx.x >> 3),
                                  reinterpret_cast<float*>(smem));
  }
}

template <class F>
void with_mode(const IndexerArgs& a, F&& f) {   // FP8, or FP4 with its rounding policy
  if (!a.fp4) f(IC<kModeFp8>{});
  else if (a.rounding == code(Rounding::threshold)) f(IC<kModeFp4<Rounding::threshold>>{});
  else if (a.rounding == code(Rounding::rne)) f(IC<kModeFp4<Rounding::rne>>{});
  else f(IC<kModeFp4<Rounding::hardware>>{});
}

#if !defined(__HIP__)
// A kernel with the shared-memory row ring (4 blocks of ~33 KB per SM) asks for the largest shared-memory
// carveout: once per kernel and device, and never during stream capture (it is not a stream operation).
template <int MODE, int IN_DT, int CDT, bool NEOX>
void prefer_shared_memory(cudaStream_t stream) {
  if (kStages<MODE> < 2) return;
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64 || (done.load(std::memory_order_relaxed) >> dev & 1)) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return;
  if (cudaFuncSetAttribute(indexer_kernel<MODE, IN_DT, CDT, NEOX>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) == cudaSuccess)
    done.fetch_or(uint64_t{1} << dev);
}
#endif

}  // namespace
}  // namespace dsqk

int dsq_indexer_launch(const IndexerArgs& a, cudaStream_t stream) {
  if (a.T == 0) return 0;
  using namespace dsqk;
  // q work units: 32 heads of a token (one per group). Many units: a warp takes a whole token (its
  // per-token work is shared by H/4 heads per group); few: one unit per block, so that a small call's
  // heads spread over several SMs.
  const int64_t units = (a.H + kGroups - 1) / kGroups;
  const bool whole = a.T * units >= (a.fp4 ? DSQ_INDEXER_WHOLE_TOKEN_UNITS_FP4 : DSQ_INDEXER_WHOLE_TOKEN_UNITS_FP8);
  const int64_t tokens_per_block = kGroups / 4;
  const int64_t nq = whole ? (a.T + tokens_per_block - 1) / tokens_per_block : a.T * units;
  const int chunks = whole ? 0 : static_cast<int>(units);
  const int64_t nk = (a.T + kGroups - 1) / kGroups;
  const int64_t blocks = nq + nk;
  // Small T: the k blocks first (the k row is the call's longer chain: its blocks start first); large T:
  // last (short blocks fill the tail).
  const int64_t nk_first = whole ? 0 : nk;
  with_mode(a, [&](auto mode) {
    with_half(a.in_dt, [&](auto in_dt) {
      with_float(a.rope.dtype, [&](auto cdt) {
        with_bool(a.neox, [&](auto neox) {
          constexpr int M = decltype(mode)::value, D = decltype(in_dt)::value, C = decltype(cdt)::value;
          constexpr bool N = decltype(neox)::value;
#if !defined(__HIP__)
          prefer_shared_memory<M, D, C, N>(stream);
#endif
          indexer_kernel<M, D, C, N><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a, nk_first, nq, chunks, kGroups);
        });
      });
    });
  });
  return static_cast<int>(cudaGetLastError());
}
