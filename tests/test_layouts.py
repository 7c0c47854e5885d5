"""SPEC §6 cache layouts: literal offsets worked out by hand, then writer/reader round trips and the
packed68 <-> aiter_fp4 converters.

Hand arithmetic used below (P = 64):
  packed68: page = 64*68 = 4352 bytes; payload of o at 64*o; exponents at 4096 + 4*o.
  fp8_132:  block = 64*132 = 8448 bytes; data at 128*o + d (plain) or
            (o/16)*2048 + (d/16)*256 + (o%16)*16 + d%16 (preshuffled); scale at 8192 + 4*o.
  aiter_fp4: kv_cache [NB, 1, 4, 64, 16]: one page is 4*64*16 = 4096 bytes, the byte-group b/16 selects a
            1024-byte plane, o*16 + b%16 inside it. kv_cache_scale [NB, 1, 4, 64]: 256 bytes a page,
            group g selects a 64-byte plane, sflat(o) = (o%16)*4 + o/16 inside it.
"""
from __future__ import annotations

import pytest
import torch

from dsaquant.reference import layouts as L

U8 = torch.uint8


# ---- literal offsets -------------------------------------------------------------------------------
@pytest.mark.parametrize("slot,byte,block,payload_off,scale_off", [
    (0, 0, 0, 0, 4096),
    (1, 0, 0, 64, 4100),
    (1, 63, 3, 127, 4103),
    (63, 0, 0, 4032, 4348),
    (63, 63, 3, 4095, 4351),
    (64, 0, 0, 4352, 8448),
    (130, 0, 0, 8832, 12808),      # page 2 (base 8704), o = 2
    (130, 5, 3, 8837, 12811),
])
def test_packed68_offsets(slot, byte, block, payload_off, scale_off):
    assert L.packed68_payload_offset(slot, 64, byte) == payload_off
    assert L.packed68_scale_offset(slot, 64, block) == scale_off


def test_packed68_offsets_p16():
    # P = 16: page 1088 bytes, exponents at 1024 + 4*o. slot 37 -> page 2 (base 2176), o = 5.
    assert L.packed68_payload_offset(37, 16, 1) == 2176 + 320 + 1
    assert L.packed68_scale_offset(37, 16, 2) == 2176 + 1024 + 20 + 2


@pytest.mark.parametrize("slot,d,plain,shuffled", [
    (0, 0, 0, 0),
    (1, 5, 133, 21),
    (0, 16, 16, 256),
    (17, 35, 2211, 2579),          # o/16 = 1, d/16 = 2, o%16 = 1, d%16 = 3
    (63, 127, 8191, 8191),
    (64, 0, 8448, 8448),
    (100, 100, 13156, 14148),      # block 1 (base 8448), o = 36: 8448 + 4608 + 100
    (130, 17, 17169, 17185),       # block 2 (base 16896), o = 2
])
def test_fp8_132_data_offsets(slot, d, plain, shuffled):
    assert L.fp8_132_data_offset(slot, 64, d, False) == plain
    assert L.fp8_132_data_offset(slot, 64, d, True) == shuffled


@pytest.mark.parametrize("slot,off", [(0, 8192), (1, 8196), (63, 8444), (64, 16640), (130, 25096)])
def test_fp8_132_scale_offsets(slot, off):
    assert L.fp8_132_scale_offset(slot, 64) == off


@pytest.mark.parametrize("slot,b,off", [
    (0, 0, 0), (0, 16, 1024), (1, 0, 16), (1, 17, 1041), (0, 63, 3087), (63, 63, 4095), (64, 0, 4096),
    (130, 40, 10280),              # n = 2, o = 2: (2*4 + 2)*1024 + 32 + 8
])
def test_aiter_fp4_data_offsets(slot, b, off):
    assert L.aiter_fp4_data_offset(slot, 64, b) == off


@pytest.mark.parametrize("slot,g,off", [
    (0, 0, 0), (1, 0, 4), (16, 0, 1), (15, 0, 60), (17, 2, 133), (63, 3, 255), (64, 0, 256),
    (130, 1, 584),                 # n = 2, o = 2: (8 + 1)*64 + 8
    (100, 3, 466),                 # n = 1, o = 36: (4 + 3)*64 + 4*4 + 2
])
def test_aiter_fp4_scale_offsets(slot, g, off):
    assert L.aiter_fp4_scale_offset(slot, 64, g) == off


