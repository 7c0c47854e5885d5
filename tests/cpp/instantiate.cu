// Build check of the shared header as device code: every header function is called from a
// __global__ kernel. Compiled by tests/test_header_builds.py with nvcc (sm_90a, sm_100a) and as HIP
// device code with clang (gfx942, gfx950). Nothing runs; the HIP assembly of `fp4_hardware_kernel` is
// checked for V_CVT_SCALEF32_PK_FP4_F32 on gfx950 (and its absence on gfx942).
#if defined(__HIP__)
#include <hip/hip_runtime.h>
#define DSQ_SHFL_XOR(v, s) __shfl_xor((v), (s), 32)
#else
#include <cuda_runtime.h>
#define DSQ_SHFL_XOR(v, s) __shfl_xor_sync(0xFFFFFFFFu, (v), (s), 32)
#endif

#include "dsaquant/dsaquant.h"

using namespace dsq;

// The gfx950 instruction path alone: one block of 32 with policy `hardware`.
extern "C" __global__ void fp4_hardware_kernel(const float* x, const int* e, uint8_t* out) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  fp4_encode_block32(x + 32 * b, e[b], Rounding::hardware, out + 16 * b);
}

// The emulated policies (no instruction on any target).
extern "C" __global__ void fp4_emulated_kernel(const float* x, int rule, uint8_t* out, uint8_t* exps) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  const float* blk = x + 32 * b;
  const int e = fp4_block_exponent(blk, 32, rule ? ScaleRule::recip : ScaleRule::pack);
  exps[b] = static_cast<uint8_t>(e);
  fp4_encode_block32(blk, e, Rounding::rne, out + 16 * b);
  fp4_encode_block32(blk, e, Rounding::threshold, out + 16 * (b + gridDim.x * blockDim.x));
}

// The packed bf16 encoder (e2m1x8.h), every policy: 8 values per thread.
extern "C" __global__ void fp4_bf16x8_kernel(const uint32_t* x, const int* e, uint32_t* out) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t w[4], aw[4];
  for (int j = 0; j < 4; ++j) {
    w[j] = x[4 * b + j];
    aw[j] = bf16x2_abs(w[j]);
  }
  out[3 * b] = e2m1_encode8_bf16<Rounding::threshold>(w, aw, e[b]);
  out[3 * b + 1] = e2m1_encode8_bf16<Rounding::rne>(w, aw, e[b]);
  out[3 * b + 2] = e2m1_encode8_bf16<Rounding::hardware>(w, aw, e[b]) ^ bf16x2_max_nn(w[0], w[1]) ^ byte_perm(w[2], w[3], 0x5410u);
}

// SPEC §7.2 for bf16 inputs (two_stage_x8.h): block parameters, the fast and the general two-stage encoders,
// stage 1 alone; 8 values of each of two blocks per thread, the policy a runtime argument.
extern "C" __global__ void two_stage_bf16x8_kernel(const uint32_t* x, int r, uint32_t* out) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t w[4], aw[4];
  for (int j = 0; j < 4; ++j) {
    w[j] = x[4 * b + j];
    aw[j] = bf16x2_abs(w[j]);
  }
  const uint32_t m = bf16x2_min_nan(bf16x2_max_nn(aw[0], aw[1]), 0x7F807F80u);
  const TwoStageBf16x2 p = two_stage_params_bf16x2(m);
  const Rounding rr = static_cast<Rounding>(r);
  int e2, e1, e2b;
  two_stage_exponents_bf16(m >> 16, e1, e2b);
  out[4 * b] = p.fast_a ? two_stage8_bf16_fast(w, aw, p.inv_a, p.clamp_a, p.kr_a, p.thr_a, rr)
                        : two_stage8_bf16(w, aw, m & 0xFFFFu, rr, e2);
  out[4 * b + 1] = p.e2 + static_cast<uint32_t>(e1 + e2b + ue8m0_pack_exponent_bf16(m >> 16)) + p.fast_b;
  const FakeQuantBf16x2 k = fake_quant_consts_bf16x2(e1);
  out[4 * b + 2] = fake_quant_bf16x2(w[2], aw[2], k) ^ fake_quant_threshold_bf16x2(p.thr_b) ^ p.inv_b ^ p.kr_b;
  out[4 * b + 3] = e2m1_join8(e2m1_mags8_bf16(aw), e2m1_signs8_bf16(w), rr) ^ p.clamp_b;
}

