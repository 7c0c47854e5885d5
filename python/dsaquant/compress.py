"""The DeepSeek-V4 ops of SPEC §7.6 (`compress_kv`, the compressor) and §7.7 (`rope_rotate_quant`, query-side
RoPE + rotate + quant), following ops.py's pattern: validate (SPEC §7.5) -> dispatch.choose -> one
`torch.library` custom op with its mutated arguments declared and a fake implementation.

`compress_kv` knobs can be filled by name from `PRESETS` (SPEC §7.6 table) with `preset=`; keywords given
explicitly override the preset. See docs/compress_kv.md for the shapes, the ring and the presets.
"""

from typing import Optional

import torch
from torch import Tensor

from . import dispatch, errors, preference
from . import validate as V
from .reference.compress import FP4_OUT_DTYPES, FP8_OUT_DTYPES, QUANT_MODES, ROUNDING_POINTS
from .reference.fp4 import POLICIES, SCALE_RULES
from .reference.fp8 import FLAVOURS
from .reference.layouts import aiter_q_scale_pad

F32, BF16 = torch.float32, torch.bfloat16


class _Unset:
    """Marks a knob the caller did not pass: the preset's value, else the SPEC default, applies."""

    def __repr__(self):
        return "<default>"


_UNSET = _Unset()

# SPEC §7.6 signature defaults of the knobs a preset may set.
DEFAULTS = {
    "quant_mode": "none", "layout": "packed68", "scale_rule": "recip", "rounding": "rne", "scale_fmt": "ue8m0",
    "fp8_flavour": "e4m3fn", "preshuffle": False, "hadamard": False, "bf16_after": ("pool", "norm", "rope"),
}

# SPEC §7.6 presets: the settings that bring compress_kv to each producer's rounding points. Agreement with the
# producer itself is a tolerance test (see the table's "remaining differences"), never a byte test.
# quant_mode is not part of a preset: the cache the caller passes decides it. `layout` applies to quant_mode
# "fp4"; `scale_fmt` and `preshuffle` to "fp8".
PRESETS = {
    "dsv4-ref": {"bf16_after": ("pool", "norm", "rope", "hadamard"), "hadamard": True, "scale_rule": "recip",
                 "rounding": "rne", "layout": "packed68"},
    "aiter": {"bf16_after": (), "hadamard": False, "scale_rule": "recip", "rounding": "hardware",
              "layout": "aiter_fp4", "scale_fmt": "ue8m0", "preshuffle": True},
    "vllm-v4": {"bf16_after": ("rope",), "hadamard": False, "scale_rule": "recip", "rounding": "hardware",
                "layout": "packed68", "scale_fmt": "ue8m0", "preshuffle": False},
    "sglang-c4": {"bf16_after": (), "hadamard": True, "scale_rule": "pack", "rounding": "threshold",
                  "layout": "packed68", "scale_fmt": None, "preshuffle": False},
}

HEAD_DIMS = (128, 512)
RATIOS = (4, 128)
ROTATE_DIMS = (128, 256, 512, 1024)


def _call(op: str, backend: str, *args):
    return dispatch.get(backend, op)(*args)


def _knobs(preset, given: dict) -> dict:
    """SPEC defaults, then the preset, then the explicitly given keywords."""
    if preset is not None:
        if not isinstance(preset, str):
            raise TypeError(f"preset: expected a str (one of {tuple(PRESETS)}) or None, got {type(preset).__name__}")
        V.choice("preset", preset, tuple(PRESETS))
    k = dict(DEFAULTS)
    if preset is not None:
        k.update(PRESETS[preset])
    k.update({n: v for n, v in given.items() if v is not _UNSET})
    return k


def _rounding_points(bf16_after) -> tuple:
    if bf16_after is None:
        return ()
    if isinstance(bf16_after, str) or not isinstance(bf16_after, (tuple, list, set, frozenset)):
        raise TypeError(f"bf16_after: expected a tuple of names from {ROUNDING_POINTS}, got "
                        f"{type(bf16_after).__name__} {bf16_after!r}")
    for n in bf16_after:
        if n not in ROUNDING_POINTS:
            raise ValueError(f"bf16_after: expected names from {ROUNDING_POINTS}, got {n!r}")
    return tuple(n for n in ROUNDING_POINTS if n in bf16_after)   # canonical order, no duplicates


