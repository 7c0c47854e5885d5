"""SPEC §2 exhaustively: every bf16 bit pattern x, every UE8M0 exponent e in 1..254, v = fl(x / 2^(e-127)),
all three rounding policies, checked against a second formulation of §2 written here.

The oracle works in the value domain: the distance from |v| to each of the 8 grid magnitudes (float64),
the nearest one wins, and an exact tie between two grid points is resolved by policy (threshold: toward
zero, rne/hardware: the even index). It shares no code and no comparison chain with the reference.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from dsaquant.formats import e2m1_encode

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
POLICIES = ("threshold", "rne", "hardware")


def all_bf16_as_f32() -> np.ndarray:
    """The 65536 bf16 bit patterns, widened exactly to fp32."""
    return (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)


def scaled(x: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """v = fl(x / 2^(e-127)) in fp32 for each e in exps: shape [len(exps), len(x)]."""
    scale = (exps.astype(np.uint32) << 23).view(np.float32)            # 2^(e-127) from bits
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return x[None, :] / scale[:, None]                               # one fp32 division each


def oracle(v: np.ndarray) -> dict[str, np.ndarray]:
    """Second formulation of SPEC §2 for fp32 v (any shape) -> {policy: uint8 codes}."""
    v = v.reshape(-1)
    nan = np.isnan(v)
    a = np.abs(v.astype(np.float64))
    a = np.where(nan, 0.0, np.minimum(a, 7.0))            # anything above 6 (incl. Inf) is nearest to 6
    dist = np.abs(a[:, None] - GRID[None, :])             # [N, 8]; exact near every midpoint
    dmin = dist.min(axis=1, keepdims=True)
    cand = dist == dmin                                   # one candidate, or two on an exact tie
    low = np.argmax(cand, axis=1)                         # the candidate nearer zero
    high = 7 - np.argmax(cand[:, ::-1], axis=1)           # the candidate farther from zero
    tie = low != high
    assert np.all(high - low <= 1)
    m_thr = low                                           # ties toward zero
    m_even = np.where(tie & (low % 2 == 1), high, low)    # ties to the even index
    m_thr = np.where(nan, 7, m_thr)
    m_even = np.where(nan, 7, m_even)
    neg_value = v < 0                                     # False for -0 and NaN
    sign_bit = np.signbit(v)                              # the raw sign bit, NaN included
    out = {}
    for name, m in (("threshold", m_thr), ("rne", m_even)):
        out[name] = (m | np.where(neg_value & (m != 0), 8, 0)).astype(np.uint8)
    out["hardware"] = (m_even | np.where(sign_bit, 8, 0)).astype(np.uint8)
    return out


def sweep(exps: np.ndarray, chunk: int = 24) -> tuple[int, int, list]:
    x = all_bf16_as_f32()
    comparisons = mismatches = 0
    examples = []
    for i in range(0, len(exps), chunk):
        es = exps[i:i + chunk]
        v = scaled(x, es)
        want = oracle(v)
        vt = torch.from_numpy(v)
        for pol in POLICIES:
            got = e2m1_encode(vt, pol).numpy().reshape(-1)
            bad = got != want[pol]
            comparisons += got.size
            n_bad = int(bad.sum())
            if n_bad:
                mismatches += n_bad
                for j in np.flatnonzero(bad)[:3]:
                    vv = v.reshape(-1)[j]
                    examples.append((pol, int(es[j // x.size]), hex(int(x.view(np.uint32)[j % x.size] >> 16)),
                                     hex(int(np.float32(vv).view(np.uint32))), int(got[j]), int(want[pol][j])))
    return comparisons, mismatches, examples


def test_oracle_self_check():
    # The oracle against the SPEC's own tie table and golden rows (so it cannot drift silently).
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.2, 0.26, -1.75, 5.0000005, -7.0, np.inf],
                 dtype=np.float32)
    v = np.append(v, np.array([0xFFC00000], dtype=np.uint32).view(np.float32))
    o = oracle(v)
    assert o["threshold"].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 0xB, 7, 0xF, 7, 7]
    assert o["rne"].tolist() == [0, 2, 2, 4, 4, 6, 6, 0, 0, 1, 0xC, 7, 0xF, 7, 7]
    assert o["hardware"].tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 8, 1, 0xC, 7, 0xF, 7, 0xF]


def test_scaled_values_cover_every_class():
    # The sweep really reaches subnormal results, overflow to Inf, NaN of both signs and exact ties.
    v = scaled(all_bf16_as_f32(), np.array([1, 127, 254]))
    assert np.isinf(v).any() and np.isnan(v).any()
    assert ((v != 0) & (np.abs(v) < np.float32(2.0 ** -126))).any()
    assert np.signbit(v[np.isnan(v)]).any() and (~np.signbit(v[np.isnan(v)])).any()
    assert np.isin(np.abs(v[1]), np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).sum() == 14


def test_e2m1_every_bf16_every_exponent():
    t0 = time.perf_counter()
    exps = np.arange(1, 255)
    comparisons, mismatches, examples = sweep(exps)
    dt = time.perf_counter() - t0
    print(f"\ne2m1 exhaustive: {comparisons} comparisons (65536 bf16 x {len(exps)} exponents x 3 policies), "
          f"{mismatches} mismatches, {dt:.1f} s")
    assert comparisons == 65536 * 254 * 3
    assert mismatches == 0, examples[:20]   # (policy, e, bf16 bits, v bits, got, want)


def test_e2m1_every_fp32_near_the_grid():
    # Every fp32 in [0, 8) with the 16 low mantissa bits stepped finely around each midpoint: the
    # neighbours of each tie (+-1..64 ulp) and the ties themselves, both signs.
    mids = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    base = mids.view(np.int32)
    steps = np.arange(-64, 65, dtype=np.int32)
    v = (base[:, None] + steps[None, :]).reshape(-1).view(np.float32)
    v = np.concatenate([v, -v])
    want = oracle(v)
    for pol in POLICIES:
        got = e2m1_encode(torch.from_numpy(v), pol).numpy()
        assert np.array_equal(got, want[pol]), pol
