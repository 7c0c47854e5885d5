// kernels/cuda/indexer.cu: SPEC §7.1 indexer_qk_rope_quant_and_cache, FP8 and FP4 modes, one launch.
//
// Work items are 128-wide rows: the T*H q rows first (token-major, so consecutive groups read
// consecutive memory), then the T k rows. Each 16-lane group takes one row (row16.cuh), so a block
// of 256 threads handles 16 rows. Grid: ceil((T*H + T) / 16) blocks (1-D, no 65535 limit).
#include "indexer.h"
#include "row16.cuh"

namespace dsqk {

// weights_out[t, h] in its dtype (fp32, or rounded to bf16/fp16).
__device__ __forceinline__ void store_weight(const IndexerArgs& a, int64_t t, int64_t h, float w) {
  const int64_t i = t * a.w_out_st + h * a.w_out_sh;
  if (a.w_out_dt == kF32)
    static_cast<float*>(a.w_out)[i] = canon_nan(w);   // NaN weights: the canonical NaN (docs/semantics.md)
  else
    static_cast<uint16_t*>(a.w_out)[i] = to_half_bits(w, a.w_out_dt);
}

// One row's inputs, loaded ahead of its processing so that several rows' loads are in flight at once.
struct RowIn {
  int64_t row, t, h, slot, pos;
  bool valid, is_q;
  float w;            // the head weight (q rows)
  float v[kVals];
};

template <int IN_DT>
__device__ __forceinline__ void indexer_load(const IndexerArgs& a, int lane, int64_t row, RowIn& in) {
  const int64_t q_rows = a.T * a.H;
  in.row = row;
  in.valid = row < q_rows + a.T;
  if (!in.valid) return;
  in.is_q = row < q_rows;
  if (in.is_q) {   // 32-bit division when the row count allows (the common case)
    if (q_rows < (int64_t(1) << 31)) {
      in.t = static_cast<uint32_t>(row) / static_cast<uint32_t>(a.H);
      in.h = static_cast<uint32_t>(row) - static_cast<uint32_t>(in.t) * static_cast<uint32_t>(a.H);
    } else {
      in.t = row / a.H;
      in.h = row % a.H;
    }
  } else {
    in.t = row - q_rows;
    in.h = 0;
  }
  in.slot = load_i(a.slots, in.t, a.slots_dt);
  in.pos = load_i(a.positions, in.t, a.pos_dt);
  if (in.is_q) {
    load_row8<IN_DT>(static_cast<const uint16_t*>(a.q) + in.t * a.q_st + in.h * a.q_sh, lane, a.q_vec, in.v);
    in.w = load_f(a.w, in.t * a.w_st + in.h * a.w_sh, a.w_dt);
  } else
    load_row8<IN_DT>(static_cast<const uint16_t*>(a.k) + in.t * a.k_st, lane, a.k_vec, in.v);
}

template <bool FP4, int IN_DT, int CDT, bool NEOX>
__device__ __forceinline__ void indexer_row(const IndexerArgs& a, unsigned mask, int lane, RowIn& in) {
  if (!in.valid) return;
  const bool is_q = in.is_q;
  const int64_t row = in.row, t = in.t, h = in.h, slot = in.slot;
  float (&v)[kVals] = in.v;
  // SPEC §7.5: an out-of-range position is clamped and reported (once per token: by its k row).
  if (!is_q && lane == 0 && (in.pos < 0 || in.pos >= a.rope.max_pos)) atomicOr(a.err_flag, 2);
  if (is_q ? (!a.compute_all && slot < 0) : slot < 0) return;
  const int64_t capacity = a.num_blocks * a.P;
  if (!is_q && slot >= capacity) {
    if (lane == 0) atomicOr(a.err_flag, 1);
    return;
  }
  const int64_t pos = rope_position(in.pos, a.rope.max_pos, 1);
  if (!is_q) {
    // LayerNorm (SPEC §5): mean = S(x)/128, d = x - mean, var = S(d*d)/128, y = fl(fl(d*inv)*w) + b.
    const float mean = fdiv(row_sum(mask, v), 128.0f);
    float d2[kVals];
#pragma unroll
    for (int e = 0; e < kVals; ++e) { v[e] = fsub(v[e], mean); d2[e] = fmul(v[e], v[e]); }
    const float inv = inv_sqrt_eps(fdiv(row_sum(mask, d2), 128.0f), a.eps);
#pragma unroll
    for (int e = 0; e < kVals; ++e)
      v[e] = round_to<IN_DT>(layer_norm_apply(v[e], inv, load_f(a.norm_w, kVals * lane + e, a.norm_w_dt),
                                              load_f(a.norm_b, kVals * lane + e, a.norm_b_dt)));
  }

  rope_row<NEOX, /*TAIL=*/false, CDT>(mask, lane, v, a.rope, pos);
#pragma unroll
  for (int e = 0; e < kVals; ++e) v[e] = round_to<IN_DT>(v[e]);

  if constexpr (FP4) {
    int e;
    const uint32_t word = fp4_quant8(mask, v, ScaleRule::recip, static_cast<Rounding>(a.rounding), e);
    const bool first = (lane & 3) == 0;
    const int g = lane >> 2;
    if (is_q) {
      reinterpret_cast<uint32_t*>(a.q_out + row * 64)[lane] = word;
      if (first) {
        a.q_scale_out[aiter_q_scale_offset(t, h, g, a.H)] = static_cast<uint8_t>(e);
        if (h < 16)   // pad entries h/16 >= H/16 of this (t, g, h % 16) are written 0
          for (int64_t hp = a.H; hp < aiter_q_scale_pad(a.H) * 16; hp += 16)
            a.q_scale_out[aiter_q_scale_offset(t, hp + h, g, a.H)] = 0;
      }
      if (lane == 0) store_weight(a, t, h, in.w);
    } else {
      *reinterpret_cast<uint32_t*>(a.kv_cache + aiter_fp4_data_offset(slot, a.P, 4 * lane)) = word;
      if (first) a.kv_scale[aiter_fp4_scale_offset(slot, a.P, g)] = static_cast<uint8_t>(e);
    }
  } else {
  // FP8 mode (SPEC §4): one scale per row.
  const Fp8Flavour fl = static_cast<Fp8Flavour>(a.flavour);
  const float s = fp8_row_scale(group_amax(mask, v, kLanes), fl, is_q ? Fp8Role::q : Fp8Role::k, a.ue8m0);
  const float inv = fp8_inv_scale(s);
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = fp8_encode2(fmul(v[2 * e], inv), fmul(v[2 * e + 1], inv), fl);
  const uint32_t lo = w[0] | (w[1] << 16), hi = w[2] | (w[3] << 16);
  if (is_q) {
    reinterpret_cast<uint2*>(a.q_out + row * 128)[lane] = make_uint2(lo, hi);
    if (lane == 0)
      store_weight(a, t, h, fmul(fmul(in.w, s), a.weights_scale));
  } else {
    *reinterpret_cast<uint2*>(a.kv_cache + fp8_132_data_offset(slot, a.P, kVals * lane, a.preshuffle)) =
        make_uint2(lo, hi);
    if (lane == 0) *reinterpret_cast<float*>(a.kv_cache + fp8_132_scale_offset(slot, a.P)) = s;
  }
  }
}

// Rows per 16-lane group: a block of 256 threads (16 groups) covers 16 * kRowsPerGroup consecutive
// rows; step i of every group reads 16 consecutive rows, all steps' loads are issued first. Measured
// on the H200: 4 rows per group was slower than 1 (the kernels are instruction-bound, and the extra
// registers halve the occupancy), so 1.
constexpr int kRowsPerGroup = 1;

template <bool FP4, int IN_DT, int CDT, bool NEOX>
__global__ void __launch_bounds__(256) indexer_kernel(IndexerArgs a) {
  const int lane = threadIdx.x & 15;
  const unsigned mask = group_mask();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (16 * kRowsPerGroup) + (threadIdx.x >> 4);
  RowIn in[kRowsPerGroup];
#pragma unroll
  for (int i = 0; i < kRowsPerGroup; ++i) indexer_load<IN_DT>(a, lane, base + 16 * i, in[i]);
#pragma unroll
  for (int i = 0; i < kRowsPerGroup; ++i) indexer_row<FP4, IN_DT, CDT, NEOX>(a, mask, lane, in[i]);
}

}  // namespace dsqk

int dsq_indexer_launch(const IndexerArgs& a, cudaStream_t stream) {
  const int64_t rows = a.T * a.H + a.T;
  if (rows == 0) return 0;
  const int64_t blocks = (rows + 16 * dsqk::kRowsPerGroup - 1) / (16 * dsqk::kRowsPerGroup);
  using namespace dsqk;
  with_bool(a.fp4, [&](auto fp4) {
    with_half(a.in_dt, [&](auto in_dt) {
      with_table(a.rope, [&](auto cdt) {
        with_bool(a.neox, [&](auto neox) {
          indexer_kernel<decltype(fp4)::value, decltype(in_dt)::value, decltype(cdt)::value, decltype(neox)::value>
              <<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
        });
      });
    });
  });
  return static_cast<int>(cudaGetLastError());
}
