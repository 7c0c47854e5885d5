// dsaquant/codes.h: every integer code shared by the Python side and the kernels, defined once. The Python
// mirror is python/dsaquant/codes.py (same enum names, same member names, same values); tests/test_codes.py
// compiles this header and compares the two name by name.
//
// Each enum is an X-macro list X(member, value), expanded here into an `enum class` and, through
// DSQ_CODE_ENUMS, into whatever else needs the whole table (the test's printer).
#pragma once

// SPEC §2 rounding policies of FP4 codes.
#define DSQ_CODES_Rounding(X) X(threshold, 0) X(rne, 1) X(hardware, 2)
// SPEC §6 cache layouts.
#define DSQ_CODES_Layout(X) X(fp8_132, 0) X(packed68, 1) X(aiter_fp4, 2)
// SPEC §3 UE8M0 block-scale rules.
#define DSQ_CODES_ScaleRule(X) X(pack, 0) X(recip, 1)
// SPEC §4 FP8 E4M3 flavours.
#define DSQ_CODES_Fp8Flavour(X) X(e4m3fn, 0) X(e4m3fnuz, 1)
// SPEC §7.6 compress_kv quantisation of the compressed rows.
#define DSQ_CODES_QuantMode(X) X(none, 0) X(fp4, 1) X(fp4_sim, 2) X(fp8, 3)
// SPEC §7.6 steps 3-6: the points after which values are rounded to bf16 (bits, OR-ed).
#define DSQ_CODES_RoundPoint(X) X(pool, 1) X(norm, 2) X(rope, 4) X(hadamard, 8)
// SPEC §7.7 rope_rotate_quant output kinds.
#define DSQ_CODES_OutKind(X) X(fp4, 0) X(fp8, 1) X(half, 2)
// The k writer's cache formats: SPEC §7.2 sglang-v41 packed68, §7.3 aiter_fp4, §7.3 dense.
#define DSQ_CODES_KStoreMode(X) X(packed68, 0) X(aiter_fp4, 1) X(dense, 2)
// The q packer's outputs: SPEC §7.2 payload + weights, rope_fake_quant_fp4 with ue8m0/32 or e4m3/16 scales.
#define DSQ_CODES_QPackMode(X) X(pack, 0) X(fake_ue8m0, 1) X(fake_e4m3, 2)
// Element dtypes of the tensors the kernels read and write.
#define DSQ_CODES_DType(X) X(f32, 0) X(bf16, 1) X(f16, 2) X(i32, 3) X(i64, 4)
// Bits of the per-device int32 error flag (python/dsaquant/errors.py).
#define DSQ_CODES_ErrFlag(X) X(slot_out_of_range, 1) X(position_out_of_range, 2) X(page_out_of_range, 4)

#define DSQ_CODE_ENUMS(X)                                                                                   \
  X(Rounding) X(Layout) X(ScaleRule) X(Fp8Flavour) X(QuantMode) X(RoundPoint) X(OutKind) X(KStoreMode)     \
  X(QPackMode) X(DType) X(ErrFlag)

#ifdef __cplusplus
#if defined(__CUDACC__) || defined(__HIP__)
#define DSQ_CODE_FN __host__ __device__ constexpr
#else
#define DSQ_CODE_FN constexpr
#endif

namespace dsq {

#define DSQ_CODE_MEMBER_(member, value) member = value,
#define DSQ_CODE_ENUM_(name) enum class name : int { DSQ_CODES_##name(DSQ_CODE_MEMBER_) };
DSQ_CODE_ENUMS(DSQ_CODE_ENUM_)
#undef DSQ_CODE_ENUM_
#undef DSQ_CODE_MEMBER_

// The int of a code, for the int fields of the argument structs and for integer template parameters.
template <class E>
DSQ_CODE_FN int code(E e) { return static_cast<int>(e); }

// The DType codes as ints: the kernels switch on them and take them as template parameters.
constexpr int kF32 = code(DType::f32), kBF16 = code(DType::bf16), kF16 = code(DType::f16), kI32 = code(DType::i32),
              kI64 = code(DType::i64);

}  // namespace dsq
#endif
