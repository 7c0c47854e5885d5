// kernels/cuda/rotate_body.cuh: the body of SPEC §7.7 rope_rotate_quant, written once against the SIMT layer that
// compress_body.cuh's includers define, so that the same code runs on the GPU (kernels/cuda/compress.cu, and hipified
// for AMD) and under the host emulator of the tests (tests/cpp/compress_host.cpp), which holds it to the reference.
//
// The includer defines, in namespace dsqv4, before including this file (besides compress_body.cuh's list: V4_FN,
// V4_UNROLL, thread_id, block_id, block_sync, shfl_xor, atomic_or, ld16, st16):
//   void st8(void* p, uint32_t w0, uint32_t w1), st4(void* p, uint32_t w)
//                                                      stores of 8 / 4 bytes at p (aligned to their size)
// Blocks have kThreads = 128 threads here (not compress_kv's 256). All format math is the shared header's.
//
// Layout. A row (t, h) of D values is held by a group of L = D/V consecutive lanes, V values a lane (V = 16 or 32
// for small calls, 64 for large ones: rotate_plan). Lane l of the group loads x[V*l .. V*l + V-1] (16-byte vector
// loads where the rows are 16-byte aligned), so the Hadamard's strides 1 .. V/2 (SPEC §5, ascending) are inside the
// lane; each stride V*2^r (r = 0 .. log2(L)-1) is one exchange between lanes l and l ^ 2^r in which each lane sends
// half of its values and keeps the other half: the lane whose bit r is 0 keeps its first half (element bit
// log2(V)-1 clear), the other its second half; each then holds both elements of V/2 pairs, computes a+b into its
// first half and a-b into its second. After the exchanges (the traded bit moves into the lane index, the stage's bit
// into the top value bit) lane l holds two runs of V/2 values: x[V/2*l ..] and x[D/2 + V/2*l ..] (without the
// Hadamard: x[V*l ..] and x[V*l + V/2 ..]), and quantizes and stores both runs with 4- to 16-byte stores.
// The pair's operands reach the two lanes in opposite roles (a is the lower lane's own value, the upper lane's
// received one), so a - b is computed as fl(sigma*own - sigma*recv) with sigma = -1 in the upper lane: the same
// rounding and the same zero sign as fl(a - b); sigma*own is exact, so one fused multiply-add computes it with the
// product sigma*recv (platform.h fadd_signed).
// RoPE: the lanes holding the tail 64 values rotate their pairs, with (cos, sin) from a block table in shared
// memory, filled once per token of the block (the block's rows are consecutive, so its tokens are few), or read
// per row when the block spans more than kTabTokens tokens (H < kRows / kTabTokens).
#pragma once

#include <cstdint>
#include <type_traits>

#include "dsaquant/dsaquant.h"
#include "compress_args.h"
#include "compress_body.cuh"   // load_i, rope_cs