// SPEC §0, §1-§4 scalar helpers.
extern "C" __global__ void scalar_kernel(const float* x, float* f, uint32_t* u, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  int k = 0;
  f[k++] = fadd(v, 1.0f) + fsub(v, 2.0f) + fmul(v, 3.0f) + fdiv(v, 5.0f) + fsqrt(abs_f(v)) + rint_f(v);
  f[k++] = fmax_nn(v, 0.5f) + clamp_lo(v, 0.0f) + clamp_hi(v, 1.0f) + canon_nan(v);
  f[k++] = pow2(ceil_exp(abs_f(v))) + exp_ds(-abs_f(v));
  f[k++] = bf16_to_f32(round_bf16(v)) + round_to_bf16(v) + fp16_to_f32(round_fp16(v)) + round_to_fp16(v);
  f[k++] = e2m1_decode(e2m1_encode(v, Rounding::threshold)) + e2m1_decode(e2m1_encode(v, Rounding::rne)) +
           e2m1_decode(e2m1_encode(v, Rounding::hardware));
  f[k++] = static_cast<float>(e2m1_encode_scaled(v, 130, Rounding::rne) + e2m1_nan_scale_code(v, Rounding::hardware) +
                              pack_nibbles(1, 2) + e2m1_encode_pair(v, -v, 127, Rounding::hardware));
  f[k++] = fp4_fake_quant_value(v, pow2(ue8m0_exponent(abs_f(v), ScaleRule::recip)));
  f[k++] = static_cast<float>(ue8m0_exponent(abs_f(v), ScaleRule::pack));
  f[k++] = fp8_decode(fp8_encode(v, Fp8Flavour::e4m3fn), Fp8Flavour::e4m3fn) +
           fp8_decode(fp8_encode(v, Fp8Flavour::e4m3fnuz), Fp8Flavour::e4m3fnuz) +
           static_cast<float>(fp8_is_nan(static_cast<uint8_t>(i), Fp8Flavour::e4m3fn) + fp8_bias(Fp8Flavour::e4m3fnuz)) +
           fp8_max(Fp8Flavour::e4m3fn);
  const float s = fp8_row_scale(abs_f(v), Fp8Flavour::e4m3fn, Fp8Role::q, true) +
                  fp8_row_scale(abs_f(v), Fp8Flavour::e4m3fnuz, Fp8Role::k, false);
  f[k++] = static_cast<float>(fp8_encode_scaled(v, fp8_inv_scale(s), Fp8Flavour::e4m3fn));
  f[k++] = u2f(f2u(v) ^ 1u) + static_cast<float>(is_nan(v) + is_inf(v) + sign_bit(v));
  f[k++] = hadamard_scale(128) + inv_sqrt_eps(v, 1e-6f) + layer_norm_apply(v, 2.0f, 3.0f, 4.0f) + rms_norm_apply(v, 2.0f, 3.0f);
  float a = v, b = -v;
  rope_pair(a, b, 0.5f, 0.25f);
  f[k++] = a + b + static_cast<float>(rope_dim_a(i & 31, true, false) + rope_dim_b(i & 31, false, true) +
                                      rope_position(i, 4096, 4));
  // SPEC §7.6 pool pieces, §7.7 FP8 group scale.
  PoolMax pm = pool_max_init();
  pool_max_add(pm, -abs_f(v));
  pool_max_merge(pm, fmax_nan(v, -v));
  f[k++] = pool_finish(pool_term(pool_exp(-abs_f(v), pm.m), 2.0f, v) + pool_weight(0.5f, 3.0f), pm) +
           fp8_group_scale(abs_f(v), Fp8Flavour::e4m3fn);
  u[i] = f2u(f[0]);
}

