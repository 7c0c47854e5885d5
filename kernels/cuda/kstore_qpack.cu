// kernels/cuda/kstore_qpack.cu: SPEC §7.2's k writer (sglang-v41) and §7.3 (aiter's DeepSeek-V4 k writer). One
// 16-lane group per 128-wide row (row16.cuh), 16 rows per 256-thread block. (§7.2's q writers: qpack.cu.)
#include "indexer.h"
#include "row16.cuh"

namespace dsqk {

// SPEC §7.2 stage 1 (recip fake-quant, rounded to bf16) then stage 2 (rule pack, codes by `r`):
// returns the lane's 4 payload bytes and the block's stage-2 exponent.
__device__ __forceinline__ uint32_t two_stage(unsigned mask, float (&v)[kVals], Rounding r, int& e2) {
  const int e1 = ue8m0_exponent(group_amax(mask, v, 4), ScaleRule::recip);
#pragma unroll
  for (int e = 0; e < kVals; ++e) v[e] = round_to_bf16(fp4_fake_quant_value_e(canon(v[e]), e1));
  return fp4_quant8(mask, v, ScaleRule::pack, r, e2);
}

template <int IN_DT, int CDT, int MODE>
__global__ void __launch_bounds__(256) kstore_kernel(KStoreArgs a) {
  const int lane = threadIdx.x & 15;
  const unsigned mask = group_mask<kLanes>();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kLanes) + (threadIdx.x >> 4);
  if (t >= a.T) return;
  const int64_t slot = load_i(a.slots, t, a.slots_dt);
  const int64_t pos_in = load_i(a.positions, t, a.pos_dt);
  if (lane == 0 && (pos_in < 0 || pos_in >= a.rope.max_pos)) atomicOr(a.err_flag, code(ErrFlag::position_out_of_range));   // SPEC §7.5
  constexpr bool v41 = MODE == code(KStoreMode::packed68);
  if (slot < (v41 ? 1 : 0)) return;                 // §7.2: slot 0 reserved; negative slots skipped
  const int64_t capacity = MODE == code(KStoreMode::dense) ? a.num_blocks : a.num_blocks * a.P;
  if (slot >= capacity) {
    if (lane == 0) atomicOr(a.err_flag, code(ErrFlag::slot_out_of_range));
    return;
  }
  float v[kVals];
  load_row8<IN_DT>(static_cast<const char*>(a.k) + t * a.k_st * (IN_DT == kF32 ? 4 : 2), lane, a.k_vec, v);
  // RMSNorm (SPEC §5): inv = 1/sqrt(S(x*x)/128 + eps), y = fl(w * fl(x*inv)).
  float sq[kVals];
#pragma unroll
  for (int e = 0; e < kVals; ++e) sq[e] = fmul(v[e], v[e]);
  const float inv = inv_sqrt_eps(fdiv(row_sum(mask, sq), 128.0f), a.eps);
#pragma unroll
  for (int e = 0; e < kVals; ++e) {
    v[e] = rms_norm_apply(v[e], inv, load_f(a.norm_w, kVals * lane + e, a.norm_w_dt));
    if (v41) v[e] = round_to<IN_DT>(v[e]);
  }
  const int64_t pos = rope_position(pos_in, a.rope.max_pos, a.compress_ratio);
  rope_row</*NEOX=*/false, /*TAIL=*/true, CDT>(mask, lane, v, a.rope, pos);
  const Rounding r = static_cast<Rounding>(a.rounding);
  const int g = lane >> 2;
  const bool first = (lane & 3) == 0;
  int e;
  if constexpr (v41) {
#pragma unroll
    for (int i = 0; i < kVals; ++i) v[i] = round_to<IN_DT>(v[i]);
    const uint32_t word = two_stage(mask, v, r, e);
    *reinterpret_cast<uint32_t*>(a.cache + packed68_payload_offset(slot, a.P, 4 * lane)) = word;
    if (first) a.cache[packed68_scale_offset(slot, a.P, g)] = static_cast<uint8_t>(e);
  } else {
  if (a.hadamard) hadamard_row(mask, lane, v);
  const uint32_t word = fp4_quant8(mask, v, ScaleRule::recip, r, e);
  if (MODE == code(KStoreMode::aiter_fp4)) {
    *reinterpret_cast<uint32_t*>(a.cache + aiter_fp4_data_offset(slot, a.P, 4 * lane)) = word;
    if (first) a.cache_scale[aiter_fp4_scale_offset(slot, a.P, g)] = static_cast<uint8_t>(e);
  } else {
    reinterpret_cast<uint32_t*>(a.cache + slot * 64)[lane] = word;
    if (first) a.cache_scale[slot * 4 + g] = static_cast<uint8_t>(e);
  }
  }
}

}  // namespace dsqk

int dsq_kstore_launch(const KStoreArgs& a, cudaStream_t stream) {
  if (a.T == 0) return 0;
  using namespace dsqk;
  const unsigned blocks = static_cast<unsigned>((a.T + 15) / 16);
  constexpr int kPacked68 = code(KStoreMode::packed68), kAiter = code(KStoreMode::aiter_fp4),
                kDense = code(KStoreMode::dense);
  if (a.mode == kPacked68) {
    with_half(a.in_dt, [&](auto in_dt) {
      kstore_kernel<decltype(in_dt)::value, kPairs, kPacked68><<<blocks, 256, 0, stream>>>(a);
    });
  } else {
    with_float(a.in_dt, [&](auto in_dt) {
      with_table(a.rope, [&](auto cdt) {
        if (a.mode == kAiter)
          kstore_kernel<decltype(in_dt)::value, decltype(cdt)::value, kAiter><<<blocks, 256, 0, stream>>>(a);
        else
          kstore_kernel<decltype(in_dt)::value, decltype(cdt)::value, kDense><<<blocks, 256, 0, stream>>>(a);
      });
    });
  }
  return static_cast<int>(cudaGetLastError());
}
