"""Edge sizes and strided (server-style) inputs of every writer op on one backend, for compute-sanitizer
(memcheck / racecheck / initcheck), like ci/sanitize_cases.py. Usage:

    compute-sanitizer --tool memcheck python ci/sanitize_edge_cases.py [cuda|triton] [--compare]

Cases (small: the tools are slow): T = 0 and 1 with every kind of slot; H not a multiple of 16 in FP8 mode
and for the sglang ops; H = 0; caches of exactly one page with every slot written plus slots at the
capacity, 2^31-1 (int32) and 2^40 (int64) (the device guard must skip them without touching memory);
the dense V4 layout with one slot; q as a view into a fused projection output and with heads at an odd
offset; k / weights / x as column slices, including one flush against the end of its allocation at an odd
offset (a vector load there would read past the end); transposed and broadcast weights; norm and RoPE
tables as slices.

The strided / broadcast positions and slot maps, the strided weights_out and a position tensor broadcast
from one element are included: they were the `cuda` backend's stride bug (fixed: backends/compiled.py makes
index tensors dense and passes weights_out's strides; tests/gpu/test_reliability_gpu.py). `--compare` also
checks every case byte for byte against backend="reference" (slower). With TRITON_INTERPRET=1 and backend triton it dry-runs on the CPU.
"""
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "python"))

import test_edge_cases as te  # noqa: E402
import test_properties as tp  # noqa: E402
from dsaquant import testing as tt  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
backend = args[0] if args else "cuda"
compare = "--compare" in sys.argv
# TRITON_INTERPRET=1 with backend triton: a CPU dry run of the case list (no sanitizer meaning)
dev = torch.device("cpu") if (backend == "triton" and __import__("os").environ.get("TRITON_INTERPRET") == "1") \
    else torch.device("cuda")


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def flush_end(t):
    """t [T, n] as the last n columns of [T, n + 3]: odd offset, the last row ends at the allocation's end."""
    big = torch.full((t.shape[0], t.shape[1] + 3), 7, dtype=t.dtype)
    big[:, 3:] = t
    return big[:, 3:]


def cases():
    """(label, Call on the CPU)."""
    out = []
    for op in tp.OPS:
        out.append((f"{op} T=0", tp.build(tp.base_case(op, T=0))))
        for kind in ("fresh", "zero", "last", "neg"):
            out.append((f"{op} T=1 {kind}", tp.build(tp.base_case(op, T=1, slots=[kind]))))
        for style in (1, 2):
            for iv in (False, True):
                c = tp.base_case(op, strided=style, strided_idx=iv, pos_dtype="int32",
                                 **({"H": 5} if op in ("q_pack", "fake_quant") else {}),
                                 **({"hk": None} if op == "v4_k" else {}))
                out.append((f"{op} strided style {style}{' idx view' if iv else ''}", tp.build(c)))
    for H in (1, 3, 17):
        out.append((f"indexer_fp8 H={H}", tp.build(tp.base_case("indexer_fp8", H=H, preshuffle=H == 17,
                                                                all_q=H == 3))))
        out.append((f"q_pack H={H}", tp.build(tp.base_case("q_pack", H=H))))
        out.append((f"fake_quant H={H}", tp.build(tp.base_case("fake_quant", H=H, block=16, scale="e4m3"))))
    for op in te.SLOT_OPS:
        for P in (16, 64):
            out.append((f"{op} one page P={P}", tp.build(tp.base_case(op, T=P + 1, P=P, extra_pages=-10,
                                                                      slots=["fresh"] * P + ["oob"],
                                                                      pos=["in"] * (P + 1)))))
        for dt in ("int32", "int64"):
            out.append((f"{op} slots at/past capacity {dt}", te._oob_call(op, dt, True)))
    out.append(("v4_k dense one slot", tp.build(tp.base_case("v4_k", T=3, layout="dense", extra_pages=-1,
                                                             slots=["fresh", "oob", "neg"], pos=["in"] * 3))))
    out.append(("v4_k dense slots past capacity", te._oob_call("v4_k", "int64", True, "dense")))
    for name, (op, mutate) in sorted(te.STRIDED_INPUTS.items()):
        call = tp.build(tp.base_case(op))
        mutate(call.kwargs)
        out.append((name, call))
    for op, key in (("indexer_fp8", "k"), ("indexer_fp4", "weights"), ("k_store", "k"), ("v4_k", "kv"),
                    ("q_pack", "head_weights")):
        call = tp.build(tp.base_case(op))
        call.kwargs[key] = flush_end(call.kwargs[key])
        out.append((f"{op} {key} flush against the end of its allocation", call))
    call = tp.build(tp.base_case("indexer_fp8"))
    call.kwargs["positions"] = torch.tensor([5]).expand(call.meta["T"])     # a one-element storage
    out.append(("indexer_fp8 positions broadcast from one element", call))
    return out


def zero_heads():
    call = tp.build(tp.base_case("indexer_fp8", T=6, slots=["fresh"] * 6, pos=["in"] * 6))
    call.kwargs.update(q=torch.zeros(6, 0, 128, dtype=torch.bfloat16), weights=torch.zeros(6, 0),
                       q_out=tt.poisoned((6, 0, 128), torch.float8_e4m3fn, "cpu"),
                       weights_out=tt.poisoned((6, 0), torch.float32, "cpu"))
    return "indexer_fp8 H=0", call


n_bad = 0
all_cases = cases() + [zero_heads()]
for label, cpu_call in all_cases:
    call = tp.call_to(cpu_call, dev)
    if compare:
        problems, total, bad = tp.compare_backend(call, backend)
        if problems:
            n_bad += 1
            print(f"MISMATCH {label}: {problems[0]}")
    else:
        kw = dict(call.kwargs, **tp._clone_outs(call))
        call.fn(**kw, backend=backend)
    sync()
    tp.drain_flags()
sync()
print(f"sanitize edge cases done on backend {backend}: {len(all_cases)} cases"
      + (f" ({n_bad} cases differ from the reference)" if compare else ""))
