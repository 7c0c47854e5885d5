"""The device code of the CUDA library (docs/wheels.md): the build's target list (tools/build_native.py: cubins for
sm_90a and sm_100a, compute_80 PTX for every other GPU from sm_80 on) and its nvcc options, and how `dsaquant info`
names the code a GPU runs from dsq_kernel_code's versions (abi.describe_code)."""
import sys
from pathlib import Path

import pytest

from dsaquant.backends.abi import describe_code

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import build_native as bn  # noqa: E402

DEFAULT = ["sm_90a", "sm_100a", "compute_80"]


def test_default_targets(monkeypatch):
    monkeypatch.delenv("DSAQUANT_CUDA_ARCHS", raising=False)
    assert bn.cuda_targets() == DEFAULT
    assert bn.gencode_flags(DEFAULT) == ["-gencode=arch=compute_90a,code=sm_90a",
                                         "-gencode=arch=compute_100a,code=sm_100a",
                                         "-gencode=arch=compute_80,code=compute_80"]
    assert '-DDSQ_DEVICE_CODE="sm_90a;sm_100a;compute_80"' in bn.nvcc_flags()


def test_target_spellings(monkeypatch):
    assert bn.cuda_targets("90a; 100f;;sm_80;compute_80") == ["sm_90a", "sm_100f", "sm_80", "compute_80"]
    assert bn.gencode_flags(["sm_100f"]) == ["-gencode=arch=compute_100f,code=sm_100f"]
    monkeypatch.setenv("DSAQUANT_CUDA_ARCHS", "90a")
    assert bn.cuda_targets() == ["sm_90a"]
    with pytest.raises(ValueError, match="not an architecture"):
        bn.cuda_targets("hopper")


@pytest.mark.parametrize("ptx, binary, text", [
    (90, 90, "cubin sm_90a"),                                  # H100 / H200
    (100, 100, "cubin sm_100a"),                               # B200
    (80, 86, "PTX compute_80, JIT-compiled for sm_86"),        # A10, RTX 30
    (80, 103, "PTX compute_80, JIT-compiled for sm_103"),      # B300 without an sm_100f cubin
    (80, 120, "PTX compute_80, JIT-compiled for sm_120"),      # RTX 50
])
def test_describe_code(ptx, binary, text):
    assert describe_code(DEFAULT, ptx, binary) == text


def test_describe_code_family_and_plain_cubins():
    assert describe_code(["sm_90a", "sm_100f", "compute_80"], 100, 100) == "cubin sm_100f"
    assert describe_code(["sm_80", "compute_80"], 80, 80) == "cubin sm_80"   # also on an sm_86 GPU (same major)
    assert describe_code([], 90, 90) == "cubin sm_90"


KERNELS = Path(__file__).resolve().parent.parent / "kernels" / "cuda"
# The dependent launch: the launch attribute, the launch call that takes it, and the instructions that a kernel so
# launched must run before it touches global memory (kernels/cuda/launch.cuh).
DEPENDENT_LAUNCH = ("griddepcontrol", "cudaLaunchAttributeProgrammaticStreamSerialization", "cudaLaunchKernelEx",
                    "cudaLaunchAttributeClusterDimension")


def _outside_launch_header(root: Path) -> list[str]:
    return [f"{p.name}: {word}" for p in sorted(root.glob("*")) if p.name != "launch.cuh" and p.is_file()
            for word in DEPENDENT_LAUNCH if word in p.read_text()]


def test_dependent_launch_has_one_home():
    """Every launch with attributes (dependent, clusters) goes through dsq_launch::launch, and the griddepcontrol
    instructions are dsq_launch::dependent_entry's alone; each kernel that a launch site may make dependent calls it."""
    assert _outside_launch_header(KERNELS) == []
    for name, kernel in [("scorer.cu", "paged_logits_kernel"), ("topk.cu", "topk_cache_kernel"),
                         ("compress.cu", "compress_kv_kernel"), ("compress.cu", "rope_rotate_kernel"),
                         ("indexer.cu", "indexer_kernel"), ("qpack.cu", "qpack_kernel"),
                         ("kstore_qpack.cu", "kstore_kernel")]:
        text = (KERNELS / name).read_text()
        body = text[text.index(f" {kernel}("):]
        body = body[:body.index("\n}\n")]
        assert "dsq_launch::dependent_entry();" in body or (   # the two steps, then the block body (last call)
            body.index("dsq_launch::allow_dependents();") < body.index("dsq_launch::wait_previous();")
            < body.rindex("_block<")), (name, kernel)
        assert "dsq_launch::launch(" in text, name


def test_the_one_home_check_catches(tmp_path):
    (tmp_path / "launch.cuh").write_text('asm volatile("griddepcontrol.wait;");')
    (tmp_path / "other.cu").write_text("cudaLaunchKernelEx(&cfg, k);")
    assert _outside_launch_header(tmp_path) == ["other.cu: cudaLaunchKernelEx"]
