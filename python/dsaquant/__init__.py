"""dsaquant: one set of bytes for the DeepSeek Sparse Attention indexer on every GPU.

Ops (docs/spec.md §7): indexer_qk_rope_quant_and_cache, index_k_norm_rope_pack_store,
index_q_rope_pack_weights, rope_fake_quant_fp4, rmsnorm_rope_rotate_fp4quant_kvcache,
paged_mqa_logits, convert_fp4_cache, topk_indices; prefill (docs/prefill.md): mqa_logits, mqa_topk, gather_index_cache;
DeepSeek-V4: compress_kv, rope_rotate_quant (COMPRESS_PRESETS). Low-level format math: dsaquant.formats.
Backends: reference | triton | cuda | hip, chosen per call (backend=), by DSAQUANT_BACKEND, or automatically.
"""
from . import formats  # noqa: F401
from .constants import FP8_FLAVOURS, LAYOUTS, ROUNDINGS, SCALE_RULES, Layout, Rounding  # noqa: F401
from .dispatch import BACKENDS, BackendUnavailable  # noqa: F401
from .errors import DsaquantError, check_errors, set_host_checks  # noqa: F401
from .info import info  # noqa: F401
from .ops import (convert_fp4_cache, index_k_norm_rope_pack_store, index_q_rope_pack_weights,  # noqa: F401
                  indexer_qk_rope_quant_and_cache, paged_mqa_logits, rmsnorm_rope_rotate_fp4quant_kvcache,
                  rope_fake_quant_fp4)
from .topk import topk_indices  # noqa: F401
from .prefill import gather_index_cache, mqa_logits, mqa_topk  # noqa: F401
from .compress import PRESETS as COMPRESS_PRESETS, compress_kv, rope_rotate_quant  # noqa: F401
from .version import __version__  # noqa: F401
