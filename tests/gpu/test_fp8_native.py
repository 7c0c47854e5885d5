"""The hardware converts the CUDA kernels use (e4m3fn pairs on sm_89+, bf16 and fp16 rounding on sm_80+)
against the header's software definitions, over every fp32 bit pattern (2^32), on the GPU. A
native instruction is used only where a test on that hardware shows it identical."""
import pytest
import torch

from dsaquant import dispatch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or not dispatch.available("cuda")[0]:
    pytest.skip("needs a CUDA GPU and the cuda backend", allow_module_level=True)


def test_hardware_converts_match_software_for_all_fp32():
    from dsaquant.backends.abi import DsqSelfcheckArgs
    from dsaquant.backends.compiled import library
    lib = library("cuda")
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    chunk = 1 << 28
    for start in range(0, 1 << 32, chunk):
        lib.launch("fp8_selfcheck", DsqSelfcheckArgs(device=out.device.index, start=start, count=chunk,
                                                     out=out.data_ptr()), stream)
    mism = int(out.item())
    print(f"hardware vs software converts: {1 << 33} e4m3fn + {1 << 32} bf16 + {1 << 32} fp16 compared, "
          f"{mism} mismatches")
    assert mism == 0
