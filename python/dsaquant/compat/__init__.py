"""Drop-in modules with the public signatures and documented semantics of peer projects.

`dsaquant.compat.deep_gemm`: DeepGEMM's indexer logits (paged decode and ragged prefill) and the paged
metadata call. `dsaquant.compat.vllm`: vLLM's per-row top-k selection. Each function maps arguments onto a
dsaquant op and adds no computation of its own; docs/compat.md lists the mapping side by side.
"""
