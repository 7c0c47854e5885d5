// kernels/cuda/indexer.cu: SPEC §7.1 indexer_qk_rope_quant_and_cache, FP8 and FP4 modes, one launch.
//
// Lanes ("split" layout): a 16-lane group holds one 128-wide row; lane l holds the four values
// x[4l .. 4l+3] ("a", all in the RoPE half, dims 0..63) and x[64+4l .. 64+4l+3] ("b"). So every lane
// takes part in RoPE (neox partners j, j+32 are 8 lanes apart; interleaved pairs are inside a lane), an
// FP4 block of 32 is the a's or the b's of 8 lanes, and the first level of the canonical sum (partial i
// plus partial i+16) is inside a lane.
//
// Blocks of 256 threads (16 groups). The first T blocks are q blocks, one per token: group g takes the
// heads g, g+16, g+32, ..., so the token's slot, position and RoPE table entries are loaded once per
// group, and the loads of up to kHeadsInFlight heads are issued before any of them is processed. The
// last ceil(T/16) blocks are k blocks, one k row per group. 1-D grid (no 65535 limit).
// Template parameters: MODE 0 = FP8; 1, 2, 3 = FP4 with rounding policy MODE-1 (SPEC §2); IN_DT the
// q/k dtype; CDT the cos/sin table dtype; NEOX the RoPE style.
#include "indexer.h"
#include "row16.cuh"   // DType codes, scalar loads, rope_load, group_mask/shuffles, with_* dispatch

