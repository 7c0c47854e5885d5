"""Glue between the ops and a compiled library with the C interface of src/include/dsaquant/abi.h
(libdsaquant_cuda.so or libdsaquant_hip.so, loaded with ctypes: abi.py).

Each function here has the reference function's signature (python/dsaquant/reference/ops.py), fills the op's
argument struct (abi.py: raw pointers, element strides, codes.py codes, the device index of the tensors) and
calls the library with that device's current stream. No host synchronisation; CUDA-graph capturable.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import errors
from ..codes import Fp8Flavour, KStoreMode, OutKind, QPackMode, QuantMode, RoundPoint, Rounding, ScaleRule, \
    code_of, dtype_code as _dt
from ..dispatch import register
from ..reference.compress import FP4_OUT_DTYPES, FP8_OUT_DTYPES
from .abi import DsqCompressArgs, DsqIndexerArgs, DsqKStoreArgs, DsqQPackArgs, DsqRope, DsqRotateArgs, Library


def _p(t):
    return 0 if t is None else t.data_ptr()


def _vec(t: torch.Tensor, *strides: int) -> bool:
    """True when every row of t starts on a 16-byte boundary (vector loads are safe)."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in strides)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _rope(cos_cache=None, sin_cache=None, freqs=None):
    """The DsqRope of the tables, and the tensors it points into (kept alive until the launch is enqueued)."""
    if freqs is not None:
        return DsqRope(cos=freqs.data_ptr(), sin=0, row_stride=freqs.stride(0), max_pos=freqs.shape[0],
                       dtype=_dt(torch.float32), pairs=True, vec=_vec(freqs, freqs.stride(0))), (freqs,)
    if cos_cache.stride(0) != sin_cache.stride(0):
        cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    return DsqRope(cos=cos_cache.data_ptr(), sin=sin_cache.data_ptr(), row_stride=cos_cache.stride(0),
                   max_pos=cos_cache.shape[0], dtype=_dt(cos_cache.dtype), pairs=False,
                   vec=_vec(cos_cache, cos_cache.stride(0)) and _vec(sin_cache, sin_cache.stride(0))), \
        (cos_cache, sin_cache)


def _device(t: torch.Tensor) -> int:
    """The device index the library makes current for the launch (0 for CPU tensors: only tests/test_compress_host.py's
    emulated library is ever driven with them)."""
    return 0 if t.device.type == "cpu" else t.device.index


def _stream(t: torch.Tensor) -> int:
    """The current stream of t's device (not of the current device)."""
    if t.device.type == "cpu":
        return 0
    return torch.cuda.current_stream(t.device).cuda_stream


def _flag(t: torch.Tensor) -> int:
    return errors.flag_tensor(t.device).data_ptr()


