"""Tally of byte comparisons per (backend, op) for the GPU suite's closing table."""
from collections import defaultdict

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