namespace dsqk {
namespace {

// Tuning (measured on the H200: benchmarks/results/h200-2026-11-29/NOTES.md); macros so that a
// variant can be built for a comparison (tools/build_native.py DSAQUANT_NVCC_EXTRA).
#ifndef DSQ_INDEXER_HEADS_IN_FLIGHT
#define DSQ_INDEXER_HEADS_IN_FLIGHT 4
#endif
#ifndef DSQ_INDEXER_MIN_BLOCKS
#define DSQ_INDEXER_MIN_BLOCKS 3
#endif
constexpr int kHeadsInFlight = DSQ_INDEXER_HEADS_IN_FLIGHT;

// Four consecutive 16-bit values at p (vector load when `vec`: p is then 8-byte aligned).
__device__ __forceinline__ uint2 load4(const uint16_t* p, bool vec) {
  if (vec) return *reinterpret_cast<const uint2*>(p);
  return make_uint2(p[0] | (static_cast<uint32_t>(p[1]) << 16), p[2] | (static_cast<uint32_t>(p[3]) << 16));
}

template <int DT>
__device__ __forceinline__ float half_to_f32(uint32_t h) {
  return DT == kBF16 ? bf16_to_f32(static_cast<uint16_t>(h)) : fp16_to_f32(static_cast<uint16_t>(h));
}

// A row's raw 16-bit values for this lane: a = x[4l..4l+3], b = x[64+4l..64+4l+3].
struct Raw {
  uint2 a, b;
};
__device__ __forceinline__ Raw load_raw(const uint16_t* row, int lane, bool vec) {
  return Raw{load4(row + 4 * lane, vec), load4(row + 64 + 4 * lane, vec)};
}
template <int DT>
__device__ __forceinline__ void unpack(const Raw& r, float (&v)[8]) {
  const uint32_t w[4] = {r.a.x, r.a.y, r.b.x, r.b.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = half_to_f32<DT>(w[i] & 0xFFFFu);
    v[2 * i + 1] = half_to_f32<DT>(w[i] >> 16);
  }
}

// The lane's RoPE table entries (SPEC §5, head RoPE on dims 0..63) at position p: neox: pairs
// j = 4(l&7) .. +3 (lane l < 8 holds their first elements, lane l+8 their second); interleaved: pairs
// 2l and 2l+1, in c[0..1] / s[0..1].
template <bool NEOX, int CDT>
__device__ __forceinline__ void rope_entries(const RopeArgs& tab, int64_t p, int lane, float (&c)[4], float (&s)[4]) {
  if (NEOX) {
    rope_load<4, CDT>(tab, p, 4 * (lane & 7), c, s);
  } else {
    float c4[4], s4[4];
    rope_load<4, CDT>(tab, p, 4 * (lane >> 1), c4, s4);
    const bool hi = lane & 1;
    c[0] = hi ? c4[2] : c4[0];
    c[1] = hi ? c4[3] : c4[1];
    s[0] = hi ? s4[2] : s4[0];
    s[1] = hi ? s4[3] : s4[1];
    c[2] = c[3] = s[2] = s[3] = 0.0f;
  }
}

// SPEC §5 RoPE of the a values (dims 0..63), then the rounding to the input dtype (SPEC §7.1).
// neox: a' = fl(fl(a*c) - fl(b*s)) on lanes 0..7, b' = fl(fl(b*c) + fl(a*s)) on lanes 8..15 (x - y is
// x + (-y) exactly, so both are one add of the two products).
template <bool NEOX, int IN_DT>
__device__ __forceinline__ void rope_a(unsigned mask, int lane, float (&v)[8], const float (&c)[4], const float (&s)[4]) {
  if (NEOX) {
    const bool first = lane < 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float other = shfl_xor16(mask, v[i], 8);
      const float t = fmul(other, s[i]);
      v[i] = fadd(fmul(v[i], c[i]), first ? -t : t);
    }
  } else {
    rope_pair(v[0], v[1], c[0], s[0]);
    rope_pair(v[2], v[3], c[1], s[1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = round_to<IN_DT>(v[i]);
}

// NaN-ignoring max |x| of the lane's a values (h = 0) or b values (h = 1), then over `lanes` lanes.
__device__ __forceinline__ float amax4(unsigned mask, const float (&v)[8], int h, int lanes) {
  float m = fmax_nn(fmax_nn(abs_f(v[4 * h]), abs_f(v[4 * h + 1])), fmax_nn(abs_f(v[4 * h + 2]), abs_f(v[4 * h + 3])));
  m = fmax_nn(m, 0.0f);   // an all-NaN lane contributes 0 (SPEC §0.3)
  for (int s = lanes >> 1; s >= 1; s >>= 1) m = fmax_nn(m, shfl_xor16(mask, m, s));
  return m;
}

// FP4 (SPEC §2-§3, rule recip): the two blocks this lane takes part in (a: block lane/8, b: block
// 2 + lane/8), their exponents and the lane's 2 + 2 packed bytes.
template <Rounding R>
__device__ __forceinline__ void fp4_quant(unsigned mask, const float (&v)[8], uint32_t& bytes_a, uint32_t& bytes_b,
                                          int& e_a, int& e_b) {
  e_a = ue8m0_exponent(amax4(mask, v, 0, 8), ScaleRule::recip);
  e_b = ue8m0_exponent(amax4(mask, v, 1, 8), ScaleRule::recip);
  // A NaN input counts as the canonical (positive) NaN; only `hardware` reads a NaN's sign, and under
  // threshold/rne a NaN gives 0x7 either way (e2m1.h), so only hardware pays for the canonicalisation.
  auto in = [&](int i) { return R == Rounding::hardware ? canon(v[i]) : v[i]; };
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int e = h ? e_b : e_a;
    w[h] = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i)
      w[h] |= static_cast<uint32_t>(e2m1_encode_pair(in(4 * h + 2 * i), in(4 * h + 2 * i + 1), e, R)) << (8 * i);
  }
  bytes_a = w[0];
  bytes_b = w[1];
}

// FP8 (SPEC §4): the row's scale and the lane's 4 + 4 codes.
__device__ __forceinline__ float fp8_quant(unsigned mask, const float (&v)[8], Fp8Flavour fl, Fp8Role role, bool ue8m0,
                                           uint32_t& codes_a, uint32_t& codes_b) {
  const float amax = fmax_nn(amax4(mask, v, 0, 1), amax4(mask, v, 1, 1));
  float m = amax;
#pragma unroll
  for (int s = 8; s >= 1; s >>= 1) m = fmax_nn(m, shfl_xor16(mask, m, s));
  const float s = fp8_row_scale(m, fl, role, ue8m0);
  const float inv = fp8_inv_scale(s);
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] = fp8_encode2(fmul(v[2 * i], inv), fmul(v[2 * i + 1], inv), fl);
  codes_a = c[0] | (c[1] << 16);
  codes_b = c[2] | (c[3] << 16);
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

// ---- q blocks: one token, 16 groups over its heads -------------------------------------------------
template <int MODE, int IN_DT, int CDT, bool NEOX>
__device__ __forceinline__ void q_token(const IndexerArgs& a, int64_t t) {
  const int lane = threadIdx.x & 15, g = threadIdx.x >> 4;
  const unsigned mask = group_mask();
  // The slot, the position and the first heads' rows are loaded together (none depends on another):
  // at small T this dependent-load chain is most of the call. Rows of a skipped token are read and
  // dropped (in bounds either way).
  const int64_t slot = load_i(a.slots, t, a.slots_dt);
  const int64_t pos_in = load_i(a.positions, t, a.pos_dt);     // flagged by the token's k row if out of range
  const uint16_t* q_t = static_cast<const uint16_t*>(a.q) + t * a.q_st;
  const int64_t H = a.H;
  for (int64_t h0 = g; h0 < H; h0 += 16 * kHeadsInFlight) {
    Raw raw[kHeadsInFlight];
    float w[kHeadsInFlight];
#pragma unroll
    for (int i = 0; i < kHeadsInFlight; ++i) {
      const int64_t h = h0 + 16 * i;
      if (h < H) {
        raw[i] = load_raw(q_t + h * a.q_sh, lane, a.q_vec);
        w[i] = lane == 0 ? load_f(a.w, t * a.w_st + h * a.w_sh, a.w_dt) : 0.0f;
      }
    }
    if (!a.compute_all && slot < 0) return;                    // q rows of a skipped token: not written
    float c[4], s[4];   // after the q loads are issued: their latency overlaps the table's
    rope_entries<NEOX, CDT>(a.rope, rope_position(pos_in, a.rope.max_pos, 1), lane, c, s);
#pragma unroll
    for (int i = 0; i < kHeadsInFlight; ++i) {
      const int64_t h = h0 + 16 * i;
      if (h >= H) break;
      const int64_t row = t * H + h;
      float v[8];
      unpack<IN_DT>(raw[i], v);
      rope_a<NEOX, IN_DT>(mask, lane, v, c, s);
      if constexpr (MODE == 0) {
        uint32_t ca, cb;
        const float sc = fp8_quant(mask, v, static_cast<Fp8Flavour>(a.flavour), Fp8Role::q, a.ue8m0, ca, cb);
        uint32_t* out = reinterpret_cast<uint32_t*>(a.q_out + row * 128);
        out[lane] = ca;
        out[16 + lane] = cb;
        if (lane == 0) store_weight(a, t, h, fmul(fmul(w[i], sc), a.weights_scale));
      } else {
        uint32_t ba, bb;
        int ea, eb;
        fp4_quant<static_cast<Rounding>(MODE - 1)>(mask, v, ba, bb, ea, eb);
        uint16_t* out = reinterpret_cast<uint16_t*>(a.q_out + row * 64);
        out[lane] = static_cast<uint16_t>(ba);
        out[16 + lane] = static_cast<uint16_t>(bb);
        if ((lane & 7) == 0) {   // lane 0: blocks 0 and 2; lane 8: blocks 1 and 3
          const int blk = lane >> 3;
          a.q_scale_out[aiter_q_scale_offset(t, h, blk, H)] = static_cast<uint8_t>(ea);
          a.q_scale_out[aiter_q_scale_offset(t, h, 2 + blk, H)] = static_cast<uint8_t>(eb);
          if (h < 16)   // pad entries h/16 >= H/16 of this (t, block, h % 16) are written 0
            for (int64_t hp = H; hp < aiter_q_scale_pad(H) * 16; hp += 16) {
              a.q_scale_out[aiter_q_scale_offset(t, hp + h, blk, H)] = 0;
              a.q_scale_out[aiter_q_scale_offset(t, hp + h, 2 + blk, H)] = 0;
            }
        }
        if (lane == 0) store_weight(a, t, h, w[i]);
      }
    }
  }
}

// ---- k blocks: one k row per group ----------------------------------------------------------------
template <int MODE, int IN_DT, int CDT, bool NEOX>
__device__ __forceinline__ void k_row(const IndexerArgs& a, int64_t t) {
  const int lane = threadIdx.x & 15;
  const unsigned mask = group_mask();
  const int64_t slot = load_i(a.slots, t, a.slots_dt);
  const int64_t pos_in = load_i(a.positions, t, a.pos_dt);
  // SPEC §7.5: an out-of-range position is clamped and reported (once per token: here).
  if (lane == 0 && (pos_in < 0 || pos_in >= a.rope.max_pos)) atomicOr(a.err_flag, 2);
  if (slot < 0) return;
  if (slot >= a.num_blocks * a.P) {
    if (lane == 0) atomicOr(a.err_flag, 1);
    return;
  }
  float v[8];
  unpack<IN_DT>(load_raw(static_cast<const uint16_t*>(a.k) + t * a.k_st, lane, a.k_vec), v);
  float c[4], s[4];
  rope_entries<NEOX, CDT>(a.rope, rope_position(pos_in, a.rope.max_pos, 1), lane, c, s);
  // LayerNorm (SPEC §5): mean = S(x)/128, d = x - mean, var = S(d*d)/128, y = fl(fl(d*inv)*w) + b,
  // rounded to the input dtype. S is the canonical sum: partial l (a) plus partial 16+l (b), then
  // the butterfly over lanes l ^ 8, 4, 2, 1.
  auto row_sum = [&](const float (&x)[8]) {
    float p = fadd(canonical_partial(x[0], x[1], x[2], x[3]), canonical_partial(x[4], x[5], x[6], x[7]));
#pragma unroll
    for (int sh = 8; sh >= 1; sh >>= 1) p = fadd(p, shfl_xor16(mask, p, sh));
    return p;
  };
  const float mean = fdiv(row_sum(v), 128.0f);
  float d2[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = fsub(v[i], mean);
    d2[i] = fmul(v[i], v[i]);
  }
  const float inv = inv_sqrt_eps(fdiv(row_sum(d2), 128.0f), a.eps);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int dim = (i < 4 ? 0 : 64) + 4 * lane + (i & 3);
    v[i] = round_to<IN_DT>(layer_norm_apply(v[i], inv, load_f(a.norm_w, dim, a.norm_w_dt), load_f(a.norm_b, dim, a.norm_b_dt)));
  }
  rope_a<NEOX, IN_DT>(mask, lane, v, c, s);
  if constexpr (MODE == 0) {
    uint32_t ca, cb;
    const float sc = fp8_quant(mask, v, static_cast<Fp8Flavour>(a.flavour), Fp8Role::k, a.ue8m0, ca, cb);
    *reinterpret_cast<uint32_t*>(a.kv_cache + fp8_132_data_offset(slot, a.P, 4 * lane, a.preshuffle)) = ca;
    *reinterpret_cast<uint32_t*>(a.kv_cache + fp8_132_data_offset(slot, a.P, 64 + 4 * lane, a.preshuffle)) = cb;
    if (lane == 0) *reinterpret_cast<float*>(a.kv_cache + fp8_132_scale_offset(slot, a.P)) = sc;
  } else {
    uint32_t ba, bb;
    int ea, eb;
    fp4_quant<static_cast<Rounding>(MODE - 1)>(mask, v, ba, bb, ea, eb);
    *reinterpret_cast<uint16_t*>(a.kv_cache + aiter_fp4_data_offset(slot, a.P, 2 * lane)) = static_cast<uint16_t>(ba);
    *reinterpret_cast<uint16_t*>(a.kv_cache + aiter_fp4_data_offset(slot, a.P, 32 + 2 * lane)) = static_cast<uint16_t>(bb);
    if ((lane & 7) == 0) {
      const int blk = lane >> 3;
      a.kv_scale[aiter_fp4_scale_offset(slot, a.P, blk)] = static_cast<uint8_t>(ea);
      a.kv_scale[aiter_fp4_scale_offset(slot, a.P, 2 + blk)] = static_cast<uint8_t>(eb);
    }
  }
}

template <int MODE, int IN_DT, int CDT, bool NEOX>
__global__ void __launch_bounds__(256, DSQ_INDEXER_MIN_BLOCKS) indexer_kernel(IndexerArgs a) {
  const int64_t b = blockIdx.x;
  if (b < a.T) {
    q_token<MODE, IN_DT, CDT, NEOX>(a, b);
  } else {
    const int64_t t = (b - a.T) * 16 + (threadIdx.x >> 4);
    if (t < a.T) k_row<MODE, IN_DT, CDT, NEOX>(a, t);
  }
}

template <class F>
void with_mode(const IndexerArgs& a, F&& f) {   // FP8, or FP4 with its rounding policy
  if (!a.fp4) f(IC<0>{});
  else if (a.rounding == 0) f(IC<1>{});
  else if (a.rounding == 1) f(IC<2>{});
  else f(IC<3>{});
}

}  // namespace
}  // namespace dsqk

int dsq_indexer_launch(const IndexerArgs& a, cudaStream_t stream) {
  if (a.T == 0) return 0;
  using namespace dsqk;
  const int64_t blocks = a.T + (a.T + 15) / 16;
  with_mode(a, [&](auto mode) {
    with_half(a.in_dt, [&](auto in_dt) {
      with_float(a.rope.dtype, [&](auto cdt) {
        with_bool(a.neox, [&](auto neox) {
          indexer_kernel<decltype(mode)::value, decltype(in_dt)::value, decltype(cdt)::value, decltype(neox)::value>
              <<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
        });
      });
    });
  });
  return static_cast<int>(cudaGetLastError());
}
