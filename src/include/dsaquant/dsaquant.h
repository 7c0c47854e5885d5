// dsaquant/dsaquant.h: the shared header, all of it. The one C++ definition of SPEC §0-§6 for
// host C++17, CUDA (nvcc) and HIP (clang). See docs/shared_header.md.
#pragma once

#include "codes.h"     // the integer codes shared with Python (Rounding, ScaleRule, Fp8Flavour, DType, ...)
#include "platform.h"  // DSQ_HD, bit casts, fadd/fsub/fmul/fdiv/fsqrt, rint, fmaxf (§0.1, §0.3)
#include "arith.h"     // pow2, ceil_exp, nan_amax, bf16/fp16, canonical sum, exp_ds (§0)
#include "e2m1.h"      // FP4 codes, policies, packing, block encoder, stage-1 value (§1, §2, §3, §7.2)
#include "e2m1x8.h"    // the same encoder for bf16 inputs, two values per operation (§1-§3)
#include "two_stage_x8.h" // §7.2 stage 1 and stage 2 for bf16 inputs, two values per operation
#include "ue8m0.h"     // FP4 block scale rules pack / recip (§3)
#include "fp8.h"       // E4M3 flavours, row scales (§4)
#include "rope.h"      // RoPE, LayerNorm, RMSNorm, Hadamard (§5)
#include "layouts.h"   // cache offsets (§6)
#include "pool.h"      // the compressor's window pool (§7.6 step 2)
#include "exact_dot.h" // the exact FP4 logit of mqa_logits(exact=True) (docs/prefill.md)
