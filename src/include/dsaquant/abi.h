/* dsaquant/abi.h: the C interface of the compiled library (libdsaquant_cuda.so / libdsaquant_hip.so).
 *
 * One argument struct per op, passed by pointer with the stream handle:
 *   int dsq_<op>(const Dsq<Op>Args* args, void* stream)
 * returns the cudaError_t / hipError_t code of the launch (0: launched). Pointers are raw device pointers,
 * strides are in elements, dtype and option fields hold the codes of dsaquant/codes.h. `device` is the
 * device index of the op's tensors: the call makes it current for the launch and restores the caller's.
 * The kernels take these structs by value (kernels/cuda/indexer.h, compress_args.h).
 *
 * Each struct's fields are listed once, as an X-macro X(type, name); the list expands into the struct and
 * into the layout table that dsq_abi_field() reports, against which tests check the ctypes mirror
 * (python/dsaquant/backends/abi.py). Plain C: includable from C and C++.
 */
#ifndef DSAQUANT_ABI_H
#define DSAQUANT_ABI_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DSQ_ABI_VERSION 1

/* RoPE tables: cos/sin two [max_pos, 32] tables of `dtype`, or `pairs`: one fp32 [max_pos, 64] (cos, sin). */
#define DSQ_FIELDS_DsqRope(X)                                                                      \
  X(const void*, cos) X(const void*, sin) /* sin: unused with pairs */                             \
  X(int64_t, row_stride)                  /* elements between positions */                         \
  X(int64_t, max_pos) X(int, dtype) X(bool, pairs)                                                 \
  X(bool, vec)                            /* tables and row stride 16-byte aligned: vector loads */

/* SPEC §7.1 indexer_qk_rope_quant_and_cache. */
#define DSQ_FIELDS_DsqIndexerArgs(X)                                                               \
  X(int, device) X(int64_t, T) X(int64_t, H) X(int64_t, num_blocks) X(int64_t, P)                  \
  X(const void*, q) X(int64_t, q_st) X(int64_t, q_sh) X(bool, q_vec)                               \
  X(const void*, k) X(int64_t, k_st) X(bool, k_vec)                                                \
  X(int, in_dt)                                    /* q and k dtype (bf16 / fp16) */               \
  X(const void*, w) X(int64_t, w_st) X(int64_t, w_sh) X(int, w_dt)                                \
  X(void*, w_out) X(int64_t, w_out_st) X(int64_t, w_out_sh) X(int, w_out_dt) /* [T, H] */          \
  X(uint8_t*, q_out)                 /* [T, H, 128] fp8 codes or [T, H, 64] fp4 bytes */           \
  X(uint8_t*, q_scale_out)           /* FP4: [T, 1, 4, 16, qs_pad] */                              \
  X(uint8_t*, kv_cache) X(uint8_t*, kv_scale) /* kv_scale: FP4 only */                             \
  X(const void*, slots) X(int, slots_dt)                                                           \
  X(const void*, positions) X(int, pos_dt)                                                         \
  X(const void*, norm_w) X(int, norm_w_dt)                                                         \
  X(const void*, norm_b) X(int, norm_b_dt)                                                         \
  X(DsqRope, rope) X(float, eps) X(float, weights_scale)                                           \
  X(bool, fp4) X(bool, neox) X(bool, compute_all) X(bool, preshuffle) X(bool, ue8m0)               \
  X(int, rounding) X(int, flavour) X(int*, err_flag)

/* SPEC §7.2 index_k_norm_rope_pack_store and §7.3 (aiter V4 k writer); mode: KStoreMode. */
#define DSQ_FIELDS_DsqKStoreArgs(X)                                                                \
  X(int, device) X(int64_t, T) X(int64_t, num_blocks) X(int64_t, P)                                \
  X(const void*, k) X(int64_t, k_st) X(bool, k_vec) X(int, in_dt)                                  \
  X(const void*, norm_w) X(int, norm_w_dt)                                                         \
  X(const void*, positions) X(int, pos_dt)                                                         \
  X(const void*, slots) X(int, slots_dt)                                                           \
  X(DsqRope, rope) X(int64_t, compress_ratio) X(float, eps) X(int, rounding) X(int, mode)          \
  X(bool, hadamard) X(uint8_t*, cache) X(uint8_t*, cache_scale) X(int*, err_flag)

