"""Backend choice (dispatch.py) on a CPU-only machine: auto -> reference, the backend= argument and the
DSAQUANT_BACKEND override, unavailable and unknown backends, dsaquant.info(), and thread safety."""
from __future__ import annotations

import threading

import pytest
import torch

import dsaquant
from dsaquant import dispatch
from dsaquant import testing as tt

OPS = ("indexer_qk_rope_quant_and_cache", "index_k_norm_rope_pack_store", "index_q_rope_pack_weights",
       "rope_fake_quant_fp4", "rmsnorm_rope_rotate_fp4quant_kvcache", "paged_mqa_logits")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("DSAQUANT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _indexer_call(backend=None, seed=0):
    a = tt.make_indexer(T=16, H=16, mode="fp8", page_size=16, seed=seed)
    dsaquant.indexer_qk_rope_quant_and_cache(**a, backend=backend)
    return a


def _bytes(a):
    return [a[k].view(torch.uint8).clone() for k in ("q_out", "weights_out", "kv_cache")]


def _all_poison(a):
    return all(bool((a[k].view(torch.uint8) == tt.POISON).all()) for k in ("q_out", "weights_out", "kv_cache"))


@pytest.mark.parametrize("op", OPS)
def test_auto_choice_on_cpu_is_reference(op):
    assert dispatch.choose(op, CPU) == "reference"


def test_explicit_reference_and_env_override_give_the_same_bytes(monkeypatch):
    auto = _bytes(_indexer_call())
    explicit = _bytes(_indexer_call(backend="reference"))
    monkeypatch.setenv("DSAQUANT_BACKEND", "reference")
    assert dispatch.choose("indexer_qk_rope_quant_and_cache", CPU) == "reference"
    env = _bytes(_indexer_call())
    for x, y, z in zip(auto, explicit, env):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert not all(bool((b == tt.POISON).all()) for b in auto)


@pytest.mark.parametrize("name", ["cuda", "hip", "triton"])
def test_forced_unavailable_backend_raises(name):
    a = tt.make_indexer(T=4, H=16, mode="fp8", page_size=16)
    with pytest.raises(dsaquant.BackendUnavailable) as ei:
        dsaquant.indexer_qk_rope_quant_and_cache(**a, backend=name)
    msg = str(ei.value)
    assert f"{name!r}" in msg and "backend=" in msg
    # it says why: not importable / not built, or needs GPU tensors
    ok, why = dispatch.available(name)
    assert (not ok and why in msg) or (ok and "GPU" in msg), msg
    assert _all_poison(a)                                    # nothing was written


@pytest.mark.parametrize("name", ["cuda", "hip"])
def test_env_forced_unavailable_backend_raises(monkeypatch, name):
    monkeypatch.setenv("DSAQUANT_BACKEND", name)
    a = tt.make_k_store(T=4, page_size=16)
    with pytest.raises(dsaquant.BackendUnavailable) as ei:
        dsaquant.index_k_norm_rope_pack_store(**a)
    msg = str(ei.value)
    assert "DSAQUANT_BACKEND=" in msg and f"{name!r}" in msg
    assert bool((a["cache"] == tt.POISON).all())
    # the argument wins over the environment
    dsaquant.index_k_norm_rope_pack_store(**a, backend="reference")
    assert not bool((a["cache"] == tt.POISON).all())


@pytest.mark.parametrize("how", ["arg", "env"])
def test_unknown_backend_raises(monkeypatch, how):
    a = tt.make_indexer(T=4, H=16, mode="fp8", page_size=16)
    kw = {}
    if how == "arg":
        kw["backend"] = "opencl"
    else:
        monkeypatch.setenv("DSAQUANT_BACKEND", "opencl")
    with pytest.raises(dsaquant.BackendUnavailable) as ei:
        dsaquant.indexer_qk_rope_quant_and_cache(**a, **kw)
    msg = str(ei.value)
    assert "'opencl'" in msg and all(b in msg for b in dsaquant.BACKENDS)
    assert _all_poison(a)


def test_register_rejects_unknown_backend():
    with pytest.raises(ValueError, match="opencl"):
        dispatch.register("opencl", "paged_mqa_logits", lambda *a: None)


def test_get_missing_op_raises():
    with pytest.raises(dsaquant.BackendUnavailable, match="no_such_op"):
        dispatch.get("reference", "no_such_op")


def test_routing_to_a_registered_backend(monkeypatch):
    """A backend that implements an op is called with the reference's arguments; on the CPU it is only
    chosen when forced (triton under TRITON_INTERPRET=1), never automatically."""
    calls = []

    def fake(*args):
        calls.append(len(args))
        args[6].fill_(7)          # kv_cache... (the cache is argument 6 of index_k_norm_rope_pack_store)

    monkeypatch.setitem(dispatch._impls, "triton", {"index_k_norm_rope_pack_store": fake})
    monkeypatch.setattr(dispatch, "_loaded", dispatch._loaded | {"triton"})
    monkeypatch.setattr(dispatch, "_load_errors", {k: v for k, v in dispatch._load_errors.items() if k != "triton"})
    assert dispatch.available("triton") == (True, "")
    assert dispatch.choose("index_k_norm_rope_pack_store", CPU) == "reference"
    with pytest.raises(dsaquant.BackendUnavailable, match="GPU"):
        dispatch.choose("index_k_norm_rope_pack_store", CPU, "triton")
    with pytest.raises(dsaquant.BackendUnavailable, match="does not implement"):
        dispatch.choose("paged_mqa_logits", CPU, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = tt.make_k_store(T=4, page_size=16)
    dsaquant.index_k_norm_rope_pack_store(**a, backend="triton")
    assert calls == [10] and bool((a["cache"] == 7).all())


def test_info_reports_all_backends():
    d = dsaquant.info()
    assert set(d["backends"]) == {"reference", "triton", "cuda", "hip"}
    for name, v in d["backends"].items():
        assert isinstance(v["available"], bool)
        if v["available"]:
            assert v["reason"] == "" and v["ops"], name
        else:
            assert v["reason"] and v["ops"] == [], name
    assert d["backends"]["reference"]["available"]
    assert set(OPS) <= set(d["backends"]["reference"]["ops"])
    # cuda/hip may be importable (a built module) on a CPU-only machine, but never chosen for CPU tensors
    assert d["chosen"] == "reference"
    assert "CPU" in d["device"]
    assert d["torch"] == torch.__version__ and d["dsaquant"] == dsaquant.__version__
    assert d["vendor"] == dispatch.vendor() and d["auto_order"] == dispatch.preference.describe(d["vendor"])


def _race(n, work):
    """Run work(0) .. work(n-1) in n threads released together by a barrier; assert that none raised."""
    barrier = threading.Barrier(n)
    errors = []

    def run(i):
        try:
            barrier.wait()
            work(i)
        except Exception as e:   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_threads_give_the_same_bytes_as_sequential_calls():
    n = 8
    seq = [_bytes(_indexer_call(seed=i)) for i in range(n)]
    args = [tt.make_indexer(T=16, H=16, mode="fp8", page_size=16, seed=i) for i in range(n)]

    def work(i):
        for _ in range(3):
            dsaquant.indexer_qk_rope_quant_and_cache(**args[i])

    _race(n, work)
    for i in range(n):
        for x, y in zip(seq[i], _bytes(args[i])):
            assert torch.equal(x, y), i
    dsaquant.check_errors()


def test_threads_racing_the_first_backend_load(monkeypatch):
    """Forget what was loaded, then let 8 threads trigger the first load at once (the lock's job)."""
    monkeypatch.setattr(dispatch, "_loaded", set())
    monkeypatch.setattr(dispatch, "_load_errors", {})
    n = 8
    got = [None] * n

    def work(i):
        got[i] = (dispatch.choose("paged_mqa_logits", CPU), dispatch.available("cuda"))

    _race(n, work)
    assert dispatch._loaded >= {"reference", "cuda"}
    assert all(g == ("reference", dispatch.available("cuda")) for g in got), got
    ok, why = dispatch.available("cuda")
    assert ok or why, "an unavailable backend must say why"
    # the reference's ops are still all registered once the race is over
    assert set(OPS) <= set(dispatch.ops_of("reference"))


def test_library_op_eager_call_skips_the_custom_op(monkeypatch):
    """An eager call runs the op's implementation directly (the custom op's Python dispatch costs host time);
    the bytes are those of the registered custom op, which torch.compile and opcheck use."""
    from dsaquant import ops
    a = tt.make_indexer(T=5, H=16, mode="fp4", seed=3)
    b = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}

    def refuse(*args):
        raise AssertionError("an eager call went through the custom op")

    versions = {n: a[n]._version for n in ("q_out", "kv_cache", "q")}
    with monkeypatch.context() as m:
        m.setattr(ops._indexer_op, "op", refuse)
        ops.indexer_qk_rope_quant_and_cache(**a, backend="reference")
    # the mutated arguments' version counters move (autograd sees the writes), the inputs' do not
    assert a["q_out"]._version > versions["q_out"] and a["kv_cache"]._version > versions["kv_cache"]
    assert a["q"]._version == versions["q"]
    with monkeypatch.context() as m:   # the path a compiled graph takes: the registered custom op
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        m.setattr(ops._indexer_op, "fn", refuse)
        ops.indexer_qk_rope_quant_and_cache(**b, backend="reference")
    for n in ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"):
        assert torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)), n
    assert bool((a["kv_cache"] != 0).any())


def test_library_op_eager_call_bumps_the_mutated_versions():
    """A kernel writes through a pointer, which autograd does not see: the eager path bumps the version
    counters of the declared mutated arguments itself (the custom op's dispatch would), and only theirs."""
    calls = []

    def touch(x: torch.Tensor, y: torch.Tensor, scale: float) -> None:   # writes nothing torch can see
        calls.append(scale)

    # real types, not this module's postponed strings (torch 2.4 reads custom-op schemas from them)
    touch.__annotations__ = {"x": torch.Tensor, "y": torch.Tensor, "scale": float, "return": None}
    op = dispatch.library_op("dsaquant_test::touch_versions", mutates_args=("x",))(touch)
    x, y = torch.zeros(3), torch.zeros(3)
    vx, vy = x._version, y._version
    op(x, y, 2.0)
    assert calls == [2.0] and x._version > vx and y._version == vy
