"""Glue between the ops and a compiled module (dsaquant._cuda or dsaquant._hip).

Each function here has the reference function's signature (python/dsaquant/reference/ops.py), turns
its tensors into raw pointers, element strides and dtype codes (kernels/cuda/row16.cuh `DType`), and
calls the module with the current stream. No host synchronisation; CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from .. import errors
from ..dispatch import register
from ..reference.compress import FP4_OUT_DTYPES, FP8_OUT_DTYPES
from ..reference.fp4 import POLICIES, SCALE_RULES

DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int32: 3, torch.int64: 4}
FLAVOUR = {"e4m3fn": 0, "e4m3fnuz": 1}


def _p(t):
    return 0 if t is None else t.data_ptr()


def _vec(t: torch.Tensor, *strides: int) -> bool:
    """True when every row of t starts on a 16-byte boundary (vector loads are safe)."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in strides)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _rope(positions, cos_cache=None, sin_cache=None, freqs=None):
    if freqs is not None:
        return dict(rope_cos=freqs.data_ptr(), rope_sin=0, rope_stride=freqs.stride(0), rope_max_pos=freqs.shape[0],
                    rope_dt=0, rope_pairs=True, rope_vec=_vec(freqs, freqs.stride(0))), (freqs,)
    if cos_cache.stride(0) != sin_cache.stride(0):
        cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    return dict(rope_cos=cos_cache.data_ptr(), rope_sin=sin_cache.data_ptr(), rope_stride=cos_cache.stride(0),
                rope_max_pos=cos_cache.shape[0], rope_dt=DTYPE[cos_cache.dtype], rope_pairs=False,
                rope_vec=_vec(cos_cache, cos_cache.stride(0)) and _vec(sin_cache, sin_cache.stride(0))), (cos_cache, sin_cache)


def _stream(t: torch.Tensor) -> int:
    if t.device.type == "cpu":   # only tests/test_v4_host.py's emulated module is ever driven with CPU tensors
        return 0
    return torch.cuda.current_stream(t.device).cuda_stream


# SPEC §7.6 codes of kernels/cuda/v4_args.h (QuantMode, RoundPoint).
QUANT_MODE = {"none": 0, "fp4": 1, "fp4_sim": 2, "fp8": 3}
ROUND_POINT = {"pool": 1, "norm": 2, "rope": 4, "hadamard": 8}


