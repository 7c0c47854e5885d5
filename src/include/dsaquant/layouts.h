// dsaquant/layouts.h: every cache offset of SPEC §6, in bytes (int64) from the start of the tensor
// viewed as flat uint8. P is the page (block) size in tokens; slot t lives in page t / P at o = t % P.
// Slots are non-negative here: callers skip negative slots before computing offsets.
#pragma once

#include "platform.h"

namespace dsq {

constexpr int64_t kPacked68Row = 68;   // 64 payload bytes + 4 exponent bytes per token
constexpr int64_t kFp8132Row = 132;    // 128 data bytes + one fp32 scale per token
constexpr int64_t kAiterKTiles = 1;    // 128-wide rows: one k tile of 128 values

// A slot's page n = t / P and its place o = t % P in the page (t >= 0, P >= 1). In 32 bits when both
// fit (on CUDA a 64-bit division is a call of some 70 instructions: kernels split a slot once, then
// take every offset of it from the split with the *_at functions).
struct SlotPos {
  int64_t n, o;
};
DSQ_HD SlotPos slot_pos(int64_t t, int64_t P) {
  if ((static_cast<uint64_t>(t) | static_cast<uint64_t>(P)) <= 0xFFFFFFFFu) {
    const uint32_t ut = static_cast<uint32_t>(t), up = static_cast<uint32_t>(P);
    return SlotPos{static_cast<int64_t>(ut / up), static_cast<int64_t>(ut % up)};
  }
  return SlotPos{t / P, t % P};
}

// ---- packed68 (FP4; sglang-v41, DeepGEMM, vLLM V4): page = P*64 payload bytes, then P*4 exponents
// Payload byte `byte` (0..63) of slot t.
DSQ_HD int64_t packed68_payload_offset_at(SlotPos s, int64_t P, int64_t byte) {
  return s.n * (P * kPacked68Row) + 64 * s.o + byte;
}
DSQ_HD int64_t packed68_payload_offset(int64_t t, int64_t P, int64_t byte) {
  return packed68_payload_offset_at(slot_pos(t, P), P, byte);
}
// Exponent of block-of-32 `block` (0..3) of slot t.
DSQ_HD int64_t packed68_scale_offset_at(SlotPos s, int64_t P, int64_t block) {
  return s.n * (P * kPacked68Row) + 64 * P + 4 * s.o + block;
}
DSQ_HD int64_t packed68_scale_offset(int64_t t, int64_t P, int64_t block) {
  return packed68_scale_offset_at(slot_pos(t, P), P, block);
}

// ---- fp8_132 (FP8; aiter, vLLM, sglang V3.2): block = P*128 data bytes, then P fp32 scales -----
// Data byte d (0..127) of slot t; preshuffled (needs P % 16 == 0):
// (o/16)*2048 + (d/16)*256 + (o%16)*16 + d%16 within the block.
DSQ_HD int64_t fp8_132_data_offset_at(SlotPos s, int64_t P, int64_t d, bool preshuffle) {
  const int64_t o = s.o, base = s.n * (P * kFp8132Row);
  if (preshuffle) return base + (o / 16) * 2048 + (d / 16) * 256 + (o % 16) * 16 + (d % 16);
  return base + 128 * o + d;
}
DSQ_HD int64_t fp8_132_data_offset(int64_t t, int64_t P, int64_t d, bool preshuffle) {
  return fp8_132_data_offset_at(slot_pos(t, P), P, d, preshuffle);
}
// Position o + 16 lies 2048 bytes after position o in the same page, plain or preshuffled (o % 16 kept).
constexpr int64_t kFp8132Rows16 = 16 * 128;
// First byte of the fp32 scale of slot t (little endian), preshuffled or not.
DSQ_HD int64_t fp8_132_scale_offset_at(SlotPos s, int64_t P) { return s.n * (P * kFp8132Row) + 128 * P + 4 * s.o; }
DSQ_HD int64_t fp8_132_scale_offset(int64_t t, int64_t P) { return fp8_132_scale_offset_at(slot_pos(t, P), P); }

// ---- aiter_fp4 (pa_mqa_logits_fp4): kv_cache u8 [NB, 1, 4, P, 16], kv_cache_scale u8 [NB, 1, 4, P]
// Offset in kv_cache of payload byte b (0..63) of slot t.
DSQ_HD int64_t aiter_fp4_data_offset_at(SlotPos s, int64_t P, int64_t b) {
  return ((s.n * kAiterKTiles + b / 64) * 4 + (b % 64) / 16) * P * 16 + s.o * 16 + b % 16;
}
DSQ_HD int64_t aiter_fp4_data_offset(int64_t t, int64_t P, int64_t b) { return aiter_fp4_data_offset_at(slot_pos(t, P), P, b); }
// Interleaved scale position of o in a page: (o % 16) * (P/16) + o / 16 (needs P % 16 == 0;
// aiter's scorer reads it correctly only for P = 64).
DSQ_HD int64_t aiter_sflat(int64_t o, int64_t P) { return (o % 16) * (P / 16) + o / 16; }
// Offset in kv_cache_scale of the exponent of block-of-32 g (0..3) of slot t.
DSQ_HD int64_t aiter_fp4_scale_offset_at(SlotPos s, int64_t P, int64_t g) {
  return ((s.n * kAiterKTiles + g / 4) * 4 + g % 4) * P + aiter_sflat(s.o, P);
}
DSQ_HD int64_t aiter_fp4_scale_offset(int64_t t, int64_t P, int64_t g) { return aiter_fp4_scale_offset_at(slot_pos(t, P), P, g); }

// ---- aiter q scales: q_scale_out u8 [T, 1, 4, 16, qs_pad] -----------------------------------------
// qs_pad = round_up(H/16, 4); entries with h/16 >= H/16 are padding (written as 0).
DSQ_HD int64_t aiter_q_scale_pad(int64_t H) { return (H / 16 + 3) / 4 * 4; }
// Offset of the exponent of head h, group g within its token's 64 * qs_pad bytes: [g/4, g%4, h%16, h/16]
// = the head's part plus the group's part (kernels that walk heads add the group's part once).
// 32-bit: a token's part is small; kernels add the token's base once. h, g >= 0: the arithmetic is
// unsigned, so that / and % by 16 are a shift and a mask.
DSQ_HD int32_t aiter_q_scale_head_part(int32_t h, int32_t qs_pad) {
  const uint32_t uh = static_cast<uint32_t>(h);
  return static_cast<int32_t>(uh % 16) * qs_pad + static_cast<int32_t>(uh / 16);
}
DSQ_HD int32_t aiter_q_scale_group_part(int32_t g, int32_t qs_pad) {
  const uint32_t ug = static_cast<uint32_t>(g);
  return static_cast<int32_t>(((ug / 4) * 4 + ug % 4) * 16) * qs_pad;
}
DSQ_HD int32_t aiter_q_scale_in_token(int32_t h, int32_t g, int32_t qs_pad) {
  return aiter_q_scale_group_part(g, qs_pad) + aiter_q_scale_head_part(h, qs_pad);
}
// Offset of the exponent of token t, head h, group g: [t, g/4, g%4, h%16, h/16].
DSQ_HD int64_t aiter_q_scale_offset(int64_t t, int64_t h, int64_t g, int64_t H) {
  static_assert(kAiterKTiles == 1, "a 128 row has one k tile");
  const int64_t pad = aiter_q_scale_pad(H);
  return t * 64 * pad + aiter_q_scale_in_token(static_cast<int32_t>(h), static_cast<int32_t>(g), static_cast<int32_t>(pad));
}

}  // namespace dsq
