"""String constants (and str-enums) for the options every op takes. Plain strings work everywhere too."""
from enum import Enum


class Rounding(str, Enum):
    """SPEC §2 rounding policies for FP4 codes."""
    THRESHOLD = "threshold"   # midpoints toward zero (sglang-c4, DeepGEMM reference packer)
    RNE = "rne"               # round half to even, no -0 code (sglang-v41)
    HARDWARE = "hardware"     # AMD v_cvt_scalef32_pk_fp4_f32: RNE, keeps the sign of zero


class Layout(str, Enum):
    """SPEC §6 cache layouts."""
    PACKED68 = "packed68"     # FP4, sglang-v41 / DeepGEMM / vLLM V4
    FP8_132 = "fp8_132"       # FP8, aiter / vLLM / sglang V3.2
    AITER_FP4 = "aiter_fp4"   # FP4, aiter pa_mqa_logits_fp4


ROUNDINGS = tuple(r.value for r in Rounding)
LAYOUTS = tuple(x.value for x in Layout)
SCALE_RULES = ("pack", "recip")
FP8_FLAVOURS = ("e4m3fn", "e4m3fnuz")
