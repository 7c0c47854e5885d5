"""Edge sizes and server-style inputs for the five writer ops, on the CPU reference (reliability).

- T = 0 is a no-op for every op (nothing written, no error flag), with the host checks off and on;
- T = 1; H not a multiple of 16 in FP8 mode (and for the sglang ops) works; FP4 mode rejects it;
- caches of exactly one page, every slot of the page written (and slot P flagged);
- strided inputs as servers produce them (q a view into a fused projection output, k/weights column slices,
  positions and slot maps strided or broadcast, int32/int64, norm/RoPE tables as slices, weights_out a
  column slice): each gives the same bytes as the contiguous inputs or is rejected with a ValueError that
  names the argument and writes nothing (silently reading the wrong elements is the failure);
- a slot at (or far past) the capacity is skipped and flagged (check_errors raises DsaquantError, then
  is clean); the opt-in host check raises ValueError before writing; check_errors() with no error is silent.

The SPEC expectations themselves are checked by tests/test_properties.py (whose builders and checker this
file reuses): every case here runs `run_reference_and_check` where it applies.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_properties as tp  # noqa: E402

import dsaquant as dq  # noqa: E402
from dsaquant import errors  # noqa: E402
from dsaquant import testing as tt  # noqa: E402

POISON = tt.POISON
OPS = tp.OPS
SLOT_OPS = ("indexer_fp8", "indexer_fp4", "k_store", "v4_k")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: torch's intra-op threads only spin (slow on an oversubscribed machine). Restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _clean_flags_and_host_checks():
    """Every test starts and ends with no pending error flag and the host checks off."""
    tp.drain_flags()
    dq.set_host_checks(False)
    yield
    dq.set_host_checks(False)
    tp.drain_flags()


def _outputs(call, kw=None, ret=None):
    kw = call.kwargs if kw is None else kw
    return tp._flat_outputs(kw, call.outs, ret if call.returns else None)


def _all_poison(call) -> bool:
    return all(bool((tp.u8(t) == POISON).all()) for _, t in _outputs(call))


def _run(call, **extra):
    """Run `call` on layout-preserving clones of its outputs; returns (kwargs used, return value)."""
    kw = dict(call.kwargs, **tp._clone_outs(call), **extra)
    return kw, call.fn(**kw)


def _contig(call):
    """The same call with every input made contiguous (same values) and fresh poisoned contiguous outputs."""
    kw = {}
    for k, v in call.kwargs.items():
        if k in call.outs:
            kw[k] = (tuple(tt.poisoned(tuple(x.shape), x.dtype, x.device) for x in v) if isinstance(v, tuple)
                     else tt.poisoned(tuple(v.shape), v.dtype, v.device))
        elif isinstance(v, torch.Tensor):
            kw[k] = v.contiguous()
        else:
            kw[k] = v
    return tp.Call(call.fn, kw, call.outs, call.meta, call.returns)


def _same_bytes(strided):
    """Run `strided` and its contiguous twin in place: every output byte equal (bytes of slots written twice
    excepted, docs/semantics.md); no input byte and no byte around a strided output's view changed."""
    contig = _contig(strided)
    views = {k: (v, tp.storage_u8(v).clone()) for k, v in strided.kwargs.items()
             if isinstance(v, torch.Tensor) and (not v.is_contiguous() or v.storage_offset())}
    r_a = contig.fn(**contig.kwargs)
    fa = tp.take_flags("cpu")
    r_b = strided.fn(**strided.kwargs)
    fb = tp.take_flags("cpu")
    assert fa == fb, f"error flags differ: contiguous {fa}, strided {fb}"
    slots = contig.kwargs.get("slot_mapping", contig.kwargs.get("slots"))
    skip = {}
    if slots is not None and contig.meta.get("caches"):
        sizes = {n: tp.u8(contig.kwargs[n]).numel() for n in contig.meta["caches"]}
        skip = tp.cache_masks(contig.meta, slots.tolist(), "twice", sizes)
    for (name, a), (_, b) in zip(_outputs(contig, None, r_a), _outputs(strided, None, r_b)):
        ab, bb = tp.u8(a), tp.u8(b)
        keep = ~skip[name] if name in skip else torch.ones_like(ab, dtype=torch.bool)
        diff = (ab != bb) & keep
        assert not bool(diff.any()), f"{name}: {int(diff.sum())} bytes differ, first at {diff.nonzero()[:4].tolist()}"
    for k, (v, before) in views.items():
        after = tp.storage_u8(v)
        changed = after != before
        if k not in strided.outs:
            assert not bool(changed.any()), f"input {k} was modified"
        else:
            assert not bool((changed & tp.outside_view(v)).any()), f"bytes around the output view {k} were written"


