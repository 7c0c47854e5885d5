"""The compiled CUDA library (libdsaquant_cuda.so): built by the package's own build where nvcc exists, it is a
plain shared library with the C interface of src/include/dsaquant/abi.h. It links the CUDA runtime statically and
neither Python nor libtorch, so it loads under any CPython and torch version; it exports the C interface and
nothing else; its argument structs have exactly the layout of the ctypes mirror (python/dsaquant/backends/abi.py);
the cuda backend registers every writer op. Without a GPU every call returns the runtime's error code (no crash,
nothing touched). Skipped where the library was not built (no nvcc)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsaquant import dispatch
from dsaquant.backends import abi
from dsaquant.backends.compiled import find_library

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from build_native import cuda_targets  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
import check_library  # noqa: E402

LIB = find_library("libdsaquant_cuda.so", "dsaquant_cuda13")
pytestmark = pytest.mark.skipif(LIB is None, reason="libdsaquant_cuda.so was not built here (no nvcc at install time)")
EXPORTS = abi.CUDA_EXPORTS   # the C interface, kernels/cuda/scorer.h, topk.h and prefill.h


def needed_libraries(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def defined_symbols(path: str) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r" [TtDdBbRrVvWwi] (\S+)$", out, re.M)}


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
def test_links_no_python_no_torch_and_no_shared_cudart():
    libs = needed_libraries(str(LIB))
    print("NEEDED:", libs)
    assert libs, "readelf found no NEEDED entries"
    assert not any("torch" in lib or "c10" in lib for lib in libs), libs
    assert not any("python" in lib for lib in libs), libs
    assert not any(lib.startswith("libcudart") for lib in libs), f"cudart should be static: {libs}"


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm not installed")
def test_exports_the_c_interface_and_nothing_else():
    syms = defined_symbols(str(LIB))
    assert not {s for s in syms if s.startswith("Py")}, "Python entry points in the library"
    assert syms == EXPORTS, f"missing {sorted(EXPORTS - syms)}, unexpected {sorted(syms - EXPORTS)}"


def test_struct_layouts_match_the_ctypes_mirror():
    lib = abi.Library(str(LIB))
    for struct in abi.STRUCTS:
        size, fields = lib.layout(struct.__name__)
        assert size > 0 and fields, struct.__name__
        assert (size, fields) == abi.mirror_layout(struct), struct.__name__
    assert lib.layout("NoSuchStruct") == (-1, [])
    assert all(lib.has(op) for op in abi.OPS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour where no GPU exists")
def test_every_entry_point_returns_an_error_code_without_a_gpu():
    """Zeroed structs (null pointers): the call stops at making the device current and returns the runtime's code;
    a bad device index and a null struct are refused before the runtime is asked."""
    lib = abi.Library(str(LIB))
    for op, (sym, struct) in abi.OPS.items():
        fn = lib._fns[op]
        err = fn(struct(), None)
        assert err != 0, op
        with pytest.raises(RuntimeError, match=f"launching {op} failed: error {err} "):
            lib.launch(op, struct(), 0)
        assert fn(struct(device=-1), None) == fn(struct(device=64), None) != 0, op
        assert fn(None, None) != 0, op
    assert "invalid device ordinal" in lib.error_string(lib._fns["exp_ds"](abi.DsqExpDsArgs(device=-1), None))
    with pytest.raises(TypeError, match=r"DsqExpDsArgs has no fields \['count'\]"):
        lib.launch("exp_ds", abi.DsqExpDsArgs(device=0, count=3), 0)


def test_registers_every_writer():
    ok, why = dispatch.available("cuda")
    assert ok, why
    assert set(dispatch.ops_of("cuda")) >= {"indexer_qk_rope_quant_and_cache", "index_k_norm_rope_pack_store",
                                            "index_q_rope_pack_weights", "rope_fake_quant_fp4",
                                            "rmsnorm_rope_rotate_fp4quant_kvcache", "compress_kv", "rope_rotate_quant",
                                            "paged_mqa_logits", "topk_indices", "mqa_logits"}


def test_scorer_struct_matches_its_mirror():
    """kernels/cuda/scorer.h's DsqPagedLogitsArgs, field by field, against backends/scorer.py's ctypes mirror."""
    from dsaquant.backends import scorer
    lib = scorer.load(str(LIB))
    assert lib is not None and scorer.layout_mismatches(lib) == []


def test_library_has_the_device_code_of_each_target():
    """The build embeds the device code of every target it was built for (DSAQUANT_CUDA_ARCHS at build time,
    default 90a;100a;compute_80: the Hopper and Blackwell cubins, PTX for every other GPU from sm_80 on), and
    dsq_device_code() lists exactly those."""
    targets = abi.Library(str(LIB)).device_code()
    assert targets and all(t.startswith(("sm_", "compute_")) for t in targets), targets
    if os.environ.get("DSAQUANT_CUDA_ARCHS") is None and os.environ.get("CI"):
        assert targets == cuda_targets()   # CI's install builds the default targets
    found = check_library.embedded_code(LIB)   # cuobjdump --list-elf / --list-ptx
    if found is None:
        pytest.skip("no cuobjdump to list the embedded cubins and PTX")
    cubins, ptx = found
    assert cubins == {t.rstrip("af") for t in targets if t.startswith("sm_")}
    assert ptx == {"sm_" + t[len("compute_"):].rstrip("af") for t in targets if t.startswith("compute_")}


def test_needed_libraries_are_the_promised_ones():
    """NEEDED: glibc's and the C++ runtime's libraries only (docs/wheels.md); never libcuda.so.1 (the static CUDA
    runtime opens the driver at run time)."""
    libs = needed_libraries(str(LIB))
    assert set(libs) <= abi.SYSTEM_LIBRARIES, libs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour where no GPU exists")
def test_kernel_code_without_a_gpu_is_an_error_code():
    lib = abi.Library(str(LIB))
    err, ptx, binary = lib.kernel_code(0)
    assert err != 0 and (ptx, binary) == (0, 0)
    assert lib.kernel_code(-1)[0] == lib.kernel_code(64)[0] != 0
    assert lib._kernel_code(0, None, None) != 0