/* SPEC §7.2 index_q_rope_pack_weights and rope_fake_quant_fp4; mode: QPackMode. */
#define DSQ_FIELDS_DsqQPackArgs(X)                                                                 \
  X(int, device) X(int64_t, T) X(int64_t, H)                                                       \
  X(const void*, q) X(int64_t, q_st) X(int64_t, q_sh) X(bool, q_vec) X(int, in_dt)                 \
  X(const void*, positions) X(int, pos_dt)                                                         \
  X(DsqRope, rope) X(int64_t, compress_ratio) X(int, rounding) X(int, mode)                        \
  X(const void*, w) X(int64_t, w_st) X(int64_t, w_sh) X(int, w_dt) X(float, weight_scale)          \
  X(uint8_t*, payload)               /* [T, H, 64] */                                              \
  X(int32_t*, exps)                  /* [T, H] */                                                  \
  X(float*, w_out)                   /* [T, H] */                                                  \
  X(uint16_t*, fq_out)               /* fake quant: [T, H, 128] in in_dt */                        \
  X(int*, err_flag)

/* SPEC §7.6 compress_kv. D = head_dim (128 | 512), K = (1 + overlap) * ratio window rows. */
#define DSQ_FIELDS_DsqCompressArgs(X)                                                              \
  X(int, device) X(int64_t, T) X(int64_t, B) X(int64_t, ratio) X(int64_t, R) X(int64_t, n_ring)    \
  X(int, D) X(int, K) X(bool, overlap)                                                             \
  X(const void*, kv) X(int64_t, kv_st)     /* [T, C] rows strided, fp32 or bf16 (in_dt) */         \
  X(const void*, score) X(int64_t, sc_st)  /* [T, C], same dtype */                                \
  X(int, in_dt)                                                                                    \
  X(const float*, ape) X(int64_t, ape_st)  /* [ratio, C] */                                        \
  X(float*, state_kv) X(int64_t, skv_s0) X(int64_t, skv_s1)       /* [N_ring, R, C] */             \
  X(float*, state_score) X(int64_t, ssc_s0) X(int64_t, ssc_s1)    /* [N_ring, R, C] */             \
  X(const int32_t*, state_slot)            /* [B] */                                               \
  X(const int32_t*, cu_seqlens)            /* [B+1] */                                             \
  X(const int64_t*, start_pos)             /* [B] */                                               \
  X(const void*, norm_w) X(int, norm_w_dt) /* [D] fp32 or bf16 */                                  \
  X(float, eps) X(DsqRope, rope)                                                                   \
  X(const int64_t*, out_slots)             /* [T] */                                               \
  X(uint8_t*, cache)                       /* by quant_mode (SPEC §7.6 Outputs) */                 \
  X(uint8_t*, cache_scale)                 /* aiter_fp4 only */                                    \
  X(int64_t, num_blocks) X(int64_t, P)                                                             \
  X(int, quant_mode)                       /* QuantMode */                                         \
  X(bool, aiter_layout)                    /* fp4: aiter_fp4 (else packed68) */                    \
  X(int, scale_rule) X(int, rounding)      /* ScaleRule, Rounding */                               \
  X(bool, ue8m0) X(int, flavour) X(bool, preshuffle)  /* fp8 */                                    \
  X(bool, hadamard) X(int, bf16_after)     /* RoundPoint bits */                                   \
  X(bool, update_state) X(int*, err_flag)

/* SPEC §7.7 rope_rotate_quant. D in 128 | 256 | 512 | 1024; out_kind: OutKind. */
#define DSQ_FIELDS_DsqRotateArgs(X)                                                                \
  X(int, device) X(int64_t, T) X(int64_t, H) X(int, D)                                             \
  X(const void*, x) X(int64_t, x_st) X(int64_t, x_sh) X(int, in_dt) /* [T, H, D], last dim dense */ \
  X(DsqRope, rope) X(const void*, positions) X(int, pos_dt)                                        \
  X(int, out_kind)                                                                                 \
  X(uint8_t*, out) X(int64_t, out_st) X(int64_t, out_sh)                                           \
  /* out: fp4 [T, H, D/2] / fp8 [T, H, D] contiguous; half: strides in elements */                 \
  X(uint8_t*, out_scale)                                                                           \
  /* out_scale: fp4 u8 shuffled [T, D/128, 4, 16, qs_pad] or dense [T, H, D/g]; fp8 fp32 [T, H, D/g] */ \
  X(int, group) X(bool, shuffle) X(bool, hadamard) X(int, rounding) X(int, flavour) X(int*, err_flag)