# Arguments that an op may reject when strided instead of honouring the strides (SPEC §7.5: "contiguity
# where it matters"), with a ValueError naming them and nothing written. Everything else must work.
MAY_REJECT = ("positions", "slot_mapping", "slots", "weights_out")


def _same_bytes_or_rejected(call):
    """_same_bytes (returns True), or a clean rejection (returns False): a ValueError naming one of the
    strided MAY_REJECT arguments, raised before anything is written."""
    strided = [k for k, v in call.kwargs.items() if isinstance(v, torch.Tensor)
               and (not v.is_contiguous() or v.storage_offset())]
    before = [(n, tp.storage_u8(t).clone()) for n, t in _outputs(call)]
    try:
        _same_bytes(call)
        return True
    except ValueError as e:
        name = str(e).split(":")[0]
        if name not in MAY_REJECT or name not in strided:
            raise
        for (n, b), (_, t) in zip(before, _outputs(call)):
            assert torch.equal(b, tp.storage_u8(t)), f"{n} was written by a rejected call"
        return False


def _check(case):
    problems = tp.run_reference_and_check(case)
    assert not problems, "\n".join(problems[:10])


# ------------------------------------------------------------------------------------------------
# T = 0 (every op: the one T = 0 test of the suite), T = 1
# ------------------------------------------------------------------------------------------------
ZERO_CASES = {
    "indexer_fp8": dict(), "indexer_fp8-H3-int32": dict(H=3, pos_dtype="int32", slot_dtype="int32"),
    "indexer_fp4": dict(), "indexer_fp4-H32": dict(H=32), "k_store": dict(), "k_store-int32": dict(
        pos_dtype="int32", slot_dtype="int32", ratio=4), "q_pack": dict(), "q_pack-H1": dict(H=1),
    "fake_quant": dict(), "fake_quant-3d": dict(H=5, block=16, scale="e4m3"), "v4_k": dict(),
    "v4_k-dense-3d": dict(layout="dense", hk=3),
}


def _zero_compress(quant_mode, layout="packed68"):
    return dq.compress_kv, tt.make_compress_kv(starts=(0, 5), lens=(0, 0), quant_mode=quant_mode, layout=layout,
                                               seed=1)


def _zero_rotate(out, **kw):
    """rope_rotate_quant with T = 0 whose outputs are empty views of poisoned T = 2 buffers (so a write past
    the view would show in the storage)."""
    full, a = tt.make_rope_rotate_quant(T=2, out=out, **kw), tt.make_rope_rotate_quant(T=0, out=out, **kw)
    for k in ("out", "out_scale"):
        if k in a:
            a[k] = full[k][:0]
    return dq.rope_rotate_quant, a


