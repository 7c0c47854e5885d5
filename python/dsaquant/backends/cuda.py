"""The `cuda` backend: the compiled pybind11 module dsaquant._cuda (built when nvcc is present)."""
from .. import _cuda  # noqa: F401  (ImportError here means the module was not built)
from .compiled import register_compiled

register_compiled("cuda", _cuda)