def make_ops(lib):
    """The backend functions over `lib`: an abi.Library (or any object with its `launch(op, args, stream)` and
    `has(op)`)."""

    def indexer_qk_rope_quant_and_cache(q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight,
                                        norm_bias, positions, cos_cache, sin_cache, epsilon, quant_block_size,
                                        scale_fmt, weights_scale, preshuffle, is_neox, compute_all_q_rope,
                                        q_scale_out, kv_cache_scale, rounding, fp8_flavour, page_size):
        T, H = q.shape[0], q.shape[1]
        nw, nb = _dense(norm_weight), _dense(norm_bias)
        slot_mapping, positions = _dense(slot_mapping), _dense(positions)   # kernels index them densely
        rope, keep = _rope(cos_cache, sin_cache)
        args = DsqIndexerArgs(
            device=_device(q), T=T, H=H, num_blocks=kv_cache.shape[0], P=page_size,
            q=q.data_ptr(), q_st=q.stride(0), q_sh=q.stride(1), q_vec=_vec(q, q.stride(0), q.stride(1)),
            k=k.data_ptr(), k_st=k.stride(0), k_vec=_vec(k, k.stride(0)), in_dt=_dt(q.dtype),
            w=weights.data_ptr(), w_st=weights.stride(0), w_sh=weights.stride(1), w_dt=_dt(weights.dtype),
            w_out=weights_out.data_ptr(), w_out_st=weights_out.stride(0), w_out_sh=weights_out.stride(1),
            w_out_dt=_dt(weights_out.dtype), q_out=q_out.data_ptr(),
            q_scale_out=_p(q_scale_out), kv_cache=kv_cache.data_ptr(), kv_scale=_p(kv_cache_scale),
            slots=slot_mapping.data_ptr(), slots_dt=_dt(slot_mapping.dtype),
            positions=positions.data_ptr(), pos_dt=_dt(positions.dtype),
            norm_w=nw.data_ptr(), norm_w_dt=_dt(nw.dtype), norm_b=nb.data_ptr(), norm_b_dt=_dt(nb.dtype),
            rope=rope, eps=float(epsilon), weights_scale=float(weights_scale), fp4=q_scale_out is not None,
            neox=bool(is_neox), compute_all=bool(compute_all_q_rope), preshuffle=bool(preshuffle),
            ue8m0=scale_fmt == "ue8m0", rounding=code_of(Rounding, rounding),
            flavour=code_of(Fp8Flavour, fp8_flavour), err_flag=_flag(q))
        lib.launch("indexer", args, _stream(q))
        del keep

    def _kstore(k, norm_weight, eps, positions, slots, cache, cache_scale, rope, compress_ratio, rounding, mode,
                hadamard, num_blocks, page_size):
        nw, positions, slots = _dense(norm_weight), _dense(positions), _dense(slots)
        args = DsqKStoreArgs(device=_device(k), T=k.shape[0], num_blocks=num_blocks, P=page_size, k=k.data_ptr(),
                             k_st=k.stride(0), k_vec=_vec(k, k.stride(0)), in_dt=_dt(k.dtype), norm_w=nw.data_ptr(),
                             norm_w_dt=_dt(nw.dtype), positions=positions.data_ptr(), pos_dt=_dt(positions.dtype),
                             slots=slots.data_ptr(), slots_dt=_dt(slots.dtype), rope=rope,
                             compress_ratio=int(compress_ratio), eps=float(eps), rounding=code_of(Rounding, rounding),
                             mode=int(mode), hadamard=bool(hadamard), cache=cache.data_ptr(),
                             cache_scale=_p(cache_scale), err_flag=_flag(k))
        lib.launch("kstore", args, _stream(k))

    def index_k_norm_rope_pack_store(k, norm_weight, eps, positions, freqs, slots, cache, compress_ratio, rounding,
                                     page_size):
        rope, keep = _rope(freqs=freqs)
        _kstore(k, norm_weight, eps, positions, slots, cache, None, rope, compress_ratio, rounding,
                KStoreMode.packed68, False, cache.shape[0], page_size)
        del keep

    def rmsnorm_rope_rotate_fp4quant_kvcache(kv, norm_weight, epsilon, positions, cos_cache, sin_cache, slot_mapping,
                                             kv_cache, kv_cache_scale, hadamard_on, rounding, layout, page_size):
        x = kv[:, 0, :] if kv.dim() == 3 else kv
        rope, keep = _rope(cos_cache, sin_cache)
        _kstore(x, norm_weight, epsilon, positions, slot_mapping, kv_cache, kv_cache_scale, rope, 1, rounding,
                KStoreMode.aiter_fp4 if layout == "aiter_fp4" else KStoreMode.dense, hadamard_on, kv_cache.shape[0],
                page_size)
        del keep

    def _qpack(q, positions, freqs, compress_ratio, mode, rounding="rne", w=None, weight_scale=1.0, payload=None,
               exps=None, w_out=None, fq_out=None):
        q3 = q if q.dim() == 3 else q.unsqueeze(1)
        positions = _dense(positions)
        rope, keep = _rope(freqs=freqs)
        w_ = w if w is not None else q3
        args = DsqQPackArgs(device=_device(q), T=q3.shape[0], H=q3.shape[1], q=q3.data_ptr(), q_st=q3.stride(0),
                            q_sh=q3.stride(1), q_vec=_vec(q3, q3.stride(0), q3.stride(1)), in_dt=_dt(q3.dtype),
                            positions=positions.data_ptr(), pos_dt=_dt(positions.dtype), rope=rope,
                            compress_ratio=int(compress_ratio), rounding=code_of(Rounding, rounding), mode=int(mode),
                            w=_p(w), w_st=w_.stride(0), w_sh=w_.stride(1), w_dt=_dt(w_.dtype),
                            weight_scale=float(weight_scale), payload=_p(payload), exps=_p(exps), w_out=_p(w_out),
                            fq_out=_p(fq_out), err_flag=_flag(q))
        lib.launch("qpack", args, _stream(q))
        del keep

    def index_q_rope_pack_weights(q, positions, freqs, head_weights, weight_scale, rounding, payload_out, exps_out,
                                  weights_out):
        _qpack(q, positions, freqs, 1, QPackMode.pack, rounding, head_weights, weight_scale, payload_out, exps_out,
               weights_out)

    def rope_fake_quant_fp4(x, positions, freqs, block, scale, compress_ratio, out):
        _qpack(x, positions, freqs, compress_ratio, QPackMode.fake_ue8m0 if scale == "ue8m0" else QPackMode.fake_e4m3,
               fq_out=out)

    def compress_kv(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight, epsilon,
                    cos_cache, sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode, layout, scale_rule,
                    rounding, scale_fmt, fp8_flavour, preshuffle, hadamard_on, bf16_after, freqs, update_state,
                    page_size):
        """SPEC §7.6 (signature: reference/compress.py compress_kv): one launch (kernels/cuda/compress.cu)."""
        T, C = kv.shape
        D = C // 2 if overlap else C
        state_slot, cu_seqlens, start_pos, out_slots = (_dense(t) for t in (state_slot, cu_seqlens, start_pos,
                                                                              out_slots))
        nw = _dense(norm_weight)
        rope, keep = _rope(cos_cache, sin_cache, freqs)
        args = DsqCompressArgs(
            device=_device(kv), T=T, B=state_slot.shape[0], ratio=int(ratio), R=state_kv.shape[1],
            n_ring=state_kv.shape[0], D=D, K=int(ratio) * (2 if overlap else 1), overlap=bool(overlap),
            kv=kv.data_ptr(), kv_st=kv.stride(0), score=score.data_ptr(), sc_st=score.stride(0), in_dt=_dt(kv.dtype),
            ape=ape.data_ptr(), ape_st=ape.stride(0),
            state_kv=state_kv.data_ptr(), skv_s0=state_kv.stride(0), skv_s1=state_kv.stride(1),
            state_score=state_score.data_ptr(), ssc_s0=state_score.stride(0), ssc_s1=state_score.stride(1),
            state_slot=state_slot.data_ptr(), cu_seqlens=cu_seqlens.data_ptr(), start_pos=start_pos.data_ptr(),
            norm_w=nw.data_ptr(), norm_w_dt=_dt(nw.dtype), eps=float(epsilon), rope=rope,
            out_slots=out_slots.data_ptr(), cache=cache.data_ptr(), cache_scale=_p(cache_scale),
            num_blocks=cache.shape[0], P=int(page_size), quant_mode=code_of(QuantMode, quant_mode),
            aiter_layout=layout == "aiter_fp4", scale_rule=code_of(ScaleRule, scale_rule),
            rounding=code_of(Rounding, rounding), ue8m0=scale_fmt == "ue8m0", flavour=code_of(Fp8Flavour, fp8_flavour),
            preshuffle=bool(preshuffle), hadamard=bool(hadamard_on),
            bf16_after=sum(code_of(RoundPoint, n) for n in set(bf16_after)), update_state=bool(update_state),
            err_flag=_flag(kv))
        lib.launch("compress_kv", args, _stream(kv))
        del keep

    def rope_rotate_quant(out, x, cos_cache, sin_cache, positions, rope_dim, out_scale, group_size, shuffle_scale,
                          hadamard_on, rounding):
        """SPEC §7.7 (signature: reference/compress.py rope_rotate_quant): one launch (kernels/cuda/compress.cu)."""
        T, H, D = x.shape
        positions = _dense(positions)
        rope, keep = _rope(cos_cache, sin_cache)
        target = out
        if out.dtype in FP4_OUT_DTYPES:
            kind, flavour = OutKind.fp4, Fp8Flavour.e4m3fn
        elif out.dtype in FP8_OUT_DTYPES:
            kind, flavour = OutKind.fp8, code_of(Fp8Flavour, FP8_OUT_DTYPES[out.dtype])
        else:
            kind, flavour = OutKind.half, Fp8Flavour.e4m3fn
            if out.stride(-1) != 1:   # the kernel writes rows with unit stride: through a dense copy
                target = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        args = DsqRotateArgs(device=_device(x), T=T, H=H, D=D, x=x.data_ptr(), x_st=x.stride(0), x_sh=x.stride(1),
                             in_dt=_dt(x.dtype), rope=rope, positions=positions.data_ptr(), pos_dt=_dt(positions.dtype),
                             out_kind=int(kind), out=target.data_ptr(), out_st=target.stride(0),
                             out_sh=target.stride(1), out_scale=_p(out_scale), group=int(group_size or 0),
                             shuffle=bool(shuffle_scale), hadamard=bool(hadamard_on),
                             rounding=code_of(Rounding, rounding), flavour=int(flavour), err_flag=_flag(x))
        lib.launch("rope_rotate_quant", args, _stream(x))
        if target is not out:
            out.copy_(target)
        del keep

    fns = [indexer_qk_rope_quant_and_cache, index_k_norm_rope_pack_store, index_q_rope_pack_weights,
           rope_fake_quant_fp4, rmsnorm_rope_rotate_fp4quant_kvcache]
    if lib.has("compress_kv"):       # a library built before SPEC §7.6/§7.7 kernels existed lacks them
        fns += [compress_kv, rope_rotate_quant]
    return {f.__name__: f for f in fns}


