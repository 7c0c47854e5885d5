"""The Triton prefill kernels (mqa_logits in every layout and mode, gather_index_cache) compile without a GPU
for sm_90, sm_100, gfx942 and gfx950 (triton.compile + GPUTarget) with the launcher's default block sizes, and
use the target's matrix instructions: the fp8 MMA for native FP8, the int8 MMA for the exact FP4 mode (whose
code must hold no fused multiply-add). On sm_90 the kernels of the fast paths (native FP8, which also scores the
folded FP4 tiles, the FP4 second pass and the fold pre-passes) spill no registers (ptxas -v, the one Triton
bundles): a spill inside the key loop made the FP4 layout 20 % slower than FP8 on the H100.

The compiles run in one subprocess per target with TRITON_INTERPRET unset (triton.jit decides interpreted or
compiled at import).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsaquant.testing import AOT_TARGETS, triton_aot_missing

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
TARGETS = AOT_TARGETS   # name: (backend, arch, warp size, native fp8 flavour)
MMA = {  # (any matrix instruction, fp8 MMA, int8 MMA)
    "sm_90": (r"wgmma\.mma_async", r"wgmma\.mma_async\S*\.e4m3\.e4m3", r"wgmma\.mma_async\S*\.s32\.s8\.s8"),
    "sm_100": (r"tcgen05\.mma|wgmma|mma\.sync", r"tcgen05\.mma|e4m3", r"tcgen05\.mma|mma\.sync\S*\.s8|\.s8\.s8"),
    "gfx942": (r"v_mfma_\w+", r"v_mfma_f32_\w+_fp8_fp8", r"v_mfma_i32_\w+"),
    "gfx950": (r"v_mfma_\w+", r"v_mfma_f32_\w+_f8f6f4|v_mfma_f32_\w+_fp8_fp8", r"v_mfma_i32_\w+"),
}

_WORKER = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from dsaquant.triton import prefill as P
kind, arch, warp, flavour = json.loads(sys.argv[1])
dot_re, fp8_re, int8_re = json.loads(sys.argv[2])
target = GPUTarget(kind, arch, warp)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def spill_bytes(k):
    # bytes of spill stores ptxas reports for the kernel's PTX on sm_90a; None off sm_90 or without ptxas
    if (kind, arch) != ("cuda", 90) or not os.path.exists(PTXAS):
        return None
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx")
        with open(f, "w") as fh:
            fh.write(k.asm["ptx"])
        log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f, "-o", f + ".cubin"], capture_output=True,
                             text=True).stderr
    found = re.findall(r"(\d+) bytes spill stores", log)
    return int(found[0]) if found else -1
fnuz = flavour == "e4m3fnuz"
configs = [  # name, kwargs, expected instruction class
    ("fp8 native H64", dict(layout="fp8", fp8_native=True, fnuz=fnuz), "fp8"),
    ("fp8 native H32 compressed bf16", dict(layout="fp8", fp8_native=True, fnuz=fnuz, H=32, compressed=True,
                                             out_bf16=True), "fp8"),
    ("fp8 decoded", dict(layout="fp8", fp8_native=False, fnuz=not fnuz, w_dtype="bf16"), "dot"),
    ("fp4 H64", dict(layout="fp4"), "dot"),
    ("fp4 H64 e4m3 fold, the tiles that do not fold", dict(layout="fp4", fp4_fp8=True), "dot"),
    ("exact H64", dict(layout="fp4", exact=True), "int8"),
    ("exact H128 bf16 no clean", dict(layout="fp4", exact=True, H=128, out_bf16=True, clean=False), "int8"),
]
for name, kw, want in configs:
    if kw.get("fp4_fp8") and fnuz:
        continue          # the launcher folds FP4 into e4m3 only where the e4m3fn dot is native
    res = dict(name=name)
    try:
        k = P.aot_compile(target, **kw)
        asm = k.asm.get("ptx") or k.asm.get("amdgcn") or ""
        res["binary"] = bool(k.asm.get("cubin") or k.asm.get("hsaco"))
        res["mma"] = bool(re.search({"fp8": fp8_re, "int8": int8_re, "dot": dot_re}[want], asm))
        res["spill"] = spill_bytes(k)
        if want == "int8":   # the exact mode: no FMA, and (PTX) no mul/add without .rn, which ptxas may contract
            res["fma"] = re.findall(r"\bfma\.\w+\.f32|\b(?:mul|add|sub)\.f32\b|v_fma_f32|v_fmac_f32|v_pk_fma_f32", asm)
        res["ok"] = True
    except Exception as e:
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    print("RESULT " + json.dumps(res), flush=True)
for rows in ("keys", "queries") if not fnuz else ():
    res = dict(name=f"fp4 {rows} into e4m3")
    try:
        k = P.aot_compile_fold(target, rows)
        res.update(ok=True, binary=bool(k.asm.get("cubin") or k.asm.get("hsaco")), mma=True, spill=spill_bytes(k))
    except Exception as e:
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    print("RESULT " + json.dumps(res), flush=True)
for layout in ("fp8_132", "aiter_fp4"):
    res = dict(name=f"gather {layout}")
    try:
        k = P.aot_compile_gather(target, layout, preshuffle=layout == "fp8_132")
        res.update(ok=True, binary=bool(k.asm.get("cubin") or k.asm.get("hsaco")), mma=True)
    except Exception as e:
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    print("RESULT " + json.dumps(res), flush=True)
"""




# The fast paths' kernels, which must not spill on sm_90 (the others, FP8 codes decoded to bf16 and the exact mode
# at H = 128, hold more values than the registers and are not what a server runs on Hopper).
NO_SPILL = ("fp8 native H64", "fp8 native H32 compressed bf16", "fp4 H64",
            "fp4 H64 e4m3 fold, the tiles that do not fold", "fp4 keys into e4m3", "fp4 queries into e4m3")


@pytest.mark.parametrize("name", list(TARGETS))
def test_prefill_kernels_compile(name):
    kind, arch, warp, flavour = TARGETS[name]
    why = triton_aot_missing(kind)
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", _WORKER, json.dumps([kind, arch, warp, flavour]),
                        json.dumps(MMA[name])], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=900)
    results = [json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"worker produced nothing (rc {r.returncode}):\n{r.stderr[-4000:]}"
    failed = [x for x in results if not x["ok"]]
    assert not failed, "\n".join(f"{x['name']}: {x['error']}" for x in failed)
    for x in results:
        assert x["binary"], f"no binary for {x['name']}"
        assert x["mma"], f"no expected matrix instruction in {x['name']}"
        assert not x.get("fma"), f"FMA in the exact kernel {x['name']}: {x['fma'][:3]}"
    if name == "sm_90":
        spills = {x["name"]: x.get("spill") for x in results if x["name"] in NO_SPILL}
        assert set(spills) == set(NO_SPILL), f"kernels not compiled: {set(NO_SPILL) - set(spills)}"
        if all(v is not None for v in spills.values()):   # (None: this triton bundles no ptxas)
            assert all(v == 0 for v in spills.values()), f"register spills on sm_90: {spills}"
