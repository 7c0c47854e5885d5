// kernels/cuda/indexer.cu: SPEC §7.1 indexer_qk_rope_quant_and_cache, FP8 and FP4 modes, one launch.
//
// Rows in 8-lane groups ("split8", qrows.cuh): lane l holds x[8l .. 8l+7] ("a", the RoPE half, dims 0..63)
// and x[64+8l .. 64+8l+7] ("b").
//
// Blocks of 256 threads (32 groups). The q blocks come first. At large T (whole-token mode) warp w of q
// block b takes token 8b + w: its 4 groups share the token's heads (H/4 each at most), so the per-token
// work (slot, position, RoPE entries, the division into tokens) is paid once per warp and token. At small
// T, block b takes 32 heads of token b / ceil(H/32), one head per group, so that a call's heads spread
// over several SMs (latency). q rows arrive either through registers (kHeadsInFlight heads loaded before
// any is processed: FP8, AMD, small T) or, for FP4 at large T on NVIDIA, through a per-thread cp.async ring
// in shared memory (kStages - 1 heads in flight, no registers held), where the warp's RoPE entries also
// wait (read again per head: the 16 registers they free keep the output addresses in registers; H200:
// 51.2 -> 49.0 us at T=8192): the loop is qrows.cuh's q_heads, and what the indexer does to a q row is
// IndexerQRow. The last ceil(T/32) blocks are k blocks, one k row per group; a k block shares the norm
// weights through shared memory, loaded with the rows (at small T the k row is the call's critical path).
// 1-D grid (no 65535 limit).
// Template parameters: MODE kModeFp8 = FP8, kModeFp4<r> = FP4 with rounding policy r (SPEC §2); IN_DT the
// q/k dtype; CDT the cos/sin table dtype; NEOX the RoPE style.
#include "indexer.h"
#include "launch.cuh"
#include "qrows.cuh"   // the split8 rows, q_heads; row16.cuh (scalar loads, rope_load, with_*), lanes.cuh

namespace dsqk {
namespace {

// The kernel's MODE template parameter folds the FP8/FP4 choice and the FP4 rounding policy into one int.
constexpr int kModeFp8 = 0;
template <Rounding R>
constexpr int kModeFp4 = 1 + code(R);
template <int MODE>
constexpr Rounding mode_rounding = static_cast<Rounding>(MODE - 1);

// Tuning (the values below were the fastest on the H200, dev/cuda_variants.sh); macros so that a
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
#ifndef DSQ_INDEXER_TABLE_IN_SMEM   // ring path: the thread's RoPE entries in shared memory, not registers
#define DSQ_INDEXER_TABLE_IN_SMEM 1
#endif


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

// ---- q rows (qrows.cuh q_heads): head RoPE, rounded to the input dtype, then FP8 or FP4 -------------------
template <int MODE, int IN_DT, int CDT, bool NEOX>
struct IndexerQRow {
  using Args = IndexerArgs;
  static constexpr int kStages = MODE == kModeFp8 ? DSQ_INDEXER_STAGES_FP8 : DSQ_INDEXER_STAGES_FP4;
  static constexpr int kHeadsInFlight =
      MODE == kModeFp8 ? DSQ_INDEXER_HEADS_IN_FLIGHT_FP8 : DSQ_INDEXER_HEADS_IN_FLIGHT_FP4;
  static constexpr bool kTableInSmem = DSQ_INDEXER_TABLE_IN_SMEM;
  static constexpr int kRowBytes = MODE == kModeFp8 ? 128 : 64;   // a q row's output bytes
  static constexpr bool kHeadWeights = MODE == kModeFp8;          // FP8: weights_out = w * scale * weights_scale
  static constexpr bool kWeightsAfter = MODE != kModeFp8;         // FP4: weights_out = the weights, unchanged
  static constexpr bool kNeox = NEOX;
  static constexpr int kCdt = CDT;

  const IndexerArgs& a;
  const int64_t t;
  const int64_t slot;       // loaded first: its load, the position's and the rows' are issued together
  const int64_t pos_in;     // flagged by the token's k row if out of range
  const uint16_t* const q_t;
  const int H;
  uint8_t* const out_t;   // the token's q_out rows: per-head offsets from it are 32-bit (a token's part is small)
  const int qs_pad, blk, scale_2;
  uint8_t* const q_scale_l;

