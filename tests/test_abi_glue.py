"""The glue of the compiled backends (python/dsaquant/backends/compiled.py) fills each op's argument struct
(backends/abi.py) with the call's pointers, strides, codes and device, and nothing else: driven here with CPU tensors
and a recording stand-in for the library, every keyword the glue gives is a field of the struct (ctypes would keep
a misspelt one as a stray Python attribute and leave the field zero), and the fields hold the values of the call."""
from __future__ import annotations

import ctypes

import pytest
import torch

from dsaquant import errors, testing as tt
from dsaquant.backends import abi
from dsaquant.backends.compiled import make_ops
from dsaquant.codes import Fp8Flavour, KStoreMode, QPackMode, QuantMode, Rounding, ScaleRule, dtype_code
from dsaquant.reference import ops as ref_ops


class Recorder:
    def __init__(self):
        self.calls = []

    def has(self, op):
        return True

    def launch(self, op, args, stream):
        self.calls.append((op, args, stream))


def _fields(s) -> dict:
    return {n: getattr(s, n) for n, _ in s._fields_}


def _check(rec: Recorder, op: str, struct: type) -> ctypes.Structure:
    assert len(rec.calls) == 1
    name, args, stream = rec.calls[0]
    assert name == op and isinstance(args, struct) and stream == 0
    assert args.__dict__ == {}, f"keywords that are no field of {struct.__name__}: {sorted(args.__dict__)}"
    assert args.device == 0 and args.err_flag == errors.flag_tensor("cpu").data_ptr()
    return args


def _run(op: str, **kw):
    rec = Recorder()
    make_ops(rec)[op](**kw)
    return rec


def _indexer_kwargs(mode):
    import inspect
    a = tt.make_indexer(T=5, H=16, mode=mode, page_size=16, seed=1)
    sig = inspect.signature(ref_ops.indexer_qk_rope_quant_and_cache)
    kw = {k: a.get(k) for k in sig.parameters if k in a}
    kw.update(fp8_flavour="e4m3fnuz" if mode == "fp8" else "e4m3fn", page_size=16)
    for k in ("q_scale_out", "kv_cache_scale"):
        kw.setdefault(k, None)
    return kw


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_indexer_struct(mode):
    kw = _indexer_kwargs(mode)
    a = _check(_run("indexer_qk_rope_quant_and_cache", **kw), "indexer", abi.DsqIndexerArgs)
    q = kw["q"]
    assert (a.T, a.H, a.num_blocks, a.P) == (5, 16, kw["kv_cache"].shape[0], 16)
    assert (a.q, a.q_st, a.q_sh) == (q.data_ptr(), q.stride(0), q.stride(1))
    assert a.k == kw["k"].data_ptr() and a.in_dt == dtype_code(q.dtype)
    assert a.w_out == kw["weights_out"].data_ptr() and a.w_out_dt == dtype_code(kw["weights_out"].dtype)
    assert a.kv_cache == kw["kv_cache"].data_ptr() and a.q_out == kw["q_out"].data_ptr()
    assert a.fp4 == (mode == "fp4") and bool(a.kv_scale) == (mode == "fp4")
    assert a.rounding == Rounding[kw["rounding"]] and a.flavour == Fp8Flavour[kw["fp8_flavour"]]
    assert a.rope.cos == kw["cos_cache"].data_ptr() and a.rope.max_pos == kw["cos_cache"].shape[0]
    assert a.rope.dtype == dtype_code(kw["cos_cache"].dtype) and not a.rope.pairs
    assert a.eps == pytest.approx(kw["epsilon"]) and a.neox == kw["is_neox"]