def test_aiter_sflat_is_a_permutation_p64():
    s = [L.aiter_sflat(o, 64) for o in range(64)]
    assert sorted(s) == list(range(64))
    assert s[:5] == [0, 4, 8, 12, 16] and s[16] == 1 and s[33] == 6


@pytest.mark.parametrize("H,pad", [(16, 4), (32, 4), (48, 4), (64, 4), (80, 8), (128, 8), (256, 16)])
def test_q_scale_pad(H, pad):
    assert L.aiter_q_scale_pad(H) == pad


@pytest.mark.parametrize("H,t,h,g,off", [
    (64, 0, 0, 0, 0), (64, 0, 1, 0, 4), (64, 0, 16, 0, 1), (64, 0, 63, 3, 255),
    (64, 2, 37, 1, 598),           # 2*256 + 1*64 + (37%16)*4 + 37/16
    (32, 0, 31, 0, 61), (32, 1, 31, 2, 445), (32, 3, 5, 3, 980),
    (128, 1, 127, 3, 1023),        # qs_pad 8: 512 a token; 512 + 3*128 + 15*8 + 7
])
def test_q_scale_offsets(H, t, h, g, off):
    assert L.aiter_q_scale_offset(t, h, g, H) == off


def test_offsets_accept_tensors():
    s = torch.tensor([0, 1, 63, 64, 130])
    assert L.packed68_payload_offset(s, 64).tolist() == [0, 64, 4032, 4352, 8832]
    assert L.packed68_scale_offset(s, 64).tolist() == [4096, 4100, 4348, 8448, 12808]
    assert L.fp8_132_data_offset(s, 64, 17, True).tolist() == [257, 273, 6641, 8705, 17185]
    assert L.fp8_132_data_offset(s, 64, 17, False).tolist() == [17, 145, 8081, 8465, 17169]
    assert L.fp8_132_scale_offset(s, 64).tolist() == [8192, 8196, 8444, 16640, 25096]
    assert L.aiter_fp4_data_offset(s, 64, 17).tolist() == [1025, 1041, 2033, 5121, 9249]
    assert L.aiter_fp4_scale_offset(s, 64, 1).tolist() == [64, 68, 127, 320, 584]


# ---- writers place bytes at the literal offsets ---------------------------------------------------
def _payload(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 64), generator=g, dtype=torch.int32).to(U8), \
        torch.randint(0, 256, (n, 4), generator=g, dtype=torch.int32).to(U8)


def test_write_packed68_lands_at_literal_offsets():
    cache = torch.full((3, 64 * 68), 0xEE, dtype=U8)
    payload = torch.arange(64, dtype=torch.int32).to(U8).unsqueeze(0)
    exps = torch.tensor([[200, 201, 202, 203]], dtype=U8)
    L.write_packed68(cache, torch.tensor([130]), payload, exps, 64)
    flat = cache.reshape(-1)
    assert flat[8832:8896].tolist() == list(range(64))
    assert flat[12808:12812].tolist() == [200, 201, 202, 203]
    assert int((flat != 0xEE).sum()) == 64 + 4           # nothing else was touched


def test_write_fp8_132_lands_at_literal_offsets():
    for pre in (False, True):
        cache = torch.zeros((3, 64 * 132), dtype=U8)
        codes = (torch.arange(128, dtype=torch.int32) + 1).to(U8).unsqueeze(0)
        scale = torch.tensor([1.5], dtype=torch.float32)         # bits 0x3FC00000, little endian 00 00 C0 3F
        L.write_fp8_132(cache, torch.tensor([130]), codes, scale, 64, pre)
        flat = cache.reshape(-1)
        if not pre:
            assert flat[16896 + 256:16896 + 384].tolist() == list(range(1, 129))
        else:
            # o = 2: d = 16*j + r at 16896 + 256*j + 32 + r
            for j in range(8):
                base = 16896 + 256 * j + 32
                assert flat[base:base + 16].tolist() == list(range(16 * j + 1, 16 * j + 17))
        assert flat[25096:25100].tolist() == [0x00, 0x00, 0xC0, 0x3F]
        assert int((flat != 0).sum()) == 128 + 2


