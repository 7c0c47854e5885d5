"""The `triton` backend: portable Triton kernels (NVIDIA and AMD). Registers what dsaquant.triton provides."""
from ..triton import register_all

register_all()

from ..dispatch import register  # noqa: E402
from ..triton import prefill as _prefill  # noqa: E402  docs/prefill.md

for _op, _fn in _prefill.OPS.items():
    register("triton", _op, _fn)