def _boundary_host_checks(cu_seqlens, start_pos, state_slot, out_slots, T, ratio, n_ring, capacity):
    """The opt-in synchronous checks (errors.set_host_checks): cu_seqlens, start_pos, state_slot and the
    out_slots of boundary tokens, as ValueError before anything is written."""
    cu = cu_seqlens.to(torch.int64).cpu()
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens: expected a non-decreasing sequence from 0 to T = {T}, got {cu.tolist()}")
    sp = start_pos.cpu()
    if bool((sp < 0).any()):
        raise ValueError(f"start_pos: expected positions >= 0, got {sp.tolist()}")
    lens = cu[1:] - cu[:-1]
    ss = state_slot.to(torch.int64).cpu()
    bad = (lens > 0) & ((ss < 0) | (ss >= n_ring))
    if bool(bad.any()):
        raise ValueError(f"state_slot: ring slot {int(ss[bad][0])} is outside the ring [0, {n_ring})")
    if T:
        b = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        p = sp[b] + (torch.arange(T) - cu[b])
        slots = out_slots.cpu()[(p + 1) % ratio == 0]
        if slots.numel() and int(slots.max()) >= capacity:
            raise ValueError(f"out_slots: slot id {int(slots.max())} is at or past the cache's capacity {capacity}")


# ------------------------------------------------------------------------------------------------
# §7.6 compress_kv
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::compress_kv", mutates_args=("state_kv", "state_score", "cache", "cache_scale"))
def _compress_op(kv: Tensor, score: Tensor, ape: Tensor, state_kv: Tensor, state_score: Tensor, state_slot: Tensor,
                 cu_seqlens: Tensor, start_pos: Tensor, norm_weight: Tensor, epsilon: float,
                 cos_cache: Optional[Tensor], sin_cache: Optional[Tensor], out_slots: Tensor, cache: Tensor,
                 cache_scale: Optional[Tensor], ratio: int, overlap: bool, quant_mode: str, layout: str,
                 scale_rule: str, rounding: str, scale_fmt: Optional[str], fp8_flavour: str, preshuffle: bool,
                 hadamard: bool, bf16_after: str, freqs: Optional[Tensor], update_state: bool, page_size: int,
                 backend: str) -> None:
    _call("compress_kv", backend, kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos,
          norm_weight, epsilon, cos_cache, sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode,
          layout, scale_rule, rounding, scale_fmt, fp8_flavour, preshuffle, hadamard,
          tuple(n for n in bf16_after.split(",") if n), freqs, update_state, page_size)


