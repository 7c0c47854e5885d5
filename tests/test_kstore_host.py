"""The CUDA k writers' row body on the CPU, byte for byte.

kernels/cuda/kstore_body.cuh holds the row body of SPEC §7.2's index_k_norm_rope_pack_store and §7.3's
rmsnorm_rope_rotate_fp4quant_kvcache that kernels/cuda/kstore_qpack.cu launches on NVIDIA (and hipified on AMD).
tests/cpp/kstore_host.cpp runs the same body on the host: one cooperative fiber per GPU thread (tests/cpp/fibers.h),
the CUDA names from tests/cpp/host_cuda/cuda_runtime.h, a row group's shuffles a rendezvous of its 8 lanes, blocks in
order, reversed or shuffled. It is built twice: with the scalar two stages (AMD's path) and with NVIDIA's bf16x2
two stages for bf16 rows of the v41 writer (on e2m1x8.h's exact emulation of the bf16x2 operations). The module is
driven through the compiled backends' own glue (dsaquant.backends.compiled.make_ops) with CPU tensors, and every
cache byte and the error flags are compared with the reference backend on the same inputs: the grids of
tests/gpu/test_backend_exact.py (every policy, special rows, compress ratios, bf16/fp16/fp32 rows, both V4 layouts,
Hadamard on and off). What this cannot see: the hardware's own conversions and fused add (platform.h fadd_signed is
std::fma here), races (none: each row is one group's), and the launch itself.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import host_cpp
from dsaquant import dispatch
from dsaquant import testing as tt
from dsaquant.backends.abi import Library
from dsaquant.backends.compiled import make_ops

REPO = Path(__file__).resolve().parents[1]
CPP = REPO / "tests" / "cpp"
SOURCES = [CPP / "kstore_host.cpp", CPP / "fibers.h", CPP / "host_cuda" / "cuda_runtime.h",
           *sorted((REPO / "kernels" / "cuda").glob("*.cuh")), REPO / "kernels" / "cuda" / "indexer.h",
           *sorted((REPO / "src" / "include" / "dsaquant").glob("*.h"))]
POLICIES = ("threshold", "rne", "hardware")
SCALES = (1.0, 40.0, 1e-3, 1e-30)


@pytest.fixture(scope="module", params=["scalar", "bf16x2"])
def emu(request):
    if host_cpp.cxx() is None:
        pytest.skip("no C++ compiler")
    packed = request.param == "bf16x2"
    so = host_cpp.build(SOURCES, "test_kstore_host" + ("_bf16x2" if packed else ""), "the k-writer emulator",
                        ("-Wno-unknown-pragmas",) + (("-DDSQ_HOST_BF16X2_PATH",) if packed else ()),
                        includes=(str(CPP / "host_cuda"), str(CPP)))
    lib = Library(str(so))
    assert lib.cdll.dsq_emu_packed_path() == int(packed)
    lib.cdll.dsq_emu_set_block_order.restype = None
    return lib


def _compare(emu, op, make, positional, outputs, order, tag):
    """op on the emulator and on the reference, each on a fresh copy of make()'s inputs: every output byte and
    the error flags."""
    emu.cdll.dsq_emu_set_block_order(order, 5)
    host_cpp.take_flag()
    a_e = make()
    make_ops(emu)[op](*positional(a_e))
    flag_e = host_cpp.take_flag()
    a_r = make()
    dispatch.get("reference", op)(*positional(a_r))
    flag_r = host_cpp.take_flag()
    for k in outputs:
        host_cpp.same_bytes(f"{tag} {k}", a_e[k], a_r[k])
    assert flag_e == flag_r, (tag, flag_e, flag_r)


def _k_store_args(a):
    return (a["k"], a["norm_weight"], float(a["eps"]), a["positions"], a["freqs"], a["slots"], a["cache"],
            a["compress_ratio"], a["rounding"], a["cache"].shape[1] // 68)


def _v4_k_args(a):
    layout = a["layout"]
    P = a["kv_cache"].shape[3] if layout == "aiter_fp4" else 1
    return (a["kv"], a["norm_weight"], float(a["epsilon"]), a["positions"], a["cos_cache"], a["sin_cache"],
            a["slot_mapping"], a["kv_cache"], a["kv_cache_scale"], a["hadamard"], a["rounding"], layout, P)


@pytest.mark.parametrize("T", (1, 5, 64, 300))
@pytest.mark.parametrize("ratio", (1, 2, 4))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_index_k_norm_rope_pack_store(emu, T, ratio, dtype):
    for i, policy in enumerate(POLICIES):
        def make():
            a = tt.make_k_store(T=T, device="cpu", seed=T + ratio * 7 + i, scale=SCALES[(T + i) % 4],
                                compress_ratio=ratio, rounding=policy)
            a["k"] = tt.special_rows(a["k"]).to(dtype)
            if i == 1:
                a["positions"] = a["positions"].to(torch.int32)
            return a
        _compare(emu, "index_k_norm_rope_pack_store", make, _k_store_args, ("cache",), i, f"T{T} r{ratio} {policy}")


@pytest.mark.parametrize("T", (1, 5, 64, 300))
@pytest.mark.parametrize("layout", ("aiter_fp4", "dense"))
def test_rmsnorm_rope_rotate_fp4quant_kvcache(emu, T, layout):
    for i, policy in enumerate(POLICIES):
        for hadamard in (False, True):
            def make():
                a = tt.make_v4_k(T=T, device="cpu", seed=T + i, scale=SCALES[(T + i) % 4], layout=layout,
                                 rounding=policy, hadamard=hadamard,
                                 dtype=(torch.bfloat16, torch.float32, torch.float16)[i])
                a["kv"] = tt.special_rows(a["kv"])
                return a
            _compare(emu, "rmsnorm_rope_rotate_fp4quant_kvcache", make, _v4_k_args, ("kv_cache", "kv_cache_scale"),
                     i, f"T{T} {layout} {policy} hadamard={hadamard}")


def test_bad_slots_and_positions_are_flagged(emu):
    """Slots past the cache and positions past the table: nothing written for them, the same error flags."""
    def make():
        a = tt.make_k_store(T=40, device="cpu", seed=3)
        a["slots"][3] = a["cache"].shape[0] * (a["cache"].shape[1] // 68) + 5
        a["slots"][4] = -2
        a["positions"][5] = a["freqs"].shape[0] + 1
        return a
    _compare(emu, "index_k_norm_rope_pack_store", make, _k_store_args, ("cache",), 2, "bad slots")


@pytest.mark.parametrize("shift", (1, 2, 3))
def test_unaligned_rows_and_caches(emu, shift):
    """Rows that are not 16-byte aligned (the one-value-at-a-time loads) and caches that are not 4-byte aligned
    (the byte stores): the same bytes as the reference."""
    def make_k():
        a = tt.make_k_store(T=37, device="cpu", seed=11 + shift)
        a["k"] = tt.at_offset(a["k"], 2, pad=1)
        a["cache"] = tt.at_offset(a["cache"], shift)
        return a
    _compare(emu, "index_k_norm_rope_pack_store", make_k, _k_store_args, ("cache",), 0, f"v41 shift {shift}")
    for layout in ("aiter_fp4", "dense"):
        def make_v4():
            a = tt.make_v4_k(T=37, device="cpu", seed=13 + shift, layout=layout, hadamard=True,
                             dtype=torch.float32 if shift == 2 else torch.bfloat16)
            kv = a["kv"]
            a["kv"] = tt.at_offset(kv, kv.element_size(), pad=1)
            a["kv_cache"] = tt.at_offset(a["kv_cache"], shift)
            a["kv_cache_scale"] = tt.at_offset(a["kv_cache_scale"], 3)
            return a
        _compare(emu, "rmsnorm_rope_rotate_fp4quant_kvcache", make_v4, _v4_k_args, ("kv_cache", "kv_cache_scale"),
                 1, f"{layout} shift {shift}")


def test_offset_helpers_keep_the_misalignment():
    """The unaligned cases above and in the GPU suites rest on testing.at_offset placing a tensor off alignment and
    testing.clone_tensor (the GPU suites' clones) keeping it there, in storage of its own."""
    k = torch.randn(5, 128).to(torch.bfloat16)
    for nbytes, pad in ((2, 1), (6, 0), (4, 3)):
        u = tt.at_offset(k, nbytes, pad=pad)
        assert torch.equal(u, k) and u.data_ptr() % 16 == nbytes % 16
        assert u.stride(0) == 128 + pad
        c = tt.clone_tensor(u)
        assert torch.equal(c, u) and c.stride() == u.stride() and c.data_ptr() % 16 == nbytes % 16
        assert c.untyped_storage().data_ptr() != u.untyped_storage().data_ptr()
        c.zero_()
        assert torch.equal(u, k)
    cache = tt.at_offset(torch.arange(200, dtype=torch.uint8).view(10, 20), 3)
    assert cache.data_ptr() % 4 == 3 and tt.clone_tensor(cache).data_ptr() % 4 == 3
    with pytest.raises(ValueError, match="nbytes"):
        tt.at_offset(k, 3)