def register_compiled(backend: str, lib) -> None:
    for name, fn in make_ops(lib).items():
        register(backend, name, fn)
    if backend == "cuda":   # the decode scorer and the top-k kernels: their own C structs in the same library
        import os

        from .scorer import load, make_paged_mqa_logits
        scorer_lib = load(lib.path)
        if scorer_lib is not None:
            splits = int(os.environ.get("DSAQUANT_SCORER_SPLITS", "0"))
            register(backend, "paged_mqa_logits", make_paged_mqa_logits(scorer_lib, splits))
        if hasattr(lib.cdll, "dsq_topk_indices"):
            register(backend, "topk_indices", _topk_over(lib.cdll))
        if hasattr(lib.cdll, "dsq_mqa_logits"):
            register(backend, "mqa_logits", _mqa_logits_over(lib.cdll))


def _mqa_logits_over(lib):
    """The cuda backend's mqa_logits over kernels/cuda/prefill.cu's C ABI (backends/prefill_abi.py), on sm_90a:
    the FP8 layout; and the FP4 fast mode folded into e4m3 (docs/prefill.md): a Triton pre-pass folds the keys,
    the CUDA kernel folds the query rows and writes the entries whose key and query fold, Triton's second pass the
    others. Every other call (exact FP4, e4m3fnuz codes, other devices, prefill_abi.supported) runs the Triton
    kernel, as does a call the library answers with cudaErrorNotSupported."""
    from . import prefill_abi

    def mqa_logits(q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, fp8_flavour, exact, clean_logits,
                   compressed):
        dev = q.device
        if (dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0) and out.shape[0] * out.shape[1]
                and k.shape[0] and prefill_abi.supported(q, k, k_scale, weights, out, layout, fp8_flavour, exact)):
            with torch.cuda.device(dev):
                rc = prefill_abi.run(lib, torch.cuda.current_stream(dev).cuda_stream, q, q_scale, k, k_scale, weights,
                                     lo, hi, base, out, layout, clean_logits, compressed)
            if rc == 0:
                return out
            if rc != prefill_abi.ERR_NOT_SUPPORTED:
                raise RuntimeError(f"dsaquant: launching mqa_logits failed with CUDA error {rc}")
        from ..triton.prefill import mqa_logits as triton_mqa_logits
        return triton_mqa_logits(q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, fp8_flavour, exact,
                                 clean_logits, compressed)

    return mqa_logits


