"""The `cuda` backend: the compiled library libdsaquant_cuda.so, built in the source tree (when nvcc is present at
install time) or installed as the plugin wheel `dsaquant-cuda13` (dsaquant_cuda13/libdsaquant_cuda.so)."""
from .compiled import load_and_register

load_and_register("cuda", "libdsaquant_cuda.so", "dsaquant_cuda13",
                  "pip install 'dsaquant[cuda13]', or install from source with nvcc present")
