"""The README's Python blocks run as written (each block in a fresh namespace, on the CPU here: the blocks
pick `device = "cuda" if available else "cpu"`), and what the server snippet writes and scores is what the
reference backend writes and scores from the same inputs, byte for byte. tests/gpu/test_readme_gpu.py runs
the same blocks on a GPU (CUDA-graph branch)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

import dsaquant

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def run_block(src: str) -> dict:
    ns: dict = {"__name__": "__readme__"}
    exec(compile(src, str(README), "exec"), ns)
    return ns


def check_server_snippet(ns: dict) -> None:
    """The snippet's caches and logits against the reference backend on fresh copies of its inputs."""
    T, H = ns["T"], ns["H"]
    logits = ns["logits"]
    assert logits.shape == (1, T) and logits.dtype == torch.float32
    assert bool(torch.isfinite(logits).all())
    assert ns["top"].shape == (16,)
    q_out, w_out, kv = torch.empty_like(ns["q_out"]), torch.empty_like(ns["w_out"]), torch.zeros_like(ns["kv_cache"])
    dsaquant.indexer_qk_rope_quant_and_cache(
        ns["q"], q_out, ns["weights"], w_out, ns["k"], kv, ns["slot_mapping"], ns["ln_weight"], ns["ln_bias"],
        ns["positions"], ns["cos_cache"], ns["sin_cache"], 1e-6, 128, "ue8m0", ns["softmax_scale"] * H ** -0.5,
        backend="reference")
    assert torch.equal(kv.cpu(), ns["kv_cache"].cpu())
    assert torch.equal(q_out.view(torch.uint8).cpu(), ns["q_out"].view(torch.uint8).cpu())
    assert torch.equal(w_out.cpu(), ns["w_out"].cpu())
    ref = dsaquant.paged_mqa_logits(q_out[-1:].view(1, 1, H, 128), kv, w_out[-1:], ns["context_lens"],
                                    ns["block_tables"], T, layout="fp8_132", backend="reference")
    if logits.device.type == "cpu":   # the snippet ran on the reference itself
        assert torch.equal(logits, ref)
    else:   # the GPU scorer may take an FP8 tensor-core dot (relative error about 1e-4 of the largest logit)
        torch.testing.assert_close(logits.cpu(), ref.cpu(), rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    assert bool((kv[1:] == 0).all())                      # T = 64 slots fill page 0 only
    # the logits from the cache bytes by SPEC §6 and §7.4 alone: codes at 128*o + d, fp32 scales at 128*P + 4*o
    P = ns["P"]
    page = kv[0].cpu()
    k_deq = page[:128 * T].view(torch.float8_e4m3fn).float().view(T, 128)
    k_deq = k_deq * page[128 * P:128 * P + 4 * T].view(torch.float32).unsqueeze(1)
    q_deq = q_out[-1].cpu().view(torch.uint8).view(torch.float8_e4m3fn).float()             # [H, 128]
    w = w_out[-1].cpu().double().unsqueeze(1)
    want = (torch.relu(q_deq.double() @ k_deq.double().T) * w).sum(0)
    # docs/scorer.md's bounds: within 1e-3 * mag on every backend (FP8 tensor cores), 3e-5 * mag where the dot
    # is accumulated in fp32 (the reference the CPU runs), mag = sum_h |w_h| sum_d |q_hd k_pd|
    mag = ((q_deq.double().abs() @ k_deq.double().abs().T) * w.abs()).sum(0)
    bound = (3e-5 if logits.device.type == "cpu" else 1e-3) * mag
    assert bool(((logits[0].cpu().double() - want).abs() <= bound).all())


def test_readme_has_the_server_snippet():
    blocks = python_blocks()
    assert blocks and any("indexer_step" in b for b in blocks)


def test_readme_python_blocks_run():
    for src in python_blocks():
        ns = run_block(src)
        if "indexer_step" in ns:
            check_server_snippet(ns)
