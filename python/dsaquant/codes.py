"""Every integer code shared by the Python side and the compiled kernels, defined once.

The C++ mirror is src/include/dsaquant/codes.h (same enum names, member names and values;
tests/test_codes.py compiles it and compares). Member names are the option strings the ops take
(`Rounding.rne.name == "rne"`), so an option string maps to its code with `code_of(Rounding, "rne")`
and the tuple of an option's strings is `names(Rounding)`, in code order.
"""
from __future__ import annotations

from enum import IntEnum

import torch


class Rounding(IntEnum):
    """SPEC §2 rounding policies of FP4 codes."""
    threshold = 0   # midpoints toward zero (sglang-c4, DeepGEMM reference packer)
    rne = 1         # round half to even, no -0 code (sglang-v41)
    hardware = 2    # AMD v_cvt_scalef32_pk_fp4_f32: RNE, keeps the sign of zero


class Layout(IntEnum):
    """SPEC §6 cache layouts."""
    fp8_132 = 0     # FP8, aiter / vLLM / sglang V3.2
    packed68 = 1    # FP4, sglang-v41 / DeepGEMM / vLLM V4
    aiter_fp4 = 2   # FP4, aiter pa_mqa_logits_fp4


class ScaleRule(IntEnum):
    """SPEC §3 UE8M0 block-scale rules."""
    pack = 0
    recip = 1


class Fp8Flavour(IntEnum):
    """SPEC §4 FP8 E4M3 flavours."""
    e4m3fn = 0      # bias 7, max 448 (NVIDIA, gfx950)
    e4m3fnuz = 1    # bias 8, max 240 (gfx942)


class QuantMode(IntEnum):
    """SPEC §7.6 compress_kv quantisation of the compressed rows."""
    none = 0
    fp4 = 1
    fp4_sim = 2
    fp8 = 3


class RoundPoint(IntEnum):
    """SPEC §7.6 steps 3-6: the points after which values are rounded to bf16 (bits, OR-ed)."""
    pool = 1
    norm = 2
    rope = 4
    hadamard = 8


class OutKind(IntEnum):
    """SPEC §7.7 rope_rotate_quant output kinds."""
    fp4 = 0
    fp8 = 1
    half = 2


class KStoreMode(IntEnum):
    """The k writer's cache formats: SPEC §7.2 sglang-v41 packed68, §7.3 aiter_fp4 and dense."""
    packed68 = 0
    aiter_fp4 = 1
    dense = 2


class QPackMode(IntEnum):
    """The q packer's outputs: SPEC §7.2 payload + weights; rope_fake_quant_fp4 with ue8m0/32 or e4m3/16 scales."""
    pack = 0
    fake_ue8m0 = 1
    fake_e4m3 = 2


class DType(IntEnum):
    """Element dtypes of the tensors the kernels read and write."""
    f32 = 0
    bf16 = 1
    f16 = 2
    i32 = 3
    i64 = 4


class ErrFlag(IntEnum):
    """Bits of the per-device int32 error flag (errors.py)."""
    slot_out_of_range = 1
    position_out_of_range = 2
    page_out_of_range = 4


ENUMS = (Rounding, Layout, ScaleRule, Fp8Flavour, QuantMode, RoundPoint, OutKind, KStoreMode, QPackMode, DType,
         ErrFlag)

TORCH_DTYPE = {torch.float32: DType.f32, torch.bfloat16: DType.bf16, torch.float16: DType.f16,
               torch.int32: DType.i32, torch.int64: DType.i64}


def names(enum: type[IntEnum]) -> tuple[str, ...]:
    """The option strings of `enum`, in code order."""
    return tuple(m.name for m in sorted(enum, key=int))


def code_of(enum: type[IntEnum], option) -> int:
    """The int code of option string (or member) `option` of `enum`; ValueError naming the choices otherwise."""
    if isinstance(option, enum):
        return int(option)
    try:
        return int(enum[option])
    except (KeyError, TypeError):
        raise ValueError(f"{enum.__name__}: expected one of {names(enum)}, got {option!r}") from None


def dtype_code(dtype: torch.dtype) -> int:
    """The DType code of a torch dtype (float32, bfloat16, float16, int32, int64)."""
    try:
        return int(TORCH_DTYPE[dtype])
    except KeyError:
        raise TypeError(f"dtype {dtype} has no kernel code; expected one of {tuple(TORCH_DTYPE)}") from None


# The option strings of the ops, in code order.
ROUNDINGS = names(Rounding)
LAYOUTS = names(Layout)
SCALE_RULES = names(ScaleRule)
FP8_FLAVOURS = names(Fp8Flavour)
QUANT_MODES = names(QuantMode)