// SPEC §7.6 step 2: the whole pool of one column in one thread (K = 8).
extern "C" __global__ void pool_kernel(const float* sig, const float* kv, float* y) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  bool incl[8];
  for (int k = 0; k < 8; ++k) incl[k] = sig[8 * c + k] > -1e30f;
  y[c] = pool_window<8>(sig + 8 * c, kv + 8 * c, incl);
}

// Row helpers: canonical sums (thread-local and across lanes), norms, RoPE, Hadamard, FP8 row.
extern "C" __global__ void row_kernel(const float* x, const float* w, const float* bias, const float* cs,
                                      float* y, uint8_t* codes, float* scales) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  float row[128];
  for (int i = 0; i < 128; ++i) row[i] = x[128 * r + i];
  const float s0 = canonical_sum<128>(row) + canonical_sum_n(row, 64) + nan_amax(row, 128);
  const int lane = threadIdx.x & 31;
  const float lanes = canonical_reduce_lanes(canonical_partial(row[4 * lane], row[4 * lane + 1], row[4 * lane + 2],
                                                               row[4 * lane + 3]),
                                             32, [](float v, int s) { return DSQ_SHFL_XOR(v, s); });
  float p[8] = {row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7]};
  const float s1 = canonical_butterfly(p, 8);
  layer_norm_row<128>(row, w, bias, 1e-6f);
  rope_row128(row, cs, cs + 32, true, false);
  hadamard128(row);
  rms_norm_row<128>(row, w, 1e-6f);
  hadamard_inplace<64>(row + 64);
  scales[r] = fp8_quantize_row(row, 128, Fp8Flavour::e4m3fnuz, Fp8Role::k, true, codes + 128 * r) + s0 + lanes + s1;
  for (int i = 0; i < 128; ++i) y[128 * r + i] = row[i];
}

// SPEC §6 offsets.
extern "C" __global__ void layout_kernel(const int64_t* slots, int64_t P, int64_t H, int64_t* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t t = slots[i];
  int64_t* o = out + 12 * i;
  o[0] = packed68_payload_offset(t, P, i & 63);
  o[1] = packed68_scale_offset(t, P, i & 3);
  o[2] = fp8_132_data_offset(t, P, i & 127, false);
  o[3] = fp8_132_data_offset(t, P, i & 127, true);
  o[4] = fp8_132_scale_offset(t, P);
  o[5] = aiter_fp4_data_offset(t, P, i & 63);
  o[6] = aiter_sflat(t % P, P);
  o[7] = aiter_fp4_scale_offset(t, P, i & 3);
  o[8] = aiter_q_scale_pad(H);
  o[9] = aiter_q_scale_offset(t, i % H, i & 3, H);
  o[10] = kPacked68Row + kFp8132Row + kAiterKTiles + kHeadDim + kRopeDim;
  o[11] = static_cast<int64_t>(kCanonicalNanBits);
}

// Header arithmetic only (no test-side float operators), so that the HIP IR of this kernel can be
// checked for `contract` flags even when built with HIP's default -ffp-contract=fast-honor-pragmas.
extern "C" __global__ void no_contract_kernel(const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float a = x[4 * i], b = x[4 * i + 1];
  rope_pair(a, b, x[4 * i + 2], x[4 * i + 3]);
  y[4 * i] = a;
  y[4 * i + 1] = b;
  y[4 * i + 2] = layer_norm_apply(a, b, x[4 * i + 2], x[4 * i + 3]);
  y[4 * i + 3] = exp_ds(fsub(canonical_partial(a, b, a, b), fdiv(fsqrt(a), b)));
}

// The exact FP4 logit (exact_dot.h): one key row per thread against one query row of 64 heads.
extern "C" __global__ void exact_logit_kernel(const uint8_t* q, const uint32_t* qexp, const float* w,
                                              const uint8_t* k, const uint32_t* kexp, float* out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  out[j] = exact_logit(q, qexp, w, 64, k + 64 * j, kexp[j]);
}
