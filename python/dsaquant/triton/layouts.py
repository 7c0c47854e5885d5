"""SPEC §6 cache offsets in Triton: the mirror of src/include/dsaquant/layouts.h, the one home of the layout
formulas for every Triton kernel, the writers (quant.py, compress.py, rope_rotate.py) and the readers
(scorer.py, prefill.py). Offsets are in bytes from the start of the cache viewed as uint8 (or in elements of
the named view).

- Element-wise functions (`*_at`, `*_in_page`, `aiter_sflat`, `aiter_q_scale_at`): page ids `n`, in-page
  positions `o` and byte / block / head indices of any shapes that broadcast against each other; the result
  has the broadcast shape. The writers call these.
- Tile functions (the rest): `page` and `o` are the page ids and in-page positions [R] of a tile's rows, the
  column indices are [C]; the result is [R, C] (or [R]). The readers call these; they are built on the
  element-wise ones.

The tests hold the kernels that use them to the reference (python/dsaquant/reference/layouts.py)."""
import triton
import triton.language as tl


# ---- element-wise ------------------------------------------------------------------------------------
@triton.jit
def packed68_payload_at(n, o, P):
    """packed68: byte offset of payload byte 0 of position o of page n (bytes 0..63 follow)."""
    return n * (P * 68) + 64 * o


@triton.jit
def packed68_exponent_at(n, o, P):
    """packed68: byte offset of the exponent of block 0 of position o of page n (blocks 1..3 follow)."""
    return n * (P * 68) + 64 * P + 4 * o


@triton.jit
def fp8_132_page_at(n, P):
    """fp8_132: byte offset of page n (P*128 data bytes, then P fp32 scales)."""
    return n * (P * 132)


@triton.jit
def fp8_132_row_shuffled(o):
    """fp8_132 preshuffled (P % 16 == 0): the part of a data byte's in-page offset that depends on the
    position o, (o / 16) * 2048 + (o % 16) * 16; fp8_132_col_shuffled(d) adds the byte's part."""
    return (o // 16) * 2048 + (o % 16) * 16


@triton.jit
def fp8_132_col_shuffled(d):
    """fp8_132 preshuffled: the part of data byte d's in-page offset that depends on d, (d / 16) * 256 + d % 16."""
    return (d // 16) * 256 + d % 16


@triton.jit
def fp8_132_data_in_page(o, d, presh):
    """fp8_132: in-page byte offset of data byte d of position o: 128*o + d, or preshuffled when the runtime
    flag presh != 0."""
    return tl.where(presh != 0, fp8_132_row_shuffled(o) + fp8_132_col_shuffled(d), 128 * o + d)


@triton.jit
def fp8_132_scale_in_page(o, P):
    """fp8_132: in-page byte offset of the fp32 scale of position o (4 bytes, little endian)."""
    return 128 * P + 4 * o


@triton.jit
def aiter_fp4_payload_at(n, o, k, P):
    """aiter_fp4, kv_cache [NB, 1, 4, P, 16]: byte offset of payload tile k (bytes 16k..16k+15) of position o
    of page n."""
    return ((n * 4 + k) * P + o) * 16


@triton.jit
def aiter_sflat(o, P):
    """aiter_fp4: the interleaved scale position of o in a page, (o % 16) * (P/16) + o / 16."""
    return (o % 16) * (P // 16) + o // 16


@triton.jit
def aiter_fp4_exponent_at(n, sf, g, P):
    """aiter_fp4, kv_cache_scale [NB, 1, 4, P]: byte offset of the exponent of block g of the position whose
    interleaved scale position (aiter_sflat) is sf, in page n."""
    return (n * 4 + g) * P + sf


@triton.jit
def aiter_q_scale_at(t, g, h, NG, qs_pad):
    """aiter q scales [T, D/128, 4, 16, qs_pad] (NG = D/32 groups a token): offset of the exponent of group g
    (= 4*k_tile + block) of head h of token t, ((t*NG + g)*16 + h%16)*qs_pad + h/16. Pad column j (H/16 <= j <
    qs_pad) of the 16-head row of head h is aiter_q_scale_at(t, g, h % 16, NG, qs_pad) + j."""
    return ((t * NG + g) * 16 + h % 16) * qs_pad + h // 16


@triton.jit
def dense_fp4_payload_at(slot):
    """dense FP4 k cache [num_slots, 64]: byte offset of payload byte 0 of slot `slot` (no pages)."""
    return slot * 64


@triton.jit
def dense_fp4_exponent_at(slot):
    """dense FP4 k cache scales [num_slots, 4]: byte offset of the exponent of block 0 of slot `slot`."""
    return slot * 4


@triton.jit
def dense_q_scale_at(r, g, NG):
    """dense q scales [T, H, NG] (NG groups a row): offset of group g of row r = t*H + h."""
    return r * NG + g


# ---- tiles: rows [R] by columns [C] ------------------------------------------------------------------
@triton.jit
def fp8_132_data(page, o, d, PAGE: tl.constexpr, PRESHUFFLE: tl.constexpr):
    """[R, D] byte offsets of data bytes d of positions (page, o); preshuffled:
    (o / 16) * 2048 + (d / 16) * 256 + (o % 16) * 16 + d % 16 within the page."""
    if PRESHUFFLE:
        return page[:, None] * (PAGE * 132) + fp8_132_row_shuffled(o)[:, None] + fp8_132_col_shuffled(d)[None, :]
    return page[:, None] * (PAGE * 132) + (o * 128)[:, None] + d[None, :]


@triton.jit
def fp8_132_scale(page, o, PAGE: tl.constexpr):
    """[R] fp32-element offsets (the cache viewed as fp32) of the scales of positions (page, o)."""
    return page * (PAGE * 33) + 32 * PAGE + o


@triton.jit
def packed68_payload(page, o, col, PAGE: tl.constexpr):
    """[R, C] byte offsets of payload bytes col of positions (page, o)."""
    return page[:, None] * (PAGE * 68) + (o * 64)[:, None] + col[None, :]


@triton.jit
def packed68_exponent(page, o, g, PAGE: tl.constexpr):
    """[R, G] byte offsets of the exponents of blocks g of positions (page, o)."""
    return page[:, None] * (PAGE * 68) + 64 * PAGE + (o * 4)[:, None] + g[None, :]


@triton.jit
def packed68_exponent_word(page, o, PAGE: tl.constexpr):
    """[R] int32-element offsets (the cache viewed as int32) of the four exponent bytes of positions (page, o)."""
    return page * (PAGE * 17) + 16 * PAGE + o


@triton.jit
def aiter_fp4_payload(page, o, col, PAGE: tl.constexpr):
    """[R, C] byte offsets in kv_cache [NB, 1, 4, P, 16] of payload bytes col of positions (page, o)."""
    return page[:, None] * (PAGE * 64) + ((col // 16) * (PAGE * 16) + col % 16)[None, :] + (o * 16)[:, None]


@triton.jit
def aiter_fp4_exponent(page, o, PAGE: tl.constexpr):
    """[R] byte offsets in kv_cache_scale [NB, 1, 4, P] of block 0's exponent of positions (page, o), at the
    interleaved position (o % 16) * (P / 16) + o / 16; block g is g * P further."""
    return page * (4 * PAGE) + aiter_sflat(o, PAGE)
