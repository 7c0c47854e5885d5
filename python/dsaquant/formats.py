"""Public low-level format math (SPEC §1-§4, §7.2 stage 1) for users who test their own kernels or
quantize offline. Every function takes torch tensors on any device and implements the SPEC exactly
(it is the same code the `reference` backend runs).

- `e2m1_encode(v, rounding)`: fp32 already-scaled values -> uint8 codes, one per element (§2).
- `e2m1_decode(codes)`: uint8 codes -> fp32 values (§1).
- `ue8m0_exponent(amax, rule)`: fp32 block maxima -> int32 biased exponents, rule "pack" | "recip" (§3).
- `fp4_quantize(x, rounding, rule, block=32)`: x [..., n] -> (packed uint8 [..., n/2], uint8 exponents [..., n/block]).
- `fp4_dequantize(packed, exponents, block=32)`: the inverse, fp32 [..., n].
- `fp8_encode(x, flavor)` / `fp8_decode(codes, flavor)`: E4M3 codes, flavor "e4m3fn" | "e4m3fnuz" (§4).
- `fp8_quantize(x, flavor, role, scale_fmt)`: per-128 row codes and fp32 scales, role "q" | "k" (§4).
- `fp4_fake_quant(x, block=32, scale="ue8m0")`: §7.2 stage 1 on any tensor, returns x's dtype.
- `exp_ds(x)`: §0.7's exponential. `ceil_exp(f)`: §3's bit rule. `canonical_sum(x)`: §0.2.
"""
from .reference.arith import canonical_sum, ceil_exp, exp_ds
from .reference.fp4 import (E2M1_MAGNITUDES, POLICIES, SCALE_RULES, e2m1_decode, e2m1_encode, fp4_dequantize,
                            fp4_fake_quant, fp4_quantize, pack_nibbles, ue8m0_exponent, unpack_nibbles)
from .reference.fp8 import FLAVOURS, fp8_decode, fp8_encode, fp8_quantize

__all__ = [
    "E2M1_MAGNITUDES", "POLICIES", "SCALE_RULES", "FLAVOURS", "canonical_sum", "ceil_exp", "exp_ds",
    "e2m1_decode", "e2m1_encode", "fp4_dequantize", "fp4_fake_quant", "fp4_quantize", "pack_nibbles",
    "unpack_nibbles", "ue8m0_exponent", "fp8_decode", "fp8_encode", "fp8_quantize",
]
