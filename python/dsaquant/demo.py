"""`python -m dsaquant demo`: one realistic indexer step on the best available backend.

Writes T tokens of q and k through indexer_qk_rope_quant_and_cache in FP8 mode (fp8_132 cache) and
FP4 mode (aiter_fp4 cache), converts the FP4 cache to packed68, scores the last `queries` tokens
against all T keys with paged_mqa_logits for each layout, and compares with a bf16 ground truth
(the same roped, normalised q and k, unquantized): cosine of the logits and top-k overlap.
"""
from __future__ import annotations

import time

import torch

from . import ops, testing
from .reference.arith import round_to
from .reference.transforms import cos_sin, layer_norm, rope


def ground_truth(a, rows):
    """bf16 q/k after RoPE and LayerNorm, in fp32, as the indexer sees them before quantization."""
    cos, sin = cos_sin(a["positions"], a["cos_cache"], a["sin_cache"])
    q = round_to(rope(a["q"], cos.unsqueeze(1), sin.unsqueeze(1), a["is_neox"], False), torch.bfloat16)
    k = round_to(layer_norm(a["k"], a["norm_weight"], a["norm_bias"], a["epsilon"]), torch.bfloat16)
    k = round_to(rope(k, cos, sin, a["is_neox"], False), torch.bfloat16)
    dots = torch.einsum("nhd,ld->nhl", q[rows], k)
    return (torch.relu(dots) * a["weights"][rows].float().unsqueeze(-1)).sum(1) * a["weights_scale"]


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows] for any dtype: float8 tensors are gathered through a uint8 view (older torch has no CPU
    index kernel for float8)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)[rows].view(t.dtype)
    return t[rows]


def run(T=2048, H=64, queries=16, page_size=64, device=None, backend=None, topk=(512,)):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = torch.arange(T - queries, T, device=device)
    results = []
    for mode in ("fp8", "fp4"):
        a = testing.make_indexer(T=T, H=H, mode=mode, device=device, page_size=page_size, extra_pages=0)
        a["slot_mapping"] = torch.arange(T, device=device)          # token i -> slot i
        a["positions"] = torch.arange(T, device=device)
        t0 = time.perf_counter()
        ops.indexer_qk_rope_quant_and_cache(**a, backend=backend)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_write = time.perf_counter() - t0
        NB = a["kv_cache"].shape[0]
        tables = torch.arange(NB, device=device, dtype=torch.int32).unsqueeze(0)
        ctx = torch.tensor([T], device=device, dtype=torch.int32)
        truth = ground_truth(a, rows)
        if mode == "fp8":
            q = take_rows(a["q_out"], rows).unsqueeze(0)
            layouts = [("fp8_132", dict(q=q, kv_cache=a["kv_cache"], weights=a["weights_out"][rows],
                                        preshuffle=a["preshuffle"]))]
        else:
            from .reference.layouts import read_aiter_q_scale
            q = take_rows(a["q_out"], rows).unsqueeze(0)
            qs_rows = a["q_scale_out"][rows]
            exps = read_aiter_q_scale(a["q_scale_out"], H)[rows].contiguous()      # [n, H, 4]
            packed = ops.convert_fp4_cache(a["kv_cache"], a["kv_cache_scale"], to="packed68")
            w = a["weights_out"][rows].float()
            layouts = [("aiter_fp4", dict(q=q, kv_cache=a["kv_cache"], kv_cache_scale=a["kv_cache_scale"],
                                          q_scale=qs_rows, weights=w, weight_scale=a["weights_scale"])),
                       ("packed68", dict(q=q, kv_cache=packed, q_scale=exps.unsqueeze(0), weights=w,
                                         weight_scale=a["weights_scale"]))]
        for layout, kw in layouts:
            # the scorer takes [B=1, N=queries, H, ...]: one sequence with `queries` query tokens
            kw["q"] = kw["q"].reshape(1, queries, *kw["q"].shape[2:])
            t0 = time.perf_counter()
            logits = ops.paged_mqa_logits(context_lens=ctx, block_tables=tables, max_seq_len=T, layout=layout,
                                          backend=backend, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_score = time.perf_counter() - t0
            row = dict(layout=layout, cosine=testing.cosine(logits, truth), write_s=t_write, score_s=t_score)
            for k in topk:
                row[f"top{k}"] = testing.topk_overlap(logits, truth, k)
            results.append(row)
    return device, results


def add_arguments(p) -> None:
    """The demo's options, on an argparse parser (the CLI's `demo` subcommand uses them)."""
    p.add_argument("--tokens", type=int, default=2048, help="T, the tokens written (default 2048)")
    p.add_argument("--heads", type=int, default=64, help="H, the query heads (default 64)")
    p.add_argument("--backend", default=None, choices=("reference", "triton", "cuda", "hip"),
                   help="force a backend (default: the best available one for the device)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="dsaquant demo", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    show(a)


def show(a) -> None:
    """Run the demo with parsed options `a` and print one row per cache layout."""
    from .dispatch import choose
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"indexer step: T={a.tokens} tokens, H={a.heads} heads, device {dev}, "
          f"backend {choose('indexer_qk_rope_quant_and_cache', dev, a.backend)}")
    dev, res = run(T=a.tokens, H=a.heads, device=dev, backend=a.backend)
    print(f"{'layout':<10} {'cosine':>9} {'top512':>8} {'write ms':>9} {'score ms':>9}")
    for r in res:
        print(f"{r['layout']:<10} {r['cosine']:>9.5f} {r['top512']:>8.4f} {r['write_s']*1e3:>9.1f} {r['score_s']*1e3:>9.1f}")
    print("cosine and top-k overlap are against the unquantized bf16 ground truth (16 query tokens, all keys).")
