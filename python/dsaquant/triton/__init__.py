"""Portable Triton kernels (NVIDIA and AMD; the CPU under TRITON_INTERPRET=1).

`quant.py` holds the writers (SPEC §7.1-§7.3), `scorer.py` the paged MQA logits reader (§7.4),
`compress.py` the DeepSeek-V4 compressor (§7.6), `rope_rotate.py` the query-side RoPE + rotate + quant (§7.7)
and `topk.py` the per-row top-k selection (docs/topk.md). `register_all()` registers every op they implement as
the `triton` backend, each launching on the device of its tensors (on_tensor_device).
"""
from __future__ import annotations

import functools
import importlib


def on_tensor_device(fn):
    """`fn` run with the device of its first tensor argument current (Triton launches on the current device and its
    current stream); the caller's current device is restored afterwards. The ops have checked that every tensor
    argument is on that one device."""
    import torch

    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if t is None or t.device.type != "cuda":
            return fn(*args, **kwargs)
        with torch.cuda.device(t.device):
            return fn(*args, **kwargs)

    return run


def register_all() -> None:
    import triton  # noqa: F401  (ImportError: the backend is unavailable)
    from ..dispatch import register
    for mod_name in ("quant", "scorer", "compress", "rope_rotate", "topk"):
        mod = importlib.import_module(f"{__name__}.{mod_name}")
        for op, fn in getattr(mod, "OPS", {}).items():
            register("triton", op, on_tensor_device(fn))
