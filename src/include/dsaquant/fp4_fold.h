// dsaquant/fp4_fold.h: FP4 rows folded into e4m3 (SPEC §1/§3 values), for the FP4 fast paths of the scorers
// (docs/scorer.md, docs/prefill.md), which run FP4 dot products on FP8 tensor cores.
//
// A row of 128 E2M1 values in four 32-value blocks with UE8M0 exponents e_0..e_3 (block j in byte j of the
// exponent word) is value * 2^(e_b - 127). Folded: every block's values times 2^(e_b - emax + kFoldShift), emax
// the row's largest exponent, as e4m3 codes, and one power-of-two scale 2^(emax - 127 - kFoldShift) for the row.
// Every E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^t is an e4m3 value for -9 + 1 <= t <= 6 (6 * 2^6 = 384 <=
// 448; 0.5 * 2^-8 = 2^-9, e4m3's smallest subnormal), so a row whose exponents lie within kFoldSpan of its largest
// folds exactly (fold_exact); a block farther below rounds to e4m3 subnormals or zero.
// The rule of which rows fold exactly is also written in Python (dsaquant/triton/prefill.py: FOLD_SHIFT,
// FOLD_SPAN, _fold_ok); tests/test_prefill_host.py runs both on the same rows.
#pragma once

#include <cstdint>

#include "arith.h"
#include "e2m1x8.h"
#include "fp8.h"

namespace dsq {

constexpr int kFoldShift = 6;   // values scaled by up to 2^6
constexpr int kFoldSpan = 14;   // exponents within 14 of the row's largest fold exactly
constexpr int kFoldMinExp = 64, kFoldMaxExp = 190;   // exact folds keep the row scale a normal fp32 number

// The largest of the four exponents of word e.
DSQ_HD int fold_emax(uint32_t e) {
  const int a = static_cast<int>(e & 255), b = static_cast<int>((e >> 8) & 255);
  const int c = static_cast<int>((e >> 16) & 255), d = static_cast<int>(e >> 24);
  const int ab = a > b ? a : b, cd = c > d ? c : d;
  return ab > cd ? ab : cd;
}

// Whether the row of exponent word e folds exactly, with its row scale a normal number: every exponent in
// [kFoldMinExp, kFoldMaxExp] and within kFoldSpan of the largest.
DSQ_HD bool fold_exact(uint32_t e) {
  int lo = 255, hi = 0;
  for (int j = 0; j < 4; ++j) {
    const int x = static_cast<int>((e >> (8 * j)) & 255);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  return lo >= kFoldMinExp && hi <= kFoldMaxExp && hi - lo <= kFoldSpan;
}

// The e4m3 codes of the eight E2M1 magnitudes times 2^(kFoldShift - (emax - e)), as a byte-permute table (lo:
// magnitudes 0..3, hi: 4..7); the all-zero table for a zero exponent (a zero scale).
DSQ_HD void fold_table(int e, int emax, uint32_t& lo, uint32_t& hi) {
  int t = kFoldShift - (emax - e);
  t = t > -40 ? t : -40;
  const float s = e == 0 ? 0.f : u2f(static_cast<uint32_t>(t + 127) << 23);
  constexpr Fp8Flavour fn = Fp8Flavour::e4m3fn;
  lo = fp8_encode2(0.f, 0.5f * s, fn) | (static_cast<uint32_t>(fp8_encode2(s, 1.5f * s, fn)) << 16);
  hi = fp8_encode2(2.f * s, 3.f * s, fn) | (static_cast<uint32_t>(fp8_encode2(4.f * s, 6.f * s, fn)) << 16);
}

// Eight packed E2M1 codes (element 2i in the low nibble of byte i) -> eight e4m3 bytes: x = elements 0..3, y =
// elements 4..7. The magnitudes come from the table (byte_perm on the low three bits of each nibble); each
// nibble's sign bit (bit 3) goes to bit 7 of its byte by one more byte_perm, of the byte of w << 4 (even
// nibbles) or of w (odd nibbles).
DSQ_HD void fold_expand8(uint32_t w, uint32_t lo, uint32_t hi, uint32_t& x, uint32_t& y) {
  const uint32_t u = w << 4;
  x = byte_perm(lo, hi, w & 0x7777u) | (byte_perm(u, w, 0x5140u) & 0x80808080u);
  y = byte_perm(lo, hi, (w >> 16) & 0x7777u) | (byte_perm(u, w, 0x7362u) & 0x80808080u);
}

// The scale a folded row keeps, 2^(emax - 127 - kFoldShift), from bits; 0 for an all-zero-scale row, NaN for a
// block with the NaN scale 255 (SPEC §3).
// Selects, not branches: the scorers compute it for every key row of a tile.
DSQ_HD float fold_scale(int emax) {
  const int e = emax - kFoldShift;
  const uint32_t normal = static_cast<uint32_t>(e) << 23;
  const uint32_t sub = 1u << ((e + 22) & 31);   // emax 1..6: the subnormals 2^-126 .. 2^-131
  uint32_t bits = e >= 1 ? normal : sub;
  bits = emax == 0 ? 0u : bits;
  return u2f(emax == 255 ? 0x7FC00000u : bits);
}

}  // namespace dsq
