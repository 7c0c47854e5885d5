"""numpy.float32 helpers of the tests that restate SPEC rules one rounding at a time (numpy float32 ufuncs and
scalar operations are single IEEE operations; no FMA): bit views and the SPEC §0.2 canonical sum."""
from __future__ import annotations

import numpy as np
import torch

f32 = np.float32


def b32(x) -> np.ndarray:
    """The uint32 bit patterns of float32 values."""
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def from_bits(b) -> np.ndarray:
    """float32 values from their uint32 bit patterns."""
    return np.asarray(b, dtype=np.uint32).view(np.float32)


def same_bits(a, b) -> bool:
    """Whether two float32 arrays or tensors have the same shape and bit patterns (NaN payloads included)."""
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    b = b.numpy() if isinstance(b, torch.Tensor) else b
    return a.shape == b.shape and np.array_equal(b32(a), b32(b))


def canonical_np(row) -> np.float32:
    """SPEC §0.2's canonical sum of a row (a multiple of 4 long), numpy.float32 scalar steps: fours
    summed left to right, then butterfly levels of strides m/2 .. 1 over the m partials."""
    x = [f32(v) for v in row]
    m = len(x) // 4
    p = [((x[4 * i] + x[4 * i + 1]) + x[4 * i + 2]) + x[4 * i + 3] for i in range(m)]
    s = m // 2
    while s >= 1:
        p = [p[i] + p[i ^ s] for i in range(m)]
        s //= 2
    assert all(type(v) is np.float32 for v in p)
    return p[0]
