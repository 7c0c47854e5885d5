// kernels/hip/fp4_selfcheck.hip: the gfx950 FP4 instruction against its emulation, on the GPU (HIP only; linked
// into dsaquant._hip by tools/build_hip.py, called through ctypes by `python3 tools/build_hip.py --selfcheck`).
//
// dsq::e2m1_encode_pair(x_even, x_odd, e, Rounding::hardware) is V_CVT_SCALEF32_PK_FP4_F32 on gfx950 and the
// bit-exact emulation everywhere else (src/include/dsaquant/e2m1.h). This kernel compares it with the emulation
// written out, pack_nibbles(e2m1_encode_scaled(x_even, e, hw), e2m1_encode_scaled(x_odd, e, hw)), for every bf16
// bit pattern (x 5 choices of the 16 low fp32 bits) as x_even, a permutation of them as x_odd, and every
// exponent e = 1..254; twice: raw inputs (NaN keeps its sign) and as the kernels call it (NaN made canonical
// first, arith.h canon_nan). On gfx942 both sides are the emulation (a check of the harness itself).
// Until this reports 0 mismatches on an MI355, the emulation is the definition (docs/shared_header.md).
#include <hip/hip_runtime.h>

#include <cstdint>

#include "dsaquant/dsaquant.h"

namespace dsqk_hip {

using namespace dsq;

struct Fp4Mismatch {      // one recorded disagreement (the first `max_first` of a launch)
  uint32_t x_even, x_odd; // fp32 bits
  int32_t e;              // biased block exponent
  uint32_t codes;         // byte 0: instruction (or the header's pair path), byte 1: emulation, byte 2: 1 = canonical-NaN pass
};

__device__ __forceinline__ uint32_t low_bits(uint32_t variant) {
  switch (variant) {
    case 0: return 0x0000u;
    case 1: return 0x0001u;
    case 2: return 0x7FFFu;
    case 3: return 0x8000u;
    default: return 0xFFFFu;
  }
}

__global__ void __launch_bounds__(256) fp4_hw_selfcheck_kernel(uint32_t variant, unsigned long long* counts,
                                                               Fp4Mismatch* first, unsigned int* n_first,
                                                               unsigned int max_first) {
  constexpr uint64_t kTotal = 65536ull * 254ull;
  const uint32_t lo = low_bits(variant);
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < kTotal;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t p = static_cast<uint32_t>(i & 0xFFFFu);
    const int e = 1 + static_cast<int>(i >> 16);
    const uint32_t q = (p * 40503u + 0x9E37u) & 0xFFFFu;   // an odd multiplier: a permutation of the patterns
    const float xe = u2f((p << 16) | lo), xo = u2f((q << 16) | (lo ^ 0x5555u));
#pragma unroll
    for (int canon = 0; canon < 2; ++canon) {
      const float a = canon ? canon_nan(xe) : xe, b = canon ? canon_nan(xo) : xo;
      const uint8_t hw = e2m1_encode_pair(a, b, e, Rounding::hardware);
      const uint8_t sw = pack_nibbles(e2m1_encode_scaled(a, e, Rounding::hardware),
                                      e2m1_encode_scaled(b, e, Rounding::hardware));
      if (hw != sw) {
        atomicAdd(counts + canon, 1ull);
        const unsigned int k = atomicAdd(n_first, 1u);
        if (k < max_first)
          first[k] = Fp4Mismatch{f2u(a), f2u(b), e, static_cast<uint32_t>(hw) | (static_cast<uint32_t>(sw) << 8) |
                                                     (static_cast<uint32_t>(canon) << 16)};
      }
    }
  }
}

}  // namespace dsqk_hip

// C entry (ctypes): one variant (0..4: the low 16 bits of x_even are 0, 1, 0x7FFF, 0x8000, 0xFFFF) over all
// 65536 x 254 (pattern, e); counts[0] += raw mismatches, counts[1] += canonical-NaN mismatches. Returns hipError_t.
extern "C" __attribute__((visibility("default"))) int dsq_hip_fp4_selfcheck(uint32_t variant, unsigned long long* counts,
                                                                          void* first, unsigned int* n_first,
                                                                          unsigned int max_first, void* stream) {
  dsqk_hip::fp4_hw_selfcheck_kernel<<<2048, 256, 0, static_cast<hipStream_t>(stream)>>>(
      variant, counts, static_cast<dsqk_hip::Fp4Mismatch*>(first), n_first, max_first);
  return static_cast<int>(hipGetLastError());
}
