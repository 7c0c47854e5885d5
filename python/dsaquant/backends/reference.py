"""The `reference` backend: the torch implementation of docs/spec.md, on any device."""
from ..dispatch import register
from ..reference import ops, scorer

for _name in ("indexer_qk_rope_quant_and_cache", "index_k_norm_rope_pack_store", "index_q_rope_pack_weights",
              "rope_fake_quant_fp4", "rmsnorm_rope_rotate_fp4quant_kvcache"):
    register("reference", _name, getattr(ops, _name))
register("reference", "paged_mqa_logits", scorer.paged_mqa_logits)
from ..reference import compress  # noqa: E402  SPEC §7.6-§7.7
register("reference", "compress_kv", compress.compress_kv)
register("reference", "rope_rotate_quant", compress.rope_rotate_quant)
from ..reference import topk  # noqa: E402  docs/topk.md
register("reference", "topk_indices", topk.topk_indices)
from ..reference import prefill  # noqa: E402  docs/prefill.md
for _name, _fn in prefill.OPS.items():
    register("reference", _name, _fn)