def _topk_over(lib):
    """The cuda backend's topk_indices over kernels/cuda/topk.cu's C ABI (backends/topk_abi.py). Rows whose
    min(k, L) exceeds the kernel's sort size go to the Triton kernel (same bytes)."""
    from . import topk_abi

    plan, _ = topk_abi.host_functions(lib)   # the library's own plan: its platform's paths

    def topk_indices(logits, k, context_lens, next_n, ks, ke, relative, out):
        if logits.shape[0] == 0:
            return
        dev = logits.device
        chunks = plan(logits.shape[0], logits.shape[1], k, torch.cuda.get_device_properties(dev).multi_processor_count)
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


def find_library(filename: str, plugin: str) -> Path | None:
    """The compiled library `filename`: in the source tree (next to dsaquant's own files), or in the installed
    plugin package `plugin`. None if neither has it."""
    import importlib.util
    here = Path(__file__).resolve().parent.parent / filename
    if here.is_file():
        return here
    spec = importlib.util.find_spec(plugin)
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(d) / filename).is_file():
            return Path(d) / filename
    return None


_libraries: dict[str, Library] = {}


def library(backend: str) -> Library:
    """The Library registered for `backend` by load_and_register (KeyError if none was)."""
    return _libraries[backend]


def load_and_register(backend: str, filename: str, plugin: str, how: str) -> None:
    """Load the compiled library `filename` from the source tree or from the plugin wheel package `plugin`, and
    register its ops as `backend`. ImportError (with `how` to get it) if neither has it or it does not load."""
    path = find_library(filename, plugin)
    if path is None:
        raise ImportError(f"the {backend} library {filename} is not built here and the plugin "
                          f"`{plugin.replace('_', '-')}` is not installed ({how})")
    try:
        lib = Library(str(path))
    except OSError as e:   # "not built" and "built but does not load" differ
        raise ImportError(f"the {backend} library {path} does not load: {e}") from e
    _libraries[backend] = lib
    register_compiled(backend, lib)
