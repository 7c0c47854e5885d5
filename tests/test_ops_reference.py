"""Op-level tests of the public ops on the CPU (reference backend), SPEC §7.1-§7.3 and §6.

Two kinds of checks:
- hand cases: inputs chosen so that every expected byte is worked out in the comments from SPEC §2-§6
  (position 0, where cos = 1 and sin = 0, so RoPE is the identity);
- an independent step-by-step numpy.float32 oracle (written below, sharing no code with
  dsaquant.reference) for cases with a real rotation, compared byte for byte.
Layout offsets in this file are written as tensor indices from the SPEC §6 formulas, not by calling
dsaquant.reference.layouts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dsaquant
from dsaquant import testing as tt

POISON = 0xA5
F = np.float32
INV6 = np.array([0x3E2AAAAB], dtype=np.uint32).view(np.float32)[0]          # fl(1/6)
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _drain_flags():
    try:
        dsaquant.check_errors()
    except dsaquant.DsaquantError:
        pass


@pytest.fixture(autouse=True)
def _clean_flags():
    _drain_flags()
    dsaquant.set_host_checks(False)
    yield
    dsaquant.set_host_checks(False)
    _drain_flags()


def u8(t: torch.Tensor) -> np.ndarray:
    """Bytes of a contiguous tensor as a flat numpy uint8 array (a copy)."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


def all_poison(t: torch.Tensor) -> bool:
    return bool((t.contiguous().view(torch.uint8) == POISON).all())


def f32_bits(x) -> int:
    return int(np.asarray(x, dtype=np.float32).view(np.uint32))


def np32(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy().astype(np.float32)


# ---- independent numpy.float32 oracle (SPEC §0-§5) ------------------------------------------------
def bf16(a) -> np.ndarray:
    """Round fp32 to bf16 (nearest even) on bits; returns float32 holding the bf16 value."""
    a = np.asarray(a, dtype=np.float32)
    b = a.view(np.uint32).astype(np.uint64)
    r = (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF
    out = r.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(a), a, out).astype(np.float32)


def ceil_exp(f) -> np.ndarray:
    b = np.asarray(f, dtype=np.float32).view(np.uint32).astype(np.int64)
    return ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0)


def pow2(e) -> np.ndarray:
    return (np.asarray(e, dtype=np.int64).astype(np.uint32) << 23).view(np.float32)


def csum(x) -> np.ndarray:
    """SPEC §0.2 canonical sum over the last dim (4*m, m a power of two), in float32."""
    x = np.asarray(x, dtype=np.float32)
    p = ((x[..., 0::4] + x[..., 1::4]) + x[..., 2::4]) + x[..., 3::4]
    m = p.shape[-1]
    idx = np.arange(m)
    s = m // 2
    while s:
        p = p + p[..., idx ^ s]
        s //= 2
    return p[..., 0]


def np_rope(x, cos, sin, neox: bool, tail: bool) -> np.ndarray:
    x = np.array(x, dtype=np.float32)
    off = 64 if tail else 0
    if neox:
        ia, ib = np.arange(32) + off, np.arange(32) + off + 32
    else:
        ia, ib = np.arange(0, 64, 2) + off, np.arange(1, 64, 2) + off
    a, b = x[..., ia].copy(), x[..., ib].copy()
    x[..., ia] = a * cos - b * sin
    x[..., ib] = b * cos + a * sin
    return x


def np_layer_norm(x, w, b, eps) -> np.ndarray:
    mean = csum(x) / F(128)
    d = x - mean[..., None]
    var = csum(d * d) / F(128)
    inv = F(1) / np.sqrt(var + F(eps))
    return (d * inv[..., None]) * w + b


def np_rms_norm(x, w, eps) -> np.ndarray:
    inv = F(1) / np.sqrt(csum(x * x) / F(128) + F(eps))
    return w * (x * inv[..., None])