/* Hardware vs software e4m3fn / bf16 / fp16 encoders over the fp32 patterns [start, start + count);
 * the mismatches are added to *out. */
#define DSQ_FIELDS_DsqSelfcheckArgs(X)                                                             \
  X(int, device) X(uint64_t, start) X(uint64_t, count) X(unsigned long long*, out)

/* SPEC §0.7 exp_ds of n fp32 values, x -> y. */
#define DSQ_FIELDS_DsqExpDsArgs(X) X(int, device) X(const float*, x) X(float*, y) X(int64_t, n)

/* Every struct of the interface, in dependency order. */
#define DSQ_ABI_STRUCTS(X)                                                                         \
  X(DsqRope) X(DsqIndexerArgs) X(DsqKStoreArgs) X(DsqQPackArgs) X(DsqCompressArgs) X(DsqRotateArgs) \
  X(DsqSelfcheckArgs) X(DsqExpDsArgs)

/* Every op: X(entry point, argument struct). */
#define DSQ_ABI_OPS(X)                                                                             \
  X(dsq_indexer, DsqIndexerArgs) X(dsq_kstore, DsqKStoreArgs) X(dsq_qpack, DsqQPackArgs)           \
  X(dsq_compress_kv, DsqCompressArgs) X(dsq_rope_rotate_quant, DsqRotateArgs)                      \
  X(dsq_fp8_selfcheck, DsqSelfcheckArgs) X(dsq_exp_ds, DsqExpDsArgs)

#define DSQ_ABI_FIELD_(type, name) type name;
#define DSQ_ABI_STRUCT_(S) typedef struct S { DSQ_FIELDS_##S(DSQ_ABI_FIELD_) } S;
DSQ_ABI_STRUCTS(DSQ_ABI_STRUCT_)
#undef DSQ_ABI_STRUCT_
#undef DSQ_ABI_FIELD_

#if defined(_WIN32)
#define DSQ_API __declspec(dllexport)
#else
#define DSQ_API __attribute__((visibility("default")))
#endif

#define DSQ_ABI_DECLARE_(fn, S) DSQ_API int fn(const S* args, void* stream);
DSQ_ABI_OPS(DSQ_ABI_DECLARE_)
#undef DSQ_ABI_DECLARE_

/* DSQ_ABI_VERSION of the library. */
DSQ_API int dsq_abi_version(void);
/* sizeof(struct_name), or -1 for a name that is not one of DSQ_ABI_STRUCTS. */
DSQ_API int64_t dsq_abi_sizeof(const char* struct_name);
/* The i-th field of struct_name (its name; *offset and *size set), or NULL past the last field. */
DSQ_API const char* dsq_abi_field(const char* struct_name, int i, int64_t* offset, int64_t* size);
/* The runtime's name and description of an error code returned by an op. */
DSQ_API const char* dsq_error_string(int code);
/* The device code built into the library, as text: its targets separated by ';', e.g. "sm_90a;sm_100a;compute_80"
 * (sm_*: machine code (a cubin) for that architecture, sm_*f: for its family; compute_*: PTX, compiled by the
 * driver for the GPU it runs on; gfx*: AMD code objects). "" where the build did not record it. */
DSQ_API const char* dsq_device_code(void);
/* The code that runs the library's kernels on device `device` (all kernels are built for the same targets; one
 * stands for them): *binary = the architecture of its machine code, *ptx = the virtual architecture it was
 * compiled from, both as major * 10 + minor. *ptx < *binary: the driver compiled the PTX at load time (JIT);
 * otherwise a cubin runs as built. Returns the runtime's error code (0: both set; no image for the device:
 * cudaErrorNoKernelImageForDevice). Loads the module on the device (the JIT compile, where there is one). */
DSQ_API int dsq_kernel_code(int device, int* ptx, int* binary);

#ifdef __cplusplus
}
#endif

#endif /* DSAQUANT_ABI_H */