@_compress_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def compress_kv(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight, epsilon,
                cos_cache, sin_cache, out_slots, cache, cache_scale=None, *, ratio, overlap=None,
                quant_mode=_UNSET, layout=_UNSET, scale_rule=_UNSET, rounding=_UNSET, scale_fmt=_UNSET,
                fp8_flavour=_UNSET, preshuffle=_UNSET, hadamard=_UNSET, bf16_after=_UNSET, freqs=None,
                update_state=True, preset=None, backend=None):
    """DeepSeek-V4 compressor (SPEC §7.6): pool each run of `ratio` tokens (plus the previous run with overlap)
    by a per-feature softmax over the window, RMSNorm, tail interleaved RoPE at p + 1 - ratio, optional Hadamard,
    then quantize into a cache slot; keep the last K tokens of every sequence in an fp32 ring.

    Sizes: ratio in {4, 128}; overlap defaults to ratio == 4; K = (1+overlap)*ratio; D = head_dim (128, or 512
    with quant_mode "none"); C = (1+overlap)*D. T tokens of B sequences, one after another.
      kv, score [T, C] fp32 or bf16 (same dtype; last dim contiguous; columns [0, D) the overlap half);
      ape [ratio, C] fp32; state_kv, state_score [N_ring, R >= K, C] fp32 (row of sequence b at position p:
      [state_slot[b], p mod R]; state_score holds fl(score + ape[p mod ratio]));
      state_slot [B] int32; cu_seqlens [B+1] int32; start_pos [B] int64 (token i of b at
      start_pos[b] + i - cu_seqlens[b]); norm_weight [D] fp32/bf16; epsilon float;
      cos_cache, sin_cache [max_pos, 32] (bf16/fp16/fp32) or None with freqs [max_pos, 64] fp32;
      out_slots [T] int64 (read at boundary tokens, (p+1) % ratio == 0; negative: no store).
    Outputs by quant_mode (slot t at page t // P, position t % P):
      "none":    cache bf16 [NB, P, D] = bf16(y).
      "fp4":     D = 128, blocks of 32, `scale_rule` ("recip" | "pack"), codes by `rounding`
                 ("rne" | "hardware" | "threshold"); layout "packed68": cache u8 [NB, P*68];
                 layout "aiter_fp4": cache u8 [NB, 1, 4, 64, 16] and cache_scale u8 [NB, 1, 4, 64] (P = 64).
      "fp4_sim": D = 128, cache bf16 [NB, P, 128] = §7.2 stage 1 of y with `scale_rule`.
      "fp8":     D = 128, cache u8 (or float8) [NB, P*132], layout fp8_132 (`preshuffle` needs P % 16 == 0);
                 s = max(amax, 1e-4)/fmax, pow2-rounded with scale_fmt "ue8m0" (None: fp32 scales);
                 fp8_flavour "e4m3fn" | "e4m3fnuz" (from the cache's dtype when it is a float8 dtype).
    bf16_after: the subset of ("pool", "norm", "rope", "hadamard") after which y is rounded to bf16.
    Defaults (SPEC): quant_mode "none", layout "packed68", scale_rule "recip", rounding "rne", scale_fmt "ue8m0",
    fp8_flavour "e4m3fn", preshuffle False, hadamard False, bf16_after ("pool", "norm", "rope").
    preset: one of PRESETS ("dsv4-ref", "aiter", "vllm-v4", "sglang-c4") fills those knobs; explicit keywords win.
    update_state: write the ring rows of the last K tokens of every sequence (after every read).
    Bytes never depend on how a sequence is split into calls. Slots at or past the cache's capacity and ring
    slots outside the ring are skipped and reported by dsaquant.check_errors() (or rejected up front with
    dsaquant.set_host_checks(True)).
    """
    kn = _knobs(preset, dict(quant_mode=quant_mode, layout=layout, scale_rule=scale_rule, rounding=rounding,
                             scale_fmt=scale_fmt, fp8_flavour=fp8_flavour, preshuffle=preshuffle, hadamard=hadamard,
                             bf16_after=bf16_after))
    V.number("ratio", ratio, (int,))
    V.choice("ratio", ratio, RATIOS)
    if overlap is None:
        overlap = ratio == 4
    V.flag("overlap", overlap)
    K = ratio * (2 if overlap else 1)
    quant_mode, layout, scale_rule, rounding = kn["quant_mode"], kn["layout"], kn["scale_rule"], kn["rounding"]
    V.choice("quant_mode", quant_mode, QUANT_MODES)
    V.choice("layout", layout, ("packed68", "aiter_fp4", "fp8_132"))
    if quant_mode == "fp4" and layout == "fp8_132":
        raise ValueError("layout: quant_mode 'fp4' stores into 'packed68' or 'aiter_fp4', got 'fp8_132'")
    V.choice("scale_rule", scale_rule, SCALE_RULES)
    V.choice("rounding", rounding, POLICIES)
    V.choice("scale_fmt", kn["scale_fmt"], ("ue8m0", None))
    V.choice("fp8_flavour", kn["fp8_flavour"], tuple(FLAVOURS))
    V.flag("preshuffle", kn["preshuffle"])
    V.flag("hadamard", kn["hadamard"])
    V.flag("update_state", update_state)
    points = _rounding_points(kn["bf16_after"])

    V.tensor("kv", kv, (F32, BF16), (None, None), last_contiguous=True)
    T, C = kv.shape
    dev = kv.device
    V.tensor("score", score, (kv.dtype,), (T, C), dev, last_contiguous=True)
    D = C // (2 if overlap else 1)
    if C % (2 if overlap else 1) or D not in HEAD_DIMS:
        raise ValueError(f"kv: expected C = {'2*D' if overlap else 'D'} columns with D in {HEAD_DIMS} "
                         f"(ratio={ratio}, overlap={overlap}), got C = {C}")
    if D == 512 and quant_mode != "none":
        raise ValueError(f"quant_mode: D = 512 is supported only with quant_mode 'none', got {quant_mode!r}")
    V.tensor("ape", ape, (F32,), (ratio, C), dev, last_contiguous=True)
    V.tensor("state_kv", state_kv, (F32,), (None, None, C), dev, last_contiguous=True)
    n_ring, R = state_kv.shape[0], state_kv.shape[1]
    if n_ring < 1 or R < K:
        raise ValueError(f"state_kv: expected a ring [N_ring >= 1, R >= K = {K}, {C}], got {list(state_kv.shape)}")
    V.tensor("state_score", state_score, (F32,), (n_ring, R, C), dev, last_contiguous=True)
    if kn["hadamard"] and D != 128:
        raise ValueError(f"hadamard: the Hadamard needs D = 128, got D = {D}")
    if "hadamard" in points and not kn["hadamard"]:
        raise ValueError("bf16_after: 'hadamard' is a rounding point only with hadamard=True")

    V.tensor("state_slot", state_slot, (torch.int32,), (None,), dev)
    B = state_slot.shape[0]
    V.tensor("cu_seqlens", cu_seqlens, (torch.int32,), (B + 1,), dev)
    V.tensor("start_pos", start_pos, (torch.int64,), (B,), dev)
    V.tensor("out_slots", out_slots, (torch.int64,), (T,), dev)
    V.tensor("norm_weight", norm_weight, (F32, BF16), (D,), dev)
    V.epsilon("epsilon", epsilon)
    if freqs is not None:
        V.tensor("freqs", freqs, (F32,), (None, 64), dev, last_contiguous=True)
        for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
            if t is not None:
                raise ValueError(f"{name}: pass either cos_cache and sin_cache or freqs, not both (expected None)")
        max_pos = freqs.shape[0]
    else:
        V.tensor("cos_cache", cos_cache, V.FLOATS, (None, 32), dev, last_contiguous=True)
        V.tensor("sin_cache", sin_cache, (cos_cache.dtype,), (cos_cache.shape[0], 32), dev, last_contiguous=True)
        max_pos = cos_cache.shape[0]
    if max_pos < 1:
        raise ValueError(f"{'freqs' if freqs is not None else 'cos_cache'}: expected at least one position row, got 0")

    flavour = kn["fp8_flavour"]
    scale_needed = quant_mode == "fp4" and layout == "aiter_fp4"
    if quant_mode in ("none", "fp4_sim"):
        V.tensor("cache", cache, (BF16,), (None, None, D), dev, contiguous=True)
        P = cache.shape[1]
    elif quant_mode == "fp4" and layout == "packed68":
        V.tensor("cache", cache, (torch.uint8,), None, dev, contiguous=True)
        P = V.page_size_of("cache", cache, 68)
    elif quant_mode == "fp4":
        V.tensor("cache", cache, (torch.uint8,), (None, 1, 4, None, 16), dev, contiguous=True)
        P = cache.shape[3]
        if P != 64:
            raise ValueError(f"cache: layout 'aiter_fp4' needs page size 64 (the compressor's scale interleave), "
                             f"got {P}")
        V.tensor("cache_scale", cache_scale, (torch.uint8,), (cache.shape[0], 1, 4, P), dev, contiguous=True)
    else:
        V.tensor("cache", cache, (torch.uint8, *V.FP8_DTYPES), None, dev, contiguous=True)
        P = V.page_size_of("cache", cache, 132)
        if kn["preshuffle"]:
            V.page_multiple_of_16("cache", P, "preshuffle")
        from_dtype = V.FP8_DTYPES.get(cache.dtype)
        if from_dtype:
            if fp8_flavour is not _UNSET and fp8_flavour != from_dtype:
                raise ValueError(f"fp8_flavour: {fp8_flavour!r} contradicts cache's dtype {cache.dtype}")
            flavour = from_dtype
    if cache.shape[0] < 1 or P < 1:
        raise ValueError(f"cache: expected at least one page of at least one slot, got shape {list(cache.shape)}")
    if not scale_needed and cache_scale is not None:
        raise ValueError(f"cache_scale: only quant_mode 'fp4' with layout 'aiter_fp4' takes cache_scale; "
                         f"expected None, got a tensor (quant_mode={quant_mode!r}, layout={layout!r})")
    if errors.host_checks_enabled():
        _boundary_host_checks(cu_seqlens, start_pos, state_slot, out_slots, T, ratio, n_ring, cache.shape[0] * P)
    if T == 0 or B == 0:
        return
    name = dispatch.choose_for("compress_kv", dev, backend, T,
                               preference.variant("compress_kv", ratio=ratio, decode=T == B))
    _compress_op(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight,
                 float(epsilon), cos_cache, sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode,
                 layout, scale_rule, rounding, kn["scale_fmt"], flavour, kn["preshuffle"], kn["hadamard"],
                 ",".join(points), freqs, update_state, P, name)


