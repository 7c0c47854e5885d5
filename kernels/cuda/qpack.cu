// kernels/cuda/qpack.cu: SPEC §7.2's q writers, index_q_rope_pack_weights (QPackMode::pack: tail interleaved
// RoPE -> the input dtype -> stage 1 -> stage 2, with the head weights) and rope_fake_quant_fp4 (fake_ue8m0,
// fake_e4m3: the RoPE and stage 1 alone), on the indexer's q side (qrows.cuh): 8-lane groups, lane l holding
// x[8l .. 8l+7] ("a", not rotated) and x[64+8l .. 64+8l+7] ("b", the tail RoPE dims), a token's heads shared
// by a warp (large T, through the cp.async row ring on NVIDIA) or a block (small T), the position and RoPE
// entries loaded once per token. What is done to a row is QPackRow.
//
// For bf16 q on NVIDIA (sm_80+) the two stages run two values per operation (dsaquant/two_stage_x8.h): the
// block amax as a bf16x2 max, the blocks' parameters from it, then per value pair stage 1's grid value and
// directly stage 2's code; a block outside the fast path's conditions (a tiny amax where rule pack's floor
// applies, an Inf amax, an amax2 past the bf16 range) takes the general bf16x2 form instead, per lane. fp16 q,
// the e4m3 fake quant and HIP use the scalar definitions (e2m1.h, ue8m0.h, fake_quant.h) on fp32 values.
#include "indexer.h"
#include "launch.cuh"
#include "qrows.cuh"

// Tuning: the indexer's FP4 values (the same loop at the same size; dev/cuda_variants.sh builds variants).
#ifndef DSQ_QPACK_STAGES   // shared-memory row slots per thread (CUDA; >= 2: the cp.async ring)
#define DSQ_QPACK_STAGES 4
#endif
#if defined(__HIP__)
#undef DSQ_QPACK_STAGES
#define DSQ_QPACK_STAGES 0
#endif
#ifndef DSQ_QPACK_MIN_BLOCKS   // resident blocks per SM asked of the register allocator
#define DSQ_QPACK_MIN_BLOCKS 4
#endif
#ifndef DSQ_QPACK_WHOLE_TOKEN_UNITS   // T * ceil(H/32) from which a q warp takes a whole token
#define DSQ_QPACK_WHOLE_TOKEN_UNITS 2048
#endif
#ifndef DSQ_QPACK_TABLE_IN_SMEM   // ring path: the thread's RoPE entries in shared memory, not registers
#define DSQ_QPACK_TABLE_IN_SMEM 1
#endif

namespace dsqk {
namespace {

constexpr int kPack = code(QPackMode::pack), kFakeUe8m0 = code(QPackMode::fake_ue8m0),
              kFakeE4m3 = code(QPackMode::fake_e4m3);

// Four words (x0|x1, x2|x3, ...) as one 16-byte value.
__device__ __forceinline__ uint4 words4(const uint32_t (&w)[4]) { return make_uint4(w[0], w[1], w[2], w[3]); }

template <int IN_DT, int MODE>
struct QPackRow {
  using Args = QPackArgs;
  static constexpr int kStages = DSQ_QPACK_STAGES;
  static constexpr int kHeadsInFlight = 1;
  static constexpr bool kTableInSmem = DSQ_QPACK_TABLE_IN_SMEM;
  static constexpr int kRowBytes = MODE == kPack ? 64 : 256;   // payload row, or the row in the input dtype
  static constexpr bool kHeadWeights = false;
  static constexpr bool kWeightsAfter = MODE == kPack;           // weights_out = bf16(w * weight_scale)
  static constexpr bool kNeox = false;                           // SPEC §7.2: interleaved pairs
  static constexpr int kCdt = kPairs;                            // freqs: fp32 (cos, sin) pairs
  // bf16 on NVIDIA: the two stages on bf16x2 words (two_stage_x8.h); else fp32 values.
  static constexpr bool kPacked = IN_DT == kBF16 && kPackedFp4Native && MODE != kFakeE4m3;

