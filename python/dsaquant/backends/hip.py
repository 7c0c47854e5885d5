"""The `hip` backend: the compiled library libdsaquant_hip.so, built in the source tree (when ROCm is present at
install time) or installed as the plugin wheel `dsaquant-rocm7` (dsaquant_rocm7/libdsaquant_hip.so)."""
from .compiled import load_and_register

load_and_register("hip", "libdsaquant_hip.so", "dsaquant_rocm7",
                  "pip install 'dsaquant[rocm7]', or install from source with ROCm")