def test_write_aiter_fp4_lands_at_literal_offsets():
    kv = torch.zeros((3, 1, 4, 64, 16), dtype=U8)
    ks = torch.zeros((3, 1, 4, 64), dtype=U8)
    payload = (torch.arange(64, dtype=torch.int32) + 1).to(U8).unsqueeze(0)
    exps = torch.tensor([[200, 201, 202, 203]], dtype=U8)
    L.write_aiter_fp4(kv, ks, torch.tensor([130]), payload, exps, 64)
    f = kv.reshape(-1)
    for plane in range(4):          # n = 2, o = 2: 8192 + plane*1024 + 32
        base = 8192 + plane * 1024 + 32
        assert f[base:base + 16].tolist() == list(range(16 * plane + 1, 16 * plane + 17))
    assert int((f != 0).sum()) == 64
    fs = ks.reshape(-1)
    assert [fs[512 + 8].item(), fs[576 + 8].item(), fs[640 + 8].item(), fs[704 + 8].item()] == [200, 201, 202, 203]
    assert int((fs != 0).sum()) == 4
    # the structured view agrees: kv[n, 0, b//16, o, b%16], ks[n, 0, g, sflat(o)]
    assert kv[2, 0, 2, 2, 5].item() == 38 and ks[2, 0, 3, 8].item() == 203


def test_write_aiter_q_scale_pads_and_offsets():
    H, T = 32, 3
    q = torch.full((T, 1, 4, 16, 4), 0xEE, dtype=U8)
    exps = torch.arange(2 * H * 4, dtype=torch.int32).reshape(2, H, 4).to(U8)
    L.write_aiter_q_scale(q, torch.tensor([0, 2]), exps, H)
    flat = q.reshape(-1)
    # token 2 (base 512), head 31, group 2: 512 + 128 + 60 + 1
    assert flat[701].item() == exps[1, 31, 2].item()
    # token 0, head 5, group 3: 192 + 20 + 0
    assert flat[212].item() == exps[0, 5, 3].item()
    # pads h/16 in {2, 3} are zero for written tokens; token 1 untouched
    assert q[0, 0, :, :, 2:].eq(0).all() and q[2, 0, :, :, 2:].eq(0).all()
    assert q[1].eq(0xEE).all()
    back = L.read_aiter_q_scale(q, H)
    assert torch.equal(back[0], exps[0]) and torch.equal(back[2], exps[1])


# ---- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [16, 64])
def test_packed68_round_trip(P):
    NB = 5
    g = torch.Generator().manual_seed(P)
    slots = torch.randperm(NB * P, generator=g)[:40]
    payload, exps = _payload(40, P)
    cache = torch.zeros((NB, P * 68), dtype=U8)
    L.write_packed68(cache, slots, payload, exps, P)
    p2, e2 = L.read_packed68(cache, slots, P)
    assert torch.equal(p2, payload) and torch.equal(e2, exps)
    assert int((cache != 0).sum()) <= 40 * 68
    # an unwritten slot reads back zeros
    unused = [s for s in range(NB * P) if s not in set(slots.tolist())][0]
    p3, e3 = L.read_packed68(cache, torch.tensor([unused]), P)
    assert p3.eq(0).all() and e3.eq(0).all()


@pytest.mark.parametrize("P", [16, 64])
@pytest.mark.parametrize("pre", [False, True])
def test_fp8_132_round_trip(P, pre):
    NB = 4
    g = torch.Generator().manual_seed(P + pre)
    slots = torch.randperm(NB * P, generator=g)[:50]
    codes = torch.randint(0, 256, (50, 128), generator=g, dtype=torch.int32).to(U8)
    scales = torch.randn(50, generator=g) * 1e-3
    cache = torch.zeros((NB, P * 132), dtype=U8)
    L.write_fp8_132(cache, slots, codes, scales, P, pre)
    c2, s2 = L.read_fp8_132(cache, slots, P, pre)
    assert torch.equal(c2, codes)
    assert torch.equal(s2.view(torch.int32), scales.view(torch.int32))
    # plain and preshuffled put the same bytes in different places (except where they coincide)
    c3, _ = L.read_fp8_132(cache, slots, P, not pre)
    assert not torch.equal(c3, codes)


