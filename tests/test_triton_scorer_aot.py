"""The Triton scorer kernel compiles, without a GPU, for sm_90, sm_100, gfx942 and gfx950
(triton.compile + GPUTarget), in every configuration the launcher can pick, and uses the target's matrix
instructions (wgmma / tcgen05 / MFMA, with the fp8 variant where the fp8 dot is native).

The compiles run in a subprocess with TRITON_INTERPRET unset: the interpreter tests set it for the whole
pytest process, and triton.jit decides interpreted-or-compiled when the module is imported.
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
MMA = {  # what the assembly must contain: (any dot, native fp8 dot)
    "sm_90": (r"wgmma\.mma_async", r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3"),
    "sm_100": (r"tcgen05\.mma", r"tcgen05\.mma"),
    "gfx942": (r"v_mfma_f32_\w+", r"v_mfma_f32_\w+_fp8_fp8"),
    "gfx950": (r"v_mfma_f32_\w+", r"v_mfma_f32_\w+_f8f6f4"),
}

_WORKER = r"""
import json, re, sys
from triton.backends.compiler import GPUTarget
from dsaquant.triton import scorer as S
kind, arch, warp, native_flavour = json.loads(sys.argv[1])
dot_re, fp8_re = json.loads(sys.argv[2])
target = GPUTarget(kind, arch, warp)
fnuz_native = native_flavour == "e4m3fnuz"
configs = [
    # layout, N, H, page, kwargs, expects native fp8 instruction
    ("fp8_132", 1, 64, 64, dict(fp8_native=True, fnuz=fnuz_native), True),
    ("fp8_132", 1, 64, 64, dict(fp8_native=True, fnuz=fnuz_native, preshuffle=True), True),
    ("fp8_132", 1, 64, 64, dict(fp8_native=False, fnuz=not fnuz_native), False),   # the decode-to-bf16 path
    ("fp8_132", 4, 32, 64, dict(fp8_native=True, fnuz=fnuz_native), True),
    ("packed68", 1, 64, 64, {}, False),
    ("packed68", 3, 32, 64, {}, False),
    ("aiter_fp4", 1, 64, 64, {}, False),
    ("aiter_fp4", 2, 64, 64, {}, False),
    ("packed68", 1, 32, 16, {}, False),
    ("aiter_fp4", 16, 64, 64, {}, False),                                          # 4 query groups
    ("packed68", 2, 64, 64, dict(ctx_dtype="i64", bt_dtype="i64", w_dtype="bf16"), False),
    ("fp8_132", 1, 64, 64, dict(fp8_native=True, fnuz=fnuz_native, ctx_dtype="i64", bt_dtype="i64",
                                w_dtype="fp16"), True),
]
for layout, N, H, P, kw, fp8 in configs:
    res = dict(layout=layout, N=N, H=H, P=P, kw=kw)
    try:
        opts = S.launch_options(N, H, target=kind)   # the launcher's own warps and stages for the platform
        k = S.aot_compile(target, layout, N=N, H=H, page_size=P, num_warps=opts["num_warps"],
                          num_stages=opts["num_stages"], **kw)
        asm = k.asm.get("ptx") or k.asm.get("amdgcn") or ""
        res["binary"] = sorted(x for x in ("cubin", "hsaco") if k.asm.get(x))
        res["dot"] = bool(re.search(dot_re, asm))
        res["fp8_dot"] = bool(re.search(fp8_re, asm)) if fp8 else None
        res["ok"] = True
    except Exception as e:  # reported per config
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
    print("RESULT " + json.dumps(res), flush=True)
"""




@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Starts one worker per target at once (they overlap on a multi-core machine); name -> (rc, out, err)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    tmp = tmp_path_factory.mktemp("scorer_aot")
    procs = {}
    for name, (kind, arch, warp, flavour) in TARGETS.items():
        if not triton_aot_missing(kind):
            out, err = open(tmp / f"{name}.out", "w"), open(tmp / f"{name}.err", "w")
            p = subprocess.Popen([sys.executable, "-c", _WORKER, json.dumps([kind, arch, warp, flavour]),
                                  json.dumps(MMA[name])], stdout=out, stderr=err, env=env, cwd=str(ROOT))
            procs[name] = (p, out, err)
    done = {}

    def get(name):
        if name not in done:
            p, out, err = procs[name]
            try:
                p.wait(timeout=900)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            out.close()
            err.close()
            done[name] = (p.returncode, (tmp / f"{name}.out").read_text(), (tmp / f"{name}.err").read_text())
        return done[name]

    yield get
    for p, out, err in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("name", list(TARGETS))
def test_scorer_compiles(name, compiled):
    kind = TARGETS[name][0]
    why = triton_aot_missing(kind)
    if why:
        pytest.skip(why)
    rc, out, err = compiled(name)
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert results, f"worker produced nothing (rc {rc}):\n{err[-4000:]}"
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['layout']} N={r['N']} H={r['H']} P={r['P']} {r['kw']}: {r['error']}"
                                 for r in failed)
    for r in results:
        assert r["binary"], f"no binary for {r}"
        assert r["dot"], f"no matrix instruction in {r}"
        assert r["fp8_dot"] in (None, True), f"fp8 dot not native in {r}"
