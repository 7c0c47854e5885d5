"""The `hip` backend: the compiled pybind11 module, built in the source tree (dsaquant._hip, when ROCm is
present at install time) or installed as the plugin wheel `dsaquant-rocm7` (dsaquant_rocm7._hip)."""
try:
    from .. import _hip
except ImportError:
    try:
        from dsaquant_rocm7 import _hip
    except ImportError as e:
        raise ImportError("the HIP module is not built here and the plugin `dsaquant-rocm7` is not installed "
                          "(install from source with ROCm present: DSAQUANT_BUILD_HIP=1)") from e
from .compiled import register_compiled

register_compiled("hip", _hip)
