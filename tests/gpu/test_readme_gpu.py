"""The README's Python blocks on a GPU: the server snippet takes its CUDA-graph branch, once per GPU backend
(DSAQUANT_BACKEND), and its caches and logits equal the reference backend's (tests/test_readme.py's check)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dsaquant import dispatch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA (or ROCm) GPU", allow_module_level=True)

_spec = importlib.util.spec_from_file_location("readme_cpu", Path(__file__).resolve().parents[1] / "test_readme.py")
readme = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme)

BACKENDS = [b for b in ("cuda", "hip", "triton") if dispatch.available(b)[0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_readme_server_snippet_in_a_cuda_graph(backend, monkeypatch):
    monkeypatch.setenv("DSAQUANT_BACKEND", backend)
    blocks = [b for b in readme.python_blocks() if "indexer_step" in b]
    assert blocks
    for src in blocks:
        ns = readme.run_block(src)
        assert ns["device"] == "cuda" and isinstance(ns["graph"], torch.cuda.CUDAGraph)
        readme.check_server_snippet(ns)
