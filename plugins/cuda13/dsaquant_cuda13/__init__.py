"""dsaquant's CUDA 13 backend plugin: the compiled library `libdsaquant_cuda.so` (sm_90a and sm_100a cubins,
compute_80 PTX for every other NVIDIA GPU from sm_80 on), a plain shared library with a C interface that links the
CUDA runtime statically and neither Python nor libtorch, so one wheel serves every CPython and torch version.
`import dsaquant` finds it (docs/wheels.md)."""
__version__ = "0.1.0"