def make_ops(mod):
    """The backend functions over compiled module `mod`."""

    def indexer_qk_rope_quant_and_cache(q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight,
                                        norm_bias, positions, cos_cache, sin_cache, epsilon, quant_block_size,
                                        scale_fmt, weights_scale, preshuffle, is_neox, compute_all_q_rope,
                                        q_scale_out, kv_cache_scale, rounding, fp8_flavour, page_size):
        T, H = q.shape[0], q.shape[1]
        nw, nb = _dense(norm_weight), _dense(norm_bias)
        slot_mapping, positions = _dense(slot_mapping), _dense(positions)   # kernels index them densely
        rope, keep = _rope(positions, cos_cache, sin_cache)
        args = dict(
            T=T, H=H, num_blocks=kv_cache.shape[0], P=page_size,
            q=q.data_ptr(), q_st=q.stride(0), q_sh=q.stride(1), q_vec=_vec(q, q.stride(0), q.stride(1)),
            k=k.data_ptr(), k_st=k.stride(0), k_vec=_vec(k, k.stride(0)), in_dt=DTYPE[q.dtype],
            w=weights.data_ptr(), w_st=weights.stride(0), w_sh=weights.stride(1), w_dt=DTYPE[weights.dtype],
            w_out=weights_out.data_ptr(), w_out_st=weights_out.stride(0), w_out_sh=weights_out.stride(1),
            w_out_dt=DTYPE[weights_out.dtype], q_out=q_out.data_ptr(),
            q_scale_out=_p(q_scale_out), kv_cache=kv_cache.data_ptr(), kv_scale=_p(kv_cache_scale),
            slots=slot_mapping.data_ptr(), slots_dt=DTYPE[slot_mapping.dtype],
            positions=positions.data_ptr(), pos_dt=DTYPE[positions.dtype],
            norm_w=nw.data_ptr(), norm_w_dt=DTYPE[nw.dtype], norm_b=nb.data_ptr(), norm_b_dt=DTYPE[nb.dtype],
            eps=float(epsilon), weights_scale=float(weights_scale), fp4=q_scale_out is not None, neox=bool(is_neox),
            compute_all=bool(compute_all_q_rope), preshuffle=bool(preshuffle), ue8m0=scale_fmt == "ue8m0",
            rounding=POLICIES.index(rounding), flavour=FLAVOUR[fp8_flavour],
            err_flag=errors.flag_tensor(q.device).data_ptr(), **rope)
        mod.indexer(args, _stream(q))
        del keep

    def _kstore(k, norm_weight, eps, positions, slots, cache, cache_scale, rope, compress_ratio, rounding, mode,
                hadamard, num_blocks, page_size):
        nw, positions, slots = _dense(norm_weight), _dense(positions), _dense(slots)
        args = dict(T=k.shape[0], num_blocks=num_blocks, P=page_size, k=k.data_ptr(), k_st=k.stride(0),
                    k_vec=_vec(k, k.stride(0)), in_dt=DTYPE[k.dtype], norm_w=nw.data_ptr(), norm_w_dt=DTYPE[nw.dtype],
                    positions=positions.data_ptr(), pos_dt=DTYPE[positions.dtype], slots=slots.data_ptr(),
                    slots_dt=DTYPE[slots.dtype], compress_ratio=int(compress_ratio), eps=float(eps),
                    rounding=POLICIES.index(rounding), mode=mode, hadamard=bool(hadamard), cache=cache.data_ptr(),
                    cache_scale=_p(cache_scale), err_flag=errors.flag_tensor(k.device).data_ptr(), **rope)
        mod.kstore(args, _stream(k))

    def index_k_norm_rope_pack_store(k, norm_weight, eps, positions, freqs, slots, cache, compress_ratio, rounding,
                                     page_size):
        rope, _ = _rope(positions, freqs=freqs)
        _kstore(k, norm_weight, eps, positions, slots, cache, None, rope, compress_ratio, rounding, 0, False,
                cache.shape[0], page_size)

    def rmsnorm_rope_rotate_fp4quant_kvcache(kv, norm_weight, epsilon, positions, cos_cache, sin_cache, slot_mapping,
                                             kv_cache, kv_cache_scale, hadamard_on, rounding, layout, page_size):
        x = kv[:, 0, :] if kv.dim() == 3 else kv
        rope, keep = _rope(positions, cos_cache, sin_cache)
        _kstore(x, norm_weight, epsilon, positions, slot_mapping, kv_cache, kv_cache_scale, rope, 1, rounding,
                1 if layout == "aiter_fp4" else 2, hadamard_on, kv_cache.shape[0], page_size)
        del keep

    def _qpack(q, positions, freqs, compress_ratio, mode, rounding="rne", w=None, weight_scale=1.0, payload=None,
               exps=None, w_out=None, fq_out=None):
        q3 = q if q.dim() == 3 else q.unsqueeze(1)
        positions = _dense(positions)
        rope, _ = _rope(positions, freqs=freqs)
        w_ = w if w is not None else q3
        args = dict(T=q3.shape[0], H=q3.shape[1], q=q3.data_ptr(), q_st=q3.stride(0), q_sh=q3.stride(1),
                    q_vec=_vec(q3, q3.stride(0), q3.stride(1)), in_dt=DTYPE[q3.dtype], positions=positions.data_ptr(),
                    pos_dt=DTYPE[positions.dtype], compress_ratio=int(compress_ratio),
                    rounding=POLICIES.index(rounding), mode=mode, w=_p(w), w_st=w_.stride(0), w_sh=w_.stride(1),
                    w_dt=DTYPE[w_.dtype], weight_scale=float(weight_scale), payload=_p(payload), exps=_p(exps),
                    w_out=_p(w_out), fq_out=_p(fq_out), err_flag=errors.flag_tensor(q.device).data_ptr(), **rope)
        mod.qpack(args, _stream(q))

    def index_q_rope_pack_weights(q, positions, freqs, head_weights, weight_scale, rounding, payload_out, exps_out,
                                  weights_out):
        _qpack(q, positions, freqs, 1, 0, rounding, head_weights, weight_scale, payload_out, exps_out, weights_out)

    def rope_fake_quant_fp4(x, positions, freqs, block, scale, compress_ratio, out):
        _qpack(x, positions, freqs, compress_ratio, 1 if scale == "ue8m0" else 2, fq_out=out)

    def compress_kv(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight, epsilon,
                    cos_cache, sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode, layout, scale_rule,
                    rounding, scale_fmt, fp8_flavour, preshuffle, hadamard_on, bf16_after, freqs, update_state,
                    page_size):
        """SPEC §7.6 (signature: reference/compress.py compress_kv): one launch (kernels/cuda/v4.cu)."""
        T, C = kv.shape
        D = C // 2 if overlap else C
        state_slot, cu_seqlens, start_pos, out_slots = (_dense(t) for t in (state_slot, cu_seqlens, start_pos,
                                                                              out_slots))
        nw = _dense(norm_weight)
        rope, keep = _rope(None, cos_cache, sin_cache, freqs)
        args = dict(
            T=T, B=state_slot.shape[0], ratio=int(ratio), R=state_kv.shape[1], n_ring=state_kv.shape[0], D=D,
            K=int(ratio) * (2 if overlap else 1), overlap=bool(overlap),
            kv=kv.data_ptr(), kv_st=kv.stride(0), score=score.data_ptr(), sc_st=score.stride(0), in_dt=DTYPE[kv.dtype],
            ape=ape.data_ptr(), ape_st=ape.stride(0),
            state_kv=state_kv.data_ptr(), skv_s0=state_kv.stride(0), skv_s1=state_kv.stride(1),
            state_score=state_score.data_ptr(), ssc_s0=state_score.stride(0), ssc_s1=state_score.stride(1),
            state_slot=state_slot.data_ptr(), cu_seqlens=cu_seqlens.data_ptr(), start_pos=start_pos.data_ptr(),
            norm_w=nw.data_ptr(), norm_w_dt=DTYPE[nw.dtype], eps=float(epsilon), out_slots=out_slots.data_ptr(),
            cache=cache.data_ptr(), cache_scale=_p(cache_scale), num_blocks=cache.shape[0], P=int(page_size),
            quant_mode=QUANT_MODE[quant_mode], aiter_layout=layout == "aiter_fp4",
            scale_rule=SCALE_RULES.index(scale_rule), rounding=POLICIES.index(rounding), ue8m0=scale_fmt == "ue8m0",
            flavour=FLAVOUR[fp8_flavour], preshuffle=bool(preshuffle), hadamard=bool(hadamard_on),
            bf16_after=sum(ROUND_POINT[n] for n in set(bf16_after)), update_state=bool(update_state),
            err_flag=errors.flag_tensor(kv.device).data_ptr(), **rope)
        mod.compress_kv(args, _stream(kv))
        del keep

    def rope_rotate_quant(out, x, cos_cache, sin_cache, positions, rope_dim, out_scale, group_size, shuffle_scale,
                          hadamard_on, rounding):
        """SPEC §7.7 (signature: reference/compress.py rope_rotate_quant): one launch (kernels/cuda/v4.cu)."""
        T, H, D = x.shape
        positions = _dense(positions)
        rope, keep = _rope(positions, cos_cache, sin_cache)
        target = out
        if out.dtype in FP4_OUT_DTYPES:
            kind, flavour = 0, 0
        elif out.dtype in FP8_OUT_DTYPES:
            kind, flavour = 1, FLAVOUR[FP8_OUT_DTYPES[out.dtype]]
        else:
            kind, flavour = 2, 0
            if out.stride(-1) != 1:   # the kernel writes rows with unit stride: through a dense copy
                target = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        args = dict(T=T, H=H, D=D, x=x.data_ptr(), x_st=x.stride(0), x_sh=x.stride(1), in_dt=DTYPE[x.dtype],
                    positions=positions.data_ptr(), pos_dt=DTYPE[positions.dtype], out_kind=kind,
                    out=target.data_ptr(), out_st=target.stride(0), out_sh=target.stride(1), out_scale=_p(out_scale),
                    group=int(group_size or 0), shuffle=bool(shuffle_scale), hadamard=bool(hadamard_on),
                    rounding=POLICIES.index(rounding), flavour=flavour,
                    err_flag=errors.flag_tensor(x.device).data_ptr(), **rope)
        mod.rope_rotate_quant(args, _stream(x))
        if target is not out:
            out.copy_(target)
        del keep

    fns = [indexer_qk_rope_quant_and_cache, index_k_norm_rope_pack_store, index_q_rope_pack_weights,
           rope_fake_quant_fp4, rmsnorm_rope_rotate_fp4quant_kvcache]
    if hasattr(mod, "compress_kv"):       # a module built before SPEC §7.6/§7.7 kernels existed lacks them
        fns += [compress_kv, rope_rotate_quant]
    return {f.__name__: f for f in fns}


