"""Byte-exact grid on a GPU: every compiled/Triton backend against the reference, same inputs.

Run by ci/gpu_check.sh on the H200 (skipped without CUDA). Outputs are poisoned before each run, so a
byte a backend fails to write (or writes where it must not: skipped rows, pad entries, reserved slot 0)
is a mismatch. The count of compared bytes and mismatches per backend is printed at the end
(tests/gpu/conftest.py) and must show 0 mismatches.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import dsaquant as dq
from dsaquant import dispatch, testing as tt

from .counts import record

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
# The triton backend has its own grid (tests/gpu/test_triton_gpu.py: the same cases, with its hardware
# paths on and off); this file holds the compiled backends to the reference.
BACKENDS = [b for b in ("cuda", "hip") if dispatch.available(b)[0]]
T_GRID = (1, 5, 64, 300, 4096)
H_GRID = (16, 32, 64, 128)
SCALES = (1.0, 40.0, 1e-3, 1e-30)
POLICIES = ("threshold", "rne", "hardware")


def inject_specials(x: torch.Tensor) -> torch.Tensor:
    """The shared special rows: zeros, E2M1 midpoints, NaN/±Inf, tiny values, FMA-exposing RoPE pairs,
    negatives rounding to zero (dsaquant.testing.special_rows)."""
    return tt.special_rows(x)


clone_args = tt.clone_args


def compare(name: str, backend: str, outs_ref, outs_be, label: str, out_names=None):
    bad = 0
    total = 0
    where = []
    for i, (r, b) in enumerate(zip(outs_ref, outs_be)):
        rb, bb = r.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        total += rb.numel()
        diff = (rb != bb)
        n = int(diff.sum())
        bad += n
        if n:
            idx = diff.nonzero()[:4].tolist()
            vals = [(int(rb[tuple(j)]), int(bb[tuple(j)])) for j in idx]
            where.append(f"{out_names[i] if out_names else i}: {n} bytes, first at {idx} (ref, got) {vals}")
    record(backend, name, total, bad)
    assert bad == 0, f"{backend} {name} {label}: {bad} of {total} bytes differ from the reference; " + "; ".join(where)


def run_pair(fn, args: dict, out_keys, backend: str, name: str, label: str, returns=False):
    a_ref, a_be = clone_args(args), clone_args(args)
    r_ref = fn(**a_ref, backend="reference")
    r_be = fn(**a_be, backend=backend)
    torch.cuda.synchronize()
    if returns:
        outs_ref, outs_be = (r_ref if isinstance(r_ref, tuple) else (r_ref,)), (r_be if isinstance(r_be, tuple) else (r_be,))
        names = None
    else:
        names = [k for k in out_keys if a_ref.get(k) is not None]
        outs_ref, outs_be = [a_ref[k] for k in names], [a_be[k] for k in names]
    compare(name, backend, outs_ref, outs_be, label, names)


def indexer_cases():
    """(T, H, mode, scale, policy, neox, preshuffle, scale_fmt, pos dtype, compute_all, fp8 dtype)."""
    cases = []
    for i, (T, H) in enumerate(itertools.product(T_GRID, H_GRID)):
        for mode in ("fp8", "fp4"):
            cases.append((T, H, mode, SCALES[i % 4], POLICIES[i % 3], bool(i % 2), bool((i // 2) % 2),
                          "ue8m0" if i % 3 else None, torch.int32 if i % 2 else torch.int64, i % 5 == 0,
                          torch.float8_e4m3fnuz if i % 4 == 3 else torch.float8_e4m3fn))
    return cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", indexer_cases(), ids=lambda c: f"T{c[0]}-H{c[1]}-{c[2]}-s{c[3]:g}-{c[4]}")
def test_indexer(backend, case):
    T, H, mode, scale, policy, neox, presh, sfmt, pdt, call, f8 = case
    a = tt.make_indexer(T=T, H=H, mode=mode, device=DEV, seed=T * 131 + H, scale=scale, rounding=policy,
                        is_neox=neox, preshuffle=presh, scale_fmt=sfmt, pos_dtype=pdt, compute_all_q_rope=call,
                        fp8_dtype=f8)
    a["q"], a["k"] = inject_specials(a["q"]), inject_specials(a["k"])
    run_pair(dq.indexer_qk_rope_quant_and_cache, a,
             ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"), backend, "indexer", str(case))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H,mode,aligned", [(2048, 48, "fp4", True), (4096, 18, "fp8", True), (4096, 7, "fp8", True),
                                              (2100, 48, "fp4", False), (2048, 64, "fp8", False)])
def test_indexer_whole_token_heads(backend, T, H, mode, aligned):
    """Large T (a warp per token from T * ceil(H/32) = 2048 in FP4, 4096 in FP8; the CUDA kernel's cp.async
    row ring in FP4): FP8 head counts that leave
    part of a warp's last 4 heads empty (those groups compute on a clamped row and store nothing; FP4 needs
    H % 16 == 0), and q rows that are not 16-byte aligned (the one-value-at-a-time loader)."""
    a = tt.make_indexer(T=T, H=H, mode=mode, device=DEV, seed=T + H, rounding="rne")
    a["q"] = inject_specials(a["q"])
    if not aligned:   # row starts 2 bytes past a 16-byte boundary
        wide = torch.empty(T, H, 130, dtype=a["q"].dtype, device=DEV)
        wide[..., 1:129] = a["q"]
        a["q"] = wide[..., 1:129]
    run_pair(dq.indexer_qk_rope_quant_and_cache, a,
             ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"), backend, "indexer whole-token heads",
             f"T{T} H{H} {mode} aligned={aligned}")


@pytest.mark.parametrize("backend", BACKENDS + [b for b in ("triton",) if dispatch.available(b)[0]])
@pytest.mark.parametrize("policy", POLICIES)
def test_indexer_fp4_every_bf16_value(backend, policy):
    """FP4 mode on tt.every_bf16_blocks (every finite bf16 value at five relative scales, NaN and Inf
    blocks) in the q rows, at position 0 (cos 1, sin 0: the RoPE half keeps its values, so both the RoPE'd
    and the plain half encode every value). The CUDA kernel's packed bf16 encoder (e2m1x8.h) on the GPU."""
    blocks = tt.every_bf16_blocks(seed=7)
    H = 64
    T = -(-blocks.shape[0] // (4 * H))
    rows = torch.zeros(T * H * 4, 32, dtype=torch.bfloat16)
    rows[:blocks.shape[0]] = blocks
    a = tt.make_indexer(T=T, H=H, mode="fp4", device=DEV, seed=11, rounding=policy)
    a["q"] = rows.reshape(T, H, 128).to(DEV)
    a["positions"].zero_()
    a["cos_cache"][0] = 1.0
    a["sin_cache"][0] = 0.0
    run_pair(dq.indexer_qk_rope_quant_and_cache, a,
             ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"), backend, "indexer fp4 every bf16",
             policy)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", T_GRID)
@pytest.mark.parametrize("ratio", (1, 2, 4))
def test_k_store(backend, T, ratio):
    for i, policy in enumerate(POLICIES):
        a = tt.make_k_store(T=T, device=DEV, seed=T + ratio * 7 + i, scale=SCALES[(T + i) % 4],
                            compress_ratio=ratio, rounding=policy)
        a["k"] = inject_specials(a["k"])
        if i == 1:
            a["positions"] = a["positions"].to(torch.int32)
        run_pair(dq.index_k_norm_rope_pack_store, a, ("cache",), backend, "index_k_norm_rope_pack_store",
                 f"T{T} r{ratio} {policy}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shift", (1, 2, 3))
def test_k_writers_unaligned(backend, shift):
    """Rows that are not 16-byte aligned (the one-value-at-a-time loads) and caches that are not 4-byte aligned (the
    byte stores); clone_args keeps each tensor's offset and strides."""
    a = tt.make_k_store(T=300, device=DEV, seed=11 + shift)
    a["k"] = tt.at_offset(inject_specials(a["k"]), 2, pad=1)
    a["cache"] = tt.at_offset(a["cache"], shift)
    run_pair(dq.index_k_norm_rope_pack_store, a, ("cache",), backend, "index_k_norm_rope_pack_store unaligned",
             f"shift {shift}")
    for layout in ("aiter_fp4", "dense"):
        a = tt.make_v4_k(T=300, device=DEV, seed=13 + shift, layout=layout, hadamard=True,
                         dtype=torch.float32 if shift == 2 else torch.bfloat16)
        kv = inject_specials(a["kv"])
        a["kv"] = tt.at_offset(kv, kv.element_size(), pad=1)
        a["kv_cache"] = tt.at_offset(a["kv_cache"], shift)
        a["kv_cache_scale"] = tt.at_offset(a["kv_cache_scale"], 3)
        run_pair(dq.rmsnorm_rope_rotate_fp4quant_kvcache, a, ("kv_cache", "kv_cache_scale"), backend,
                 "rmsnorm_rope_rotate_fp4quant_kvcache unaligned", f"{layout} shift {shift}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H", list(itertools.product((1, 5, 64, 300), H_GRID)))
def test_q_pack(backend, T, H):
    for i, policy in enumerate(POLICIES):
        a = tt.make_q_pack(T=T, H=H, device=DEV, seed=T * H + i, scale=SCALES[(H + i) % 4], rounding=policy)
        a["q"] = inject_specials(a["q"])
        run_pair(dq.index_q_rope_pack_weights, a, (), backend, "index_q_rope_pack_weights", f"T{T} H{H} {policy}",
                 returns=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H,dtype,aligned,policy", [(2048, 5, torch.bfloat16, True, "hardware"),
                                                      (2100, 64, torch.bfloat16, False, "threshold"),
                                                      (2048, 64, torch.float16, True, "rne"),
                                                      (2050, 33, torch.bfloat16, True, "rne"),
                                                      (1100, 64, torch.float16, False, "hardware")])
