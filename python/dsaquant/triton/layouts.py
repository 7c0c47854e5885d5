"""SPEC §6 cache offsets in Triton: the mirror of src/include/dsaquant/layouts.h for the Triton kernels that
read the caches (scorer.py, prefill.py). Offsets are in bytes from the start of the cache viewed as uint8
(or in elements of the named view); `page` and `o` are the page ids and in-page positions of a tile's rows.
The tests hold the kernels that use them to the reference (python/dsaquant/reference/layouts.py)."""
import triton
import triton.language as tl


@triton.jit
def fp8_132_data(page, o, d, PAGE: tl.constexpr, PRESHUFFLE: tl.constexpr):
    """[R, D] byte offsets of data bytes d of positions (page, o); preshuffled:
    (o / 16) * 2048 + (d / 16) * 256 + (o % 16) * 16 + d % 16 within the page."""
    if PRESHUFFLE:
        return page[:, None] * (PAGE * 132) + ((o // 16) * 2048 + (o % 16) * 16)[:, None] \
            + ((d // 16) * 256 + d % 16)[None, :]
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
    return page * (4 * PAGE) + (o % 16) * (PAGE // 16) + o // 16