# ------------------------------------------------------------------------------------------------
# §7.7 rope_rotate_quant
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::rope_rotate_quant", mutates_args=("out", "out_scale"))
def _rope_rotate_op(out: Tensor, x: Tensor, cos_cache: Tensor, sin_cache: Tensor, positions: Tensor, rope_dim: int,
                    out_scale: Optional[Tensor], group_size: int, shuffle_scale: bool, hadamard: bool, rounding: str,
                    backend: str) -> None:
    _call("rope_rotate_quant", backend, out, x, cos_cache, sin_cache, positions, rope_dim, out_scale, group_size,
          shuffle_scale, hadamard, rounding)


@_rope_rotate_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def _group(group_size, default: int, D: int) -> int:
    if group_size is None:
        return default
    V.number("group_size", group_size, (int,))
    if group_size < 16 or group_size > D or group_size & (group_size - 1):
        raise ValueError(f"group_size: expected a power of two in [16, {D}], got {group_size}")
    return group_size


def rope_rotate_quant(out, x, cos_cache, sin_cache, positions, rope_dim=64, out_scale=None, group_size=None,
                      shuffle_scale=True, hadamard=True, rounding="hardware", *, backend=None):
    """Query-side RoPE + rotate + quant (SPEC §7.7; compat: AITER's `rope_rotate_activation`): tail RoPE with
    interleaved pairs on the last 64 dims, kept in fp32, then the optional Hadamard over D, then by out's dtype.

    x [T, H, D] bf16/fp16/fp32 (last dim contiguous), D in {128, 256, 512, 1024}, H a power of two;
    cos_cache, sin_cache [max_pos, 32] bf16/fp16/fp32; positions [T] int32/int64 (clamped and reported);
    rope_dim must be 64.
      out uint8 or float4_e2m1fn_x2 [T, H, D/2]: FP4, groups of `group_size` (default 32), rule recip, codes by
        `rounding`; out_scale uint8: shuffle_scale=True -> the aiter q-scale layout [T, D/128, 4, 16,
        round_up(H/16, 4)] (group_size 32, H % 16 == 0; pad entries written 0); False -> dense [T, H, D/group_size].
      out float8_e4m3fn / float8_e4m3fnuz [T, H, D]: groups of `group_size` (default 128),
        s = max(amax, 1e-10)/fmax, out_scale fp32 [T, H, D/group_size] (shuffle_scale is ignored).
      out bf16/fp16 of x's dtype [T, H, D]: the rotated values rounded to that dtype; out may be x itself.
    Any other dtype of out, or a missing out_scale where one is needed, raises (no silent fall-through).
    """
    V.tensor("x", x, V.FLOATS, None, last_contiguous=True)
    if x.dim() != 3:
        raise ValueError(f"x: expected shape [T, H, D], got {list(x.shape)}")
    T, H, D = x.shape
    dev = x.device
    if D not in ROTATE_DIMS:
        raise ValueError(f"x: expected D in {ROTATE_DIMS}, got shape {list(x.shape)}")
    if H < 1 or H & (H - 1):
        raise ValueError(f"x: expected H a power of two, got H = {H}")
    V.number("rope_dim", rope_dim, (int,))
    if rope_dim != 64:
        raise ValueError(f"rope_dim: only 64 is supported, got {rope_dim}")
    V.tensor("cos_cache", cos_cache, V.FLOATS, (None, 32), dev, last_contiguous=True)
    V.tensor("sin_cache", sin_cache, (cos_cache.dtype,), (cos_cache.shape[0], 32), dev, last_contiguous=True)
    if cos_cache.shape[0] < 1:
        raise ValueError("cos_cache: expected at least one position row, got 0")
    V.tensor("positions", positions, V.INDEX, (T,), dev)
    V.flag("shuffle_scale", shuffle_scale)
    V.flag("hadamard", hadamard)
    V.choice("rounding", rounding, POLICIES)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype in FP4_OUT_DTYPES:
        out_format = "fp4"
        g = _group(group_size, 32, D)
        V.tensor("out", out, None, (T, H, D // 2), dev, contiguous=True)
        if out_scale is None:
            raise ValueError("out_scale: FP4 output needs out_scale (uint8 exponents), got None")
        if shuffle_scale:
            if g != 32:
                raise ValueError(f"group_size: the shuffled (aiter) q-scale layout needs group_size 32, got {g}")
            if H % 16:
                raise ValueError(f"x: the shuffled (aiter) q-scale layout needs H % 16 == 0, got H = {H}")
            V.tensor("out_scale", out_scale, (torch.uint8,), (T, D // 128, 4, 16, aiter_q_scale_pad(H)), dev,
                     contiguous=True)
        else:
            V.tensor("out_scale", out_scale, (torch.uint8,), (T, H, D // g), dev, contiguous=True)
    elif out.dtype in FP8_OUT_DTYPES:
        out_format = "fp8"
        g = _group(group_size, 128, D)
        V.tensor("out", out, None, (T, H, D), dev, contiguous=True)
        if out_scale is None:
            raise ValueError("out_scale: FP8 output needs out_scale (fp32 group scales), got None")
        V.tensor("out_scale", out_scale, (F32,), (T, H, D // g), dev, contiguous=True)
    elif out.dtype in V.HALFS and out.dtype == x.dtype:
        out_format = "half"
        V.tensor("out", out, None, (T, H, D), dev)
        if group_size is not None:
            raise ValueError(f"group_size: a {_dtype_name(out.dtype)} output has no groups; expected None, "
                             f"got {group_size!r}")
        if out_scale is not None:
            raise ValueError(f"out_scale: a {_dtype_name(out.dtype)} output has no scales; expected None, got a tensor")
        g = 0
    else:
        raise TypeError(f"out: expected dtype uint8 or float4_e2m1fn_x2 (FP4), float8_e4m3fn or float8_e4m3fnuz "
                        f"(FP8), or x's dtype when x is bfloat16/float16 ({_dtype_name(x.dtype)}), "
                        f"got {_dtype_name(out.dtype)}")
    if T == 0:
        return
    name = dispatch.choose_for("rope_rotate_quant", dev, backend, T,
                               preference.variant("rope_rotate_quant", out_format=out_format))
    _rope_rotate_op(out, x, cos_cache, sin_cache, positions, rope_dim, out_scale, g, shuffle_scale, hadamard,
                    rounding, name)
