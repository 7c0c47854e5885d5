"""Every Triton writer kernel (dsaquant/triton/quant.py, and the DeepSeek-V4 kernels of compress.py and
rope_rotate.py) compiles ahead of time, without a GPU, for sm_90, sm_100, gfx942 and gfx950, in the variants
the ops launch (each constexpr setting below), through the same specialisation path a real launch takes
(argument alignment and divisibility from the actual tensors).

The compiled code is also checked for the SPEC §0.1 / §8 hazards: no fp32 FMA, no flush-to-zero and no
approximate division, square root, reciprocal, exp2 or log2 in the PTX; no fast-math or `contract` flags
on the LLVM IR's float operations (either target). The packed bf16x2 FP4 encoder (inline PTX) must be in
the NVIDIA builds of the variants that take it (so ptxas accepts it for sm_90 and sm_100) and nowhere else.

Needs the kernels as JIT functions: skipped (with the reason) in a process running TRITON_INTERPRET=1.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from dsaquant import testing as tt  # noqa: E402
from dsaquant.testing import AOT_TARGETS, triton_aot_missing, triton_jit_module  # noqa: E402

TARGETS = {name: t[:3] for name, t in AOT_TARGETS.items()}   # (backend, arch, warp size)


def _quant():
    return triton_jit_module("quant", "_indexer_kernel")


# ---- the ops' positional arguments (the reference signature), built on CPU tensors ----------------------
def _indexer(mode, policy="hardware", flavour="e4m3fn", scale_fmt="ue8m0", preshuffle=False, neox=True,
             all_q=False, dtype=torch.bfloat16, cs_dtype=None, w_dtype=None, wo_dtype=None):
    f8 = torch.float8_e4m3fnuz if flavour == "e4m3fnuz" else torch.float8_e4m3fn
    a = tt.make_indexer(T=8, H=16, mode=mode, dtype=dtype, preshuffle=preshuffle, is_neox=neox, scale_fmt=scale_fmt,
                        rounding=policy, compute_all_q_rope=all_q, fp8_dtype=f8, max_pos=64)
    if cs_dtype is not None:
        a["cos_cache"], a["sin_cache"], _ = tt.rope_tables(64, "cpu", cs_dtype)
    if w_dtype is not None:
        a["weights"] = a["weights"].to(w_dtype)
    if wo_dtype is not None:
        a["weights_out"] = torch.empty(a["weights_out"].shape, dtype=wo_dtype)
    P = 64
    fp4 = mode == "fp4"
    return (a["q"], a["q_out"], a["weights"], a["weights_out"], a["k"], a["kv_cache"], a["slot_mapping"],
            a["norm_weight"], a["norm_bias"], a["positions"], a["cos_cache"], a["sin_cache"], a["epsilon"],
            a["quant_block_size"], a["scale_fmt"] if not fp4 else "ue8m0", a["weights_scale"], preshuffle, neox,
            all_q, a.get("q_scale_out"), a.get("kv_cache_scale"), policy, "e4m3fn" if fp4 else flavour, P)


def _k_store(policy, ratio=1, dtype=torch.bfloat16, nw_dtype=None):
    a = tt.make_k_store(T=8, compress_ratio=ratio, rounding=policy, dtype=dtype, max_pos=64)
    nw = a["norm_weight"] if nw_dtype is None else a["norm_weight"].to(nw_dtype)
    return (a["k"], nw, a["eps"], a["positions"], a["freqs"], a["slots"], a["cache"], ratio, policy, 64)


def _q_pack(policy, dtype=torch.bfloat16, w_dtype=torch.float32):
    a = tt.make_q_pack(T=4, H=16, rounding=policy, dtype=dtype, max_pos=64)
    T, H = 4, 16
    return (a["q"], a["positions"], a["freqs"], a["head_weights"].to(w_dtype), a["weight_scale"], policy,
            torch.empty(T, H, 64, dtype=torch.uint8), torch.empty(T, H, dtype=torch.int32),
            torch.empty(T, H, dtype=torch.float32))


def _fake_quant(block, scale, ratio=1, dtype=torch.bfloat16, three_d=False):
    a = tt.make_q_pack(T=4, H=16, dtype=dtype, max_pos=64)
    x = a["q"] if three_d else a["q"][:, 0, :].contiguous()
    return (x, a["positions"], a["freqs"], block, scale, ratio, torch.empty_like(x))


def _v4_k(policy, hadamard=True, layout="aiter_fp4", dtype=torch.bfloat16, cs_dtype=None):
    a = tt.make_v4_k(T=8, hadamard=hadamard, rounding=policy, layout=layout, dtype=dtype, max_pos=64)
    if cs_dtype is not None:
        a["cos_cache"], a["sin_cache"], _ = tt.rope_tables(64, "cpu", cs_dtype)
    return (a["kv"], a["norm_weight"], a["epsilon"], a["positions"], a["cos_cache"], a["sin_cache"],
            a["slot_mapping"], a["kv_cache"], a["kv_cache_scale"], hadamard, policy, layout,
            64 if layout == "aiter_fp4" else 1)


VARIANTS = {
    "indexer-fp8-e4m3fn-ue8m0-neox": lambda: ("indexer_qk_rope_quant_and_cache", _indexer("fp8")),
    "indexer-fp8-e4m3fn-ue8m0-neox-soft": lambda: ("indexer_qk_rope_quant_and_cache", _indexer("fp8")),
    "indexer-fp8-e4m3fnuz-fp32scale-il-preshuffle-fp16": lambda: (
        "indexer_qk_rope_quant_and_cache",
        _indexer("fp8", flavour="e4m3fnuz", scale_fmt=None, preshuffle=True, neox=False, all_q=True,
                 dtype=torch.float16, cs_dtype=torch.float32)),
    "indexer-fp4-hardware-neox": lambda: ("indexer_qk_rope_quant_and_cache", _indexer("fp4", "hardware")),
    "indexer-fp4-hardware-neox-unpacked": lambda: ("indexer_qk_rope_quant_and_cache", _indexer("fp4", "hardware")),
    "indexer-fp4-rne-il-fp16": lambda: ("indexer_qk_rope_quant_and_cache",
                                        _indexer("fp4", "rne", neox=False, dtype=torch.float16,
                                                 w_dtype=torch.float32, wo_dtype=torch.float16)),
    "indexer-fp4-threshold": lambda: ("indexer_qk_rope_quant_and_cache", _indexer("fp4", "threshold", all_q=True)),
    "k_store-rne-r1": lambda: ("index_k_norm_rope_pack_store", _k_store("rne")),
    "k_store-threshold-r4-fp16": lambda: ("index_k_norm_rope_pack_store",
                                          _k_store("threshold", 4, torch.float16, torch.float32)),
    "k_store-hardware-r2": lambda: ("index_k_norm_rope_pack_store", _k_store("hardware", 2)),
    "q_pack-rne": lambda: ("index_q_rope_pack_weights", _q_pack("rne")),
    "q_pack-threshold-fp16": lambda: ("index_q_rope_pack_weights", _q_pack("threshold", torch.float16,
                                                                           torch.bfloat16)),
    "q_pack-hardware": lambda: ("index_q_rope_pack_weights", _q_pack("hardware")),
    "fake_quant-ue8m0-2d": lambda: ("rope_fake_quant_fp4", _fake_quant(32, "ue8m0")),
    "fake_quant-e4m3-3d-fp16-r4": lambda: ("rope_fake_quant_fp4", _fake_quant(16, "e4m3", 4, torch.float16, True)),
    "v4_k-hardware-hadamard-aiter": lambda: ("rmsnorm_rope_rotate_fp4quant_kvcache", _v4_k("hardware")),
    "v4_k-hardware-hadamard-aiter-soft": lambda: ("rmsnorm_rope_rotate_fp4quant_kvcache", _v4_k("hardware")),
    "v4_k-rne-dense-fp32": lambda: ("rmsnorm_rope_rotate_fp4quant_kvcache",
                                    _v4_k("rne", False, "dense", torch.float32, torch.float32)),
    "v4_k-threshold-fp16": lambda: ("rmsnorm_rope_rotate_fp4quant_kvcache", _v4_k("threshold", True, "aiter_fp4",
                                                                                  torch.float16, torch.float16)),
}


# ---- the DeepSeek-V4 kernels (dsaquant/triton/compress.py, rope_rotate.py) -------------------------------
def _v4():
    _quant()
    from dsaquant.triton import compress, rope_rotate
    return compress, rope_rotate


def _page_size(a):
    c, mode = a["cache"], a["quant_mode"]
    if mode in ("none", "fp4_sim"):
        return c.shape[1]
    if c.dim() == 5:
        return c.shape[3]
    return c.shape[1] // (68 if mode == "fp4" else 132)


def _compress(starts=(0,), lens=(512,), **kw):
    """The positional arguments of reference.compress.compress_kv, from testing.make_compress_kv."""
    a = tt.make_compress_kv(starts=starts, lens=lens, **kw)
    return (a["kv"], a["score"], a["ape"], a["state_kv"], a["state_score"], a["state_slot"], a["cu_seqlens"],
            a["start_pos"], a["norm_weight"], a["epsilon"], a["cos_cache"], a["sin_cache"], a["out_slots"], a["cache"],
            a["cache_scale"], a["ratio"], a["overlap"], a["quant_mode"], a.get("layout", "packed68"),
            a.get("scale_rule", "recip"), a.get("rounding", "rne"), a.get("scale_fmt", "ue8m0"),
            a.get("fp8_flavour", "e4m3fn"), a.get("preshuffle", False), a["hadamard"], a["bf16_after"], a["freqs"],
            a["update_state"], _page_size(a))


def _compress_state(**kw):
    args = _compress(**kw)
    return args[:8] + (args[15], args[16])


def _rope_rotate(**kw):
    """The positional arguments of reference.compress.rope_rotate_quant, from testing.make_rope_rotate_quant."""
    a = tt.make_rope_rotate_quant(**kw)
    default_group = 128 if kw.get("out") in ("e4m3fn", "e4m3fnuz") else 32
    return (a["out"], a["x"], a["cos_cache"], a["sin_cache"], a["positions"], 64, a.get("out_scale"),
            a.get("group_size", default_group), a["shuffle_scale"], a["hadamard"], a["rounding"])


V4_VARIANTS = {  # name -> (prepare function name, args); "-soft": the DSAQUANT_TRITON_NATIVE=0 fallback
    "compress-r4-fp4-packed68-bf16-blocked": ("compress", lambda: _compress(quant_mode="fp4", hadamard=True)),
    "compress-r4-fp4-packed68-bf16-blocked-soft": ("compress", lambda: _compress(quant_mode="fp4")),
    "compress-r4-fp4-aiter-hardware-decode": ("compress", lambda: _compress(
        starts=tuple(range(3, 256, 4)), lens=(1,) * 64, quant_mode="fp4", layout="aiter_fp4", rounding="hardware",
        bf16_after=())),
    "compress-r4-fp8-e4m3fn-preshuffle-fp32": ("compress", lambda: _compress(
        quant_mode="fp8", preshuffle=True, dtype=torch.float32, cs_dtype=torch.float32)),
    "compress-r4-fp8-e4m3fnuz-fp32scale": ("compress", lambda: _compress(
        quant_mode="fp8", fp8_flavour="e4m3fnuz", scale_fmt=None, nw_dtype=torch.bfloat16)),
    "compress-r4-fp4sim-pack-freqs-fp32": ("compress", lambda: _compress(
        quant_mode="fp4_sim", scale_rule="pack", use_freqs=True, dtype=torch.float32)),
    "compress-r4-nooverlap-none": ("compress", lambda: _compress(quant_mode="none", overlap=False)),
    "compress-r128-none-D512": ("compress", lambda: _compress(ratio=128, D=512, quant_mode="none")),
    "compress-r128-fp4-pack-threshold-fp32": ("compress", lambda: _compress(
        ratio=128, quant_mode="fp4", scale_rule="pack", rounding="threshold", dtype=torch.float32,
        cs_dtype=torch.float16)),
    "compress-r128-overlap-fp4sim": ("compress", lambda: _compress(ratio=128, overlap=True, quant_mode="fp4_sim")),
    "compress_state-bf16-C256": ("compress_state", lambda: _compress_state()),
    "compress_state-fp32-C512": ("compress_state", lambda: _compress_state(ratio=128, D=512, dtype=torch.float32)),
    "rope_rotate-fp4-shuffled-bf16": ("rope_rotate", lambda: _rope_rotate(T=8, H=64)),
    "rope_rotate-fp4-shuffled-bf16-soft": ("rope_rotate", lambda: _rope_rotate(T=8, H=64)),
    "rope_rotate-fp4-shuffled-H16-fp32-rne-nohadamard": ("rope_rotate", lambda: _rope_rotate(
        T=4, H=16, dtype=torch.float32, cs_dtype=torch.float32, rounding="rne", hadamard=False)),
    "rope_rotate-fp4-dense-g32-fp16-threshold": ("rope_rotate", lambda: _rope_rotate(
        T=4, H=8, dtype=torch.float16, group_size=32, shuffle_scale=False, rounding="threshold")),
    "rope_rotate-fp4-dense-g16-D1024-fp16-threshold": ("rope_rotate", lambda: _rope_rotate(
        T=4, H=4, D=1024, dtype=torch.float16, group_size=16, shuffle_scale=False, rounding="threshold")),
    "rope_rotate-fp8-e4m3fn-D512": ("rope_rotate", lambda: _rope_rotate(T=4, H=8, D=512, out="e4m3fn")),
    "rope_rotate-fp8-e4m3fnuz-g64-fp32x": ("rope_rotate", lambda: _rope_rotate(
        T=4, H=8, out="e4m3fnuz", group_size=64, dtype=torch.float32, cs_dtype=torch.float32)),
    "rope_rotate-bf16-D256-nohadamard": ("rope_rotate", lambda: _rope_rotate(T=4, H=8, D=256, out="half",
                                                                             hadamard=False)),
}




def target_modes(target):
    """The code paths a launch on that GPU takes (quant.launch_modes on a real device): NATIVE everywhere,
    HW_FP8 on NVIDIA sm_89+ (for e4m3fn launches; quant.launch_modes drops it for other flavours), PACKED_FP4
    (the bf16x2 PTX FP4 encoder) on NVIDIA sm_80+ (each prepare_* keeps it for bf16 values only)."""
    cuda = target.backend == "cuda"
    return dict(NATIVE=True, HW_FP8=cuda and int(target.arch) >= 89, PACKED_FP4=cuda and int(target.arch) >= 80)


# Variants whose launch takes the packed bf16x2 FP4 encoder on NVIDIA (formats.e2m1_code_bf16x2): the FP4
# indexer on bf16 q/k and the §7.2 key writer (bf16 stage-2 values for every input dtype). Not: the fp16 FP4
# indexer, the FP8 indexer, the §7.2 query packer (its closed-form two stages, formats.two_stage_scales, need no
# encoder), rope_fake_quant_fp4 (no codes) and the §7.3 writer (fp32 values).
PACKED_FP4_VARIANTS = {"indexer-fp4-hardware-neox", "indexer-fp4-threshold", "k_store-rne-r1",
                       "k_store-threshold-r4-fp16", "k_store-hardware-r2"}
PACKED_FP4_PTX = ("fma.rn.bf16x2", "min.bf16x2", "max.bf16x2")


def compile_and_check(prepared, tgt, kind, variant, target):
    """Compile a prepare_* result (kernel, grid, args, constexprs, warps) for `tgt` and apply the checks every
    variant gets: a binary, check_code, and check_packed_fp4. Returns the compiled kernel."""
    kernel, grid, kargs, consts, warps = prepared
    assert math.prod(grid) >= 1
    compiled = compile_variant(kernel, kargs, consts, warps, tgt)
    binary = "cubin" if kind == "cuda" else "hsaco"
    assert compiled.asm.get(binary), f"{variant} on {target}: no {binary} produced"
    problems = check_code(compiled, kind)
    assert not problems, f"{variant} on {target}:\n" + "\n".join(problems)
    check_packed_fp4(variant, target, consts, compiled, kind)
    return compiled


def check_packed_fp4(variant, target, consts, compiled, kind):
    """The packed FP4 encoder is compiled exactly where expected: its PTX (and so ptxas's verdict on it) in
    the NVIDIA builds of PACKED_FP4_VARIANTS, nowhere else (never for gfx, never in the -soft fallback)."""
    want = kind == "cuda" and variant in PACKED_FP4_VARIANTS
    assert bool(consts.get("PACKED_FP4", False)) == want, f"{variant} on {target}: {consts.get('PACKED_FP4')=}"
    if kind == "cuda":
        ptx = "\n".join(line.split("//")[0] for line in compiled.asm["ptx"].splitlines())
        for insn in PACKED_FP4_PTX:
            assert (insn in ptx) == want, f"{variant} on {target}: {insn} {'missing' if want else 'present'}"
        if want:
            # five per asm instance, at least one instance per 32-value tile (four tiles per row)
            assert ptx.count("fma.rn.bf16x2") >= 5 * 4, f"{variant} on {target}: too few packed FMAs"
    else:
        assert "bf16x2" not in compiled.asm.get("amdgcn", ""), f"{variant} on {target}"


def compile_variant(kernel, args, consts, num_warps, target):
    """Compile one launch's kernel for `target` through the runtime's own specialisation (binder) path."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(consts, num_warps=num_warps, enable_fp_fusion=False, debug=False)
    bound_args, specialization, options = binder(*args, **kwargs)
    opt_kwargs = {k: v for k, v in kwargs.items() if k not in consts}
    options, signature, constexprs, attrs = kernel._pack_args(backend, opt_kwargs, bound_args, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


_FLOAT_OP = re.compile(r"= (fadd|fsub|fmul|fdiv|fneg|frem|fcmp|call float @llvm\.\w+\.f32)\b(.*)")
PTX_FORBIDDEN = [
    (re.compile(r"\bfma\.[a-z.]*f32\b"), "fp32 FMA"),
    (re.compile(r"\bmad\.[a-z.]*f32\b"), "fp32 mad"),
    (re.compile(r"\.ftz\b"), "flush-to-zero"),
    (re.compile(r"\b(div\.approx|div\.full|sqrt\.approx|rsqrt|rcp\.approx|ex2|lg2)\b"), "approximate math"),
    (re.compile(r"\b(add|sub|mul)\.f32\b"), "f32 add/sub/mul without .rn (ptxas may contract it into an FMA)"),
]


def check_code(compiled, kind):
    problems = []
    llir = compiled.asm["llir"]
    for line in llir.splitlines():
        m = _FLOAT_OP.search(line)
        if m and re.search(r"\b(fast|contract|afn|reassoc|arcp|nnan|ninf)\b", m.group(2) + " " + m.group(0)):
            problems.append(f"LLVM float op with a fast-math flag: {line.strip()}")
        if "llvm.fma.f32" in line or "llvm.fmuladd.f32" in line:
            problems.append(f"LLVM fma: {line.strip()}")
    if kind == "cuda":
        for line in compiled.asm["ptx"].splitlines():
            s = line.split("//")[0]
            for rx, what in PTX_FORBIDDEN:
                if rx.search(s):
                    problems.append(f"PTX {what}: {s.strip()}")
    return problems[:10]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_writer_compiles(variant, target):
    quant = _quant()
    kind = TARGETS[target][0]
    why = triton_aot_missing(kind)
    if why:
        pytest.skip(why)
    op, args = VARIANTS[variant]()
    tgt = GPUTarget(*TARGETS[target])
    modes = target_modes(tgt)
    if variant.endswith("-soft"):          # the DSAQUANT_TRITON_NATIVE=0 fallback must compile too
        modes = dict(NATIVE=False, HW_FP8=False, PACKED_FP4=False)
    if variant.endswith("-unpacked"):      # DSAQUANT_TRITON_PACKED_FP4=0: the fp32 integer FP4 encoder
        modes = dict(modes, PACKED_FP4=False)
    compiled = compile_and_check(quant.PREPARE[op](*args, modes=modes), tgt, kind, variant, target)
    # spills would hurt the bandwidth target: report them (not a failure)
    n_spills = getattr(compiled, "n_spills", None)
    if n_spills:
        print(f"{variant} {target}: {n_spills} spilled registers")


def test_every_op_has_an_aot_variant():
    quant = _quant()
    ops = {VARIANTS[v]()[0] for v in VARIANTS}
    assert ops == set(quant.OPS) == set(quant.PREPARE)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("variant", list(V4_VARIANTS))
def test_v4_kernel_compiles(variant, target):
    """compress_kv's two launches and rope_rotate_quant's one (SPEC §7.6, §7.7), same checks as above."""
    compress, rope_rotate = _v4()
    kind = TARGETS[target][0]
    why = triton_aot_missing(kind)
    if why:
        pytest.skip(why)
    which, make = V4_VARIANTS[variant]
    prep = {"compress": compress.prepare_compress, "compress_state": compress.prepare_state,
            "rope_rotate": rope_rotate.prepare_rope_rotate}[which]
    tgt = GPUTarget(*TARGETS[target])
    modes = dict(NATIVE=False, HW_FP8=False) if variant.endswith("-soft") else target_modes(tgt)
    compile_and_check(prep(*make(), modes=modes), tgt, kind, variant, target)


def test_every_v4_op_has_an_aot_variant():
    compress, rope_rotate = _v4()
    names = {v.split("-")[0] for v in V4_VARIANTS}
    assert names == {"compress", "compress_state", "rope_rotate"}
    assert set(compress.OPS) | set(rope_rotate.OPS) == {"compress_kv", "rope_rotate_quant"}
