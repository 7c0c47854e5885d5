"""Every op runs on the device of its tensors, whatever device is current, and leaves the current device as it was.

- one GPU: each op on cuda:0 leaves cuda:0 current; the compiled library refuses a device index past the last
  GPU (RuntimeError naming the runtime's error) without touching the current device or any output.
- two GPUs (skipped on fewer): each op with its tensors on cuda:1 while cuda:0 is current gives the bytes of the
  same call on cuda:0 (every output and every input after the call) and leaves cuda:0 current; two threads, one
  per GPU, capture a CUDA graph of the indexer step and replay it for 10 s on new inputs, every replay byte-identical
  to the reference, check_errors() clean on both devices; a call whose tensors span two GPUs is rejected
  (ValueError) before anything is written.
Backends: each of cuda / hip / triton that is available, for the ops it implements.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import dsaquant as dq
from dsaquant import dispatch, testing as tt

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

BACKENDS = [b for b in ("cuda", "hip", "triton") if dispatch.available(b)[0]]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs two GPUs, found {torch.cuda.device_count()}")
REPLAY_SECONDS = 10.0


def _q_pack(device):
    a = tt.make_q_pack(T=64, H=64, device=device, seed=3)
    a["out"] = (tt.poisoned((64, 64, 64), torch.uint8, device), tt.poisoned((64, 64), torch.int32, device),
                tt.poisoned((64, 64), torch.float32, device))
    return a


def _fake_quant(device):
    q = tt.make_q_pack(T=64, H=4, device=device, seed=4)
    return dict(x=q["q"], positions=q["positions"], freqs=q["freqs"],
                out=tt.poisoned(tuple(q["q"].shape), q["q"].dtype, device))


def _scorer(device, B=2, N=1, H=64, P=64, NB=6):
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 0x7E, (B, N, H, 128), generator=g, dtype=torch.uint8)
    cache = torch.randint(0, 0x7E, (NB, P * 132), generator=g, dtype=torch.uint8)
    return dict(q=q.to(device), kv_cache=cache.to(device), weights=torch.randn(B * N, H, generator=g).to(device),
                context_lens=torch.tensor([150, 37], dtype=torch.int32).to(device),
                block_tables=torch.tensor([[2, 0, 5], [1, 3, 4]], dtype=torch.int32).to(device),
                max_seq_len=3 * P, layout="fp8_132")


# name -> (op, builder of the keyword arguments on a device)
CASES = {
    "indexer_fp8": (dq.indexer_qk_rope_quant_and_cache,
                    lambda d: tt.make_indexer(T=128, H=64, mode="fp8", device=d, seed=1)),
    "indexer_fp4": (dq.indexer_qk_rope_quant_and_cache,
                    lambda d: tt.make_indexer(T=128, H=64, mode="fp4", device=d, seed=1)),
    "k_store": (dq.index_k_norm_rope_pack_store, lambda d: tt.make_k_store(T=64, device=d, seed=2, compress_ratio=4)),
    "q_pack": (dq.index_q_rope_pack_weights, _q_pack),
    "fake_quant": (dq.rope_fake_quant_fp4, _fake_quant),
    "v4_aiter": (dq.rmsnorm_rope_rotate_fp4quant_kvcache, lambda d: tt.make_v4_k(T=64, device=d, seed=6)),
    "v4_dense": (dq.rmsnorm_rope_rotate_fp4quant_kvcache,
                 lambda d: tt.make_v4_k(T=64, device=d, seed=6, layout="dense")),
    "compress_fp4": (dq.compress_kv, lambda d: tt.make_compress_kv(starts=(0, 13), lens=(40, 21), quant_mode="fp4",
                                                                   device=d, seed=7)),
    "compress_fp8": (dq.compress_kv, lambda d: tt.make_compress_kv(starts=(3,), lens=(64,), quant_mode="fp8",
                                                                   device=d, seed=8)),
    "rotate_fp4": (dq.rope_rotate_quant, lambda d: tt.make_rope_rotate_quant(T=16, out="fp4", device=d, seed=9)),
    "rotate_fp8": (dq.rope_rotate_quant, lambda d: tt.make_rope_rotate_quant(T=16, out="e4m3fn", device=d, seed=9)),
    "scorer_fp8": (dq.paged_mqa_logits, _scorer),
}
PARAMS = [(b, n) for b in BACKENDS for n, (fn, _) in CASES.items() if fn.__name__ in dispatch.ops_of(b)]


def _tensors(a: dict, result) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, v in [*a.items(), ("result", result)]:
        for i, t in enumerate(v if isinstance(v, tuple) else (v,)):
            if isinstance(t, torch.Tensor):
                out.append((f"{name}[{i}]", t))
    return out


def _run(name: str, backend: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The bytes (on the CPU) of every tensor of one call on `device`, after it."""
    fn, make = CASES[name]
    a = make(device)
    result = fn(**a, backend=backend)
    torch.cuda.synchronize(device)
    return {k: t.contiguous().view(torch.uint8).cpu() if t.dim() else t.cpu() for k, t in _tensors(a, result)}


