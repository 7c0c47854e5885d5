"""dsaquant's CUDA 13 backend plugin: the compiled module `_cuda` (sm_90a and sm_100a), which links the CUDA
runtime statically and no libtorch, so one wheel serves every torch version. `import dsaquant` finds it."""
__version__ = "0.1.0"