def e4m3_codes(x) -> np.ndarray:
    """fp32 -> e4m3fn codes via torch's own float8 cast (saturating first), not dsaquant's encoder."""
    x = np.clip(np.asarray(x, dtype=np.float32), -448.0, 448.0).astype(np.float32)
    return torch.from_numpy(x.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def e2m1_codes(v, rounding: str) -> np.ndarray:
    """SPEC §2 by nearest-grid distance (float64), ties by policy. v fp32 (finite or inf)."""
    v = np.asarray(v, dtype=np.float32)
    a = np.minimum(np.abs(v.astype(np.float64)), 7.0)
    dist = np.abs(a[..., None] - GRID)
    best = dist.min(-1, keepdims=True)
    cand = dist == best                                    # one or two (a tie) candidates
    lo = np.argmax(cand, -1)
    hi = 7 - np.argmax(cand[..., ::-1], -1)
    if rounding == "threshold":
        m = lo
    else:
        m = np.where(lo % 2 == 0, lo, hi)
    m = m.astype(np.uint8)
    if rounding == "hardware":
        sign = np.signbit(v).astype(np.uint8) << 3
    else:
        sign = ((v < 0) & (m != 0)).astype(np.uint8) << 3
    return (m | sign).astype(np.uint8)


def grid_rne_value(a) -> np.ndarray:
    return GRID[e2m1_codes(np.abs(a), "rne") & 7].astype(np.float32)


def pack(codes) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def fp4_recip(x, rounding):
    """x fp32 [..., 128] -> (packed [..., 64], exps [..., 4]) with the `recip` rule, blocks of 32."""
    xb = x.reshape(*x.shape[:-1], 4, 32)
    amax = np.abs(xb).max(-1)
    e = ceil_exp(np.maximum(amax, F(6 * 2.0 ** -126)) * INV6)
    v = xb / pow2(e)[..., None]
    return pack(e2m1_codes(v, rounding).reshape(x.shape)), e.astype(np.uint8)


def fp16(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


def sglang_stage1(x, rnd=bf16) -> np.ndarray:
    xb = x.reshape(*x.shape[:-1], 4, 32)
    amax = np.abs(xb).max(-1)
    s = pow2(ceil_exp(np.maximum(amax, F(6 * 2.0 ** -126)) * INV6))[..., None]
    y = np.clip(xb / s, F(-6), F(6))
    r = grid_rne_value(y)
    q = np.where(y < 0, -r, r).astype(np.float32)
    return rnd(q * s).reshape(x.shape)


def sglang_stage2(x, rounding):
    xb = x.reshape(*x.shape[:-1], 4, 32)
    amax = np.abs(xb).max(-1)
    e = np.clip(ceil_exp(np.maximum(amax / F(6), F(1e-4))), 1, 254)
    v = xb / pow2(e)[..., None]
    return pack(e2m1_codes(v, rounding).reshape(x.shape)), e.astype(np.uint8)


# ---- SPEC §6 layouts, as tensor indices ------------------------------------------------------------
def fp8_132_row(cache, slot, P, preshuffle=False):
    """(codes u8 [128], scale fp32) of `slot` in an fp8_132 cache."""
    flat = u8(cache)
    n, o = slot // P, slot % P
    base = n * P * 132
    d = np.arange(128)
    if preshuffle:
        off = base + (o // 16) * 2048 + (d // 16) * 256 + (o % 16) * 16 + (d % 16)
    else:
        off = base + 128 * o + d
    sc = flat[base + 128 * P + 4 * o: base + 128 * P + 4 * o + 4].view(np.float32)[0]
    return flat[off], sc


def fp8_132_row_offsets(slot, P, preshuffle=False):
    n, o = slot // P, slot % P
    base = n * P * 132
    d = np.arange(128)
    if preshuffle:
        data = base + (o // 16) * 2048 + (d // 16) * 256 + (o % 16) * 16 + (d % 16)
    else:
        data = base + 128 * o + d
    return np.concatenate([data, base + 128 * P + 4 * o + np.arange(4)])


def packed68_row(cache, slot, P):
    flat = u8(cache)
    n, o = slot // P, slot % P
    base = n * P * 68
    return flat[base + 64 * o: base + 64 * o + 64], flat[base + 64 * P + 4 * o: base + 64 * P + 4 * o + 4]


def packed68_row_offsets(slot, P):
    n, o = slot // P, slot % P
    base = n * P * 68
    return np.concatenate([base + 64 * o + np.arange(64), base + 64 * P + 4 * o + np.arange(4)])


def aiter_row(kv, ks, slot, P):
    n, o = slot // P, slot % P
    b = np.arange(64)
    payload = kv[n, 0].numpy()[b // 16, o, b % 16]
    sflat = (o % 16) * (P // 16) + o // 16
    exps = ks[n, 0].numpy()[np.arange(4), sflat]
    return payload, exps


def aiter_q_exps(qs, t, H):
    """[H, 4] exponents of token t from q_scale_out [T, 1, 4, 16, qs_pad]."""
    h = np.arange(H)[:, None]
    g = np.arange(4)[None, :]
    return qs[t, 0].numpy()[g, h % 16, h // 16]


def aiter_row_offsets(slot, P):
    """(flat offsets into kv_cache, flat offsets into kv_cache_scale) of `slot` in the aiter_fp4 layout."""
    n, o = slot // P, slot % P
    b = np.arange(64)
    data = (((n * 4 + b // 16) * P) + o) * 16 + b % 16           # index [n, 0, b//16, o, b%16]
    g = np.arange(4)
    scale = (n * 4 + g) * P + (o % 16) * (P // 16) + o // 16     # index [n, 0, g, sflat(o)]
    return data, scale


def aiter_untouched_except(kv, ks, slots, P) -> bool:
    offs = [aiter_row_offsets(s, P) for s in slots]
    d = np.concatenate([o[0] for o in offs]) if offs else np.zeros(0, np.int64)
    sc = np.concatenate([o[1] for o in offs]) if offs else np.zeros(0, np.int64)
    return (untouched_except(np.full(kv.numel(), POISON, np.uint8), u8(kv), d)
            and untouched_except(np.full(ks.numel(), POISON, np.uint8), u8(ks), sc))


def untouched_except(before: np.ndarray, after: np.ndarray, written: np.ndarray) -> bool:
    """Every byte outside `written` offsets is unchanged."""
    mask = np.ones(before.shape, dtype=bool)
    mask[written] = False
    return bool((before[mask] == after[mask]).all())


def tables(max_pos=4096, dtype=torch.bfloat16):
    return tt.rope_tables(max_pos, "cpu", dtype)


def test_rope_table_position0_is_identity():
    cos, sin, freqs = tables()
    assert torch.equal(cos[0].float(), torch.ones(32)) and torch.equal(sin[0].float(), torch.zeros(32))
    assert torch.equal(freqs[0, 0::2], torch.ones(32)) and torch.equal(freqs[0, 1::2], torch.zeros(32))


# ------------------------------------------------------------------------------------------------
# §7.1 indexer_qk_rope_quant_and_cache
# ------------------------------------------------------------------------------------------------
def _indexer_args(T, H, mode, P=16, NB=2, dtype=torch.bfloat16, max_pos=4096, wdtype=torch.float32):
    cos, sin, _ = tables(max_pos, dtype)
    a = dict(q=torch.zeros(T, H, 128, dtype=dtype), weights=torch.zeros(T, H, dtype=torch.float32),
             k=torch.zeros(T, 128, dtype=dtype), slot_mapping=torch.zeros(T, dtype=torch.int64),
             norm_weight=torch.ones(128), norm_bias=torch.zeros(128), positions=torch.zeros(T, dtype=torch.int64),
             cos_cache=cos, sin_cache=sin, epsilon=1e-6, weights_scale=0.5)
    if mode == "fp8":
        a.update(q_out=tt.poisoned((T, H, 128), torch.float8_e4m3fn, "cpu"),
                 weights_out=tt.poisoned((T, H), torch.float32, "cpu"),
                 kv_cache=tt.poisoned((NB, P * 132), torch.uint8, "cpu"), quant_block_size=128, scale_fmt="ue8m0")
    else:
        pad = (H // 16 + 3) // 4 * 4
        a.update(q_out=tt.poisoned((T, H, 64), torch.uint8, "cpu"), weights_out=tt.poisoned((T, H), wdtype, "cpu"),
                 kv_cache=tt.poisoned((NB, 1, 4, P, 16), torch.uint8, "cpu"), quant_block_size=32, scale_fmt="ue8m0",
                 q_scale_out=tt.poisoned((T, 1, 4, 16, pad), torch.uint8, "cpu"),
                 kv_cache_scale=tt.poisoned((NB, 1, 4, P), torch.uint8, "cpu"))
    return a


def _k_alternating(sign=1.0):
    """k = (3, -1, 3, -1, ...): S(x) = 128 exactly, mean 1, d = +-2, var 4, inv = 1/sqrt(4 + 1e-6) = 0.49999994.
    With norm weight 2 and bias 0.5: y = 2*0.99999988 + 0.5 = 2.4999998 -> bf16 2.5, and -1.4999998 -> bf16 -1.5."""
    k = torch.tensor([3.0, -1.0] * 64) * sign
    return k.to(torch.bfloat16)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_indexer_fp8_hand(scale_fmt):
    T, H, P = 3, 16, 16
    a = _indexer_args(T, H, "fp8", P=P)
    qa = torch.ones(128)
    qa[7] = 448.0                          # pattern A: amax 448
    qb = torch.full((128,), 0.5)
    qb[5] = -2.0                           # pattern B: amax 2
    q = torch.stack([qa] + [qb] * (H - 1))
    a["q"] = torch.stack([q, q, -q]).to(torch.bfloat16)
    a["k"] = torch.stack([_k_alternating(), _k_alternating(), _k_alternating(-1.0)])
    a["norm_weight"] = torch.full((128,), 2.0)
    a["norm_bias"] = torch.full((128,), 0.5)
    a["weights"] = torch.arange(1, H + 1, dtype=torch.float32).repeat(T, 1)
    a["slot_mapping"] = torch.tensor([5, -1, 2 * P - 1])
    a["scale_fmt"] = scale_fmt
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    dsaquant.check_errors()

    qo = a["q_out"].view(torch.uint8).numpy()
    # pattern A: s = max(448, 1e-10) * fl(1/448) = 7 * fl(1/7) rounded = 1.0 exactly (ue8m0 keeps 1.0).
    # 1.0 -> e4m3fn 0x38 (exponent 0 + bias 7, mantissa 0); 448 -> 0x7E (the max finite).
    exp_a = np.full(128, 0x38, np.uint8)
    exp_a[7] = 0x7E
    if scale_fmt == "ue8m0":
        # pattern B: s = 2 * fl(1/448) = 0.0044642859 (0x3B924925) -> next power of two 2^-7; 1/s = 128.
        # 0.5 * 128 = 64 = 2^6 -> (6+7) << 3 = 0x68; -2 * 128 = -256 = -2^8 -> 0x80 | (15 << 3) = 0xF8.
        sb = 2.0 ** -7
        exp_b = np.full(128, 0x68, np.uint8)
        exp_b[5] = 0xF8
    else:
        # pattern B: s = 0x3B924925, fl(1/s) = 223.99998; 0.5 * that = 111.99999 -> 112 (quantum 8 in [64, 128)):
        # 112 / 64 = 1.75 -> mantissa 6, exponent 13 -> 0x6E; -447.99997 -> -448 -> 0xFE.
        sb = float(np.array([0x3B924925], np.uint32).view(np.float32)[0])
        exp_b = np.full(128, 0x6E, np.uint8)
        exp_b[5] = 0xFE
    assert (qo[0, 0] == exp_a).all()
    for h in range(1, H):
        assert (qo[0, h] == exp_b).all(), h
    # row 2 holds -q: same codes with the sign bit set
    assert (qo[2, 0] == (exp_a | 0x80)).all()
    assert (qo[2, 1] == (exp_b ^ 0x80)).all()
    # weights_out = fl(fl(w * s) * 0.5): head 0 (s = 1) -> (h+1) * 0.5; others (h+1) * s * 0.5
    wo = a["weights_out"].numpy()
    assert wo[0, 0] == 0.5
    for h in range(1, H):
        assert f32_bits(wo[0, h]) == f32_bits((F(h + 1) * F(sb)) * F(0.5)), h
    assert (wo[2] == wo[0]).all()
    # row 1 (slot -1): nothing written
    assert all_poison(a["q_out"][1]) and all_poison(a["weights_out"][1])

    # k: bf16 values (2.5, -1.5, ...). ue8m0: s = 2.5/448 = 0.00558 -> 2^-7, 1/s = 128:
    # 2.5*128 = 320 = 1.25 * 2^8 -> (15 << 3) | 2 = 0x7A; -1.5*128 = -192 = -1.5 * 2^7 -> 0x80 | (14 << 3) | 4 = 0xF4.
    # fp32: s = fl(2.5/448) = 0.0055803573, fl(1/s) = 179.2: 2.5 * 179.2 = 448 -> 0x7E;
    #   -1.5 * 179.2 = -268.8 -> -256 (quantum 32) -> 0xF8.
    if scale_fmt == "ue8m0":
        kp, kn, ks = 0x7A, 0xF4, 2.0 ** -7
    else:
        kp, kn, ks = 0x7E, 0xF8, float(F(2.5) / F(448))
    codes, sc = fp8_132_row(a["kv_cache"], 5, P)
    assert (codes[0::2] == kp).all() and (codes[1::2] == kn).all()
    assert f32_bits(sc) == f32_bits(ks)
    codes, sc = fp8_132_row(a["kv_cache"], 2 * P - 1, P)       # k negated: (-1.5, 2.5, ...)
    assert (codes[0::2] == kn).all() and (codes[1::2] == kp).all()
    assert f32_bits(sc) == f32_bits(ks)
    before = np.full(a["kv_cache"].numel(), POISON, np.uint8)
    written = np.concatenate([fp8_132_row_offsets(5, P), fp8_132_row_offsets(2 * P - 1, P)])
    assert untouched_except(before, u8(a["kv_cache"]), written)


def _fp4_q_row():
    """A 128 row whose four blocks of 32 exercise SPEC §2/§3 (expected codes per block in the test)."""
    x = torch.ones(128)
    x[0], x[1] = 6.0, -0.5            # block 0: amax 6 -> f = 6 * fl(1/6) = 1.0 -> e = 127 (scale 1)
    x[32] = 3.0                       # block 1: amax 3 -> f = 0.5 -> e = 126 (scale 1/2)
    x[64], x[65] = 7.0, 1.5           # block 2: amax 7 -> f = 1.1666667 -> e = 128 (scale 2)
    x[96:] = 0.0
    x[97] = -0.0                      # block 3: all zero -> e = 1; -0 gives 0x8 only under `hardware`
    return x


def _fp4_q_expected(rounding):
    payload = np.zeros(64, np.uint8)
    payload[0] = 0x7 | (0x9 << 4)     # 6/1 -> 0x7, -0.5/1 -> 0x9
    payload[1:16] = 0x22              # 1/1 -> 0x2
    payload[16] = 0x7 | (0x4 << 4)    # 3/0.5 = 6 -> 0x7, 1/0.5 = 2 -> 0x4
    payload[17:32] = 0x44
    # 7/2 = 3.5 (a midpoint): threshold -> 3 (0x5), rne/hardware -> 4 (0x6); 1.5/2 = 0.75: threshold 0x1, else 0x2
    payload[32] = 0x15 if rounding == "threshold" else 0x26
    payload[33:48] = 0x11             # 1/2 = 0.5 -> 0x1
    payload[48] = 0x80 if rounding == "hardware" else 0x00
    return payload, np.array([127, 126, 128, 1], np.uint8)


@pytest.mark.parametrize("rounding", ["threshold", "rne", "hardware"])
def test_indexer_fp4_hand(rounding):
    T, H, P = 3, 32, 16
    a = _indexer_args(T, H, "fp4", P=P, wdtype=torch.bfloat16)
    row = _fp4_q_row()
    a["q"] = row.expand(T, H, 128).to(torch.bfloat16).contiguous()
    a["k"] = torch.stack([_k_alternating()] * T)
    a["norm_weight"] = torch.full((128,), 2.0)
    a["norm_bias"] = torch.full((128,), 0.5)
    a["weights"] = torch.randn(T, H).to(torch.bfloat16).float()      # bf16-representable: copied exactly
    a["slot_mapping"] = torch.tensor([5, -1, 2 * P - 1])
    a["rounding"] = rounding
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    dsaquant.check_errors()

    payload, exps = _fp4_q_expected(rounding)
    qo = a["q_out"].numpy()
    for t in (0, 2):
        assert (qo[t] == payload).all(), t
        assert (aiter_q_exps(a["q_scale_out"], t, H) == exps).all()
        # H = 32: qs_pad = round_up(2, 4) = 4, so h/16 in {2, 3} are pad entries, written 0
        assert (a["q_scale_out"][t, 0, :, :, 2:] == 0).all()
        assert torch.equal(a["weights_out"][t].float(), a["weights"][t])
    assert all_poison(a["q_out"][1]) and all_poison(a["q_scale_out"][1]) and all_poison(a["weights_out"][1])
    # k: (2.5, -1.5, ...) per block: f = 2.5 * fl(1/6) = 0.41666669 -> e = 126 (scale 1/2);
    # 2.5/0.5 = 5 (midpoint 5 -> 4 under every policy) -> 0x6; -1.5/0.5 = -3 -> 0xD; byte = 0x6 | 0xD << 4 = 0xD6.
    for slot in (5, 2 * P - 1):
        p, e = aiter_row(a["kv_cache"], a["kv_cache_scale"], slot, P)
        assert (p == 0xD6).all() and (e == 126).all(), slot
    assert aiter_untouched_except(a["kv_cache"], a["kv_cache_scale"], (5, 2 * P - 1), P)


def _np_positions(pos, max_pos):
    return np.clip(pos.numpy().astype(np.int64), 0, max_pos - 1)


def _oracle_indexer(a, mode):
    """Step-by-step numpy.float32 version of SPEC §7.1 for every row (slots ignored)."""
    p = _np_positions(a["positions"], a["cos_cache"].shape[0])
    c, s = np32(a["cos_cache"])[p], np32(a["sin_cache"])[p]
    neox = a["is_neox"]
    qr = bf16(np_rope(np32(a["q"]), c[:, None], s[:, None], neox, False))
    kn = bf16(np_layer_norm(np32(a["k"]), np32(a["norm_weight"]), np32(a["norm_bias"]), a["epsilon"]))
    kr = bf16(np_rope(kn, c, s, neox, False))
    if mode == "fp4":
        qp, qe = fp4_recip(qr, a["rounding"])
        kp, ke = fp4_recip(kr, a["rounding"])
        return dict(q=qp, qe=qe, k=kp, ke=ke, w=np32(a["weights"]))
    sq = np.maximum(np.abs(qr).max(-1), F(1e-10)) * (F(1) / F(448))
    sk = np.maximum(np.abs(kr).max(-1), F(1e-4)) / F(448)
    if a["scale_fmt"] == "ue8m0":
        sq, sk = pow2(ceil_exp(sq)), pow2(ceil_exp(sk))
    qc = e4m3_codes(qr * (F(1) / sq)[..., None])
    kc = e4m3_codes(kr * (F(1) / sk)[..., None])
    w = (np32(a["weights"]) * sq) * F(a["weights_scale"])
    return dict(q=qc, k=kc, ks=sk, w=w)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_indexer_fp8_rotation_vs_numpy(is_neox, scale_fmt):
    T, H, P = 4, 16, 16
    a = tt.make_indexer(T=T, H=H, mode="fp8", page_size=P, seed=3, is_neox=is_neox, scale_fmt=scale_fmt)
    a["positions"] = torch.tensor([3, 1000, 4095, 77])
    a["slot_mapping"] = torch.tensor([0, 21, 30, a["kv_cache"].shape[0] * P - 1])   # the last is capacity - 1
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    dsaquant.check_errors()
    o = _oracle_indexer(a, "fp8")
    assert (a["q_out"].view(torch.uint8).numpy() == o["q"]).all()
    assert (a["weights_out"].numpy().view(np.uint32) == o["w"].view(np.uint32)).all()
    for t, slot in enumerate(a["slot_mapping"].tolist()):
        codes, sc = fp8_132_row(a["kv_cache"], slot, P)
        assert (codes == o["k"][t]).all(), t
        assert f32_bits(sc) == f32_bits(o["ks"][t]), t
    # the rotation is real: the roped q differs from the unroped one for position 1000
    assert not np.array_equal(np_rope(np32(a["q"][1]), np32(a["cos_cache"][1000]), np32(a["sin_cache"][1000]),
                                      is_neox, False), np32(a["q"][1]))


@pytest.mark.parametrize("rounding", ["threshold", "rne", "hardware"])
@pytest.mark.parametrize("is_neox", [True, False])
def test_indexer_fp4_rotation_vs_numpy(rounding, is_neox):
    T, H, P = 4, 16, 16
    a = tt.make_indexer(T=T, H=H, mode="fp4", page_size=P, seed=5, is_neox=is_neox, rounding=rounding)
    a["positions"] = torch.tensor([3, 1000, 4095, 77])
    cap = a["kv_cache"].shape[0] * P
    a["slot_mapping"] = torch.tensor([0, 17, 4, cap - 1])
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    dsaquant.check_errors()
    o = _oracle_indexer(a, "fp4")
    assert (a["q_out"].numpy() == o["q"]).all()
    for t, slot in enumerate(a["slot_mapping"].tolist()):
        assert (aiter_q_exps(a["q_scale_out"], t, H) == o["qe"][t]).all(), t
        assert (a["q_scale_out"][t, 0, :, :, 1:] == 0).all()         # H = 16: qs_pad 4, entries 1..3 are pad
        p, e = aiter_row(a["kv_cache"], a["kv_cache_scale"], slot, P)
        assert (p == o["k"][t]).all() and (e == o["ke"][t]).all(), t
    assert torch.equal(a["weights_out"].float(), a["weights"].to(a["weights_out"].dtype).float())


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
@pytest.mark.parametrize("compute_all", [False, True])
def test_indexer_skipped_rows(mode, compute_all):
    T, H, P = 6, 16, 16
    a = tt.make_indexer(T=T, H=H, mode=mode, page_size=P, seed=11, compute_all_q_rope=compute_all)
    cap = a["kv_cache"].shape[0] * P
    a["slot_mapping"] = torch.tensor([3, -1, 7, -5, cap - 1, -1])
    a["positions"][5] = 10 ** 6                                      # clamped to max_pos - 1 (q only)
    full = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    full["slot_mapping"] = torch.tensor([3, 10, 7, 12, cap - 1, 13])  # every row written
    full["compute_all_q_rope"] = False
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    dsaquant.indexer_qk_rope_quant_and_cache(**full)
    with pytest.raises(dsaquant.DsaquantError, match="position"):   # clamped and reported (SPEC §7.5)
        dsaquant.check_errors()
    dsaquant.check_errors()                                          # no slot error, flags cleared
    neg = [1, 3, 5]
    outs = ["q_out", "weights_out"] + (["q_scale_out"] if mode == "fp4" else [])
    for name in outs:
        for t in range(T):
            if t in neg and not compute_all:
                assert all_poison(a[name][t]), (name, t)
            else:
                assert torch.equal(a[name][t].view(torch.uint8), full[name][t].view(torch.uint8)), (name, t)
    # k only for slot >= 0, whatever compute_all_q_rope says
    if mode == "fp8":
        flat, fflat = u8(a["kv_cache"]), u8(full["kv_cache"])
        written = np.concatenate([fp8_132_row_offsets(s, P) for s in (3, 7, cap - 1)])
        assert (flat[written] == fflat[written]).all()
        assert untouched_except(np.full(flat.size, POISON, np.uint8), flat, written)
    else:
        for s in (3, 7, cap - 1):
            p, e = aiter_row(a["kv_cache"], a["kv_cache_scale"], s, P)
            fp, fe = aiter_row(full["kv_cache"], full["kv_cache_scale"], s, P)
            assert (p == fp).all() and (e == fe).all()
        assert aiter_untouched_except(a["kv_cache"], a["kv_cache_scale"], (3, 7, cap - 1), P)
    if compute_all:
        # the clamped position 10**6 rotates exactly like max_pos - 1
        b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in full.items()}
        b["positions"][5] = a["cos_cache"].shape[0] - 1
        dsaquant.indexer_qk_rope_quant_and_cache(**b)
        assert torch.equal(b["q_out"][5].view(torch.uint8), a["q_out"][5].view(torch.uint8))


def test_indexer_preshuffle_offsets():
    T, H, P = 8, 16, 32
    a = tt.make_indexer(T=T, H=H, mode="fp8", page_size=P, seed=2)
    cap = a["kv_cache"].shape[0] * P
    a["slot_mapping"] = torch.tensor([0, 15, 16, 17, 31, 33, 50, cap - 1])
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    b["preshuffle"] = True
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    dsaquant.indexer_qk_rope_quant_and_cache(**b)
    dsaquant.check_errors()
    assert torch.equal(a["q_out"].view(torch.uint8), b["q_out"].view(torch.uint8))
    written = []
    for s in a["slot_mapping"].tolist():
        c0, s0 = fp8_132_row(a["kv_cache"], s, P, preshuffle=False)
        c1, s1 = fp8_132_row(b["kv_cache"], s, P, preshuffle=True)
        assert (c0 == c1).all() and f32_bits(s0) == f32_bits(s1), s
        written.append(fp8_132_row_offsets(s, P, True))
    flat = u8(b["kv_cache"])
    assert untouched_except(np.full(flat.size, POISON, np.uint8), flat, np.concatenate(written))
    # and the two layouts really differ as byte arrays (position 15 of a page moves)
    assert not torch.equal(a["kv_cache"], b["kv_cache"])


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_indexer_slot_capacity(mode):
    T, H, P = 3, 16, 16
    a = tt.make_indexer(T=T, H=H, mode=mode, page_size=P, seed=4)
    cap = a["kv_cache"].shape[0] * P
    a["slot_mapping"] = torch.tensor([cap - 1, cap, cap + 100])
    caches = ["kv_cache"] + (["kv_cache_scale"] if mode == "fp4" else [])
    snap = {k: a[k].clone() for k in caches}

    # opt-in host check: ValueError before anything is written
    dsaquant.set_host_checks(True)
    try:
        with pytest.raises(ValueError, match="slot_mapping"):
            dsaquant.indexer_qk_rope_quant_and_cache(**a)
    finally:
        dsaquant.set_host_checks(False)
    for k in caches + ["q_out", "weights_out"]:
        assert all_poison(a[k]), k

    # device-side flag: slot cap - 1 written, slots >= cap skipped and reported once
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    with pytest.raises(dsaquant.DsaquantError, match="capacity"):
        dsaquant.check_errors()
    dsaquant.check_errors()                                           # flags were cleared
    if mode == "fp8":
        flat = u8(a["kv_cache"])
        w = fp8_132_row_offsets(cap - 1, P)
        assert untouched_except(u8(snap["kv_cache"]), flat, w)
        assert not (flat[w] == POISON).all()
    else:
        p, e = aiter_row(a["kv_cache"], a["kv_cache_scale"], cap - 1, P)
        assert aiter_untouched_except(a["kv_cache"], a["kv_cache_scale"], (cap - 1,), P)
        assert not (e == POISON).all()


def test_out_of_range_positions_are_clamped():
    a = tt.make_indexer(T=3, H=16, mode="fp8", page_size=16, seed=8)
    a["slot_mapping"] = torch.tensor([1, 2, 3])
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    max_pos = a["cos_cache"].shape[0]
    a["positions"] = torch.tensor([-7, max_pos, 5])
    b["positions"] = torch.tensor([0, max_pos - 1, 5])
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    _drain_flags()
    dsaquant.indexer_qk_rope_quant_and_cache(**b)
    assert torch.equal(a["q_out"].view(torch.uint8), b["q_out"].view(torch.uint8))
    assert torch.equal(a["kv_cache"], b["kv_cache"])


def test_out_of_range_positions_are_reported():
    """SPEC §7.5: positions outside [0, max_pos) are clamped and reported like bad slots."""
    a = tt.make_indexer(T=3, H=16, mode="fp8", page_size=16, seed=8)
    a["slot_mapping"] = torch.tensor([1, 2, 3])
    a["positions"] = torch.tensor([0, a["cos_cache"].shape[0], 5])
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    with pytest.raises(dsaquant.DsaquantError, match="position"):
        dsaquant.check_errors()
    dsaquant.check_errors()   # cleared


# ------------------------------------------------------------------------------------------------
# §7.2 index_k_norm_rope_pack_store
# ------------------------------------------------------------------------------------------------
def _k_store_args(T, P=16, NB=3, max_pos=4096):
    _, _, freqs = tables(max_pos)
    return dict(k=torch.ones(T, 128, dtype=torch.bfloat16), norm_weight=torch.ones(128), eps=1e-6,
                positions=torch.zeros(T, dtype=torch.int64), freqs=freqs, slots=torch.zeros(T, dtype=torch.int64),
                cache=tt.poisoned((NB, P * 68), torch.uint8, "cpu"))


def _two_stage_weight():
    """With k = all ones, RMSNorm gives inv = 1/sqrt(1 + 1e-6) = 0.9999995 and y = w * 0.9999995, which
    rounds back to w in bf16 for the values below, so the stored row is exactly this weight."""
    w = torch.ones(128)
    w[0], w[1] = 6.5, 1.5        # block 0 (no RoPE)
    w[64], w[65] = 6.5, 1.5      # block 2 (tail RoPE region, identity at position 0)
    return w


@pytest.mark.parametrize("rounding", ["threshold", "rne", "hardware"])
def test_k_store_two_stage_hand(rounding):
    P = 16
    a = _k_store_args(2, P=P)
    a["norm_weight"] = _two_stage_weight()
    a["slots"] = torch.tensor([5, 3 * P - 1])
    dsaquant.index_k_norm_rope_pack_store(**a, rounding=rounding)
    dsaquant.check_errors()
    # Stage 1 (recip): amax 6.5 -> f = 6.5 * fl(1/6) = 1.0833334 -> e = 128, scale 2:
    #   6.5/2 = 3.25 -> 3 -> 6;  1.5/2 = 0.75 -> (half to even) 1 -> 2;  1/2 = 0.5 -> 1.   Stage-1 values 6, 2, 1.
    # Stage 2 (pack): amax 6 -> 6/6 = 1 -> e = 127, scale 1: 6 -> 0x7, 2 -> 0x4, 1 -> 0x2 (no ties: every policy).
    # Blocks of ones: stage 1 f = fl(1/6) -> e = 125 (1/4): 4 -> 1; stage 2: 1/6 -> e = 125: 4 -> 0x6.
    exp_payload = np.full(64, 0x66, np.uint8)
    exp_payload[0:16] = 0x22
    exp_payload[0] = 0x7 | (0x4 << 4)
    exp_payload[32:48] = 0x22
    exp_payload[32] = 0x7 | (0x4 << 4)
    exp_exps = np.array([127, 125, 127, 125], np.uint8)
    for s in (5, 3 * P - 1):
        p, e = packed68_row(a["cache"], s, P)
        assert (p == exp_payload).all() and (e == exp_exps).all(), s
    # A one-stage quantization (rule pack straight on 6.5, 1.5, 1): e = ceil_exp(6.5/6 = 1.083) = 128, scale 2:
    # 6.5/2 = 3.25 -> 0x5, 1.5/2 = 0.75 -> 0x1 or 0x2, 1/2 -> 0x1: byte 0 would be 0x15/0x25, exponent 128.
    one_stage_byte0 = 0x5 | ((0x1 if rounding == "threshold" else 0x2) << 4)
    assert p[0] != one_stage_byte0 and e[0] != 128
    written = np.concatenate([packed68_row_offsets(s, P) for s in (5, 3 * P - 1)])
    flat = u8(a["cache"])
    assert untouched_except(np.full(flat.size, POISON, np.uint8), flat, written)


def _oracle_k_store(a, rounding, ratio=1):
    p = a["positions"].numpy().astype(np.int64)
    p = np.clip(p & ~(ratio - 1), 0, a["freqs"].shape[0] - 1)
    fr = a["freqs"].numpy()[p]
    kn = bf16(np_rms_norm(np32(a["k"]), np32(a["norm_weight"]), a["eps"]))
    kr = bf16(np_rope(kn, fr[:, 0::2], fr[:, 1::2], neox=False, tail=True))
    return sglang_stage2(sglang_stage1(kr), rounding)


@pytest.mark.parametrize("rounding", ["threshold", "rne", "hardware"])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-30])
def test_k_store_vs_numpy(rounding, scale):
    P = 16
    a = tt.make_k_store(T=12, page_size=P, seed=1, scale=scale, rounding=rounding)
    dsaquant.index_k_norm_rope_pack_store(**a)
    dsaquant.check_errors()
    pay, ex = _oracle_k_store(a, rounding)
    written = []
    for t, s in enumerate(a["slots"].tolist()):
        if s <= 0:
            continue
        p, e = packed68_row(a["cache"], s, P)
        assert (p == pay[t]).all() and (e == ex[t]).all(), t
        written.append(packed68_row_offsets(s, P))
    flat = u8(a["cache"])
    assert untouched_except(np.full(flat.size, POISON, np.uint8), flat, np.concatenate(written))


def test_k_store_reserved_and_negative_slots():
    P = 16
    a = tt.make_k_store(T=6, page_size=P, seed=2)
    a["slots"] = torch.tensor([0, -1, 7, -3, 0, 20])
    dsaquant.index_k_norm_rope_pack_store(**a)
    dsaquant.check_errors()
    flat = u8(a["cache"])
    assert (flat[packed68_row_offsets(0, P)] == POISON).all()              # slot 0 publishes nothing
    written = np.concatenate([packed68_row_offsets(s, P) for s in (7, 20)])
    assert untouched_except(np.full(flat.size, POISON, np.uint8), flat, written)
    assert not (flat[written] == POISON).all()


@pytest.mark.parametrize("ratio,pos_a,pos_b,same", [
    (1, 4, 5, False), (2, 4, 5, True), (2, 5, 6, False), (4, 4, 7, True), (4, 3, 4, False), (4, 1001, 1003, True),
])
def test_k_store_compress_ratio(ratio, pos_a, pos_b, same):
    P = 16
    a = tt.make_k_store(T=2, page_size=P, seed=3, compress_ratio=ratio)
    a["k"] = a["k"][:1].expand(2, 128).contiguous()                      # identical k rows
    a["positions"] = torch.tensor([pos_a, pos_b])
    a["slots"] = torch.tensor([3, 9])
    dsaquant.index_k_norm_rope_pack_store(**a)
    ra, rb = packed68_row(a["cache"], 3, P), packed68_row(a["cache"], 9, P)
    equal = (ra[0] == rb[0]).all() and (ra[1] == rb[1]).all()
    assert equal == same
    # the position used is pos & ~(r-1): the same bytes as ratio 1 at that position
    b = tt.make_k_store(T=1, page_size=P, seed=3, compress_ratio=1)
    b["k"], b["norm_weight"] = a["k"][:1].clone(), a["norm_weight"].clone()
    b["positions"] = torch.tensor([pos_b & ~(ratio - 1)])
    b["slots"] = torch.tensor([9])
    dsaquant.index_k_norm_rope_pack_store(**b)
    rc = packed68_row(b["cache"], 9, P)
    assert (rc[0] == rb[0]).all() and (rc[1] == rb[1]).all()


def test_k_store_index_dtypes_identical():
    a = tt.make_k_store(T=16, page_size=16, seed=4)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    b["positions"] = b["positions"].to(torch.int32)
    b["slots"] = b["slots"].to(torch.int32)
    dsaquant.index_k_norm_rope_pack_store(**a)
    dsaquant.index_k_norm_rope_pack_store(**b)
    assert torch.equal(a["cache"], b["cache"])
    assert not all_poison(a["cache"])


def test_k_store_slot_capacity():
    P = 16
    a = tt.make_k_store(T=2, page_size=P, seed=5)
    cap = a["cache"].shape[0] * P
    a["slots"] = torch.tensor([cap - 1, cap])
    dsaquant.set_host_checks(True)
    try:
        with pytest.raises(ValueError, match="slots"):
            dsaquant.index_k_norm_rope_pack_store(**a)
    finally:
        dsaquant.set_host_checks(False)
    assert all_poison(a["cache"])
    dsaquant.index_k_norm_rope_pack_store(**a)
    with pytest.raises(dsaquant.DsaquantError):
        dsaquant.check_errors()
    dsaquant.check_errors()
    flat = u8(a["cache"])
    assert untouched_except(np.full(flat.size, POISON, np.uint8), flat, packed68_row_offsets(cap - 1, P))


# ------------------------------------------------------------------------------------------------
# §7.2 index_q_rope_pack_weights
# ------------------------------------------------------------------------------------------------
def test_q_pack_hand():
    T, H = 2, 4
    _, _, freqs = tables()
    row = torch.ones(128)
    row[0], row[1] = 6.5, 1.5            # block 0: two stages -> e = 127 (as in test_k_store_two_stage_hand)
    # block 1: ones -> e = 125
    row[64:96] = 2.0      # block 2: stage 1 f = 2*fl(1/6) = 0.33 -> e 126, 2/0.5 = 4 -> 2; stage 2: 2/6 -> 126
    row[96:128] = 4.0                    # block 3: e = 127 in both stages; 4 -> 0x6
    q = row.expand(T, H, 128).to(torch.bfloat16).contiguous()
    w = torch.tensor([[1.0, -3.0, 0.5, 0.0]] * T, dtype=torch.bfloat16)
    payload, exps, wout = dsaquant.index_q_rope_pack_weights(q, torch.zeros(T, dtype=torch.int64), freqs, w, 0.1)
    assert exps.dtype == torch.int32 and exps.shape == (T, H)
    # block j's exponent in byte j (little endian): 127 | 125 << 8 | 126 << 16 | 127 << 24
    assert (exps == (127 | (125 << 8) | (126 << 16) | (127 << 24))).all()
    assert (exps.view(torch.uint8).reshape(T, H, 4) == torch.tensor([127, 125, 126, 127], dtype=torch.uint8)).all()
    p = payload.numpy()
    assert (p[..., 0] == 0x47).all() and (p[..., 1:16] == 0x22).all() and (p[..., 16:32] == 0x66).all()
    assert (p[..., 32:48] == 0x66).all() and (p[..., 48:64] == 0x66).all()
    # weights: float(bf16(fl(w * fl(0.1)))): 1 * 0.1 -> bf16 0.10009765625; -3 * 0.1 = -0.3 -> bf16 -0.30078125
    assert wout.dtype == torch.float32
    assert wout[0].tolist() == [0.10009765625, -0.30078125, 0.050048828125, 0.0]


@pytest.mark.parametrize("rounding", ["threshold", "rne", "hardware"])
def test_q_pack_vs_numpy(rounding):
    a = tt.make_q_pack(T=5, H=16, seed=6, rounding=rounding)
    out = (tt.poisoned((5, 16, 64), torch.uint8, "cpu"), tt.poisoned((5, 16), torch.int32, "cpu"),
           tt.poisoned((5, 16), torch.float32, "cpu"))
    res = dsaquant.index_q_rope_pack_weights(**a, out=out)
    assert all(r is o for r, o in zip(res, out))
    p = np.clip(a["positions"].numpy(), 0, a["freqs"].shape[0] - 1)
    fr = a["freqs"].numpy()[p][:, None]
    qr = bf16(np_rope(np32(a["q"]), fr[..., 0::2], fr[..., 1::2], neox=False, tail=True))
    pay, ex = sglang_stage2(sglang_stage1(qr), rounding)
    assert (out[0].numpy() == pay).all()
    assert (out[1].numpy().view(np.uint8).reshape(5, 16, 4) == ex).all()
    w = bf16(np32(a["head_weights"]) * F(a["weight_scale"]))
    assert (out[2].numpy().view(np.uint32) == w.view(np.uint32)).all()


# ------------------------------------------------------------------------------------------------
# §7.2 rope_fake_quant_fp4
# ------------------------------------------------------------------------------------------------
def _fake_quant_row():
    x = torch.ones(128)
    x[0], x[1] = 6.5, 1.5
    return x


def test_rope_fake_quant_ue8m0_hand():
    _, _, freqs = tables()
    x = _fake_quant_row().expand(2, 128).to(torch.bfloat16).contiguous()
    y = dsaquant.rope_fake_quant_fp4(x, torch.zeros(2, dtype=torch.int64), freqs)
    # block 0: e = 128 (scale 2): 6.5 -> 6, 1.5 -> 2, 1 -> 1; other blocks (ones): scale 1/4, 4 -> 1.
    exp = torch.ones(128)
    exp[0], exp[1] = 6.0, 2.0
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y[0].float(), exp) and torch.equal(y[1].float(), exp)


def test_rope_fake_quant_e4m3_hand():
    _, _, freqs = tables()
    x = _fake_quant_row().expand(2, 128).to(torch.bfloat16).contiguous()
    y = dsaquant.rope_fake_quant_fp4(x, torch.zeros(2, dtype=torch.int64), freqs, block=16, scale="e4m3")
    # block 0 (16 elements): amax 6.5 * fl(1/6) = 1.0833334 -> e4m3 (quantum 1/8 in [1, 2)): 8.67 -> 9 -> s = 1.125;
    #   6.5/1.125 = 5.78 -> 6 -> 6.75; 1.5/1.125 = 1.33 -> 1.5 -> 1.6875; 1/1.125 = 0.889 -> 1 -> 1.125.
    # other blocks: fl(1/6) = 0.16666667 -> e4m3 (quantum 1/64 in [1/8, 1/4)): 10.67 -> 11 -> s = 0.171875;
    #   1/0.171875 = 5.82 -> 6 -> 1.03125 (exact in bf16).
    exp = torch.full((128,), 1.03125)
    exp[:16] = 1.125
    exp[0], exp[1] = 6.75, 1.6875
    assert torch.equal(y[0].float(), exp) and torch.equal(y[1].float(), exp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 128), (5, 3, 128)])
@pytest.mark.parametrize("variant", [(32, "ue8m0"), (16, "e4m3")])
def test_rope_fake_quant_shapes(dtype, shape, variant):
    g = torch.Generator().manual_seed(7)
    _, _, freqs = tables()
    x = torch.randn(*shape, generator=g).to(dtype)
    pos = torch.tensor([0, 9, 100, 4000, 33])
    y = dsaquant.rope_fake_quant_fp4(x, pos, freqs, block=variant[0], scale=variant[1])
    assert y.dtype == dtype and y.shape == x.shape
    out = tt.poisoned(shape, dtype, "cpu")
    r = dsaquant.rope_fake_quant_fp4(x, pos, freqs, block=variant[0], scale=variant[1], out=out)
    assert r is out and torch.equal(out.view(torch.uint8), y.view(torch.uint8))
    if variant == (32, "ue8m0"):
        # independent stage-1 oracle after a tail interleaved RoPE rounded to x's dtype
        fr = freqs.numpy()[pos.numpy()]
        c, s = fr[:, 0::2], fr[:, 1::2]
        if len(shape) == 3:
            c, s = c[:, None], s[:, None]
        xr = np_rope(np32(x), c, s, neox=False, tail=True)
        xr = torch.from_numpy(xr).to(dtype).float().numpy()
        st1 = sglang_stage1(xr, bf16 if dtype == torch.bfloat16 else fp16)    # rounded to x's dtype
        assert (y.float().numpy().view(np.uint32) == st1.view(np.uint32)).all()
    # a [T, H, 128] input is H independent rows
    if len(shape) == 3:
        y1 = dsaquant.rope_fake_quant_fp4(x[:, 1].contiguous(), pos, freqs, block=variant[0], scale=variant[1])
        assert torch.equal(y[:, 1].view(torch.uint8), y1.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# §7.3 rmsnorm_rope_rotate_fp4quant_kvcache
# ------------------------------------------------------------------------------------------------
def _v4_args(T, layout, P=16, NB=2, kv=None):
    cos, sin, _ = tables()
    if layout == "aiter_fp4":
        cache = tt.poisoned((NB, 1, 4, P, 16), torch.uint8, "cpu")
        scale = tt.poisoned((NB, 1, 4, P), torch.uint8, "cpu")
    else:
        cache = tt.poisoned((NB * P, 64), torch.uint8, "cpu")
        scale = tt.poisoned((NB * P, 4), torch.uint8, "cpu")
    return dict(kv=kv if kv is not None else torch.ones(T, 128, dtype=torch.bfloat16),
                norm_weight=torch.ones(128, dtype=torch.bfloat16), epsilon=1e-6,
                positions=torch.zeros(T, dtype=torch.int64), cos_cache=cos, sin_cache=sin,
                slot_mapping=torch.zeros(T, dtype=torch.int64), kv_cache=cache, kv_cache_scale=scale)


def _v4_row(a, layout, slot, P=16):
    if layout == "aiter_fp4":
        return aiter_row(a["kv_cache"], a["kv_cache_scale"], slot, P)
    return a["kv_cache"][slot].numpy(), a["kv_cache_scale"][slot].numpy()


@pytest.mark.parametrize("layout", ["aiter_fp4", "dense"])
@pytest.mark.parametrize("hadamard", [False, True])
def test_v4_k_hand(layout, hadamard):
    a = _v4_args(3, layout)
    a["slot_mapping"] = torch.tensor([4, -1, 31])
    dsaquant.rmsnorm_rope_rotate_fp4quant_kvcache(**a, hadamard=hadamard, layout=layout)
    dsaquant.check_errors()
    # kv = ones: RMSNorm (kept fp32) -> 0.9999995 everywhere; RoPE at position 0 is the identity.
    # no Hadamard: f = 0.9999995 * fl(1/6) = 0.1666666 -> e = 125 (1/4); 3.999998 -> 4 -> 0x6.
    # Hadamard: a constant row c -> (128c, 0, ..., 0) * fl(128^-0.5) = 11.3137...; block 0: f = 1.886 -> e = 128,
    #   11.31/2 = 5.66 -> 6 -> 0x7, zeros -> 0x0; blocks 1..3 all zero -> e = 1.
    if hadamard:
        exp_p = np.zeros(64, np.uint8)
        exp_p[0] = 0x07
        exp_e = np.array([128, 1, 1, 1], np.uint8)
    else:
        exp_p = np.full(64, 0x66, np.uint8)
        exp_e = np.full(4, 125, np.uint8)
    for s in (4, 31):
        p, e = _v4_row(a, layout, s)
        assert (p == exp_p).all() and (e == exp_e).all(), s
    if layout == "aiter_fp4":
        assert aiter_untouched_except(a["kv_cache"], a["kv_cache_scale"], (4, 31), 16)
    else:
        rest = [s for s in range(32) if s not in (4, 31)]
        assert all_poison(a["kv_cache"][rest]) and all_poison(a["kv_cache_scale"][rest])


@pytest.mark.parametrize("rounding", ["threshold", "rne", "hardware"])
@pytest.mark.parametrize("hadamard", [False, True])
def test_v4_k_layouts_heads_and_hadamard(rounding, hadamard):
    g = torch.Generator().manual_seed(9)
    T, P = 6, 16
    kv3 = torch.randn(T, 3, 128, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 77, 4095, 9000, 12])
    slots = torch.tensor([2, -1, 17, 31, 0, -4])
    res = {}
    for layout in ("aiter_fp4", "dense"):
        for name, kv in (("3d", kv3), ("2d", kv3[:, 0].contiguous())):
            a = _v4_args(T, layout, P=P, kv=kv)
            a["positions"], a["slot_mapping"] = pos, slots
            dsaquant.rmsnorm_rope_rotate_fp4quant_kvcache(**a, hadamard=hadamard, rounding=rounding, layout=layout)
            res[layout, name] = a
    with pytest.raises(dsaquant.DsaquantError, match="position"):   # 9000 >= max_pos: clamped, reported
        dsaquant.check_errors()
    for layout in ("aiter_fp4", "dense"):
        # only head 0 of a [T, Hk, 128] input is used
        assert torch.equal(res[layout, "3d"]["kv_cache"], res[layout, "2d"]["kv_cache"])
        assert torch.equal(res[layout, "3d"]["kv_cache_scale"], res[layout, "2d"]["kv_cache_scale"])
    written = [s for s in slots.tolist() if s >= 0]
    for s in written:                                              # the two layouts hold the same row
        pa, ea = _v4_row(res["aiter_fp4", "2d"], "aiter_fp4", s, P)
        pd, ed = _v4_row(res["dense", "2d"], "dense", s, P)
        assert (pa == pd).all() and (ea == ed).all(), s
    d = res["dense", "2d"]
    untouched = [s for s in range(d["kv_cache"].shape[0]) if s not in written]
    assert all_poison(d["kv_cache"][untouched]) and all_poison(d["kv_cache_scale"][untouched])
    # independent oracle: RMSNorm and RoPE kept in fp32, optional Hadamard, recip rule
    cos, sin = np32(d["cos_cache"])[np.clip(pos.numpy(), 0, 4095)], np32(d["sin_cache"])[np.clip(pos.numpy(), 0, 4095)]
    y = np_rope(np_rms_norm(np32(kv3[:, 0]), np32(d["norm_weight"]), 1e-6), cos, sin, neox=False, tail=True)
    if hadamard:
        h = 1
        while h < 128:
            yb = y.reshape(T, 128 // (2 * h), 2, h)
            y = np.stack([yb[:, :, 0] + yb[:, :, 1], yb[:, :, 0] - yb[:, :, 1]], axis=2).reshape(T, 128)
            h *= 2
        y = y * np.array([0x3DB504F3], np.uint32).view(np.float32)[0]
    pay, ex = fp4_recip(y.astype(np.float32), rounding)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert (d["kv_cache"][s].numpy() == pay[t]).all() and (d["kv_cache_scale"][s].numpy() == ex[t]).all()


def test_v4_k_hadamard_changes_bytes():
    g = torch.Generator().manual_seed(10)
    kv = torch.randn(4, 128, generator=g).to(torch.bfloat16)
    outs = []
    for had in (False, True):
        a = _v4_args(4, "dense", kv=kv)
        a["slot_mapping"] = torch.arange(4)
        dsaquant.rmsnorm_rope_rotate_fp4quant_kvcache(**a, hadamard=had, layout="dense")
        outs.append(a["kv_cache"][:4].clone())
    assert not torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------------------------------------
# §6 convert_fp4_cache
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [16, 64])
def test_convert_fp4_cache_round_trip(P):
    g = torch.Generator().manual_seed(12)
    NB = 3
    packed = torch.randint(0, 256, (NB, P * 68), generator=g, dtype=torch.uint8)
    kv, ks = dsaquant.convert_fp4_cache(packed, to="aiter_fp4", page_size=P)
    assert kv.shape == (NB, 1, 4, P, 16) and ks.shape == (NB, 1, 4, P)
    for slot in (0, 1, 15, P - 1, P + 7, NB * P - 1):
        pa, ea = aiter_row(kv, ks, slot, P)
        pp, ep = packed68_row(packed, slot, P)
        assert (pa == pp).all() and (ea == ep).all(), slot
    back = dsaquant.convert_fp4_cache(kv, ks, to="packed68")
    assert torch.equal(back, packed)
    # and the other direction, from a random aiter_fp4 cache
    kv2 = torch.randint(0, 256, (NB, 1, 4, P, 16), generator=g, dtype=torch.uint8)
    ks2 = torch.randint(0, 256, (NB, 1, 4, P), generator=g, dtype=torch.uint8)
    p2 = dsaquant.convert_fp4_cache(kv2, ks2, to="packed68")
    kv3, ks3 = dsaquant.convert_fp4_cache(p2, to="aiter_fp4", page_size=P)
    assert torch.equal(kv3, kv2) and torch.equal(ks3, ks2)
