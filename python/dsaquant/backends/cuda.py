"""The `cuda` backend: the compiled module, built in the source tree (dsaquant._cuda, when nvcc is present at
install time) or installed as the plugin wheel `dsaquant-cuda13` (dsaquant_cuda13._cuda)."""
from .compiled import load_and_register

load_and_register("cuda", "_cuda", "dsaquant_cuda13",
                  "pip install 'dsaquant[cuda13]', or install from source with nvcc present")