def test_q_pack_whole_token_heads(backend, T, H, dtype, aligned, policy):
    """Large T (a warp per token from T * ceil(H/32) = 2048; the CUDA kernel's cp.async row ring): head counts
    that leave part of a warp's last 4 heads empty (those groups compute on a clamped row and store nothing),
    fp16 q (the scalar two stages), q rows that are not 16-byte aligned (the one-value-at-a-time loader)."""
    a = tt.make_q_pack(T=T, H=H, device=DEV, seed=T + H, scale=SCALES[H % 4], rounding=policy, dtype=dtype)
    a["q"] = inject_specials(a["q"])
    if not aligned:   # row starts 2 bytes past a 16-byte boundary
        wide = torch.empty(T, H, 130, dtype=a["q"].dtype, device=DEV)
        wide[..., 1:129] = a["q"]
        a["q"] = wide[..., 1:129]
    run_pair(dq.index_q_rope_pack_weights, a, (), backend, "index_q_rope_pack_weights whole-token heads",
             f"T{T} H{H} {dtype} aligned={aligned} {policy}", returns=True)


def _every_bf16_rows(T: int, H: int) -> torch.Tensor:
    """q [T, H, 128] bf16 whose first rows are tt.every_bf16_blocks (every finite bf16 value at five relative
    scales, NaN and Inf blocks) and the rest randn."""
    blocks = tt.every_bf16_blocks(seed=7)
    rows = torch.randn(T * H * 4, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert blocks.shape[0] <= rows.shape[0]
    rows[:blocks.shape[0]] = blocks
    return rows.reshape(T, H, 128).to(DEV)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("T", (24, 1024))
def test_q_pack_every_bf16_value(backend, policy, T):
    """The two stages (SPEC §7.2) on tt.every_bf16_blocks in the q rows, at position 0 (cos 1, sin 0: the RoPE
    half keeps its values, so both halves quantize every value), in both of the CUDA kernel's modes (T = 24: a
    block per token's 32 heads; T = 1024: a warp per token, through the row ring): its bf16x2 two stages
    (two_stage_x8.h), the fast path and the general one, on the GPU."""
    H = 64
    a = tt.make_q_pack(T=T, H=H, device=DEV, seed=13, rounding=policy)
    a["q"] = _every_bf16_rows(T, H)
    a["positions"].zero_()
    run_pair(dq.index_q_rope_pack_weights, a, (), backend, "index_q_rope_pack_weights every bf16", f"T{T} {policy}",
             returns=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ((32, "ue8m0"), (16, "e4m3")))
@pytest.mark.parametrize("T", (24, 1024))
def test_rope_fake_quant_every_bf16_value(backend, variant, T):
    """Stage 1 alone (rope_fake_quant_fp4) on the rows above, at position 0, in both kernel modes: the bf16x2
    stage 1 (two_stage_x8.h fake_quant_bf16x2) for UE8M0 scales, the scalar one for e4m3 scales; bf16 and fp16."""
    block, scale = variant
    H = 64
    a = tt.make_q_pack(T=T, H=H, device=DEV, seed=17)
    for dtype in (torch.bfloat16, torch.float16):
        x = _every_bf16_rows(T, H).to(dtype)
        args = dict(x=x, positions=torch.zeros_like(a["positions"]), freqs=a["freqs"], block=block, scale=scale,
                    compress_ratio=1)
        run_pair(dq.rope_fake_quant_fp4, args, (), backend, "rope_fake_quant_fp4 every bf16",
                 f"T{T} {variant} {dtype}", returns=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", (1, 5, 64, 300))
@pytest.mark.parametrize("variant", ((32, "ue8m0", 1), (16, "e4m3", 1), (32, "ue8m0", 4)))
def test_rope_fake_quant(backend, T, variant):
    block, scale, ratio = variant
    for dtype in (torch.bfloat16, torch.float16):
        a = tt.make_q_pack(T=T, H=8, device=DEV, seed=T + block, scale=SCALES[T % 4], dtype=dtype)
        x = inject_specials(a["q"])
        args = dict(x=x, positions=a["positions"], freqs=a["freqs"], block=block, scale=scale, compress_ratio=ratio)
        run_pair(dq.rope_fake_quant_fp4, args, (), backend, "rope_fake_quant_fp4", f"T{T} {variant} {dtype}",
                 returns=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", T_GRID)
@pytest.mark.parametrize("layout", ("aiter_fp4", "dense"))
def test_v4_k(backend, T, layout):
    for i, policy in enumerate(POLICIES):
        a = tt.make_v4_k(T=T, device=DEV, seed=T + i, scale=SCALES[(T + i) % 4], layout=layout, rounding=policy,
                         hadamard=bool(i % 2), dtype=(torch.bfloat16, torch.float32, torch.float16)[i])
        a["kv"] = inject_specials(a["kv"])
        run_pair(dq.rmsnorm_rope_rotate_fp4quant_kvcache, a, ("kv_cache", "kv_cache_scale"), backend,
                 "rmsnorm_rope_rotate_fp4quant_kvcache", f"T{T} {layout} {policy}")
