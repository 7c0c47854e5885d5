"""The automatic choice's table: per GPU vendor and op, the order in which backends are tried.

Where the table has no rule for an op (or none that matches the call), the vendor's default order holds:
NVIDIA cuda, triton, reference; AMD hip, triton, reference (the CPU has only the reference). A rule can
name a `variant` (a string the op's wrapper passes, see `variant`) and a range of sizes [min_size,
max_size) of the op's token count T; the first matching rule of the op wins. An order lists the backends
to try first; the default order's remaining backends follow it, so an order never loses a fallback.

The NVIDIA rules come from the H200 measurements in benchmarks/results/h200.md ("Writers" and "Read side",
2026-12-05: CUDA-graph medians at T = 1, 64, 1024, 8192, 32768, H = 64; compress_kv: its own table of
2026-12-06 there and in benchmarks/results/h100.md). An op whose ranking was the same at every measured T has one
order and no size range; a size range starts at the first measured T where the ranking turns; sizes and variants
not measured keep the default order. Kept on the default order (cuda first, measured faster at every T):
`index_q_rope_pack_weights` (but 1024, where triton is 2 % faster), the k writers `index_k_norm_rope_pack_store`
and `rmsnorm_rope_rotate_fp4quant_kvcache`, `compress_kv` (every ratio, decode steps included), `paged_mqa_logits`,
`mqa_logits` and `topk_indices`. On AMD the default order holds until measured.
"""
from __future__ import annotations

from typing import NamedTuple

VENDORS = ("nvidia", "amd")
DEFAULT = {"nvidia": ("cuda", "triton", "reference"), "amd": ("hip", "triton", "reference")}


class Rule(NamedTuple):
    """Backends to try first for calls that match: `variant` None matches every variant; sizes T with
    min_size <= T < max_size (None: unbounded) match, and a call without a size matches only a rule with
    neither bound."""
    order: tuple[str, ...]
    variant: str | None = None
    min_size: int | None = None
    max_size: int | None = None
    why: str = ""

    def matches(self, size: int | None, variant: str | None) -> bool:
        if self.variant is not None and self.variant != variant:
            return False
        if self.min_size is None and self.max_size is None:
            return True
        if size is None:
            return False
        return ((self.min_size is None or size >= self.min_size)
                and (self.max_size is None or size < self.max_size))


TRITON_FIRST = ("triton", "cuda", "reference")

TABLE: dict[str, dict[str, tuple[Rule, ...]]] = {
    "nvidia": {
        "indexer_qk_rope_quant_and_cache": (Rule(TRITON_FIRST, variant="fp8", min_size=1024, max_size=2048,
                                                 why="FP8, T=1024: cuda 12.47 vs triton 10.97 µs (T=64 2.84 vs "
                                                 "3.11, T=8192 53.39 vs 59.05: cuda)"),),
        "rope_rotate_quant": (Rule(TRITON_FIRST, variant="fp4", min_size=1024, why="FP4 out, H=64: T=1024 cuda "
                                   "27.30 vs triton 15.94 µs, T=8192 151.50 vs 84.26 (T=1 3.17 vs 5.06, T=64 "
                                   "3.44 vs 5.79: cuda)"),),
    },
    "amd": {},
}


def variant(op: str, *, ratio: int | None = None, out_format: str | None = None, decode: bool = False) -> str | None:
    """The variant string the table's rules of `op` match: compress_kv "ratio=<ratio>", or "ratio=<ratio> decode"
    for a decode step (`decode`: every sequence brings one token, T = B); rope_rotate_quant
    the output format, "fp4" (uint8 / float4_e2m1fn_x2 out), "fp8" or "half" (bf16/fp16 out); the indexer
    its quantization, "fp8" or "fp4" (out_format); None for the other ops. The op wrappers and the bench both
    build it here."""
    if op == "indexer_qk_rope_quant_and_cache" and out_format is not None:
        return out_format
    if op == "compress_kv" and ratio is not None:
        return f"ratio={int(ratio)}" + (" decode" if decode else "")
    if op == "rope_rotate_quant" and out_format is not None:
        return out_format
    return None


def size_key(op: str, n) -> int:
    """The token count `n` of a call of `op` as the rules see it: the largest rule bound (min_size or
    max_size of any vendor's rule of `op`) that n reaches, 0 if none. Every rule matches it exactly when
    it matches n, and it is a plain int even where n is symbolic (torch.compile with dynamic shapes: the
    comparisons with the bounds become guards, the choice stays a trace-time constant)."""
    key = 0
    for t in sorted({b for rules in TABLE.values() for r in rules.get(op, ())
                     for b in (r.min_size, r.max_size) if b is not None}):
        if n >= t:
            key = t
    return key


def _then_default(first: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(first) + tuple(b for b in default if b not in first)


def order(vendor: str, op: str, size: int | None = None, variant: str | None = None) -> tuple[str, ...]:
    """Backends to try, in order, for `op` on a GPU of `vendor` ("nvidia" or "amd"), a call of `size`
    tokens (None: not known) and `variant`: the first matching rule's order followed by the default
    order's remaining backends, or the vendor's default order."""
    if vendor not in DEFAULT:
        raise ValueError(f"unknown vendor {vendor!r}; expected one of {VENDORS}")
    default = DEFAULT[vendor]
    for rule in TABLE.get(vendor, {}).get(op, ()):
        if rule.matches(size, variant):
            return _then_default(rule.order, default)
    return default


def describe(vendor: str) -> list[str]:
    """One line per op with a rule on `vendor`, then the default order: for `dsaquant info`."""
    default = DEFAULT[vendor]
    lines = []
    for op, rules in sorted(TABLE.get(vendor, {}).items()):
        for r in rules:
            when = []
            if r.variant is not None:
                when.append(r.variant)
            if r.min_size is not None or r.max_size is not None:
                lo = "" if r.min_size is None else f"{r.min_size} <= "
                hi = "" if r.max_size is None else f" < {r.max_size}"
                when.append(f"{lo}T{hi}")
            cond = f" [{', '.join(when)}]" if when else ""
            lines.append(f"{op}{cond}: {' > '.join(_then_default(r.order, default))}")
    lines.append(f"every other op, variant and size: {' > '.join(default)}")
    return lines