def test_k_store_and_q_pack_structs():
    k = tt.make_k_store(T=6, page_size=16, seed=2, compress_ratio=4, rounding="threshold")
    a = _check(_run("index_k_norm_rope_pack_store", **k, page_size=16), "kstore", abi.DsqKStoreArgs)
    assert a.mode == KStoreMode.packed68 and a.rounding == Rounding.threshold and a.compress_ratio == 4
    assert a.rope.pairs and a.rope.cos == k["freqs"].data_ptr() and a.cache == k["cache"].data_ptr()
    v = tt.make_v4_k(T=6, page_size=16, seed=3, layout="dense")
    args = {n: v[n] for n in ("kv", "norm_weight", "epsilon", "positions", "cos_cache", "sin_cache", "slot_mapping",
                              "kv_cache", "kv_cache_scale", "rounding", "layout")}
    a = _check(_run("rmsnorm_rope_rotate_fp4quant_kvcache", **args, hadamard_on=True, page_size=16), "kstore",
               abi.DsqKStoreArgs)
    assert a.mode == KStoreMode.dense and a.hadamard and a.cache_scale == v["kv_cache_scale"].data_ptr()
    q = tt.make_q_pack(T=4, H=16, seed=4, rounding="hardware")
    outs = (torch.empty(4, 16, 64, dtype=torch.uint8), torch.empty(4, 16, dtype=torch.int32),
            torch.empty(4, 16, dtype=torch.float32))
    a = _check(_run("index_q_rope_pack_weights", q=q["q"], positions=q["positions"], freqs=q["freqs"],
                    head_weights=q["head_weights"], weight_scale=0.5, rounding="hardware", payload_out=outs[0],
                    exps_out=outs[1], weights_out=outs[2]), "qpack", abi.DsqQPackArgs)
    assert a.mode == QPackMode.pack and a.rounding == Rounding.hardware and a.weight_scale == 0.5
    assert (a.payload, a.exps, a.w_out, a.fq_out) == (outs[0].data_ptr(), outs[1].data_ptr(), outs[2].data_ptr(), None)
    x = q["q"][:, 0].contiguous()
    out = torch.empty_like(x)
    a = _check(_run("rope_fake_quant_fp4", x=x, positions=q["positions"], freqs=q["freqs"], block=16, scale="e4m3",
                    compress_ratio=1, out=out), "qpack", abi.DsqQPackArgs)
    assert a.mode == QPackMode.fake_e4m3 and a.fq_out == out.data_ptr() and (a.T, a.H) == (4, 1)


def test_compress_and_rotate_structs():
    import inspect

    from dsaquant.reference import compress as rc
    c = tt.make_compress_kv(starts=(0, 3), lens=(6, 5), quant_mode="fp4", layout="aiter_fp4", scale_rule="pack",
                            rounding="threshold", seed=5)
    sig = inspect.signature(rc.compress_kv)
    kw = {k: c.get(k) for k in sig.parameters}
    kw.update(overlap=True, fp8_flavour="e4m3fn", bf16_after=("pool", "rope"), update_state=True,
              hadamard_on=False, page_size=c["cache"].shape[3], preshuffle=False, scale_fmt="ue8m0", freqs=None)
    a = _check(_run("compress_kv", **kw), "compress_kv", abi.DsqCompressArgs)
    assert a.quant_mode == QuantMode.fp4 and a.aiter_layout and a.scale_rule == ScaleRule.pack
    assert a.rounding == Rounding.threshold and a.bf16_after == 1 | 4 and a.K == 2 * c["ratio"]
    assert a.state_kv == c["state_kv"].data_ptr() and a.cache_scale == c["cache_scale"].data_ptr()
    r = tt.make_rope_rotate_quant(T=3, out="e4m3fnuz", seed=6)
    a = _check(_run("rope_rotate_quant", out=r["out"], x=r["x"], cos_cache=r["cos_cache"], sin_cache=r["sin_cache"],
                    positions=r["positions"], rope_dim=64, out_scale=r["out_scale"], group_size=128,
                    shuffle_scale=False, hadamard_on=True, rounding="rne"), "rope_rotate_quant", abi.DsqRotateArgs)
    assert a.out_kind == 1 and a.flavour == Fp8Flavour.e4m3fnuz and a.group == 128 and a.out == r["out"].data_ptr()