def _assert_same(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad} differ"


@pytest.mark.parametrize("backend,name", PARAMS, ids=[f"{b}-{n}" for b, n in PARAMS])
def test_current_device_unchanged_one_gpu(backend, name):
    torch.cuda.set_device(0)
    _run(name, backend, torch.device("cuda", 0))
    assert torch.cuda.current_device() == 0
    dq.check_errors()


@pytest.mark.skipif("cuda" not in BACKENDS and "hip" not in BACKENDS, reason="no compiled backend")
def test_library_refuses_a_device_past_the_last():
    from dsaquant.backends.abi import DsqExpDsArgs
    from dsaquant.backends.compiled import library
    lib = library("cuda" if "cuda" in BACKENDS else "hip")
    torch.cuda.set_device(0)
    x = torch.full((256,), -1.0, device="cuda:0")
    y = tt.poisoned((256,), torch.float32, "cuda:0")
    args = DsqExpDsArgs(device=torch.cuda.device_count(), x=x.data_ptr(), y=y.data_ptr(), n=x.numel())
    with pytest.raises(RuntimeError, match="launching exp_ds failed"):
        lib.launch("exp_ds", args, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.cuda.current_device() == 0
    assert bool((y.view(torch.uint8) == tt.POISON).all()), "written by a refused call"
    args.device = 0
    lib.launch("exp_ds", args, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert not bool((y.view(torch.uint8) == tt.POISON).all())


@two_gpus
@pytest.mark.parametrize("backend,name", PARAMS, ids=[f"{b}-{n}" for b, n in PARAMS])
def test_op_on_the_second_gpu_while_the_first_is_current(backend, name):
    torch.cuda.set_device(0)
    want = _run(name, backend, torch.device("cuda", 0))
    torch.cuda.set_device(0)
    got = _run(name, backend, torch.device("cuda", 1))
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    _assert_same(got, want, f"{backend} {name} on cuda:1")
    dq.check_errors()


@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_device_call_is_rejected_before_writing(backend):
    a = tt.make_indexer(T=64, H=64, mode="fp4", device="cuda:0", seed=1)
    a["kv_cache"] = a["kv_cache"].to("cuda:1")
    a["kv_cache_scale"] = a["kv_cache_scale"].to("cuda:1")
    with pytest.raises(ValueError, match="kv_cache: expected a tensor on cuda:0"):
        dq.indexer_qk_rope_quant_and_cache(**a, backend=backend)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for k in ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"):
        assert bool((a[k].view(torch.uint8) == tt.POISON).all()), f"{k} written by a rejected call"


IN_KEYS = ("q", "k", "weights", "slot_mapping", "positions")
OUT_KEYS = ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale")


def _graph_worker(backend: str, index: int, mode: str, stats: dict, errors: list):
    """Capture the indexer step on cuda:<index> and replay it on new inputs until REPLAY_SECONDS have passed."""
    try:
        dev = torch.device("cuda", index)
        with torch.cuda.device(dev):
            inputs, refs = [], []
            for seed in range(4):                   # input sets and their reference outputs, on this device
                b = tt.make_indexer(T=256, H=64, mode=mode, device=dev, seed=10 + seed)
                dq.indexer_qk_rope_quant_and_cache(**b, backend="reference")
                inputs.append({k: b[k] for k in IN_KEYS})
                refs.append({k: b[k].view(torch.uint8).clone() for k in OUT_KEYS if b.get(k) is not None})
            a = tt.make_indexer(T=256, H=64, mode=mode, device=dev, seed=10)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                dq.indexer_qk_rope_quant_and_cache(**a, backend=backend)   # warm-up: compiles, creates the flag
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                dq.indexer_qk_rope_quant_and_cache(**a, backend=backend)
            n, t_end = 0, time.monotonic() + REPLAY_SECONDS
            while time.monotonic() < t_end:
                i = n % len(inputs)
                for k in IN_KEYS:
                    a[k].copy_(inputs[i][k])
                for k in refs[i]:
                    a[k].view(torch.uint8).fill_(tt.POISON)
                g.replay()
                torch.cuda.synchronize(dev)
                for k, want in refs[i].items():
                    if not torch.equal(a[k].view(torch.uint8), want):
                        raise AssertionError(f"cuda:{index} replay {n}: {k} differs from the reference")
                n += 1
            stats[index] = n
    except BaseException as e:   # reported by the main thread
        errors.append((index, e))


@two_gpus
@pytest.mark.parametrize("mode", ["fp8", "fp4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_threads_replay_graphs_on_two_gpus(backend, mode):
    dq.check_errors()
    stats, errors = {}, []
    threads = [threading.Thread(target=_graph_worker, args=(backend, i, mode, stats, errors)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    print(f"{backend} {mode}: replays per GPU {stats}")
    assert stats.get(0, 0) > 0 and stats.get(1, 0) > 0, stats
    dq.check_errors("cuda:0")
    dq.check_errors("cuda:1")
