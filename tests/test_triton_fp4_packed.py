"""The packed bf16x2 FP4 encoder of the `triton` backend (formats.e2m1_code_bf16x2, NVIDIA sm_80+) on CPU.

The encoder is inline PTX, which neither the CPU nor the Triton interpreter runs. Here the PTX text the kernels
embed (formats.E2M1_BF16X2_PTX_*) is executed instruction by instruction by a small emulator of the few PTX
instructions it uses (mov/and/or/not/shr.b32, add.u32, fma.rn.bf16x2 with one rounding to nearest even and
subnormals kept, min/max.bf16x2 ignoring a NaN operand), on every bf16 value x and every block exponent e in
1..255, under each rounding policy, and each 4-bit code must equal the reference's (dsaquant.reference.fp4:
fp4_quantize's code of x in a block with exponent e: e2m1_encode of canon_nan(x) / 2^(e-127), the NaN-scale
code for e = 255). The two halves of a register get different exponents, so a half never depends on the
other one.

The Triton code around the asm (exponents, scale bits) runs under the interpreter in tests/test_triton_quant.py
(case fmt-fp4_packed, codes from this emulator); the asm on a GPU and its use in the kernels: tests/gpu
(test_backend_exact.py, test_triton_gpu.py); that the kernels compile it for sm_90/sm_100 (ptxas) and not
for gfx: tests/test_triton_aot.py.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

POLICIES = ("threshold", "rne", "hardware")


# ---- a PTX emulator for the instructions of the packed encoder --------------------------------------------
def _halves(w: np.ndarray):
    return (w & 0xFFFF).astype(np.uint32), (w >> 16).astype(np.uint32)


def _bf16_to_f64(h: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fl_bf16(a*b + c) per 16-bit pattern (uint32 arrays holding bf16 bits): one rounding to nearest even,
    subnormals kept, NaN -> 0x7FFF. a*b is exact in float64 (8 + 8 significant bits); the sum is split into
    its float64 rounding s and the exact error (two-sum), which breaks an exact bf16 tie of s."""
    with np.errstate(all="ignore"):
        p = _bf16_to_f64(a) * _bf16_to_f64(b)
        cd = _bf16_to_f64(c)
        s = p + cd
        bb = s - p
        err = (p - (s - bb)) + (cd - bb)
        err = np.where(np.isfinite(s), err, 0.0)
        a_s = np.abs(s)
        _, ex = np.frexp(np.where(np.isfinite(a_s) & (a_s > 0), a_s, 1.0))      # a_s in [2^(ex-1), 2^ex)
        q = np.maximum(ex - 1, -126) - 7                                         # bf16 ulp 2^q at a_s
        k = np.ldexp(a_s, -q)
        fl = np.floor(k)
        frac = k - fl
        tie_up = np.where(err == 0.0, fl % 2 == 1, (err > 0.0) == (s > 0.0))
        r = np.where(frac > 0.5, fl + 1, np.where(frac < 0.5, fl, np.where(tie_up, fl + 1, fl)))
        mag = np.ldexp(r, q)
        mag = np.where(np.isfinite(s) & (mag >= 2.0 ** 128), np.inf, mag)
        bits = (mag.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
        bits |= np.where(np.signbit(s), 0x8000, 0).astype(np.uint32)
        return np.where(np.isnan(s), np.uint32(0x7FFF), bits).astype(np.uint32)


def bf16_minmax(a: np.ndarray, b: np.ndarray, is_min: bool) -> np.ndarray:
    """min/max.bf16x2 on one half: a NaN operand is ignored (two NaNs: 0x7FFF)."""
    fa, fb = _bf16_to_f64(a), _bf16_to_f64(b)
    with np.errstate(all="ignore"):
        pick_a = (fa <= fb) if is_min else (fa >= fb)
    out = np.where(np.isnan(fb) | pick_a, a, b)
    out = np.where(np.isnan(fa) & ~np.isnan(fb), b, out)
    return np.where(np.isnan(fa) & np.isnan(fb), np.uint32(0x7FFF), out).astype(np.uint32)


def _pairwise(f, *ws):
    lo = f(*[_halves(w)[0] for w in ws])
    hi = f(*[_halves(w)[1] for w in ws])
    return (lo | (hi << 16)).astype(np.uint32)


_INSN = re.compile(r"^([a-z0-9.]+)\s+(.*);$")


def run_ptx(asm: str, operands: dict) -> dict:
    """Execute the packed encoder's PTX on uint32 arrays. operands: the inputs {'$2': ..., '$3': ...}; returns
    every register, the outputs '$0' and '$1' included (every value a full 32-bit register)."""
    regs = {k: np.asarray(v, dtype=np.uint32) for k, v in operands.items()}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 0))

    for line in asm.splitlines():
        line = line.split("//")[0].strip()
        if not line or line in ("{", "}") or line.startswith(".reg"):
            continue
        m = _INSN.match(line)
        assert m, f"unparsed PTX line: {line!r}"
        op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
        d, src = args[0], [val(t) for t in args[1:]]
        if op == "mov.b32":
            res = src[0]
        elif op == "and.b32":
            res = (src[0] & src[1]).astype(np.uint32)
        elif op == "or.b32":
            res = (src[0] | src[1]).astype(np.uint32)
        elif op == "not.b32":
            res = (~np.asarray(src[0], dtype=np.uint32)).astype(np.uint32)
        elif op == "add.u32":
            res = ((np.asarray(src[0], dtype=np.uint64) + np.uint64(src[1])) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "shr.b32":
            res = (src[0] >> src[1]).astype(np.uint32)
        elif op == "fma.rn.bf16x2":
            res = _pairwise(bf16_fma, *[np.broadcast_to(s, np.shape(regs["$2"])).astype(np.uint32) for s in src])
        elif op in ("min.bf16x2", "max.bf16x2"):
            res = _pairwise(lambda a, b: bf16_minmax(a, b, op.startswith("min")),
                            *[np.broadcast_to(s, np.shape(regs["$2"])).astype(np.uint32) for s in src])
        else:
            raise AssertionError(f"PTX instruction {op!r} is not emulated")
        regs[d] = res
    return regs


def test_bf16_fma_emulation_spot_checks():
    """The emulator's FMA against exact rational arithmetic on a random sample (ties included)."""
    from fractions import Fraction
    rng = np.random.default_rng(0)
    n = 4000
    a = rng.integers(0, 1 << 16, n).astype(np.uint32)
    b = rng.integers(0, 1 << 16, n).astype(np.uint32)
    c = rng.integers(0, 1 << 16, n).astype(np.uint32)
    # 1.0 * b + 64 with b in [0.25, 6), as the encoder's c*K + M: many exact bf16 ties (ulp 0.5 at 64)
    a[:500] = 0x3F80                                                              # 1.0
    b[:500] = (np.arange(500) % 48 * 0x10 + 0x3E80).astype(np.uint32)            # 0.25 .. around 6
    c[:500] = 0x4280                                                              # 64
    got = bf16_fma(a, b, c)

    def exact(h):
        v = float(_bf16_to_f64(np.array([h]))[0])
        return None if not np.isfinite(v) else Fraction(v)

    allv = _bf16_to_f64(np.arange(0x7F80, dtype=np.uint32))                       # finite non-negative bf16
    checked = 0
    for i in range(n):
        fa, fb, fc = exact(int(a[i])), exact(int(b[i])), exact(int(c[i]))
        if fa is None or fb is None or fc is None:
            continue
        t = fa * fb + fc
        if t == 0:
            continue
        mag = abs(t)
        if mag > Fraction(float(allv[-1])):
            continue
        j = int(np.searchsorted(allv, float(mag)))                                # allv[j-1] < mag <= allv[j]
        lo, hi = Fraction(float(allv[j - 1])), Fraction(float(allv[j]))
        if hi == mag:
            k = j
        else:
            dl, dh = mag - lo, hi - mag
            k = j - 1 if dl < dh else j if dh < dl else (j - 1 if (j - 1) % 2 == 0 else j)
        want = k | (0x8000 if t < 0 else 0)
        assert int(got[i]) == want, (hex(a[i]), hex(b[i]), hex(c[i]), hex(int(got[i])), hex(want))
        checked += 1
    assert checked > 3000


def _scale_bits(e: np.ndarray) -> np.ndarray:
    """formats.bf16_inv_pow2_bits restated: 2^(127-e) as bf16 bits, 0x0040 for e = 254, +Inf for e = 255."""
    return np.where(e < 254, (254 - e) << 7, np.where(e == 254, 0x40, 0x7F80)).astype(np.uint32)


def expected_code(x_bits: np.ndarray, e: np.ndarray, policy: str) -> np.ndarray:
    """fp4_quantize's 4-bit code of the bf16 value x (bits) in a block with exponent e (1..255)."""
    from dsaquant.reference.arith import bits, canon_nan, pow2
    from dsaquant.reference.fp4 import e2m1_encode
    x = canon_nan(torch.from_numpy((x_bits.astype(np.uint32) << 16).view(np.float32).copy()))
    et = torch.from_numpy(e.astype(np.int32))
    codes = e2m1_encode(x / pow2(et), policy)
    fill = ((bits(x) < 0).to(torch.uint8) << 3) | 7 if policy == "hardware" else torch.full_like(codes, 7)
    return torch.where(et == 255, fill, codes).numpy().astype(np.uint32)


def packed_codes(policy: str, x_words: np.ndarray, s_words: np.ndarray):
    """The packed encoder's two outputs (the codes of the low and of the high value) for words of two bf16
    values and words of their two scales."""
    from dsaquant.triton import formats as F
    asm = {"threshold": F.E2M1_BF16X2_PTX_THRESHOLD, "rne": F.E2M1_BF16X2_PTX_RNE,
           "hardware": F.E2M1_BF16X2_PTX_HARDWARE}[policy].value
    regs = run_ptx(asm, {"$2": x_words, "$3": s_words})
    return regs["$0"], regs["$1"]


def _formats():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the PTX text is read from dsaquant.triton.formats; not under TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    from dsaquant.triton import formats as F
    return F


@pytest.mark.parametrize("policy", POLICIES)
def test_packed_codes_every_bf16_value_every_exponent(policy):
    _formats()
    vals = np.arange(1 << 16, dtype=np.uint32)
    x_words = vals[0::2] | (vals[1::2] << 16)                  # value 2i low, 2i + 1 high
    bad = []
    for e0 in range(1, 256, 15):
        es = np.arange(e0, min(e0 + 15, 256), dtype=np.uint32)
        e_lo = np.repeat(es, x_words.size)
        e_hi = (e_lo * 7) % 255 + 1                            # another exponent in the high half
        xw = np.tile(x_words, es.size)
        c_lo, c_hi = packed_codes(policy, xw, _scale_bits(e_lo) | (_scale_bits(e_hi) << 16))
        for half, g, e, x in (("lo", c_lo, e_lo, xw & 0xFFFF), ("hi", c_hi, e_hi, xw >> 16)):
            w = expected_code(x, e, policy)
            d = np.nonzero(g != w)[0]
            bad += [(half, hex(int(x[i])), int(e[i]), int(g[i]), int(w[i])) for i in d[:5]]
    assert not bad, f"{policy}: packed code != reference (half, x bits, e, got, want): {bad[:10]}"


def test_ptx_text():
    """The three variants: threshold and rne differ only in the rounding constant K; hardware drops the two
    sign masks (m != 0, e != 255); only emulated instructions, five bf16x2 FMAs each."""
    F = _formats()
    thr, rne, hw = (F.E2M1_BF16X2_PTX_THRESHOLD.value, F.E2M1_BF16X2_PTX_RNE.value,
                    F.E2M1_BF16X2_PTX_HARDWARE.value)
    assert thr.replace("0x3F7F3F7F;", "0x3F803F80;") == rne
    assert len(hw.splitlines()) == len(rne.splitlines()) - 5
    assert "$4" not in rne and all(f"${i}" in rne for i in range(4))
    for asm in (thr, rne, hw):
        assert asm.count("fma.rn.bf16x2") == 5 and asm.count("min.bf16x2") == 1 and asm.count("max.bf16x2") == 1