  const QPackArgs& a;
  const int64_t t;
  const int64_t pos_in;
  const uint16_t* const q_t;
  const int H;
  uint8_t* const out_t;
  const bool reports;   // the token's one thread that reports an out-of-range position

  __device__ __forceinline__ QPackRow(const QPackArgs& a_, int64_t t_, int h_begin, int g, int lane)
      : a(a_),
        t(t_),
        pos_in(load_i(a_.positions, t_, a_.pos_dt)),
        q_t(static_cast<const uint16_t*>(a_.q) + t_ * a_.q_st),
        H(static_cast<int>(a_.H)),
        out_t((MODE == kPack ? a_.payload : reinterpret_cast<uint8_t*>(a_.fq_out)) + t_ * H * kRowBytes),
        reports(h_begin == 0 && g == 0 && lane == 0) {}
  __device__ __forceinline__ bool writes() const { return true; }
  // SPEC §7.5: an out-of-range position is clamped and reported; the table row is pos & ~(r-1).
  __device__ __forceinline__ int64_t position() const {
    if (reports && (pos_in < 0 || pos_in >= a.rope.max_pos)) atomicOr(a.err_flag, code(ErrFlag::position_out_of_range));
    return rope_position(pos_in, a.rope.max_pos, a.compress_ratio);
  }
  __device__ __forceinline__ void weight(int h, float w) const {
    a.w_out[t * H + h] = round_to_bf16(fmul(w, a.weight_scale));
  }

  __device__ __forceinline__ void head(unsigned mask, int lane, const Raw& raw, const float (&c)[8],
                                       const float (&s)[8], int h, float, bool act, uint8_t* out_h) const {
    float v[16];
    if constexpr (kPacked) {
      unpack_b<IN_DT>(raw, v);   // the a values stay bf16 words
    } else {
      unpack<IN_DT>(raw, v);
    }
    rope8</*NEOX=*/false, /*OFF=*/8>(mask, lane, v, c, s);
    if constexpr (!kPacked) round8<IN_DT>(v, 8);   // the RoPE dims rounded to the input dtype (SPEC §7.2)
    if constexpr (MODE == kPack) {
      const Rounding r = static_cast<Rounding>(a.rounding);
      uint32_t ba, bb, e2;   // e2: stage 2's exponents of the a block (bits 0..7) and the b block (16..23)
      if constexpr (kPacked) {
        uint32_t xa[4], xb[4];   // values j and j + 4 per word, as the encoder pairs them
        pair_j_j4(raw.a, xa);
        round_j_j4(v, 8, xb);
        e2 = two_stage_bf16x2(mask, xa, xb, r, ba, bb);
      } else {
        e2 = two_stage_f32(mask, v, r, ba, bb);
      }
      // The row's exponent word, block j in byte j: lane 0 holds blocks 0 and 2, lane 4 blocks 1 and 3.
      const uint32_t e2_other = group_shfl_xor<kGroupLanes>(mask, e2, 4);
      if (!act) return;
      uint32_t* out = reinterpret_cast<uint32_t*>(out_h);
      out[lane] = ba;
      out[8 + lane] = bb;
      if (lane == 0) a.exps[t * H + h] = static_cast<int32_t>(e2 | (e2_other << 8));
    } else {
      uint32_t wa[4], wb[4];   // the lane's a and b values in the input dtype, x0|x1, x2|x3, ... (SPEC §1 order)
      if constexpr (kPacked) {   // stage 1 with UE8M0 scales on blocks of 32 (rule recip), bf16x2
        const uint32_t ra[4] = {raw.a.x, raw.a.y, raw.a.z, raw.a.w};
        uint32_t aa[4], ab[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wb[i] = round_pair_any_nan(v[8 + 2 * i], v[9 + 2 * i], true);
          aa[i] = bf16x2_abs(ra[i]);
          ab[i] = bf16x2_abs(wb[i]);
        }
        const uint32_t m = block_amax_bf16(mask, aa, ab);
        const FakeQuantBf16x2 ka = fake_quant_consts_bf16x2(ue8m0_recip_exponent_bf16(m & 0xFFFFu));
        const FakeQuantBf16x2 kb = fake_quant_consts_bf16x2(ue8m0_recip_exponent_bf16(m >> 16));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wa[i] = fake_quant_bf16x2(ra[i], aa[i], ka);
          wb[i] = fake_quant_bf16x2(wb[i], ab[i], kb);
        }
      } else {
        uint16_t hb[16];
        if constexpr (MODE == kFakeUe8m0) {   // UE8M0 scales on blocks of 32 (rule recip): 4 lanes
          const int ea = ue8m0_exponent(amax_lanes(mask, v, 0, 4), ScaleRule::recip);
          const int eb = ue8m0_exponent(amax_lanes(mask, v, 1, 4), ScaleRule::recip);
#pragma unroll
          for (int i = 0; i < 16; ++i)
            hb[i] = to_half_bits<IN_DT>(fp4_fake_quant_value_e(canon(v[i]), i < 8 ? ea : eb));
        } else {   // e4m3 scales on blocks of 16: 2 lanes
          const float sa = nvfp4_e4m3_scale(amax_lanes(mask, v, 0, 2));
          const float sb = nvfp4_e4m3_scale(amax_lanes(mask, v, 1, 2));
#pragma unroll
          for (int i = 0; i < 16; ++i)
            hb[i] = to_half_bits<IN_DT>(fp4_fake_quant_value(canon(v[i]), i < 8 ? sa : sb));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wa[i] = hb[2 * i] | (static_cast<uint32_t>(hb[2 * i + 1]) << 16);
          wb[i] = hb[8 + 2 * i] | (static_cast<uint32_t>(hb[9 + 2 * i]) << 16);
        }
      }
      if (!act) return;
      uint4* out = reinterpret_cast<uint4*>(out_h);
      out[lane] = words4(wa);
      out[8 + lane] = words4(wb);
    }
  }
};

// The q blocks of qrows.cuh's q_block, as the indexer's (indexer.cu), without its k blocks.
template <int IN_DT, int MODE>
__global__ void __launch_bounds__(256, DSQ_QPACK_MIN_BLOCKS) qpack_kernel(QPackArgs a, int chunks, int chunk_heads) {
  using Row = QPackRow<IN_DT, MODE>;
  dsq_launch::dependent_entry();
#if !defined(__HIP__)
  __shared__ uint4 smem[kQSmemVec4<Row> > 0 ? kQSmemVec4<Row> : 1];
  q_block<Row>(a, blockIdx.x, chunks, chunk_heads, smem);
#else
  q_block<Row>(a, blockIdx.x, chunks, chunk_heads, nullptr);   // AMD: no shared memory (no cp.async)
#endif
}

}  // namespace
}  // namespace dsqk

