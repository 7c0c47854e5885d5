"""The `triton` backend: portable Triton kernels (NVIDIA and AMD). Registers what dsaquant.triton provides."""
from ..triton import register_all

register_all()
