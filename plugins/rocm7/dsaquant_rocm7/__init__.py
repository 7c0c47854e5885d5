"""dsaquant's ROCm 7 backend plugin: the compiled library `libdsaquant_hip.so` (gfx942 and gfx950), hipified from
the CUDA sources, a plain shared library with a C interface linking amdhip64 and neither Python nor libtorch.
`import dsaquant` finds it."""
__version__ = "0.1.0"
