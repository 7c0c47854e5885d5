"""The shared header's DeepSeek-V4 math (SPEC §0.7 exp_ds, §7.6 pool, §7.7 FP8 group scale) against the torch
reference on the host, bit for bit, through the harness tests/cpp/header_host.cpp (fixture `header_host`).

- exp_ds over a strided sweep of every negative fp32 pattern down to -104 (and past it), plus all of them with
  DSAQUANT_EXHAUSTIVE=1 (about 1.1e9 values; minutes);
- dsq::pool_exp (the pool's exp_ds for a finite window max) against exp_ds over the same sweeps (every pattern
  with DSAQUANT_EXHAUSTIVE=1) and on random (sig, m) pairs;
- dsq::pool_window<K> (K = 4, 8, 128, 256) against reference.compress.pool on random windows with excluded rows,
  NaN / +-Inf scores, all--Inf windows, tiny and huge magnitudes;
- dsq::fp8_group_scale against reference.compress.fp8_group_quantize's scales.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dsaquant.reference import arith
from dsaquant.reference import compress as rc

SEED = 20250611


@pytest.fixture(scope="module")
def h(header_host):
    return header_host


def _check(counts, name, got, want):
    got = np.ascontiguousarray(got, dtype=np.float32)
    want = np.ascontiguousarray(want.detach().cpu().numpy() if isinstance(want, torch.Tensor) else want,
                                dtype=np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    both_nan = np.isnan(got) & np.isnan(want)
    bad = (got.view(np.uint32) != want.view(np.uint32)) & ~both_nan
    c = counts.setdefault(name, [0, 0])
    c[0] += int(bad.size)
    c[1] += int(bad.sum())
    if bad.any():
        i = np.argwhere(bad)[:5].ravel().tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.size} differ; first at {i}: "
                             f"got {got.ravel()[i].view(np.uint32)}, want {want.ravel()[i].view(np.uint32)}")


# ---- SPEC §0.7 -------------------------------------------------------------------------------------------
def _neg_patterns(lo: int, hi: int, stride: int, offset: int = 0) -> np.ndarray:
    return (np.arange(lo + offset, hi, stride, dtype=np.uint64) | 0x80000000).astype(np.uint32).view(np.float32)


def test_exp_ds_sweep(h, header_counts):
    """Every stride-th negative fp32 in [-104, -0] (about 1.7e7 values, two offsets), and a sparser sweep of
    everything below -104 (all +0 there)."""
    top = 0x42D00001   # |x| bits up to just past 104
    for off in (0, 31):
        x = _neg_patterns(0, top, 131, off)
        _check(header_counts, "exp_ds sweep [-104, 0]", h.exp_ds(x), arith.exp_ds(torch.from_numpy(x)))
    x = _neg_patterns(top, 0x7F800001, 4099)
    _check(header_counts, "exp_ds sweep below -104", h.exp_ds(x), arith.exp_ds(torch.from_numpy(x)))


@pytest.mark.skipif(os.environ.get("DSAQUANT_EXHAUSTIVE") != "1", reason="set DSAQUANT_EXHAUSTIVE=1 (minutes)")
def test_exp_ds_exhaustive(h, header_counts):
    """All negative fp32 patterns with |x| <= 104 (and -0)."""
    top, chunk = 0x42D00001, 1 << 24
    for lo in range(0, top, chunk):
        x = _neg_patterns(lo, min(lo + chunk, top), 1)
        _check(header_counts, "exp_ds exhaustive [-104, 0]", h.exp_ds(x), arith.exp_ds(torch.from_numpy(x)))


def test_pool_exp_is_exp_ds(h, header_counts):
    """pool_exp(sig, m) = exp_ds(fl(sig - m)) wherever m is finite: x = fl(sig - m) over the strided sweeps of
    [-104, -0] and below (-Inf included), as sig with m = 0, and random pairs of every magnitude."""
    top = 0x42D00001
    for x in (_neg_patterns(0, top, 127, 5), _neg_patterns(top, 0x7F800001, 4093),
              np.array([0.0, -0.0, -np.inf, -200.0, -np.float32(200.00002), -1e-45], dtype=np.float32)):
        _check(header_counts, "pool_exp sweep", h.pool_exp(x, np.zeros_like(x)), h.exp_ds(x))
    rng = np.random.default_rng(SEED)
    m = (rng.standard_normal(1 << 16) * 2.0 ** rng.integers(-20, 20, 1 << 16)).astype(np.float32)
    sig = np.minimum(m - np.abs(rng.standard_normal(1 << 16) * 2.0 ** rng.integers(-20, 9, 1 << 16)), m)
    sig = sig.astype(np.float32)
    sig[::97] = -np.inf
    want = arith.exp_ds(torch.from_numpy(sig) - torch.from_numpy(m))
    _check(header_counts, "pool_exp pairs", h.pool_exp(sig, m), want)
    if os.environ.get("DSAQUANT_EXHAUSTIVE") == "1":
        for lo in range(0, 0x7F800001, 1 << 24):
            x = _neg_patterns(lo, min(lo + (1 << 24), 0x7F800001), 1)
            _check(header_counts, "pool_exp exhaustive", h.pool_exp(x, np.zeros_like(x)), h.exp_ds(x))


# ---- SPEC §7.6 step 2 ---------------------------------------------------------------------------------------
def _windows(rng, N: int, K: int):
    """N windows of K rows: (sig, kv, incl) with every kind of special case in some rows."""
    mag = 2.0 ** rng.integers(-8, 8, (N, 1))
    sig = (rng.standard_normal((N, K)) * mag).astype(np.float32)
    kv = (rng.standard_normal((N, K)) * 2.0 ** rng.integers(-30, 30, (N, 1))).astype(np.float32)
    incl = np.ones((N, K), dtype=bool)
    # the first windows of a sequence: the leading rows (s < 0) excluded
    n_ex = rng.integers(0, K, N)
    incl[np.arange(K)[None, :] < n_ex[:, None]] = False
    incl[::97] = True
    q = N // 16
    sig[0:q, rng.integers(0, K)] = np.nan                       # poisoned (if included)
    sig[q:2 * q, rng.integers(0, K)] = np.inf
    sig[2 * q:3 * q, :] = -np.inf                               # all -inf: NaN
    sig[3 * q:4 * q, : K // 2] = -np.inf                        # some -inf: weight 0
    sig[4 * q:5 * q] *= np.float32(1e30)                        # huge spread: most e underflow to 0
    sig[5 * q:6 * q] *= np.float32(1e-30)                       # flat: every e is 1
    sig[6 * q:7 * q, -1] = np.float32(3e38)
    sig[6 * q:7 * q, 0] = np.float32(-3e38)                     # sig - m overflows to -inf
    kv[7 * q:8 * q, rng.integers(0, K)] = np.inf                # inf * w
    kv[8 * q:9 * q, rng.integers(0, K)] = np.nan
    sig[9 * q:10 * q] = np.where(rng.random((q, K)) < 0.5, np.float32(0.0), np.float32(-0.0))   # +-0 ties
    incl[10 * q:11 * q] = False                                 # nothing included: NaN
    incl[10 * q:11 * q, -1] = True
    sig[10 * q:11 * q, :-1] = np.nan                            # NaN only in excluded rows: finite
    return sig, kv, incl


@pytest.mark.parametrize("K", [4, 8, 128, 256])
def test_pool_window(h, header_counts, K):
    rng = np.random.default_rng(SEED + K)
    N = 4096 if K <= 8 else 768
    sig, kv, incl = _windows(rng, N, K)
    want = rc.pool(torch.from_numpy(sig), torch.from_numpy(kv), torch.from_numpy(incl))
    _check(header_counts, f"pool_window K={K}", h.pool_window(sig, kv, incl), want)


# ---- SPEC §7.7 FP8 group scale ------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour,code", [("e4m3fn", 0), ("e4m3fnuz", 1)])
def test_fp8_group_scale(h, header_counts, flavour, code):
    rng = np.random.default_rng(SEED + 7 + code)
    n = 20000
    x = (rng.standard_normal((n, 16)) * 2.0 ** rng.integers(-140, 120, (n, 1))).astype(np.float32)
    x[:50] = 0.0
    x[50:60, 3] = np.inf
    x[60:70, 5] = np.nan
    x[70:80] = np.float32(1e-10) * rng.random((10, 16)).astype(np.float32)
    _, s = rc.fp8_group_quantize(torch.from_numpy(x), flavour, 16)
    amax = arith.nan_amax(torch.from_numpy(x)).numpy()
    _check(header_counts, f"fp8_group_scale {flavour}", h.fp8_group_scale(amax, code), s[:, 0])
