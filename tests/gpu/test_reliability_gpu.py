"""Reliability on a GPU: every compiled/Triton backend against backend="reference" on CUDA tensors.

For each backend in ("cuda", "triton") that dispatch.available() reports:
- server-style strided inputs (the builders' fused/odd-offset views and tests/test_edge_cases.py's
  STRIDED_INPUTS: column slices, every-other and broadcast index tensors, transposed weights, table slices,
  strided weights_out), compared byte for byte with the reference, bytes around strided outputs included;
- edge sizes: T = 0 and 1, H not a multiple of 16 (FP8 mode and the sglang ops), H = 0, caches of exactly
  one page with every slot written and slot P flagged, the dense V4 layout with one slot;
- T = 70 000, H = 128 (T·H·128 > 2^30 elements, far more blocks than any 65535 grid-dimension limit): the
  full call, compared against the reference run in chunks of tokens, for both indexer modes and the q packer;
- the same op on two CUDA streams (distinct outputs, launches interleaved) and from two Python threads gives
  the bytes of sequential calls;
- the device-side slot guard: a slot at/past the capacity (including 2^31-1 in int32 and 2^40 in int64) is
  never written, check_errors() raises DsaquantError, then is clean;
- the hypothesis properties of tests/test_properties.py (backend == reference) with a larger budget:
  DSAQUANT_HYPOTHESIS_EXAMPLES examples per op (default GPU_EXAMPLES below: cuda 50, triton 12), T up to
  160, H up to 64.

Byte counts go into the table printed at the end of the GPU suite (tests/gpu/counts.py).

Known bugs would be marked xfail(strict=True). The one this file found first (the `cuda` backend read
strided or broadcast `positions` / `slot_mapping` / `slots` and wrote a strided `weights_out` as if dense)
is fixed: backends/compiled.py makes index tensors dense and passes weights_out's strides.

Dry run without a GPU (checks this file's logic, not a GPU): DSAQUANT_RELIABILITY_DRYRUN=1 TRITON_INTERPRET=1
runs the triton backend on the CPU with small sizes; the stream/thread tests are skipped.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_edge_cases as te  # noqa: E402
import test_properties as tp  # noqa: E402

import dsaquant as dq  # noqa: E402
from dsaquant import dispatch, testing as tt  # noqa: E402

from .counts import record  # noqa: E402

pytestmark = pytest.mark.gpu

DRYRUN = os.environ.get("DSAQUANT_RELIABILITY_DRYRUN") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
if not DRYRUN and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cpu") if DRYRUN else torch.device("cuda")
BACKENDS = ["triton"] if DRYRUN else [b for b in ("cuda", "triton") if dispatch.available(b)[0]]
if not BACKENDS or (DRYRUN and not dispatch.available("triton")[0]):
    pytest.skip("no GPU backend (cuda, triton) is available", allow_module_level=True)

# examples per op and backend (DSAQUANT_HYPOTHESIS_EXAMPLES overrides): triton compiles a kernel for almost
# every drawn option combination (constexpr dtypes/policies, int and pointer-alignment specialisations), so
# it gets fewer; the Triton interpreter run of tests/test_properties.py covers its logic more broadly.
GPU_EXAMPLES = {"cuda": 3, "triton": 3} if DRYRUN else {"cuda": 50, "triton": 12}
GPU_MAX_T, GPU_MAX_H = (12, 20) if DRYRUN else (160, 64)
LARGE_T, LARGE_H = (300, 16) if DRYRUN else (70_000, 128)
KNOWN_BUG = "bug: see the module docstring"


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _clean():
    tp.drain_flags()
    dq.set_host_checks(False)
    yield
    _sync()
    tp.drain_flags()


def _params(names, bug=lambda backend, name: False):
    """(backend, name) pairs, xfail(strict) where `bug` says a known bug makes the case fail."""
    out = []
    for b in BACKENDS:
        for n in names:
            marks = [pytest.mark.xfail(strict=True, reason=KNOWN_BUG)] if bug(b, n) else []
            out.append(pytest.param(b, n, marks=marks, id=f"{b}-{n}"))
    return out


def _check_pair(call, backend, label):
    try:
        problems, total, bad = tp.compare_backend(call, backend)
    except ValueError as e:          # a clean rejection of a strided index tensor / weights_out is allowed
        name = str(e).split(":")[0]
        v = call.kwargs.get(name)
        if name not in te.MAY_REJECT or not isinstance(v, torch.Tensor) or v.is_contiguous():
            raise
        return
    _sync()
    record(backend, f"reliability:{call.meta['op']}", total, bad)
    assert not problems, f"{backend} {label}:\n" + "\n".join(problems[:12])


# ------------------------------------------------------------------------------------------------
# strided inputs
# ------------------------------------------------------------------------------------------------
BUILDER_STRIDED = [f"{op}-s{style}-{idx}-{'idxview' if iv else 'idxdense'}"
                   for op in tp.OPS for style in (1, 2) for idx in ("int64", "int32") for iv in (False, True)]


@pytest.mark.parametrize("backend,name", _params(BUILDER_STRIDED))
def test_builder_strided_inputs(backend, name):
    """q in a fused projection output / heads 136 apart at an odd offset, k / weights / x column slices,
    and (idxview) positions and slots as a column of a [T, 2] tensor."""
    op, style, idx, iv = name.split("-")
    kw = dict(pos_dtype=idx, strided=int(style[1]), strided_idx=iv == "idxview")
    if op in te.SLOT_OPS:
        kw["slot_dtype"] = idx
    if op in ("q_pack", "fake_quant"):
        kw["H"] = 5
    if op == "v4_k":
        kw["hk"] = None
    _check_pair(tp.build(tp.base_case(op, **kw), DEV), backend, name)


@pytest.mark.parametrize("backend,name", _params(sorted(te.STRIDED_INPUTS)))
def test_strided_inputs(backend, name):
    op, mutate = te.STRIDED_INPUTS[name]
    call = tp.build(tp.base_case(op))
    mutate(call.kwargs)
    _check_pair(tp.call_to(call, DEV), backend, name)


# ------------------------------------------------------------------------------------------------
# edge sizes
# ------------------------------------------------------------------------------------------------
def _edge_cases():
    cases = {}
    for op in tp.OPS:
        cases[f"{op}-T0"] = tp.base_case(op, T=0)
        for kind in ("fresh", "zero", "last", "neg"):
            cases[f"{op}-T1-{kind}"] = tp.base_case(op, T=1, slots=[kind], pos=["last" if kind == "neg" else "in"])
    for H in (1, 2, 3, 7, 15, 17, 40):
        cases[f"indexer_fp8-H{H}"] = tp.base_case("indexer_fp8", H=H)
        cases[f"indexer_fp8-H{H}-allq-presh"] = tp.base_case("indexer_fp8", H=H, T=5, all_q=True, preshuffle=True,
                                                             scale_fmt=None, q_out="float8_e4m3fnuz")
    for H in (1, 3, 17, 33):
        cases[f"q_pack-H{H}"] = tp.base_case("q_pack", H=H)
        cases[f"fake_quant-H{H}"] = tp.base_case("fake_quant", H=H, block=16, scale="e4m3")
    for op in te.SLOT_OPS:
        for P in (16, 32, 64):
            cases[f"{op}-onepage-P{P}"] = tp.base_case(op, T=P + 1, P=P, extra_pages=-10,
                                                       slots=["fresh"] * P + ["oob"], pos=["in"] * (P + 1))
    cases["v4_k-dense-one-slot"] = tp.base_case("v4_k", T=3, layout="dense", extra_pages=-1,
                                                slots=["fresh", "oob", "neg"], pos=["in"] * 3)
    return cases


EDGE = _edge_cases()


@pytest.mark.parametrize("backend,name", _params(sorted(EDGE)))
def test_edge_sizes(backend, name):
    _check_pair(tp.build(EDGE[name], DEV), backend, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_heads(backend):
    """H = 0 in FP8 mode (a degenerate but valid shape): only k is written, as the reference does."""
    call = tp.build(tp.base_case("indexer_fp8", T=6, slots=["fresh"] * 6, pos=["in"] * 6), DEV)
    T = 6
    call.kwargs.update(q=torch.zeros(T, 0, 128, dtype=torch.bfloat16, device=DEV),
                       weights=torch.zeros(T, 0, device=DEV),
                       q_out=tt.poisoned((T, 0, 128), torch.float8_e4m3fn, DEV),
                       weights_out=tt.poisoned((T, 0), torch.float32, DEV))
    _check_pair(call, backend, "H=0")


# ------------------------------------------------------------------------------------------------
# T large enough for any 65535 grid-dimension limit, reference in chunks
# ------------------------------------------------------------------------------------------------
def _randn(shape, g, dtype, chunk=8192):
    out = torch.empty(shape, dtype=dtype, device=DEV)
    for i in range(0, shape[0], chunk):
        n = min(chunk, shape[0] - i)
        out[i:i + n] = torch.randn((n, *shape[1:]), generator=g, device=DEV).to(dtype)
    return out


def _big_indexer(mode, T, H, seed=7):
    g = torch.Generator(device=DEV).manual_seed(seed)
    P = 64
    NB = T // P + 2
    cap = NB * P
    cos, sin, _ = tt.rope_tables(4096, DEV)
    q = _randn((T, H, 128), g, torch.bfloat16)
    q[::997] *= 1e-30                                               # tiny rows
    q[1::1009, :, 64:] = torch.tensor(tp.MIDPOINTS * 8, device=DEV).to(torch.bfloat16)   # E2M1 ties
    slots = torch.randperm(cap, generator=g, device=DEV)[:T]
    slots[::101] = -1
    slots[5] = cap                                                  # at the capacity: flagged
    positions = torch.randint(0, 4096, (T,), generator=g, device=DEV)
    positions[::1013] = 5000                                        # out of range: clamped and flagged
    a = dict(q=q, weights=torch.randn(T, H, generator=g, device=DEV), k=_randn((T, 128), g, torch.bfloat16),
             slot_mapping=slots, norm_weight=1 + 0.1 * torch.randn(128, generator=g, device=DEV),
             norm_bias=0.1 * torch.randn(128, generator=g, device=DEV), positions=positions, cos_cache=cos,
             sin_cache=sin, epsilon=1e-6, weights_scale=128 ** -0.5 * 64 ** -0.5, preshuffle=mode == "fp8",
             is_neox=True, compute_all_q_rope=False, rounding="rne")
    if mode == "fp8":
        a.update(q_out=tt.poisoned((T, H, 128), torch.float8_e4m3fn, DEV),
                 weights_out=tt.poisoned((T, H), torch.float32, DEV),
                 kv_cache=tt.poisoned((NB, P * 132), torch.uint8, DEV), quant_block_size=128, scale_fmt="ue8m0")
        outs = ("q_out", "weights_out", "kv_cache")
    else:
        a.update(q_out=tt.poisoned((T, H, 64), torch.uint8, DEV), weights_out=tt.poisoned((T, H), torch.bfloat16, DEV),
                 kv_cache=tt.poisoned((NB, 1, 4, P, 16), torch.uint8, DEV), quant_block_size=32, scale_fmt="ue8m0",
                 q_scale_out=tt.poisoned((T, 1, 4, 16, (H // 16 + 3) // 4 * 4), torch.uint8, DEV),
                 kv_cache_scale=tt.poisoned((NB, 1, 4, P), torch.uint8, DEV))
        outs = ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale")
    return a, outs


def _diff_bytes(x, y):
    return int((x.contiguous().view(torch.uint8) != y.contiguous().view(torch.uint8)).sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_large_T_indexer(backend, mode):
    T, H = LARGE_T, LARGE_H
    a, outs = _big_indexer(mode, T, H)
    be = {n: a[n] for n in outs}
    ref = {n: tt.poisoned(tuple(a[n].shape), a[n].dtype, DEV) for n in outs}
    dq.indexer_qk_rope_quant_and_cache(**a, backend=backend)                  # the full call
    f_be = tp.take_flags(DEV)
    per_token = ("q", "weights", "k", "slot_mapping", "positions")
    chunk = 4096
    for t0 in range(0, T, chunk):                                           # the reference, by tokens
        sl = slice(t0, t0 + chunk)
        kw = {k: (v[sl] if k in per_token else v) for k, v in a.items()}
        kw.update({n: (ref[n][sl] if n in ("q_out", "weights_out", "q_scale_out") else ref[n]) for n in outs})
        dq.indexer_qk_rope_quant_and_cache(**kw, backend="reference")
    f_ref = tp.take_flags(DEV)
    _sync()
    assert f_be == f_ref == 3, f"error flags: {backend} {f_be}, reference {f_ref} (both slot and position expected)"
    for n in outs:
        bad = _diff_bytes(be[n], ref[n])
        record(backend, f"reliability:indexer-T{T}", be[n].numel() * be[n].element_size(), bad)
        assert bad == 0, f"{backend} T={T} H={H} {mode}: {n} has {bad} bytes different from the reference"
    assert not bool((be["q_out"][T - 1].view(torch.uint8) == tt.POISON).all()), "the last token was not written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_T_q_pack(backend):
    T, H = LARGE_T, LARGE_H
    g = torch.Generator(device=DEV).manual_seed(11)
    _, _, freqs = tt.rope_tables(4096, DEV)
    q = _randn((T, H, 128), g, torch.bfloat16)
    pos = torch.randint(0, 4096, (T,), generator=g, device=DEV)
    w = torch.randn(T, H, generator=g, device=DEV)
    be = dq.index_q_rope_pack_weights(q, pos, freqs, w, 128 ** -0.5, "rne", backend=backend)
    ref = tuple(torch.empty_like(x) for x in be)
    for t0 in range(0, T, 4096):
        sl = slice(t0, t0 + 4096)
        dq.index_q_rope_pack_weights(q[sl], pos[sl], freqs, w[sl], 128 ** -0.5, "rne",
                                     out=tuple(r[sl] for r in ref), backend="reference")
    _sync()
    for name, x, y in zip(("payload", "exponents", "weights"), be, ref):
        bad = _diff_bytes(x, y)
        record(backend, f"reliability:q_pack-T{T}", x.numel() * x.element_size(), bad)
        assert bad == 0, f"{backend} q_pack T={T}: {name} has {bad} bytes different from the reference"


# ------------------------------------------------------------------------------------------------
# streams and threads
# ------------------------------------------------------------------------------------------------
CONCURRENT = {
    "indexer_fp8": dict(T=2048, H=32), "indexer_fp4": dict(T=1024, H=32), "k_store": dict(T=4096),
    "q_pack": dict(T=1024, H=32), "fake_quant": dict(T=2048, H=8), "v4_k": dict(T=4096),
}


def _concurrent_call(op):
    kw = dict(CONCURRENT[op])
    T = kw["T"]
    if op in te.SLOT_OPS:
        kw.update(extra_pages=1, slots=["fresh"] * T, pos=["in"] * T)
    else:
        kw.update(pos=["in"] * T)
    return tp.build(tp.base_case(op, **kw), DEV)


def _launch(call, backend, stream=None):
    """Clone the poisoned outputs and run the op, both on `stream` (so the clone is ordered before the op)."""
    if stream is None:
        kw = dict(call.kwargs, **tp._clone_outs(call))
        return kw, call.fn(**kw, backend=backend)
    with torch.cuda.stream(stream):
        kw = dict(call.kwargs, **tp._clone_outs(call))
        return kw, call.fn(**kw, backend=backend)


def _assert_same(call, backend, base, runs, label):
    for i, (kw, ret) in enumerate(runs):
        problems, total, bad = tp.compare_outputs(call, base[0], base[1], kw, ret, "sequential", f"{label}#{i}")
        record(backend, f"reliability:{label}", total, bad)
        assert not problems, "\n".join(problems[:8])


@pytest.mark.skipif(DEV.type != "cuda", reason="needs CUDA streams")
@pytest.mark.parametrize("backend,op", _params(tp.OPS))
def test_two_streams(backend, op):
    call = _concurrent_call(op)
    base = _launch(call, backend)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    runs = []
    for _ in range(4):                                    # interleaved launches on the two streams
        runs.append(_launch(call, backend, s1))
        runs.append(_launch(call, backend, s2))
    torch.cuda.synchronize()
    tp.take_flags(DEV)
    _assert_same(call, backend, base, runs, "two-streams")


@pytest.mark.skipif(DEV.type != "cuda", reason="needs CUDA streams")
@pytest.mark.parametrize("backend,op", _params(tp.OPS))
def test_two_threads(backend, op):
    call = _concurrent_call(op)
    base = _launch(call, backend)                         # also compiles/warms up before the threads start
    torch.cuda.synchronize()
    results, errors_ = [None, None], []

    def worker(i):
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.default_stream())
            results[i] = [_launch(call, backend, s) for _ in range(4)]
            s.synchronize()
        except BaseException as e:                       # re-raised in the main thread
            errors_.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    torch.cuda.synchronize()
    assert not errors_, errors_[0]
    tp.take_flags(DEV)
    _assert_same(call, backend, base, results[0] + results[1], "two-threads")


# ------------------------------------------------------------------------------------------------
# the device-side slot guard
# ------------------------------------------------------------------------------------------------
GUARD = [f"{op}-{dt}-{'far' if far else 'near'}" for op in te.SLOT_OPS + ("v4_k-dense",)
         for dt in ("int64", "int32") for far in (False, True)]


@pytest.mark.parametrize("backend,name", _params(GUARD))
def test_device_slot_guard(backend, name):
    parts = name.split("-")
    op, dense = parts[0], "dense" in parts
    dt, far = parts[-2], parts[-1] == "far"
    call = tp.call_to(te._oob_call(op, dt, far, "dense" if dense else None), DEV)
    kw = dict(call.kwargs, **tp._clone_outs(call))
    call.fn(**kw, backend=backend)
    _sync()
    with pytest.raises(dq.DsaquantError, match="capacity") as ei:
        dq.check_errors()
    assert "position" not in str(ei.value)
    dq.check_errors()                                     # cleared
    slots = call.kwargs.get("slot_mapping", call.kwargs.get("slots")).cpu().tolist()
    sizes = {n: tp.u8(kw[n]).numel() for n in call.meta["caches"]}
    written = tp.cache_masks(call.meta, slots, "any", sizes)
    for n in call.meta["caches"]:
        b = tp.u8(kw[n])
        assert bool((b[~written[n]] == tt.POISON).all()), f"{n}: {backend} wrote outside the valid slots"
        assert not bool((b[written[n]] == tt.POISON).all()), f"{n}: {backend} did not write the valid slots"
    _check_pair(call, backend, name)                      # and byte-equal to the reference, flags included


# ------------------------------------------------------------------------------------------------
# the hypothesis properties with a GPU budget
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,op", _params(tp.OPS))
def test_hypothesis_backend_equals_reference(backend, op):
    def tally(total, bad):
        record(backend, f"reliability:hypothesis:{op}", total, bad)

    def adjust(case):
        return case

    tp.equality_property(op, backend, DEV, tp.examples(GPU_EXAMPLES[backend]), GPU_MAX_T, GPU_MAX_H, on_result=tally,
                         adjust=adjust, shrink=not DRYRUN)()
