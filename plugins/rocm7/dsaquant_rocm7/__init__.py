"""dsaquant's ROCm 7 backend plugin: the compiled module `_hip` (gfx942 and gfx950), hipified from the CUDA
sources, linking amdhip64 and no libtorch. `import dsaquant` finds it."""
__version__ = "0.1.0"