# The ops whose cases are not test_properties cases: name -> () -> (op, kwargs).
ZERO_OTHER = {
    "compress_kv-fp4": lambda: _zero_compress("fp4"), "compress_kv-fp4-aiter": lambda: _zero_compress("fp4", "aiter_fp4"),
    "compress_kv-fp8": lambda: _zero_compress("fp8"), "compress_kv-none": lambda: _zero_compress("none"),
    "rope_rotate_quant-fp4": lambda: _zero_rotate("fp4"),
    "rope_rotate_quant-fp4-dense": lambda: _zero_rotate("fp4", shuffle_scale=False),
    "rope_rotate_quant-e4m3fn": lambda: _zero_rotate("e4m3fn"), "rope_rotate_quant-half": lambda: _zero_rotate("half"),
}


def _tensors(kw):
    return {(k, i): t for k, v in kw.items() for i, t in enumerate(v if isinstance(v, tuple) else (v,))
            if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("host_checks", [False, True])
@pytest.mark.parametrize("name", sorted(ZERO_CASES) + sorted(ZERO_OTHER))
def test_zero_tokens_is_a_noop(name, host_checks):
    """T = 0, every op: no error flag, and no byte of any tensor argument's storage changes (outputs stay
    poisoned, rings and inputs untouched); returned tensors have 0 rows."""
    op = name.split("-")[0]
    if name in ZERO_OTHER:
        fn, kw = ZERO_OTHER[name]()
    else:
        call = tp.build(tp.base_case(op, T=0, **ZERO_CASES[name]))
        fn, kw = call.fn, call.kwargs
    before = {k: tp.storage_u8(t).clone() for k, t in _tensors(kw).items()}
    dq.set_host_checks(host_checks)
    ret = fn(**kw)
    dq.set_host_checks(False)
    assert tp.take_flags("cpu") == 0, "T = 0 raised an error flag"
    dq.check_errors()
    for k, t in _tensors(kw).items():
        assert torch.equal(tp.storage_u8(t), before[k]), f"T = 0 wrote into {k}"
    if name in ZERO_CASES:
        assert _all_poison(call), "T = 0 wrote something"
    if op == "q_pack":
        assert [tuple(t.shape) for t in ret] == [(0, call.meta["H"], 64), (0, call.meta["H"]), (0, call.meta["H"])]
    if op == "fake_quant":
        assert ret.shape[0] == 0
    if op in ("compress_kv", "rope_rotate_quant"):
        assert ret is None


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("slot_kind", ["fresh", "zero", "last", "neg"])
def test_one_token(op, slot_kind):
    """T = 1 with every kind of slot (0 is reserved for k_store only; the last slot of the cache is valid)."""
    _check(tp.base_case(op, T=1, slots=[slot_kind], pos=["last" if slot_kind == "neg" else "in"]))


# ------------------------------------------------------------------------------------------------
# H: any H in FP8 mode and for the sglang ops; H % 16 == 0 in FP4 mode
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H", [1, 2, 3, 7, 15, 17, 40])
def test_fp8_mode_any_head_count(H):
    _check(tp.base_case("indexer_fp8", H=H))
    _check(tp.base_case("indexer_fp8", H=H, all_q=True, preshuffle=True, scale_fmt=None, T=5))


@pytest.mark.parametrize("H", [1, 3, 17])
def test_sglang_ops_any_head_count(H):
    _check(tp.base_case("q_pack", H=H))
    _check(tp.base_case("fake_quant", H=H))


@pytest.mark.parametrize("H", [1, 8, 15, 17, 24, 40])
def test_fp4_mode_rejects_h_not_multiple_of_16(H):
    c = tp.base_case("indexer_fp4", H=16)
    call = tp.build(c)
    T = c["T"]
    a = dict(call.kwargs)
    a["q"] = torch.randn(T, H, 128).to(torch.bfloat16)
    a["weights"] = torch.randn(T, H)
    a["q_out"] = tt.poisoned((T, H, 64), torch.uint8, "cpu")
    a["weights_out"] = tt.poisoned((T, H), torch.bfloat16, "cpu")
    a["q_scale_out"] = tt.poisoned((T, 1, 4, 16, max(4, (H // 16 + 3) // 4 * 4)), torch.uint8, "cpu")
    with pytest.raises(ValueError) as ei:
        dq.indexer_qk_rope_quant_and_cache(**a)
    msg = str(ei.value)
    assert msg.startswith("q:") and "16" in msg and str(H) in msg, msg
    for n in ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"):
        assert bool((tp.u8(a[n]) == POISON).all()), f"{n} was written by a rejected call"
    assert tp.take_flags("cpu") == 0


def test_fp8_mode_zero_heads_writes_k_only():
    """H = 0 (degenerate, but a valid shape): only k is written."""
    call = tp.build(tp.base_case("indexer_fp8", H=1, T=4, slots=["fresh"] * 4, pos=["in"] * 4))
    a = dict(call.kwargs, **tp._clone_outs(call))
    a.update(q=torch.zeros(4, 0, 128, dtype=torch.bfloat16), weights=torch.zeros(4, 0),
             q_out=tt.poisoned((4, 0, 128), torch.float8_e4m3fn, "cpu"),
             weights_out=tt.poisoned((4, 0), torch.float32, "cpu"))
    dq.indexer_qk_rope_quant_and_cache(**a)
    dq.check_errors()
    written = tp.u8(a["kv_cache"]) != POISON
    assert int(written.sum()) == 4 * 132


# ------------------------------------------------------------------------------------------------
# caches of exactly one page
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", SLOT_OPS)
@pytest.mark.parametrize("P", [16, 32, 64])
def test_one_page_cache_every_slot(op, P):
    """NB = 1 and T = P + 1: every slot of the page once (slot 0 too; reserved for k_store), in shuffled
    order, plus slot P (at the capacity: skipped and flagged)."""
    T = P + 1
    c = tp.base_case(op, T=T, P=P, extra_pages=-10, slots=["fresh"] * P + ["oob"], pos=["in"] * T)
    call = tp.build(c)
    assert call.meta["cap"] == P and call.kwargs.get("slot_mapping", call.kwargs.get("slots"))[-1].item() >= P
    _check(c)
    kw, _ = _run(call)
    with pytest.raises(dq.DsaquantError, match="capacity"):
        dq.check_errors()
    dq.check_errors()
    lowest = 1 if op == "k_store" else 0
    sizes = {n: tp.u8(kw[n]).numel() for n in call.meta["caches"]}
    written = tp.cache_masks(call.meta, list(range(lowest, P)), "any", sizes)
    for n in call.meta["caches"]:
        untouched = tp.u8(kw[n]) == POISON
        assert not bool(untouched[written[n]].all()), f"{n}: the page was not written"
        assert bool(untouched[~written[n]].all()), f"{n}: bytes outside the page's valid slots were written"


def test_dense_v4_layout_one_slot():
    c = tp.base_case("v4_k", T=3, layout="dense", extra_pages=-1, slots=["fresh", "oob", "neg"], pos=["in"] * 3)
    assert tp.build(c).meta["cap"] == 1
    _check(c)


# ------------------------------------------------------------------------------------------------
# strided inputs: same bytes as contiguous, or a ValueError naming the argument
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("style", [1, 2])
@pytest.mark.parametrize("idx", ["int64", "int32"])
def test_strided_like_contiguous(op, style, idx):
    """The builders' server-style views (q in a fused projection output [T, H*128 + 512] or with heads 136
    apart at an odd offset, k / weights / x column slices at aligned and odd offsets, positions and slots
    as a column of a [T, 2] tensor) give the bytes of contiguous inputs and satisfy every SPEC invariant."""
    kw = dict(pos_dtype=idx, strided=style, strided_idx=True)
    if op in SLOT_OPS:
        kw["slot_dtype"] = idx
    if op == "v4_k":
        kw["hk"] = None
    if op in ("q_pack", "fake_quant"):
        kw["H"] = 5
    case = tp.base_case(op, **kw)
    call = tp.build(case)
    views = [k for k, v in call.kwargs.items() if isinstance(v, torch.Tensor) and not v.is_contiguous()]
    assert len(views) >= 2, f"the strided case has too few strided inputs: {views}"
    if _same_bytes_or_rejected(call):
        _check(case)


def _mutated(op, mutate, **kw):
    call = tp.build(tp.base_case(op, **kw))
    mutate(call.kwargs)
    return call


def _wide(t, extra=5, off=3):
    """t [..., n] as a column slice of a wider buffer filled with 7 (last dim contiguous)."""
    big = torch.full((*t.shape[:-1], t.shape[-1] + extra), 7, dtype=t.dtype)
    big[..., off:off + t.shape[-1]] = t
    return big[..., off:off + t.shape[-1]]


def _every_other(v):
    """v [n] as every other element of [2n] interleaved with different values (stride 2)."""
    return torch.stack((v, -7 - v), dim=-1).reshape(-1)[0::2]


def _bcast(v):
    """v [T, ...] -> its first row broadcast to every token (stride 0)."""
    return v[:1].expand(v.shape)


def _last_dim_strided(t):
    return torch.repeat_interleave(t, 2, dim=-1)[..., ::2]


STRIDED_INPUTS = {
    # name: (op, mutate(kwargs)) -- each must give the bytes of the same values laid out contiguously
    "indexer-norm_weight-every-other": ("indexer_fp8", lambda a: a.update(norm_weight=_every_other(a["norm_weight"]))),
    "indexer-norm_bias-every-other": ("indexer_fp4", lambda a: a.update(norm_bias=_every_other(a["norm_bias"]))),
    "indexer-cos-sin-column-slices": ("indexer_fp8", lambda a: a.update(cos_cache=_wide(a["cos_cache"], 32, 32),
                                                                        sin_cache=_wide(a["sin_cache"], 32, 0))),
    "indexer-cos-sin-different-strides": ("indexer_fp4", lambda a: a.update(cos_cache=_wide(a["cos_cache"], 32, 32))),
    "indexer-weights-transposed": ("indexer_fp4", lambda a: a.update(weights=a["weights"].t().contiguous().t())),
    "indexer-weights-column-slice-odd": ("indexer_fp8", lambda a: a.update(weights=_wide(a["weights"], 7, 5))),
    "indexer-fp4-bf16-weights-column-slice": ("indexer_fp4", lambda a: a.update(
        weights=_wide(a["weights"].to(torch.bfloat16), 9, 1))),
    "indexer-weights-head-broadcast": ("indexer_fp8", lambda a: a.update(
        weights=a["weights"][:, :1].expand(a["weights"].shape))),
    "indexer-q-head-broadcast": ("indexer_fp8", lambda a: a.update(q=a["q"][:, :1].expand(a["q"].shape))),
    "indexer-q-token-broadcast": ("indexer_fp4", lambda a: a.update(q=_bcast(a["q"]))),
    "indexer-positions-broadcast": ("indexer_fp8", lambda a: a.update(positions=_bcast(a["positions"]))),
    "indexer-positions-every-other-int32": ("indexer_fp4", lambda a: a.update(
        positions=_every_other(a["positions"].to(torch.int32)))),
    "indexer-slots-every-other-int32": ("indexer_fp8", lambda a: a.update(
        slot_mapping=_every_other(a["slot_mapping"].to(torch.int32)))),
    "indexer-slots-every-other-int64": ("indexer_fp4", lambda a: a.update(
        slot_mapping=_every_other(a["slot_mapping"]))),
    "indexer-weights_out-column-slice": ("indexer_fp8", lambda a: a.update(weights_out=_wide(a["weights_out"]))),
    "indexer-fp4-weights_out-column-slice": ("indexer_fp4", lambda a: a.update(weights_out=_wide(a["weights_out"]))),
    "indexer-weights_out-transposed": ("indexer_fp8", lambda a: a.update(
        weights_out=a["weights_out"].t().contiguous().t())),
    "k_store-freqs-row-slice": ("k_store", lambda a: a.update(freqs=_wide(a["freqs"], 64, 0))),
    "k_store-norm_weight-every-other": ("k_store", lambda a: a.update(norm_weight=_every_other(a["norm_weight"]))),
    "k_store-slots-every-other": ("k_store", lambda a: a.update(slots=_every_other(a["slots"]))),
    "k_store-positions-broadcast": ("k_store", lambda a: a.update(positions=_bcast(a["positions"]))),
    "k_store-k-token-broadcast": ("k_store", lambda a: a.update(k=_bcast(a["k"]))),
    "q_pack-head_weights-transposed": ("q_pack", lambda a: a.update(
        head_weights=a["head_weights"].t().contiguous().t())),
    "q_pack-positions-every-other": ("q_pack", lambda a: a.update(positions=_every_other(a["positions"]))),
    "q_pack-positions-broadcast": ("q_pack", lambda a: a.update(positions=_bcast(a["positions"]))),
    "q_pack-freqs-row-slice": ("q_pack", lambda a: a.update(freqs=_wide(a["freqs"], 64, 64))),
    "fake_quant-positions-every-other": ("fake_quant", lambda a: a.update(positions=_every_other(a["positions"]))),
    "v4_k-kv-3d-head0": ("v4_k", lambda a: a.update(kv=torch.stack((a["kv"], -a["kv"], a["kv"]), dim=1)[:, :2])),
    "v4_k-kv-column-slice": ("v4_k", lambda a: a.update(kv=_wide(a["kv"]))),
    "v4_k-slots-every-other": ("v4_k", lambda a: a.update(slot_mapping=_every_other(a["slot_mapping"]))),
    "v4_k-positions-broadcast": ("v4_k", lambda a: a.update(positions=_bcast(a["positions"]))),
    "v4_k-norm_weight-every-other": ("v4_k", lambda a: a.update(norm_weight=_every_other(a["norm_weight"]))),
    "v4_k-cos-sin-column-slices": ("v4_k", lambda a: a.update(cos_cache=_wide(a["cos_cache"], 32, 32),
                                                              sin_cache=_wide(a["sin_cache"], 32, 32))),
}


@pytest.mark.parametrize("name", sorted(STRIDED_INPUTS))
def test_strided_input_same_bytes(name):
    op, mutate = STRIDED_INPUTS[name]
    call = _mutated(op, mutate)
    assert any(isinstance(v, torch.Tensor) and (not v.is_contiguous() or v.storage_offset())
               for v in call.kwargs.values()), "the mutation made no strided tensor"
    _same_bytes_or_rejected(call)


REJECTED = {
    # name: (op, mutate(kwargs), the argument the ValueError must name)
    "indexer-q-last-dim-strided": ("indexer_fp8", lambda a: a.update(q=_last_dim_strided(a["q"])), "q"),
    "indexer-k-last-dim-strided": ("indexer_fp4", lambda a: a.update(k=_last_dim_strided(a["k"])), "k"),
    "indexer-cos-last-dim-strided": ("indexer_fp8", lambda a: a.update(cos_cache=_last_dim_strided(a["cos_cache"])),
                                     "cos_cache"),
    "indexer-sin-last-dim-strided": ("indexer_fp4", lambda a: a.update(sin_cache=_last_dim_strided(a["sin_cache"])),
                                     "sin_cache"),
    "indexer-q_out-strided": ("indexer_fp8", lambda a: a.update(q_out=_wide(a["q_out"].view(torch.uint8), 128, 0)
                                                                    .view(a["q_out"].dtype)), "q_out"),
    "indexer-fp4-q_out-strided": ("indexer_fp4", lambda a: a.update(q_out=_wide(a["q_out"], 64, 0)), "q_out"),
    "indexer-q_scale_out-strided": ("indexer_fp4", lambda a: a.update(q_scale_out=_wide(a["q_scale_out"], 4, 0)),
                                    "q_scale_out"),
    "indexer-kv_cache-strided": ("indexer_fp4", lambda a: a.update(kv_cache=_wide(a["kv_cache"], 16, 0)), "kv_cache"),
    "indexer-fp8-kv_cache-strided": ("indexer_fp8", lambda a: a.update(kv_cache=_wide(a["kv_cache"], 132, 0)),
                                     "kv_cache"),
    "k_store-k-last-dim-strided": ("k_store", lambda a: a.update(k=_last_dim_strided(a["k"])), "k"),
    "k_store-freqs-last-dim-strided": ("k_store", lambda a: a.update(freqs=_last_dim_strided(a["freqs"])), "freqs"),
    "k_store-cache-strided": ("k_store", lambda a: a.update(cache=_wide(a["cache"], 68, 0)), "cache"),
    "q_pack-q-last-dim-strided": ("q_pack", lambda a: a.update(q=_last_dim_strided(a["q"])), "q"),
    "q_pack-out-strided": ("q_pack", lambda a: a.update(out=(_wide(a["out"][0], 64, 0), *a["out"][1:])),
                           "out[0] (payload)"),
    "q_pack-exps-strided": ("q_pack", lambda a: a.update(out=(a["out"][0], _wide(a["out"][1], 3, 0), a["out"][2])),
                            "out[1] (exponents)"),
    "fake_quant-x-last-dim-strided": ("fake_quant", lambda a: a.update(x=_last_dim_strided(a["x"])), "x"),
    "fake_quant-out-strided": ("fake_quant", lambda a: a.update(out=_wide(a["out"], 128, 0)), "out"),
    "v4_k-kv-last-dim-strided": ("v4_k", lambda a: a.update(kv=_last_dim_strided(a["kv"])), "kv"),
    "v4_k-kv_cache-strided": ("v4_k", lambda a: a.update(kv_cache=_wide(a["kv_cache"], 16, 0)), "kv_cache"),
    "v4_k-kv_cache_scale-strided": ("v4_k", lambda a: a.update(kv_cache_scale=_wide(a["kv_cache_scale"], 16, 0)),
                                    "kv_cache_scale"),
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_strided_input_rejected_by_name(name):
    op, mutate, arg = REJECTED[name]
    call = _mutated(op, mutate, extra_pages=2)          # several pages: a one-page slice is contiguous
    flat = [t for v in call.kwargs.values() for t in (v if isinstance(v, tuple) else (v,))]
    assert any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in flat), "nothing is strided"
    before = [(n, tp.storage_u8(t).clone()) for n, t in _outputs(call)]
    with pytest.raises(ValueError) as ei:
        call.fn(**call.kwargs)
    msg = str(ei.value)
    assert msg.startswith(arg + ":"), f"the error does not start with the argument name {arg!r}: {msg}"
    assert "got" in msg, msg
    for (n, b), (_, t) in zip(before, _outputs(call)):
        assert torch.equal(b, tp.storage_u8(t)), f"{n} was written by a rejected call"
    assert tp.take_flags("cpu") == 0


# ------------------------------------------------------------------------------------------------
# slots at the capacity, host checks, check_errors
# ------------------------------------------------------------------------------------------------
def _oob_call(op, dtype, far, layout=None):
    """6 tokens: fresh, last, exactly the capacity, fresh, negative, capacity + 1 (or the dtype's extreme)."""
    T = 6
    c = tp.base_case(op, T=T, slot_dtype=dtype, slots=["fresh", "last", "fresh", "fresh", "neg", "fresh"],
                     pos=["in"] * T)
    if layout:
        c["layout"] = layout
    call = tp.build(c)
    cap = call.meta["cap"]
    key = "slot_mapping" if "slot_mapping" in call.kwargs else "slots"
    s = call.kwargs[key].clone()
    s[2] = cap
    s[5] = (2 ** 31 - 1 if dtype == "int32" else 2 ** 40) if far else cap + 1
    call.kwargs[key] = s
    return call


@pytest.mark.parametrize("op", SLOT_OPS + ("v4_k-dense",))
@pytest.mark.parametrize("dtype", ["int64", "int32"])
@pytest.mark.parametrize("far", [False, True])
def test_slot_at_capacity_is_skipped_and_flagged(op, dtype, far):
    call = _oob_call(op.split("-")[0], dtype, far, "dense" if op.endswith("dense") else None)
    kw, _ = _run(call)
    with pytest.raises(dq.DsaquantError, match="capacity") as ei:
        dq.check_errors()
    assert "position" not in str(ei.value)
    dq.check_errors()                                              # cleared: silent now
    slots = call.kwargs.get("slot_mapping", call.kwargs.get("slots")).tolist()
    sizes = {n: tp.u8(kw[n]).numel() for n in call.meta["caches"]}
    written = tp.cache_masks(call.meta, slots, "any", sizes)
    for n in call.meta["caches"]:
        b = tp.u8(kw[n])
        assert bool((b[~written[n]] == POISON).all()), f"{n}: a byte outside the valid slots was written"
        assert not bool((b[written[n]] == POISON).all()), f"{n}: the valid slots were not written"
    # the same call with the opt-in host check: ValueError naming the slot tensor, before anything is written
    dq.set_host_checks(True)
    kw2 = dict(call.kwargs, **tp._clone_outs(call))
    with pytest.raises(ValueError) as ei:
        call.fn(**kw2)
    dq.set_host_checks(False)
    msg = str(ei.value)
    assert msg.split(":")[0] in ("slot_mapping", "slots") and "capacity" in msg, msg
    assert all(bool((tp.u8(t) == POISON).all()) for _, t in _outputs(call, kw2)), "the host check let a write through"
    assert tp.take_flags("cpu") == 0


@pytest.mark.parametrize("op", SLOT_OPS)
def test_host_checks_pass_valid_slots(op):
    """With the host checks on, a call whose slots are all < capacity (negative ones included) runs."""
    c = tp.base_case(op, T=6, slots=["fresh", "last", "neg", "zero", "fresh", "neg"], pos=["in"] * 6)
    call = tp.build(c)
    dq.set_host_checks(True)
    kw, _ = _run(call)
    dq.set_host_checks(False)
    dq.check_errors()
    assert not all(bool((tp.u8(kw[n]) == POISON).all()) for n in call.meta["caches"])


def test_check_errors_silent_without_errors():
    dq.check_errors()
    dq.check_errors(torch.device("cpu"))
    call = tp.build(tp.base_case("indexer_fp8", T=4, slots=["fresh"] * 4, pos=["in"] * 4))
    _run(call)
    dq.check_errors()
    dq.check_errors()


def test_position_flag_is_separate_and_cleared():
    """An out-of-range position is clamped and reported alone (no slot message); the next check is clean."""
    call = tp.build(tp.base_case("k_store", T=4, slots=["fresh"] * 4, pos=["in", "extreme", "neg", "over"]))
    _run(call)
    with pytest.raises(dq.DsaquantError) as ei:
        dq.check_errors()
    assert "position" in str(ei.value) and "capacity" not in str(ei.value)
    dq.check_errors()


def test_both_flags_in_one_message():
    call = tp.build(tp.base_case("v4_k", T=4, slots=["fresh", "oob", "fresh", "neg"], pos=["in", "over", "in", "in"]))
    _run(call)
    with pytest.raises(dq.DsaquantError) as ei:
        dq.check_errors()
    assert "position" in str(ei.value) and "capacity" in str(ei.value)
    dq.check_errors()
    assert errors.flag_tensor("cpu").item() == 0
