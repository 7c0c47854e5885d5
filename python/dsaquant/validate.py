"""SPEC §7.5: argument checks shared by every op. Each raises TypeError (wrong type or dtype) or
ValueError (wrong shape, size, device, layout or option) naming the argument, what was expected and
what was given, before anything is launched or written."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from . import codes, errors

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALFS = (torch.bfloat16, torch.float16)
INDEX = (torch.int32, torch.int64)
FP8_DTYPES = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, t, dtypes: Sequence[torch.dtype] | None = None, shape: Sequence | None = None,
           device: torch.device | None = None, contiguous: bool = False, last_contiguous: bool = False):
    """Check one tensor argument. `shape` entries may be None (any size). Returns the tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (like the other inputs), got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(t.stride())}")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected the last dim to be contiguous (stride 1), got strides {list(t.stride())}")
    return t


def choice(name: str, value, options: Sequence) -> None:
    if value not in options:
        raise ValueError(f"{name}: expected one of {tuple(options)}, got {value!r}")


def number(name: str, value, kinds=(int, float)) -> None:
    """A Python int (or float, where `kinds` allows it), never a bool. A float must be finite: a NaN or an
    infinity would reach every element of the output, so it is rejected here like any other bad argument."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name}: expected a Python {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")


_FP32_ZERO_BELOW = 2.0 ** -150
_FP32_INF_FROM = 2.0 ** 128 * (1 - 2.0 ** -25)


def epsilon(name: str, value) -> None:
    """A norm's epsilon: a finite Python number > 0 that stays > 0 and finite once rounded to fp32 (every
    backend adds it to the variance in fp32). A negative epsilon can make `var + eps` negative and its square
    root NaN for ordinary rows; with an epsilon of 0 a row of zeros (under LayerNorm any constant row)
    normalises to 0 * inf = NaN."""
    number(name, value)
    if value <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
    # fp32 round-to-nearest-even of a positive double: 0 at or below 2^-150 (half the smallest subnormal, a tie
    # that goes to 0), inf at or above 2^128 (1 - 2^-25) (halfway between the largest finite fp32 and 2^128).
    # Plain comparisons, so that torch.compile traces them as constants.
    if value <= _FP32_ZERO_BELOW or value >= _FP32_INF_FROM:
        as_fp32 = 0.0 if value <= _FP32_ZERO_BELOW else math.inf
        raise ValueError(f"{name}: expected a number > 0 and finite in fp32, got {value!r} (fp32: {as_fp32!r})")


def flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def page_size_of(name: str, cache: torch.Tensor, row_bytes: int) -> int:
    """P of a cache whose pages are P rows of `row_bytes` bytes each ([NB, P*row] or [NB, P, row])."""
    if cache.dim() < 2 or cache.shape[0] < 1:
        raise ValueError(f"{name}: expected a cache [num_blocks, page_size*{row_bytes}] with num_blocks >= 1, "
                         f"got shape {list(cache.shape)}")
    per = cache[0].numel() * cache.element_size()
    if per % row_bytes or per == 0:
        raise ValueError(f"{name}: each block must hold page_size*{row_bytes} bytes, got {per} bytes per block "
                         f"(shape {list(cache.shape)})")
    return per // row_bytes


def page_multiple_of_16(name: str, P: int, why: str) -> None:
    if P % 16:
        raise ValueError(f"{name}: page size must be a multiple of 16 for {why}, got {P}")


def fp8_flavour_of(q_out: torch.Tensor, fp8_flavour: str | None) -> str:
    """The FP8 flavour: from q_out's dtype (float8_e4m3fn / float8_e4m3fnuz), or `fp8_flavour` for uint8,
    or the device's default (default_fp8_flavour)."""
    from_dtype = FP8_DTYPES.get(q_out.dtype)
    if fp8_flavour is not None:
        choice("fp8_flavour", fp8_flavour, codes.FP8_FLAVOURS)
        if from_dtype and from_dtype != fp8_flavour:
            raise ValueError(f"fp8_flavour: {fp8_flavour!r} contradicts q_out's dtype {q_out.dtype}")
        return fp8_flavour
    return from_dtype or default_fp8_flavour(q_out.device)


def default_fp8_flavour(device: torch.device) -> str:
    """The FP8 flavour of a uint8 output when none is asked for: e4m3fnuz on MI300 (gfx940/941/942, whose
    FP8 units use it), e4m3fn everywhere else (NVIDIA, gfx950, the CPU)."""
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
        if arch.startswith(("gfx940", "gfx941", "gfx942")):
            return "e4m3fnuz"
    return "e4m3fn"


def same_device(**tensors) -> torch.device:
    """All given tensors (None skipped) on one device; returns it."""
    dev = None
    for name, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (like the other inputs), got {t.device}")
    return dev


def host_slot_check(name: str, slots: torch.Tensor, capacity: int) -> None:
    """The opt-in synchronous slot check (errors.set_host_checks): ValueError before anything is written."""
    if errors.host_checks_enabled() and slots.numel():
        hi = int(slots.max().item())
        if hi >= capacity:
            raise ValueError(f"{name}: slot id {hi} is at or past the cache's capacity {capacity}")
