"""The `hip` backend: the compiled module, built in the source tree (dsaquant._hip, when ROCm is present at
install time) or installed as the plugin wheel `dsaquant-rocm7` (dsaquant_rocm7._hip)."""
from .compiled import load_and_register

load_and_register("hip", "_hip", "dsaquant_rocm7", "pip install 'dsaquant[rocm7]', or install from source with ROCm")