namespace dsqv4 {
namespace rot {

using namespace dsq;

constexpr int kThreads = 128;     // threads per block
constexpr int kTabTokens = 8;     // tokens of the shared RoPE table

constexpr int ilog2(int n) { return n <= 1 ? 0 : 1 + ilog2(n / 2); }

// Geometry of a row of D values held V a lane.
template <int D, int V>
struct Geo {
  static_assert(V >= 16 && V <= D && D / V <= 32, "16 <= V <= D, at most 32 lanes a row");
  static constexpr int L = D / V;                 // lanes a row
  static constexpr int kRounds = ilog2(L);        // Hadamard exchanges between lanes
  static constexpr int kRows = kThreads / L;      // rows a block
};

// Output modes: the kernel's MODE template parameter (kAnyMode: chosen at run time from the arguments).
constexpr int kFp4Threshold = 0, kFp4Rne = 1, kFp4Hardware = 2, kFp8Fn = 3, kFp8Fnuz = 4, kHalf = 5, kAnyMode = -1;

// The per-launch values the host derives from the arguments (rotate_run).
struct Run {
  int h_shift;        // log2(H)
  bool x_vec;         // x's rows 16-byte aligned: vector loads
  bool out_vec;       // out's rows 16-byte aligned: vector stores
  bool table;         // the block's tokens fit the shared RoPE table
};

struct RotateSmem {
  alignas(16) float cs[kTabTokens * 64];   // token k of the block, pair j: cos at 64k + 2j, sin at 64k + 2j + 1 (fp32)
};

// ---- elements ------------------------------------------------------------------------------------------------
// |v|, exact. On CUDA fabsf, which the instruction reading it takes as an operand modifier (no instruction).
V4_FN float abs_v(float v) {
#if defined(DSQ_CUDA_DEVICE)
  return fabsf(v);
#else
  return abs_f(v);
#endif
}
V4_FN float half_to_f32(uint16_t h, int dt) { return dt == kBF16 ? bf16_to_f32(h) : fp16_to_f32(h); }

// The lane's V values x[0 .. V-1] from element `off` of x (a row's dense last dim), as fp32 (exact). The vector
// path issues every 16-byte load of the lane before converting any: the conversions branch on the dtype, and a
// load behind a branch waits for it, so interleaving them would leave one load in flight at a time.
template <int V>
V4_FN void load_values(const RotateArgs& a, int64_t off, bool vec, float (&x)[V]) {
  if (a.in_dt == kF32) {
    const float* p = static_cast<const float*>(a.x) + off;
    if (vec) {
      V4_UNROLL
      for (int i = 0; i < V / 4; ++i) {
        uint32_t w[4];
        ld16(p + 4 * i, w);
        V4_UNROLL
        for (int k = 0; k < 4; ++k) x[4 * i + k] = u2f(w[k]);
      }
    } else {
      V4_UNROLL
      for (int i = 0; i < V; ++i) x[i] = p[i];
    }
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(a.x) + off;
  if (vec) {
    uint32_t raw[V / 2];
    V4_UNROLL
    for (int i = 0; i < V / 8; ++i) {
      uint32_t w[4];
      ld16(p + 8 * i, w);
      V4_UNROLL
      for (int k = 0; k < 4; ++k) raw[4 * i + k] = w[k];
    }
    if (a.in_dt == kBF16) {
      V4_UNROLL
      for (int k = 0; k < V / 2; ++k) {
        x[2 * k] = u2f(raw[k] << 16);
        x[2 * k + 1] = u2f(raw[k] & 0xFFFF0000u);
      }
    } else {
      V4_UNROLL
      for (int k = 0; k < V / 2; ++k) {
        x[2 * k] = fp16_to_f32(static_cast<uint16_t>(raw[k]));
        x[2 * k + 1] = fp16_to_f32(static_cast<uint16_t>(raw[k] >> 16));
      }
    }
  } else {
    V4_UNROLL
    for (int i = 0; i < V; ++i) x[i] = half_to_f32(p[i], a.in_dt);
  }
}

// n words of a run at p: vector stores when `vec` (p then aligned to 4n bytes, n <= 4, or 16), else bytes.
template <int N>
V4_FN void store_words(uint8_t* p, const uint32_t (&w)[N], bool vec) {
  if (vec) {
    if constexpr (N == 1) {
      st4(p, w[0]);
    } else if constexpr (N == 2) {
      st8(p, w[0], w[1]);
    } else {
      static_assert(N % 4 == 0, "runs of 1, 2 or a multiple of 4 words");
      V4_UNROLL
      for (int i = 0; i < N / 4; ++i) {
        const uint32_t q[4] = {w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]};
        st16(p + 16 * i, q);
      }
    }
    return;
  }
  V4_UNROLL
  for (int i = 0; i < 4 * N; ++i) p[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
}

// ---- SPEC §5 Hadamard over the row (Sylvester order, strides ascending), then times fl(D^-0.5) --------------------
template <int D, int V>
V4_FN void hadamard_row(float (&x)[V], int lane) {
  hadamard_butterflies<V>(x);   // strides below V: inside the lane
  // Stride V*2^r: the exchange with lane ^ 2^r (header comment). Before it the top value bit (slot V/2) is
  // element bit log2(V) - 1 + r, after it the stage's bit; the traded bit moves into lane bit r.
  V4_UNROLL
  for (int r = 0; r < Geo<D, V>::kRounds; ++r) {
    const bool upper = ((lane >> r) & 1) != 0;
    const float sigma = upper ? -1.0f : 1.0f;
    V4_UNROLL
    for (int k = 0; k < V / 2; ++k) {
      const float lo = x[k], hi = x[k + V / 2];
      const float own = upper ? hi : lo;
      const float recv = shfl_xor(upper ? lo : hi, 1 << r);
      x[k] = fadd(own, recv);                                    // a + b
      x[k + V / 2] = fadd_signed(own, sigma, -fmul(recv, sigma));  // a - b: fl(sigma*own - sigma*recv)
    }
  }
  const float c = hadamard_scale(D);
  V4_UNROLL
  for (int e = 0; e < V; ++e) x[e] = fmul(x[e], c);
}

// ---- groups ------------------------------------------------------------------------------------------------------
// Chunks of CS = min(g, V/2) consecutive values of a run (CS a template parameter: rotate_block dispatches on it).
// Returns each chunk's group amax (SPEC §0.3, NaN ignored). When a group is wider than a run (CS = V/2), the runs'
// maxima are combined: the lane's two runs when they lie in one group (`share`), and lpg lanes (aligned, consecutive)
// whose runs lie in one group. lpg and share are uniform over the launch (so are the shuffles).
template <int V, int CS>
V4_FN void chunk_amax(const float (&x)[V], float (&am)[V / CS], int lpg, bool share) {
  V4_UNROLL
  for (int c = 0; c < V / CS; ++c) {
    float m = 0.0f;
    V4_UNROLL
    for (int i = 0; i < CS; ++i) m = fmax_nn(m, abs_v(x[CS * c + i]));
    am[c] = m;
  }
  if constexpr (CS == V / 2) {
    if (share) am[0] = am[1] = fmax_nn(am[0], am[1]);
    for (int s = 1; s < lpg; s <<= 1) {
      am[0] = fmax_nn(am[0], shfl_xor(am[0], s));
      am[1] = fmax_nn(am[1], shfl_xor(am[1], s));
    }
  }
}

// Where the lane's runs start (elements of the row) and how its groups combine.
struct Runs {
  int e0, e1;       // first elements of the lane's first run (values 0 .. V/2-1) and its second (V/2 .. V-1)
  int lpg;          // lanes whose runs share a group (groups wider than a run)
  bool share;       // the lane's two runs lie in one group
};
template <int D, int V>
V4_FN Runs runs_of(int lane, bool had, int g) {
  Runs r;
  if (had) {        // after the exchanges: x[V/2*l ..] and x[D/2 + V/2*l ..]
    r.e0 = V / 2 * lane;
    r.e1 = D / 2 + V / 2 * lane;
    r.share = g == D;
    r.lpg = g <= V / 2 ? 1 : (g == D ? D / V : 2 * g / V);
  } else {          // as loaded: x[V*l ..], two halves
    r.e0 = V * lane;
    r.e1 = V * lane + V / 2;
    r.share = g >= V;
    r.lpg = g >= V ? g / V : 1;
  }
  return r;
}
// Element of chunk c (of CS values) of the lane.
template <int V, int CS>
V4_FN int chunk_elem(const Runs& r, int c) {
  constexpr int kPerRun = V / 2 / CS;
  return (c < kPerRun ? r.e0 : r.e1) + (c % kPerRun) * CS;
}

// The row's output pointers and indices.
struct Row {
  int64_t row, t;   // row = t * H + h
  int h;
  bool live;        // a row of the call (the last group of a launch may be past the end: computed, not stored)
};

// ---- SPEC §7.7 outputs -------------------------------------------------------------------------------------------
// FP4, rule recip, policy R: bytes [T, H, D/2]; exponents dense [T, H, D/g] or in the aiter q-scale layout (g = 32).
template <int D, int V, int CS, Rounding R>
V4_FN void store_fp4(const RotateArgs& a, const Run& run, const Row& w, const Runs& rs, const float (&x)[V], int g) {
  constexpr int NC = V / CS;
  float am[NC];
  chunk_amax<V, CS>(x, am, rs.lpg, rs.share);
  int ex[NC];
  uint32_t sc[NC];   // 2^(127-e) in both bf16 halves (the encoder's multiplier)
  V4_UNROLL
  for (int c = 0; c < NC; ++c) {
    ex[c] = ue8m0_exponent(am[c], ScaleRule::recip);
    sc[c] = bf16x2_inv_pow2(ex[c]);
  }
  constexpr int kWords = V / 16;   // a run's words of 8 values
  uint32_t wd[2][kWords];
  V4_UNROLL
  for (int q = 0; q < 2 * kWords; ++q) {
    const int c = 8 * q / CS;   // the word's chunk (CS >= 8)
    float v[8];
    V4_UNROLL
    for (int i = 0; i < 8; ++i) v[i] = x[8 * q + i];
    wd[q / kWords][q % kWords] = e2m1_encode8_f32_s<R>(v, ex[c], sc[c], ex[c] == 255);
  }
  if (!w.live) return;
  uint8_t* o = a.out + w.row * (D / 2);
  store_words(o + rs.e0 / 2, wd[0], run.out_vec);
  store_words(o + rs.e1 / 2, wd[1], run.out_vec);
  // Exponents: the lane whose chunk starts a group writes it.
  if (!a.shuffle) {
    const int64_t base = w.row * (D / g);
    V4_UNROLL
    for (int c = 0; c < NC; ++c) {
      const int e = chunk_elem<V, CS>(rs, c);
      if (e % g == 0) a.out_scale[base + e / g] = static_cast<uint8_t>(ex[c]);
    }
    return;
  }
  // aiter q-scale layout (SPEC §6), g = 32: group G of token t is k tile G / 4, row t * D/128 + G / 4 of
  // [T * D/128, 4, 16, qs_pad]; the pad entries (h/16 >= H/16) of (row, G % 4, h % 16) are written 0 by h < 16.
  const int32_t pad = static_cast<int32_t>(aiter_q_scale_pad(a.H));
  uint8_t* const sc_t = a.out_scale + aiter_q_scale_offset(w.t * (D / 128), 0, 0, a.H);   // the token's first tile
  V4_UNROLL
  for (int c = 0; c < NC; ++c) {
    const int e = chunk_elem<V, CS>(rs, c);
    if (e % 32 != 0) continue;
    const int G = e / 32;
    uint8_t* const tile = sc_t + (G / 4) * 64 * pad;
    tile[aiter_q_scale_in_token(w.h, G % 4, pad)] = static_cast<uint8_t>(ex[c]);
    if (w.h < 16)
      for (int32_t hp = static_cast<int32_t>(a.H); hp < pad * 16; hp += 16)
        tile[aiter_q_scale_in_token(hp + w.h, G % 4, pad)] = 0;
  }
}

// FP8: codes [T, H, D] of x * fl(1/s), s = max(amax, 1e-10f) / fmax per group, fp32 scales [T, H, D/g].
template <int D, int V, int CS, Fp8Flavour FL>
V4_FN void store_fp8(const RotateArgs& a, const Run& run, const Row& w, const Runs& rs, const float (&x)[V], int g) {
  constexpr int NC = V / CS;
  float am[NC];
  chunk_amax<V, CS>(x, am, rs.lpg, rs.share);
  float s[NC], inv[NC];
  V4_UNROLL
  for (int c = 0; c < NC; ++c) {
    s[c] = fp8_group_scale(am[c], FL);
    inv[c] = fp8_inv_scale(s[c]);
  }
  constexpr int kWords = V / 8;    // a run's words of 4 codes
  uint32_t wd[2][kWords];
  V4_UNROLL
  for (int q = 0; q < 2 * kWords; ++q) {
    const int c = 4 * q / CS;
    const float iv = inv[c];
    const uint32_t lo = fp8_encode2(fmul(x[4 * q], iv), fmul(x[4 * q + 1], iv), FL);
    const uint32_t hi = fp8_encode2(fmul(x[4 * q + 2], iv), fmul(x[4 * q + 3], iv), FL);
    wd[q / kWords][q % kWords] = lo | (hi << 16);
  }
  if (!w.live) return;
  uint8_t* o = a.out + w.row * D;
  store_words(o + rs.e0, wd[0], run.out_vec);
  store_words(o + rs.e1, wd[1], run.out_vec);
  float* sp = reinterpret_cast<float*>(a.out_scale) + w.row * (D / g);
  V4_UNROLL
  for (int c = 0; c < NC; ++c) {
    const int e = chunk_elem<V, CS>(rs, c);
    if (e % g == 0) sp[e / g] = s[c];
  }
}

// x's dtype (bf16 / fp16), rounded (SPEC §0.4, NaN canonical); out [T, H, D] with element strides, may alias x.
template <int D, int V>
V4_FN void store_half(const RotateArgs& a, const Run& run, const Row& w, const Runs& rs, const float (&x)[V]) {
  constexpr int kWords = V / 4;    // a run's words of 2 values
  uint32_t wd[2][kWords];
  const bool bf = a.in_dt == kBF16;
  V4_UNROLL
  for (int q = 0; q < 2 * kWords; ++q) {
    const float lo = x[2 * q], hi = x[2 * q + 1];
    wd[q / kWords][q % kWords] = bf ? (round_bf16(lo) | (static_cast<uint32_t>(round_bf16(hi)) << 16))
                                    : (round_fp16(lo) | (static_cast<uint32_t>(round_fp16(hi)) << 16));
  }
  if (!w.live) return;
  uint8_t* o = a.out + 2 * (w.t * a.out_st + w.h * a.out_sh);
  store_words(o + 2 * rs.e0, wd[0], run.out_vec);
  store_words(o + 2 * rs.e1, wd[1], run.out_vec);
}

// CS = min(g, V/2) as a template parameter: f(IC<CS>).
template <int V, class F>
V4_FN void with_chunk(int g, F&& f) {
  const int cs = g < V / 2 ? g : V / 2;
  if constexpr (V / 2 > 16) {
    if (cs == 16) return f(std::integral_constant<int, 16>{});
  }
  if constexpr (V / 2 > 32) {
    if (cs == 32) return f(std::integral_constant<int, 32>{});
  }
  f(std::integral_constant<int, V / 2>{});
}

// The output mode of the arguments (out_kind, rounding, flavour).
DSQ_HD int rotate_mode(const RotateArgs& a) {
  if (a.out_kind == code(OutKind::half)) return kHalf;
  if (a.out_kind == code(OutKind::fp8)) return a.flavour == code(Fp8Flavour::e4m3fn) ? kFp8Fn : kFp8Fnuz;
  if (a.rounding == code(Rounding::hardware)) return kFp4Hardware;
  return a.rounding == code(Rounding::rne) ? kFp4Rne : kFp4Threshold;
}

// =========================================================================================================
// SPEC §7.7 rope_rotate_quant: block b takes rows [b * kRows, (b + 1) * kRows), L lanes a row.
// =========================================================================================================
template <int D, int V, int MODE>
V4_FN void rotate_block(const RotateArgs& a, const Run& run, RotateSmem& sm) {
  using G = Geo<D, V>;
  constexpr int L = G::L;
  const int tid = thread_id();
  const int lane = tid & (L - 1);
  const int64_t rows = a.T * a.H;
  const int64_t row0 = block_id() * G::kRows;
  // SPEC §5 tail RoPE table: the block's tokens' (cos, sin) rows, the position clamped into [0, max_pos) and
  // reported once per token (SPEC §7.5). Filled before the rows are loaded: the rows' registers are then not
  // held across the fill (the rows' loads issued first measured slower: H100, T = 8192, 110.0 µs at four blocks an
  // SM and 124.3 at three, against 100.1).
  const int64_t tok0 = row0 >> run.h_shift;
  if (run.table) {
    const int ntok = (G::kRows >> run.h_shift) > 0 ? (G::kRows >> run.h_shift) : 1;
    for (int i = tid; i < 32 * ntok; i += kThreads) {
      const int64_t tk = tok0 + i / 32;
      const int64_t pos = load_i(a.positions, tk < a.T ? tk : a.T - 1, a.pos_dt);
      if ((i & 31) == 0 && tk < a.T && (pos < 0 || pos >= a.rope.max_pos))
        atomic_or(a.err_flag, code(ErrFlag::position_out_of_range));
      float c, s;
      rope_cs(a.rope, rope_position(pos, a.rope.max_pos, 1), i & 31, c, s);
      sm.cs[2 * i] = c;
      sm.cs[2 * i + 1] = s;
    }
    block_sync();
  }
  Row w;
  w.row = row0 + tid / L;
  w.live = w.row < rows;
  if (!w.live) w.row = rows - 1;    // a whole group: its shuffles stay with the warp's
  w.t = w.row >> run.h_shift;
  w.h = static_cast<int>(w.row & (a.H - 1));
  float x[V];
  load_values<V>(a, w.t * a.x_st + w.h * a.x_sh + V * lane, run.x_vec, x);

  constexpr int kTail0 = V >= 64 ? V - 64 : 0;          // first tail value of a tail lane
  const bool tail_lane = V >= 64 ? lane == L - 1 : lane >= L - 64 / V;
  if (!run.table) {                                      // read per row: the row's first lane reports its token
    const int64_t pos = load_i(a.positions, w.t, a.pos_dt);
    if (w.live && w.h == 0 && lane == 0 && (pos < 0 || pos >= a.rope.max_pos))
      atomic_or(a.err_flag, code(ErrFlag::position_out_of_range));
    if (tail_lane) {
      const int64_t p = rope_position(pos, a.rope.max_pos, 1);
      const int j0 = (V * lane + kTail0 - (D - 64)) / 2;
      V4_UNROLL
      for (int k = 0; k < (V - kTail0) / 2; ++k) {
        float c, s;
        rope_cs(a.rope, p, j0 + k, c, s);
        rope_pair(x[kTail0 + 2 * k], x[kTail0 + 2 * k + 1], c, s);
      }
    }
  } else if (tail_lane) {
    const int j0 = (V * lane + kTail0 - (D - 64)) / 2;   // even: 16-byte aligned entries
    const float* cs = sm.cs + 64 * static_cast<int>(w.t - tok0) + 2 * j0;
    V4_UNROLL
    for (int k = 0; k < (V - kTail0) / 2; k += 2) {
      uint32_t e[4];   // cos j, sin j, cos j+1, sin j+1
      ld16(cs + 2 * k, e);
      rope_pair(x[kTail0 + 2 * k], x[kTail0 + 2 * k + 1], u2f(e[0]), u2f(e[1]));
      rope_pair(x[kTail0 + 2 * k + 2], x[kTail0 + 2 * k + 3], u2f(e[2]), u2f(e[3]));
    }
  }

  if (a.hadamard) hadamard_row<D, V>(x, lane);
  const int g = a.group;
  const Runs rs = runs_of<D, V>(lane, a.hadamard, g);
  const int mode = MODE != kAnyMode ? MODE : rotate_mode(a);
  if (mode == kHalf) {
    if constexpr (MODE == kAnyMode || MODE == kHalf) store_half<D, V>(a, run, w, rs, x);
    return;
  }
  if constexpr (MODE != kHalf) with_chunk<V>(g, [&](auto cs_) {
    constexpr int CS = decltype(cs_)::value;
    if constexpr (MODE == kAnyMode || MODE == kFp8Fn) {
      if (mode == kFp8Fn) return store_fp8<D, V, CS, Fp8Flavour::e4m3fn>(a, run, w, rs, x, g);
    }
    if constexpr (MODE == kAnyMode || MODE == kFp8Fnuz) {
      if (mode == kFp8Fnuz) return store_fp8<D, V, CS, Fp8Flavour::e4m3fnuz>(a, run, w, rs, x, g);
    }
    if constexpr (MODE == kAnyMode || MODE == kFp4Hardware) {
      if (mode == kFp4Hardware) return store_fp4<D, V, CS, Rounding::hardware>(a, run, w, rs, x, g);
    }
    if constexpr (MODE == kAnyMode || MODE == kFp4Rne) {
      if (mode == kFp4Rne) return store_fp4<D, V, CS, Rounding::rne>(a, run, w, rs, x, g);
    }
    if constexpr (MODE == kAnyMode || MODE == kFp4Threshold) {
      if (mode == kFp4Threshold) return store_fp4<D, V, CS, Rounding::threshold>(a, run, w, rs, x, g);
    }
  });
}

// =========================================================================================================
// Host side: the launch's shape (the CUDA and HIP launcher and the emulator use the same).
// =========================================================================================================
// Values a lane for large calls, D = 128: two lanes a row measured faster than one at T = 1024 and 8192, H = 64
// (within 2 % at T = 32768), and than four or eight (H100, T = 8192: 99.5 µs against 106.2 with 32 values a lane
// and 127.7 with 16).
#ifndef DSQ_ROTATE_V_LARGE_128
#define DSQ_ROTATE_V_LARGE_128 64
#endif
#ifndef DSQ_ROTATE_V_LARGE_WIDE     // the same for D >= 256 (64: with 128, the exchanges' shuffles spill registers)
#define DSQ_ROTATE_V_LARGE_WIDE 64
#endif
#ifndef DSQ_ROTATE_LARGE_UNITS      // T * H * D / 128 from which a call takes the large values a lane
#define DSQ_ROTATE_LARGE_UNITS 32768
#endif

// Values a lane of the two instances of D: small calls (rows spread over more SMs, short per-thread chains) and large
// ones (few lanes a row, little exchange work).
template <int D>
struct Instances {
  static constexpr int kSmall = D / 16 > 32 ? D / 32 : 16;
  static constexpr int kLarge = D == 128 ? DSQ_ROTATE_V_LARGE_128 : DSQ_ROTATE_V_LARGE_WIDE;
  static_assert(kLarge <= D && D / kLarge <= 32 && kLarge >= kSmall, "DSQ_ROTATE_V_LARGE_*: at most D, 32 lanes a row");
};

// The values a lane of a call: the large instance for large calls, except FP8 e4m3fnuz (its software encoder
// would need more registers than a 128-value lane leaves), the small one otherwise.
inline int rotate_values_per_lane(const RotateArgs& a, int small, int large) {
  const int64_t units = a.T * a.H * (a.D / 128);
  return units >= DSQ_ROTATE_LARGE_UNITS && rotate_mode(a) != kFp8Fnuz ? large : small;
}

inline bool aligned16(const void* p, int64_t bytes1, int64_t bytes2) {
  return (reinterpret_cast<uintptr_t>(p) % 16) == 0 && bytes1 % 16 == 0 && bytes2 % 16 == 0;
}

// The per-launch values for V values a lane.
inline Run rotate_run(const RotateArgs& a, int v) {
  Run r;
  r.h_shift = 0;
  while ((int64_t{1} << r.h_shift) < a.H) ++r.h_shift;
  const int64_t es = a.in_dt == kF32 ? 4 : 2;
  r.x_vec = aligned16(a.x, a.x_st * es, a.x_sh * es);
  r.out_vec = a.out_kind == code(OutKind::half) ? aligned16(a.out, a.out_st * 2, a.out_sh * 2) : aligned16(a.out, 0, 0);
  const int rows = kThreads / (a.D / v);
  // the block's tokens: max(1, rows / H); reading the entries per row instead took twice as long (H100, T = 8192)
  r.table = rows <= kTabTokens * a.H;
  return r;
}

inline int64_t rotate_grid(const RotateArgs& a, int v) {
  const int64_t rows = kThreads / (a.D / v);
  return (a.T * a.H + rows - 1) / rows;
}

}  // namespace rot
}  // namespace dsqv4