int dsq_qpack_launch(const QPackArgs& a, cudaStream_t stream) {
  if (a.T == 0 || a.H == 0) return 0;
  using namespace dsqk;
  // Work units: 32 heads of a token. Many units: a warp takes a whole token; few: one unit per block.
  const int64_t units = (a.H + kGroups - 1) / kGroups;
  const bool whole = a.T * units >= DSQ_QPACK_WHOLE_TOKEN_UNITS;
  const int64_t blocks = whole ? (a.T + kGroups / 4 - 1) / (kGroups / 4) : a.T * units;
  const int chunks = whole ? 0 : static_cast<int>(units);
  with_half(a.in_dt, [&](auto in_dt) {
    constexpr int D = decltype(in_dt)::value;
    auto launch = [&](auto mode) {
      constexpr int M = decltype(mode)::value;
#if !defined(__HIP__)
      if constexpr (QPackRow<D, M>::kStages >= 2) prefer_shared_memory<qpack_kernel<D, M>>(stream);
#endif
      static_cast<void>(dsq_launch::launch(qpack_kernel<D, M>, {dim3(static_cast<unsigned>(blocks)), dim3(256)}, stream,
                                           dsq_launch::kWriters, a, chunks, kGroups));
    };
    if (a.mode == kPack) launch(IC<kPack>{});
    else if (a.mode == kFakeUe8m0) launch(IC<kFakeUe8m0>{});
    else launch(IC<kFakeE4m3>{});
  });
  return static_cast<int>(cudaGetLastError());
}
