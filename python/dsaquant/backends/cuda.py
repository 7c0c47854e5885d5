"""The `cuda` backend: the compiled pybind11 module, built in the source tree (dsaquant._cuda, when nvcc is
present at install time) or installed as the plugin wheel `dsaquant-cuda13` (dsaquant_cuda13._cuda)."""
try:
    from .. import _cuda
except ImportError:
    try:
        from dsaquant_cuda13 import _cuda
    except ImportError as e:
        raise ImportError("the CUDA module is not built here and the plugin `dsaquant-cuda13` is not installed "
                          "(pip install 'dsaquant[cuda13]', or install from source with nvcc present)") from e
from .compiled import register_compiled

register_compiled("cuda", _cuda)