  // FP4 exponents: lane 0 of a group stores blocks 0 and 2, lane 4 blocks 1 and 3 (layouts.h: a block's
  // part plus a head's part); q_scale_l holds the token's base plus this lane's first block's part. The
  // token's slot decides whether its q rows are written.
  __device__ __forceinline__ IndexerQRow(const IndexerArgs& a_, int64_t t_, int, int, int lane)
      : a(a_),
        t(t_),
        slot(load_i(a_.slots, t_, a_.slots_dt)),
        pos_in(load_i(a_.positions, t_, a_.pos_dt)),
        q_t(static_cast<const uint16_t*>(a_.q) + t_ * a_.q_st),
        H(static_cast<int>(a_.H)),
        out_t(a_.q_out + t_ * H * kRowBytes),
        qs_pad(static_cast<int>(aiter_q_scale_pad(H))),
        blk((lane >> 2) & 1),
        scale_2(aiter_q_scale_group_part(2, qs_pad)),
        q_scale_l(MODE == kModeFp8 ? nullptr
                                   : a_.q_scale_out + aiter_q_scale_offset(t_, 0, 0, H) +
                                         aiter_q_scale_group_part(blk, qs_pad)) {}
  __device__ __forceinline__ bool writes() const { return a.compute_all || slot >= 0; }
  __device__ __forceinline__ int64_t position() const { return rope_position(pos_in, a.rope.max_pos, 1); }
  __device__ __forceinline__ void weight(int h, float w) const { store_weight(a, t, h, w); }

  __device__ __forceinline__ void head(unsigned mask, int lane, const Raw& raw, const float (&c)[8],
                                       const float (&s)[8], int h, float w, bool act, uint8_t* out_h) const {
    float v[16];
    constexpr bool packed = MODE != kModeFp8 && IN_DT == kBF16 && kPackedFp4Native;
    unpack<IN_DT>(raw, v, packed ? 8 : 16);   // packed FP4: the b values stay bf16 pairs
    rope8<NEOX>(mask, lane, v, c, s);
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
  }
};

// The block's shared memory, in 16-byte units: a q block's row ring (qrows.cuh kQSmemVec4), or a k block's
// norm weights and biases (256 floats).
template <class QRow>
constexpr int kSmemVec4 = kQSmemVec4<QRow> > 256 / 4 ? kQSmemVec4<QRow> : 256 / 4;

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
  // rounded to the input dtype. S is the canonical sum (qrows.cuh row_sum8).
  const float mean = div128(row_sum8(mask, v));   // S / 128 without a division (rope.h)
  float d2[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = fsub(v[i], mean);
    d2[i] = fmul(v[i], v[i]);
  }
  const float inv = inv_sqrt_eps(div128(row_sum8(mask, d2)), a.eps);
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
  rope8<NEOX>(mask, lane, v, c, s);
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

// q blocks (qrows.cuh q_block: whole tokens per warp, or chunks of a token's heads per block) and k blocks.
template <int MODE, int IN_DT, int CDT, bool NEOX>
__global__ void __launch_bounds__(256, MODE == kModeFp8 ? DSQ_INDEXER_MIN_BLOCKS_FP8 : DSQ_INDEXER_MIN_BLOCKS_FP4)
    indexer_kernel(IndexerArgs a, int64_t nk_first, int64_t nq, int chunks, int chunk_heads) {
  using QRow = IndexerQRow<MODE, IN_DT, CDT, NEOX>;
  __shared__ uint4 smem[kSmemVec4<QRow>];
  dsq_launch::dependent_entry();
  // Blocks [0, nk_first) are k blocks, then nq q blocks, then the other k blocks (host: below).
  const int64_t b = static_cast<int64_t>(blockIdx.x) - nk_first;
  if (b >= 0 && b < nq) {
    q_block<QRow>(a, b, chunks, chunk_heads, smem);
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
          if constexpr (IndexerQRow<M, D, C, N>::kStages >= 2) prefer_shared_memory<indexer_kernel<M, D, C, N>>(stream);
#endif
          const dsq_launch::Shape shape{dim3(static_cast<unsigned>(blocks)), dim3(256)};
          static_cast<void>(dsq_launch::launch(indexer_kernel<M, D, C, N>, shape, stream, dsq_launch::kWriters, a,
                                               nk_first, nq, chunks, kGroups));
        });
      });
    });
  });
  return static_cast<int>(cudaGetLastError());
}
