"""CUDA-graph capture and torch.compile of every op on the GPU (compiled and Triton backends).

A graph is captured on one set of inputs, the inputs are overwritten in place with new values, the
graph is replayed, and the outputs must equal the reference on the new inputs byte for byte.
"""
from __future__ import annotations

import pytest
import torch

import dsaquant as dq
from dsaquant import dispatch, testing as tt

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
BACKENDS = [b for b in ("cuda", "hip", "triton") if dispatch.available(b)[0]]

CASES = {
    "indexer_fp8": (dq.indexer_qk_rope_quant_and_cache,
                    lambda s: tt.make_indexer(T=64, H=64, mode="fp8", device=DEV, seed=s),
                    ("q_out", "weights_out", "kv_cache"), ("q", "k", "weights")),
    "indexer_fp4": (dq.indexer_qk_rope_quant_and_cache,
                    lambda s: tt.make_indexer(T=64, H=64, mode="fp4", device=DEV, seed=s),
                    ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"), ("q", "k", "weights")),
    "k_store": (dq.index_k_norm_rope_pack_store, lambda s: tt.make_k_store(T=64, device=DEV, seed=s), ("cache",),
                ("k",)),
    "v4_k": (dq.rmsnorm_rope_rotate_fp4quant_kvcache, lambda s: tt.make_v4_k(T=64, device=DEV, seed=s),
             ("kv_cache", "kv_cache_scale"), ("kv",)),
}


def _outs(a, keys):
    return [a[k].view(torch.uint8).clone() for k in keys if a.get(k) is not None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_graph_replay_new_inputs(backend, name):
    fn, make, out_keys, in_keys = CASES[name]
    a = make(1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(**a, backend=backend)          # warm up (Triton compiles here)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(**a, backend=backend)
    fresh = make(2)
    for k in in_keys:                     # new inputs, written into the captured tensors
        a[k].copy_(fresh[k])
    for k in out_keys:
        if a.get(k) is not None:
            a[k].view(torch.uint8).fill_(tt.POISON)
    g.replay()
    torch.cuda.synchronize()
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    for k in out_keys:
        if ref.get(k) is not None:
            ref[k].view(torch.uint8).fill_(tt.POISON)
    fn(**ref, backend="reference")
    for x, y in zip(_outs(a, out_keys), _outs(ref, out_keys)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_pack_graph(backend):
    a = tt.make_q_pack(T=64, H=64, device=DEV, seed=3)
    out = tuple(torch.empty(sh, dtype=dt, device=DEV) for sh, dt in
                (((64, 64, 64), torch.uint8), ((64, 64), torch.int32), ((64, 64), torch.float32)))
    dq.index_q_rope_pack_weights(**a, out=out, backend=backend)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dq.index_q_rope_pack_weights(**a, out=out, backend=backend)
    a["q"].copy_(tt.make_q_pack(T=64, H=64, device=DEV, seed=4)["q"])
    g.replay()
    torch.cuda.synchronize()
    ref = dq.index_q_rope_pack_weights(**a, backend="reference")
    for x, y in zip(out, ref):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_gpu(backend):
    a = tt.make_indexer(T=64, H=64, mode="fp4", device=DEV, seed=5)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}

    @torch.compile(fullgraph=True)
    def step(q, k, weights, q_out, weights_out, kv_cache, q_scale_out, kv_cache_scale):
        dq.indexer_qk_rope_quant_and_cache(
            q, q_out, weights, weights_out, k, kv_cache, a["slot_mapping"], a["norm_weight"], a["norm_bias"],
            a["positions"], a["cos_cache"], a["sin_cache"], 1e-6, 32, "ue8m0", 1.0, False, True, False,
            q_scale_out, kv_cache_scale, backend=backend)
        return q_out.view(torch.uint8).float().sum()

    step(a["q"], a["k"], a["weights"], a["q_out"], a["weights_out"], a["kv_cache"], a["q_scale_out"],
         a["kv_cache_scale"])
    dq.indexer_qk_rope_quant_and_cache(
        b["q"], b["q_out"], b["weights"], b["weights_out"], b["k"], b["kv_cache"], b["slot_mapping"], b["norm_weight"],
        b["norm_bias"], b["positions"], b["cos_cache"], b["sin_cache"], 1e-6, 32, "ue8m0", 1.0, False, True, False,
        b["q_scale_out"], b["kv_cache_scale"], backend="reference")
    torch.cuda.synchronize()
    for k in ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"):
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
