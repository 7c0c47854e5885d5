"""The `hip` backend: the compiled pybind11 module dsaquant._hip (built when a ROCm toolchain is present)."""
from .. import _hip  # noqa: F401  (ImportError here means the module was not built)
from .compiled import register_compiled

register_compiled("hip", _hip)