def register_compiled(backend: str, mod) -> None:
    for name, fn in make_ops(mod).items():
        register(backend, name, fn)
    path = getattr(mod, "__file__", None)
    if backend == "cuda" and path:   # the decode scorer's C ABI (backends/scorer.py)
        import os

        from .scorer import load, make_paged_mqa_logits
        lib = load(path)
        if lib is not None:
            splits = int(os.environ.get("DSAQUANT_SCORER_SPLITS", "0"))
            register(backend, "paged_mqa_logits", make_paged_mqa_logits(lib, splits))
        if hasattr(lib, "dsq_topk_indices"):
            register(backend, "topk_indices", _topk_over(lib))


def _topk_over(lib):
    """The cuda backend's topk_indices over kernels/cuda/topk.cu's C ABI (backends/topk_abi.py). Rows whose
    min(k, L) exceeds the kernel's sort size go to the Triton kernel (same bytes)."""
    from . import topk_abi

    def topk_indices(logits, k, context_lens, next_n, ks, ke, relative, out):
        if logits.shape[0] == 0:
            return
        dev = logits.device
        chunks = topk_abi.plan_chunks(logits.shape[0], logits.shape[1], k, torch.cuda.get_device_properties(dev)
                                      .multi_processor_count)
        ws = torch.empty(max(1, topk_abi.workspace_bytes(logits.shape[0], logits.shape[1], k, chunks)),
                         dtype=torch.uint8, device=dev)
        dense = [t.contiguous() if t is not None else None for t in (context_lens, ks, ke)]
        a = topk_abi.make_args(logits, k, dense[0], next_n, dense[1], dense[2], relative, out, workspace=ws,
                               chunks=chunks)
        with torch.cuda.device(dev):
            rc = topk_abi.call(lib, a, torch.cuda.current_stream(dev).cuda_stream)
        if rc == 1:   # cudaErrorInvalidValue: min(k, L) past the kernel's sort size, nothing written
            from ..triton.topk import topk_indices as triton_topk
            return triton_topk(logits, k, context_lens, next_n, ks, ke, relative, out)
        if rc != 0:
            raise RuntimeError(f"dsaquant: launching topk_indices failed with CUDA error {rc}")
        return None

    return topk_indices


def load_and_register(backend: str, module: str, plugin: str, how: str) -> None:
    """Import the compiled module `module` from the source tree (dsaquant.<module>) or from the plugin wheel
    package `plugin`, and register its ops as `backend`. ImportError (with `how` to get it) if neither exists."""
    import importlib
    why = []
    for where in (f"dsaquant.{module}", f"{plugin}.{module}"):
        try:
            mod = importlib.import_module(where)
            break
        except ImportError as e:   # keep the reasons: "not built" and "built but does not load" differ
            why.append(f"{where}: {e}")
    else:
        raise ImportError(f"the {backend} module is not built here and the plugin `{plugin.replace('_', '-')}` is "
                          f"not installed ({how}) [{'; '.join(why)}]")
    register_compiled(backend, mod)
