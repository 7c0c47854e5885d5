"""The compiled CUDA module: built by the package's own build where nvcc exists, it links the
CUDA runtime statically and no libtorch, so it imports under any torch version; the cuda backend
registers every writer op. Skipped where the module was not built (no nvcc)."""
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from dsaquant import dispatch

spec = importlib.util.find_spec("dsaquant._cuda")
pytestmark = pytest.mark.skipif(spec is None, reason="dsaquant._cuda was not built here (no nvcc at install time)")


def needed_libraries(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
def test_links_no_torch_and_no_shared_cudart():
    libs = needed_libraries(spec.origin)
    print("NEEDED:", libs)
    assert libs, "readelf found no NEEDED entries"
    assert not any("torch" in lib or "c10" in lib for lib in libs), libs
    assert not any(lib.startswith("libcudart") for lib in libs), f"cudart should be static: {libs}"


def test_imports_and_registers_every_writer():
    import dsaquant._cuda as m
    for name in ("indexer", "kstore", "qpack", "fp8_selfcheck", "compress_kv", "rope_rotate_quant"):
        assert callable(getattr(m, name))
    ok, why = dispatch.available("cuda")
    assert ok, why
    assert set(dispatch.ops_of("cuda")) >= {"indexer_qk_rope_quant_and_cache", "index_k_norm_rope_pack_store",
                                            "index_q_rope_pack_weights", "rope_fake_quant_fp4",
                                            "rmsnorm_rope_rotate_fp4quant_kvcache", "compress_kv", "rope_rotate_quant"}


def test_module_has_sm90a_and_sm100a_code():
    """The default build embeds Hopper and Blackwell machine code (DSAQUANT_CUDA_ARCHS=90a;100a)."""
    data = Path(spec.origin).read_bytes()
    assert b"sm_90a" in data and b"sm_100a" in data