@pytest.mark.parametrize("P", [16, 64])
def test_aiter_fp4_round_trip(P):
    NB = 4
    g = torch.Generator().manual_seed(10 + P)
    slots = torch.randperm(NB * P, generator=g)[:45]
    payload, exps = _payload(45, 10 + P)
    kv = torch.zeros((NB, 1, 4, P, 16), dtype=U8)
    ks = torch.zeros((NB, 1, 4, P), dtype=U8)
    L.write_aiter_fp4(kv, ks, slots, payload, exps, P)
    p2, e2 = L.read_aiter_fp4(kv, ks, slots, P)
    assert torch.equal(p2, payload) and torch.equal(e2, exps)


@pytest.mark.parametrize("H", [16, 32, 64, 128])
def test_aiter_q_scale_round_trip(H):
    T = 5
    g = torch.Generator().manual_seed(H)
    exps = torch.randint(1, 0xEE, (T, H, 4), generator=g, dtype=torch.int32).to(U8)   # never 0 or 0xEE
    q = torch.full((T, 1, 4, 16, L.aiter_q_scale_pad(H)), 0xEE, dtype=U8)
    L.write_aiter_q_scale(q, torch.arange(T), exps, H)
    assert torch.equal(L.read_aiter_q_scale(q, H), exps)
    # every byte that is not one of the H*4 entries of a token is a zero pad
    assert int((q != 0).sum()) == T * H * 4
    assert int(q.eq(0xEE).sum()) == 0


# ---- converters -------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [16, 64])
def test_converters_round_trip_random_bytes(P):
    NB = 3
    g = torch.Generator().manual_seed(99 + P)
    cache = torch.randint(0, 256, (NB, P * 68), generator=g, dtype=torch.int32).to(U8)
    kv, ks = L.packed68_to_aiter_fp4(cache, P)
    assert kv.shape == (NB, 1, 4, P, 16) and ks.shape == (NB, 1, 4, P)
    assert kv.dtype == U8 and ks.dtype == U8
    back = L.aiter_fp4_to_packed68(kv, ks)
    assert torch.equal(back, cache)
    # and the other direction
    kv0 = torch.randint(0, 256, (NB, 1, 4, P, 16), generator=g, dtype=torch.int32).to(U8)
    ks0 = torch.randint(0, 256, (NB, 1, 4, P), generator=g, dtype=torch.int32).to(U8)
    kv1, ks1 = L.packed68_to_aiter_fp4(L.aiter_fp4_to_packed68(kv0, ks0), P)
    assert torch.equal(kv1, kv0) and torch.equal(ks1, ks0)


def test_converters_keep_slots():
    P, NB = 64, 3
    slots = torch.tensor([0, 1, 17, 63, 64, 100, 130, 191])
    payload, exps = _payload(len(slots), 5)
    cache = torch.zeros((NB, P * 68), dtype=U8)
    L.write_packed68(cache, slots, payload, exps, P)
    kv, ks = L.packed68_to_aiter_fp4(cache, P)
    p2, e2 = L.read_aiter_fp4(kv, ks, slots, P)
    assert torch.equal(p2, payload) and torch.equal(e2, exps)
    # literal spot checks of slot 130 in the converted cache (n = 2, o = 2)
    assert kv.reshape(-1)[10280].item() == payload[6, 40].item()
    assert ks.reshape(-1)[584].item() == exps[6, 1].item()
    # and back: aiter-written slots read from the converted packed68 cache
    kv2 = torch.zeros((NB, 1, 4, P, 16), dtype=U8)
    ks2 = torch.zeros((NB, 1, 4, P), dtype=U8)
    L.write_aiter_fp4(kv2, ks2, slots, payload, exps, P)
    packed = L.aiter_fp4_to_packed68(kv2, ks2)
    p3, e3 = L.read_packed68(packed, slots, P)
    assert torch.equal(p3, payload) and torch.equal(e3, exps)
    assert packed.reshape(-1)[8832 + 40].item() == payload[6, 40].item()
    assert packed.reshape(-1)[12808 + 1].item() == exps[6, 1].item()
