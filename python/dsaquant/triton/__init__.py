"""Portable Triton kernels (NVIDIA and AMD; the CPU under TRITON_INTERPRET=1).

`quant.py` holds the writers (SPEC §7.1-§7.3), `scorer.py` the paged MQA logits reader (§7.4),
`compress.py` the DeepSeek-V4 compressor (§7.6), `rope_rotate.py` the query-side RoPE + rotate + quant (§7.7)
and `topk.py` the per-row top-k selection (docs/topk.md).
`register_all()` registers every op they implement as the `triton` backend.
"""
from __future__ import annotations

import importlib


def register_all() -> None:
    import triton  # noqa: F401  (ImportError: the backend is unavailable)
    from ..dispatch import register
    for mod_name in ("quant", "scorer", "compress", "rope_rotate", "topk"):
        mod = importlib.import_module(f"{__name__}.{mod_name}")
        for op, fn in getattr(mod, "OPS", {}).items():
            register("triton", op, fn)
