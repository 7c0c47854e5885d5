"""Tally of byte comparisons per (backend, op) for the GPU suite's closing table, and the byte comparison
itself (`byte_diff`)."""
from collections import defaultdict

import torch

COUNTS = defaultdict(lambda: [0, 0, 0])   # (backend, op) -> [calls, bytes compared, mismatching bytes]


def record(backend: str, op: str, total: int, bad: int) -> None:
    c = COUNTS[(backend, op)]
    c[0] += 1
    c[1] += total
    c[2] += bad


def table() -> str:
    lines = [f"{'backend':<8} {'op':<40} {'cases':>6} {'bytes compared':>15} {'mismatches':>11}"]
    for (b, op), (n, tot, bad) in sorted(COUNTS.items()):
        lines.append(f"{b:<8} {op:<40} {n:>6} {tot:>15} {bad:>11}")
    return "\n".join(lines)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's elements in order (any strides) as one flat uint8 tensor."""
    flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def byte_diff(pairs, got: str = "got"):
    """(name, reference tensor, other tensor) pairs -> (bytes compared, mismatching bytes, a note on the first
    mismatching bytes of each pair that differs)."""
    total = bad = 0
    where = []
    for name, x, y in pairs:
        xb, yb = as_bytes(x), as_bytes(y)
        total += xb.numel()
        n = int((xb != yb).sum())
        if n:
            bad += n
            idx = torch.nonzero(xb != yb).reshape(-1)[:4].tolist()
            where.append(f"{name}: {n} bytes at {idx} ref {xb[idx].tolist()} {got} {yb[idx].tolist()}")
    return total, bad, where
