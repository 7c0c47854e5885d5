"""SPEC §6: the cache layouts as byte offsets, and writers/readers built on them.

Offsets are int64 tensors (or Python ints) counting bytes from the start of the whole cache
tensor viewed as flat uint8. `P` is the page size in tokens; slot t lives in page t // P at o = t % P.
"""
from __future__ import annotations

import torch

PACKED68_ROW = 68
FP8_132_ROW = 132
K_TILES = 1  # 128-wide rows: one k tile of 128 values


# ---- packed68 (FP4): page = P*64 payload bytes, then P*4 exponent bytes -------------------------
def packed68_payload_offset(slot, P: int, byte=0):
    """Byte offset of payload byte `byte` (0..63) of slot `slot`."""
    return (slot // P) * (P * 68) + 64 * (slot % P) + byte


def packed68_scale_offset(slot, P: int, block=0):
    """Byte offset of the exponent of block-of-32 `block` (0..3) of slot `slot`."""
    return (slot // P) * (P * 68) + 64 * P + 4 * (slot % P) + block


# ---- fp8_132 (FP8): block = P*128 data bytes then P fp32 scales ----------------------------------
def fp8_132_data_offset(slot, P: int, d, preshuffle: bool = False):
    """Byte offset of data byte d (0..127) of slot `slot`, plain or preshuffled (P % 16 == 0)."""
    o = slot % P
    base = (slot // P) * (P * 132)
    if preshuffle:
        return base + (o // 16) * 2048 + (d // 16) * 256 + (o % 16) * 16 + (d % 16)
    return base + 128 * o + d


def fp8_132_scale_offset(slot, P: int):
    """Byte offset of the fp32 scale of slot `slot` (4 bytes, little endian)."""
    return (slot // P) * (P * 132) + 128 * P + 4 * (slot % P)


# ---- aiter_fp4: kv_cache u8 [NB, 1, 4, P, 16], kv_cache_scale u8 [NB, 1, 4, P] ------------------
def aiter_fp4_data_offset(slot, P: int, b):
    """Element offset in kv_cache of payload byte b (0..63) of slot `slot`."""
    n, o = slot // P, slot % P
    return ((n * K_TILES + b // 64) * 4 + (b % 64) // 16) * P * 16 + o * 16 + b % 16


def aiter_sflat(o, P: int):
    """Interleaved scale position of o in a page: (o % 16) * (P/16) + o / 16."""
    return (o % 16) * (P // 16) + o // 16


def aiter_fp4_scale_offset(slot, P: int, g):
    """Element offset in kv_cache_scale of the exponent of block-of-32 g (0..3) of slot `slot`."""
    n, o = slot // P, slot % P
    return ((n * K_TILES + g // 4) * 4 + g % 4) * P + aiter_sflat(o, P)


def aiter_q_scale_pad(H: int) -> int:
    """qs_pad = round_up(H/16, 4)."""
    return (H // 16 + 3) // 4 * 4


def aiter_q_scale_offset(t, h, g, H: int):
    """Element offset in q_scale_out [T, 1, 4, 16, qs_pad] of token t, head h, group g."""
    qs_pad = aiter_q_scale_pad(H)
    return (((t * K_TILES + g // 4) * 4 + g % 4) * 16 + h % 16) * qs_pad + h // 16


# ---- writers and readers (rows are the slots' payloads, in slot order) ---------------------------
def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("cache tensors must be contiguous")
    return t.view(torch.uint8).reshape(-1)


def _ar(n, device):
    return torch.arange(n, device=device, dtype=torch.int64)


def write_packed68(cache, slots, payload, exps, P: int):
    """cache u8 [NB, P*68]; slots int64 [N] (all valid); payload u8 [N, 64]; exps u8 [N, 4]."""
    flat, s = _flat(cache), slots.to(torch.int64).unsqueeze(-1)
    flat[packed68_payload_offset(s, P, _ar(64, s.device))] = payload.to(torch.uint8)
    flat[packed68_scale_offset(s, P, _ar(4, s.device))] = exps.to(torch.uint8)


def read_packed68(cache, slots, P: int):
    flat, s = _flat(cache), slots.to(torch.int64).unsqueeze(-1)
    return flat[packed68_payload_offset(s, P, _ar(64, s.device))], flat[packed68_scale_offset(s, P, _ar(4, s.device))]


def write_fp8_132(cache, slots, codes, scales, P: int, preshuffle: bool):
    """cache u8 [NB, P*132]; codes u8 [N, 128]; scales fp32 [N]."""
    flat, s = _flat(cache), slots.to(torch.int64).unsqueeze(-1)
    flat[fp8_132_data_offset(s, P, _ar(128, s.device), preshuffle)] = codes.to(torch.uint8)
    sb = scales.to(torch.float32).contiguous().view(torch.uint8).reshape(-1, 4)
    flat[fp8_132_scale_offset(s, P) + _ar(4, s.device)] = sb


def read_fp8_132(cache, slots, P: int, preshuffle: bool):
    flat, s = _flat(cache), slots.to(torch.int64).unsqueeze(-1)
    codes = flat[fp8_132_data_offset(s, P, _ar(128, s.device), preshuffle)]
    sb = flat[fp8_132_scale_offset(s, P) + _ar(4, s.device)].contiguous()
    return codes, sb.view(torch.float32).reshape(-1)


def write_aiter_fp4(kv_cache, kv_scale, slots, payload, exps, P: int):
    """kv_cache u8 [NB, 1, 4, P, 16]; kv_scale u8 [NB, 1, 4, P]; payload u8 [N, 64]; exps u8 [N, 4]."""
    s = slots.to(torch.int64).unsqueeze(-1)
    _flat(kv_cache)[aiter_fp4_data_offset(s, P, _ar(64, s.device))] = payload.to(torch.uint8)
    _flat(kv_scale)[aiter_fp4_scale_offset(s, P, _ar(4, s.device))] = exps.to(torch.uint8)


def read_aiter_fp4(kv_cache, kv_scale, slots, P: int):
    s = slots.to(torch.int64).unsqueeze(-1)
    return (_flat(kv_cache)[aiter_fp4_data_offset(s, P, _ar(64, s.device))],
            _flat(kv_scale)[aiter_fp4_scale_offset(s, P, _ar(4, s.device))])


def write_aiter_q_scale(q_scale_out, rows, exps, H: int):
    """q_scale_out u8 [T, 1, 4, 16, qs_pad]; rows int64 [N] token indices; exps u8 [N, H, 4].
    The whole region of each written token is stored: pad entries (h/16 >= H/16) get 0."""
    dev = exps.device
    flat = _flat(q_scale_out)
    per_tok = q_scale_out[0].numel() if q_scale_out.shape[0] else 0
    r = rows.to(torch.int64)
    flat[(r.view(-1, 1) * per_tok + _ar(per_tok, dev)).reshape(-1)] = 0
    t = r.view(-1, 1, 1)
    h = _ar(H, dev).view(1, H, 1)
    g = _ar(4, dev).view(1, 1, 4)
    flat[aiter_q_scale_offset(t, h, g, H)] = exps.to(torch.uint8)


def read_aiter_q_scale(q_scale, H: int):
    T = q_scale.shape[0]
    dev = q_scale.device
    t = _ar(T, dev).view(T, 1, 1)
    h = _ar(H, dev).view(1, H, 1)
    g = _ar(4, dev).view(1, 1, 4)
    return _flat(q_scale)[aiter_q_scale_offset(t, h, g, H)]


# ---- conversion between the two FP4 cache layouts (SPEC §6) --------------------------------------
def packed68_to_aiter_fp4(cache: torch.Tensor, page_size: int = 64):
    """packed68 cache u8 [NB, P*68] -> (kv_cache u8 [NB, 1, 4, P, 16], kv_cache_scale u8 [NB, 1, 4, P]).
    Every slot keeps its page and position. Needs P % 16 == 0."""
    NB = cache.shape[0]
    P = page_size
    slots = _ar(NB * P, cache.device)
    payload, exps = read_packed68(cache, slots, P)
    kv = torch.empty((NB, K_TILES, 4, P, 16), dtype=torch.uint8, device=cache.device)
    ks = torch.empty((NB, K_TILES, 4, P), dtype=torch.uint8, device=cache.device)
    write_aiter_fp4(kv, ks, slots, payload, exps, P)
    return kv, ks


def aiter_fp4_to_packed68(kv_cache: torch.Tensor, kv_cache_scale: torch.Tensor):
    """(kv_cache u8 [NB, 1, 4, P, 16], kv_cache_scale u8 [NB, 1, 4, P]) -> packed68 u8 [NB, P*68]."""
    NB, P = kv_cache.shape[0], kv_cache.shape[3]
    slots = _ar(NB * P, kv_cache.device)
    payload, exps = read_aiter_fp4(kv_cache, kv_cache_scale, slots, P)
    out = torch.empty((NB, P * 68), dtype=torch.uint8, device=kv_cache.device)
    write_packed68(out, slots, payload, exps, P)
    return out
