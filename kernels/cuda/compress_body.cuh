// kernels/cuda/compress_body.cuh: the body of SPEC §7.6 compress_kv (§7.7 rope_rotate_quant's: rotate_body.cuh),
// written once against a tiny SIMT layer so that the same code runs on the GPU
// (kernels/cuda/compress.cu, and hipified for AMD) and under the host emulator of the tests
// (tests/cpp/compress_host.cpp, one cooperative fiber per thread), which holds it to the reference on the CPU.
//
// The includer defines, in namespace dsqv4, before including this file:
//   V4_FN                      function qualifier (__device__ __forceinline__ / inline)
//   V4_UNROLL, V4_NO_UNROLL    `#pragma unroll` / `#pragma unroll 1` where the compiler understands them
//   int thread_id()            threadIdx.x (blocks of kThreads = 256 threads, 1-D)
//   int64_t block_id()         blockIdx.x
//   void block_sync()          __syncthreads()
//   float shfl_xor(float, int) / int shfl_xor_i(int, int): the value of lane (lane ^ s) within the
//                              32-lane warp (CUDA width 32; on a wave64 each half is one such warp); every
//                              lane of the warp calls it together
//   void atomic_or(int*, int)  the error flag (python/dsaquant/errors.py codes)
// All format math is the shared header's (src/include/dsaquant); this file only distributes it.
#pragma once

#include "dsaquant/dsaquant.h"
#include "compress_args.h"

namespace dsqv4 {

using namespace dsq;

constexpr int kThreads = 256;            // threads per block
constexpr int kWarps = kThreads / 32;    // 32-lane warps per block

// ---- loads ------------------------------------------------------------------------------------------
V4_FN float load_f(const void* p, int64_t i, int dt) {   // fp32 / bf16 / fp16 element -> fp32 (exact)
  if (dt == kF32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dt == kBF16 ? bf16_to_f32(h) : fp16_to_f32(h);
}
V4_FN int64_t load_i(const void* p, int64_t i, int dt) {  // int32 / int64 element
  return dt == kI64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}
// SPEC §5: (cos, sin) of pair j at table row p, converted exactly to fp32.
V4_FN void rope_cs(const RopeTable& t, int64_t p, int j, float& c, float& s) {
  if (t.pairs) {
    const float* f = static_cast<const float*>(t.cos) + p * t.row_stride + 2 * j;
    c = f[0];
    s = f[1];
  } else {
    c = load_f(t.cos, p * t.row_stride + j, t.dtype);
    s = load_f(t.sin, p * t.row_stride + j, t.dtype);
  }
}
V4_FN void store_u32_bytes(uint8_t* p, uint32_t u) {   // 4 bytes, little endian, no alignment assumed
  p[0] = static_cast<uint8_t>(u);
  p[1] = static_cast<uint8_t>(u >> 8);
  p[2] = static_cast<uint8_t>(u >> 16);
  p[3] = static_cast<uint8_t>(u >> 24);
}

// ---- one row of n = 32*V values held by a warp: lane l holds x[V*l .. V*l + V-1] ----------------------
// SPEC §0.2 canonical sum: lane l owns partials V/4*l .. V/4*l + V/4-1. The butterfly's strides >= V/4 pair
// equal slots of lanes l and l ^ (stride / (V/4)); the strides below V/4 are inside the lane. Every lane
// returns the sum.
template <int V>
V4_FN float warp_sum(const float (&t)[V]) {
  constexpr int NP = V / 4;
  float p[NP];
  V4_UNROLL
  for (int q = 0; q < NP; ++q) p[q] = canonical_partial(t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
  V4_UNROLL
  for (int s = 16; s >= 1; s >>= 1) {
    V4_UNROLL
    for (int q = 0; q < NP; ++q) p[q] = fadd(p[q], shfl_xor(p[q], s));
  }
  V4_UNROLL
  for (int s = NP / 2; s >= 1; s >>= 1) {
    V4_UNROLL
    for (int q = 0; q < s; ++q) p[q] = fadd(p[q], p[q + s]);
  }
  return p[0];
}

// SPEC §5 Hadamard over the row (n = 32*V, Sylvester order, h = 1, 2, ... ascending), then times fl(n^-0.5):
// h < V inside the lane, h = V*s between lanes l and l ^ s.
template <int V>
V4_FN void warp_hadamard(float (&x)[V], int lane) {
  hadamard_butterflies<V>(x);   // strides below V: inside the lane
  V4_UNROLL
  for (int s = 1; s < 32; s <<= 1) {
    const bool upper = (lane & s) != 0;   // holds b of the pair (a, b): a - b, the lower lane a + b
    V4_UNROLL
    for (int e = 0; e < V; ++e) {
      const float o = shfl_xor(x[e], s);
      x[e] = upper ? fsub(o, x[e]) : fadd(x[e], o);
    }
  }
  const float c = hadamard_scale(32 * V);
  V4_UNROLL
  for (int e = 0; e < V; ++e) x[e] = fmul(x[e], c);
}

// SPEC §5 tail RoPE with interleaved pairs on the last 64 dims (pair j = dims n-64+2j, n-63+2j; cos/sin
// index j) at table row p. fp32, not rounded.
template <int V>
V4_FN void warp_rope_tail(float (&x)[V], int lane, const RopeTable& t, int64_t p) {
  constexpr int n = 32 * V;
  if (V * lane < n - 64) return;
  V4_UNROLL
  for (int e = 0; e < V; e += 2) {
    float c, s;
    rope_cs(t, p, (V * lane + e - (n - 64)) / 2, c, s);
    rope_pair(x[e], x[e + 1], c, s);
  }
}

template <int V>
V4_FN void warp_round_bf16(float (&x)[V]) {
  V4_UNROLL
  for (int e = 0; e < V; ++e) x[e] = round_to_bf16(x[e]);
}

// Groups of g consecutive values (g a power of two, 16 <= g <= n): a lane's values fall into kChunks(V)
// chunks of cs = min(g, V) values (2 only for V = 32, g = 16), each inside one group; a group spans
// g / V lanes when g > V.
template <int V>
struct Chunks {
  static constexpr int kMax = V > 16 ? V / 16 : 1;
};
// SPEC §0.3 amax of each chunk's group (NaN ignored); am[c] for c < V / min(g, V).
template <int V>
V4_FN void group_amax(const float (&x)[V], int g, float (&am)[Chunks<V>::kMax]) {
  constexpr int NC = Chunks<V>::kMax;
  const int cs = g < V ? g : V;
  V4_UNROLL
  for (int c = 0; c < NC; ++c) am[c] = 0.0f;
  V4_UNROLL
  for (int e = 0; e < V; ++e) {
    const float a = abs_f(x[e]);
    if (NC == 1 || e < cs) am[0] = fmax_nn(am[0], a);
    else am[NC - 1] = fmax_nn(am[NC - 1], a);
  }
  const int lpg = g > V ? g / V : 1;   // lanes per group: consecutive lanes, aligned, so xor stays inside
  for (int s = 1; s < lpg; s <<= 1) {
    V4_UNROLL
    for (int c = 0; c < NC; ++c) am[c] = fmax_nn(am[c], shfl_xor(am[c], s));
  }
}
template <int V>
V4_FN int chunk_of(int e, int g) { return (Chunks<V>::kMax > 1 && e >= (g < V ? g : V)) ? 1 : 0; }

// SPEC §1-§3: the lane's V values as V/2 packed bytes in groups of g (exponents ex by chunk).
template <int V>
V4_FN void fp4_encode_lane(const float (&x)[V], const int (&ex)[Chunks<V>::kMax], int g, Rounding r,
                           uint8_t (&out)[V / 2]) {
  V4_UNROLL
  for (int i = 0; i < V / 2; ++i) {
    const int e = chunk_of<V>(2 * i, g) ? ex[Chunks<V>::kMax - 1] : ex[0];
    out[i] = e2m1_encode_pair(canon_nan(x[2 * i]), canon_nan(x[2 * i + 1]), e, r);
  }
}

// =========================================================================================================
// SPEC §7.6 compress_kv
//
// One launch, kThreads threads a block, grid = B + ceil(T / ratio) blocks (compress_args.h compress_grid):
//   - blocks [0, B), one per sequence b ("sequence blocks"): the boundaries among the sequence's first K-1
//     tokens of the call, then __syncthreads, then (update_state) the ring rows of its last K tokens;
//   - blocks [B, ...), one per range of `ratio` consecutive tokens ("range blocks"): every other boundary (at most
//     one per range).
// Why this orders every ring read before every ring write of the call (SPEC §7.6 "State update") without a
// grid barrier or a second launch: a window row comes from the ring only when its position s < start_pos[b],
// and the window of a boundary at local index j (p = start_pos[b] + j) covers s >= p - K + 1, so only
// boundaries with j < K - 1 read the ring at all. Those are exactly the ones the sequence block handles, and
// the same block writes the sequence's ring rows only after them (block barrier). Range blocks read nothing
// but this call's inputs (kv, score, ape), which no block writes. A ring row of sequence b is read and written
// only by sequence b's block, since sequences own distinct state slots (two non-empty sequences sharing a slot
// in one call are the caller's error: the reference's own writes are then ambiguous).
// =========================================================================================================

// Compile-time geometry by window size K (ratio in {4, 128}, so K determines ratio and overlap).
template <int K>
struct Geo {
  static constexpr int kRatio = K <= 8 ? 4 : 128;
  static constexpr bool kOverlap = K == 8 || K == 256;
  static constexpr int kM = K / 4;                                 // canonical partials of the window
  // Pool: a warp covers kCL consecutive columns x kPL window slices. Lane = pl * kCL + cl holds column cl
  // and partials i = pl + kPL * q, q < kQ (window rows 4i .. 4i+3): loads of one row are kCL consecutive
  // floats, and the butterfly's strides >= kPL stay in the thread, the smaller ones cross lanes (xor s*kCL).
  static constexpr int kPL = K == 256 ? 16 : (K == 128 ? 8 : (K == 8 ? 2 : 1));
  static constexpr int kCL = 32 / kPL;
  static constexpr int kQ = kM / kPL;
  static constexpr int kCols = kWarps * kCL;                      // columns per block pass
};

struct CompressSmem {
  float y[512];         // the pooled row of the current boundary (D <= 512)
};

struct Seq {            // one sequence of the call
  int64_t first, len, start;
  int32_t slot;         // its ring slot (state_slot is int32)
};

// x mod m in [0, m) for m > 0 (x may be negative), with a 32-bit fast path (64-bit division is long on GPUs).
V4_FN int64_t mod_floor(int64_t x, int64_t m) {
  const int64_t ax = x < 0 ? -x : x;
  int64_t r;
  if (((ax | m) >> 32) == 0) r = static_cast<int64_t>(static_cast<uint32_t>(ax) % static_cast<uint32_t>(m));
  else r = ax % m;
  return x < 0 && r != 0 ? m - r : r;
}

V4_FN int64_t clamp_tok(int64_t v, int64_t T) { return v < 0 ? 0 : (v > T ? T : v); }

// cu_seqlens is clamped into [0, T] (as the reference does); a non-monotone one is caught only by the opt-in host
// check, and here gives unspecified rows but never an access out of bounds.
V4_FN Seq seq_of(const CompressArgs& a, int64_t b) {
  Seq q;
  q.first = clamp_tok(a.cu_seqlens[b], a.T);
  const int64_t end = clamp_tok(a.cu_seqlens[b + 1], a.T);
  q.len = end > q.first ? end - q.first : 0;
  q.start = a.start_pos[b];
  q.slot = a.state_slot[b];
  return q;
}

// The sequence of token i (torch.searchsorted(cu[1:], i, right=True)) or -1 when i belongs to none.
V4_FN int64_t seq_of_token(const CompressArgs& a, int64_t i) {
  int64_t lo = 0, hi = a.B;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (clamp_tok(a.cu_seqlens[mid + 1], a.T) <= i) lo = mid + 1;
    else hi = mid;
  }
  if (lo >= a.B || i < clamp_tok(a.cu_seqlens[0], a.T) || i < clamp_tok(a.cu_seqlens[lo], a.T)) return -1;
  return lo;
}

// Window row k (0..K-1) of the boundary at token i, position p, column c (0..D-1). The row's position is
// s = p - K + 1 + k (callers skip s < 0: excluded). Column half: the overlap half [0, D) for k < ratio with
// overlap, else the current half [D, 2D) (without overlap the only half, [0, D)).
template <int K, int D>
V4_FN int window_col(int k, int c) {
  return (Geo<K>::kOverlap && k >= Geo<K>::kRatio ? D : 0) + c;
}
// Where window row k lives: from the inputs (token r = i - (K-1-k)) when its position s >= start_pos, else
// in the ring at row s mod R. Rows of the inputs lie in [cu_seqlens[b], i] (s >= start_pos), so r needs no
// clamping; the ring row is ring0 + k wrapped once (ring0 = s0 mod R, and k < K <= R).
struct Win {
  int64_t i, s0, start;
  int32_t slot;
  int64_t ring0;   // (s0 mod R) in [0, R)
};
template <int K>
V4_FN Win window_of(const CompressArgs& a, const Seq& q, int64_t i, int64_t p) {
  Win w;
  w.i = i;
  w.s0 = p - (K - 1);
  w.start = q.start;
  w.slot = q.slot;
  w.ring0 = mod_floor(w.s0, a.R);
  return w;
}
V4_FN int64_t ring_row(const CompressArgs& a, const Win& w, int k) {
  const int64_t r = w.ring0 + k;
  return r >= a.R ? r - a.R : r;
}
// sig_k = fl(score[r] + ape[s mod ratio]) from the inputs, else the ring row as stored. s = s0 + k >= 0.
template <int K, int D>
V4_FN float window_sig(const CompressArgs& a, const Win& w, int k, int c) {
  const int col = window_col<K, D>(k, c);
  const int64_t s = w.s0 + k;
  if (s >= w.start) {
    const int64_t r = w.i - (K - 1 - k);
    return fadd(load_f(a.score, r * a.sc_st + col, a.in_dt), a.ape[(s & (Geo<K>::kRatio - 1)) * a.ape_st + col]);
  }
  return a.state_score[w.slot * a.ssc_s0 + ring_row(a, w, k) * a.ssc_s1 + col];
}
template <int K, int D>
V4_FN float window_kv(const CompressArgs& a, const Win& w, int k, int c) {
  const int col = window_col<K, D>(k, c);
  if (w.s0 + k >= w.start) return load_f(a.kv, (w.i - (K - 1 - k)) * a.kv_st + col, a.in_dt);
  return a.state_kv[w.slot * a.skv_s0 + ring_row(a, w, k) * a.skv_s1 + col];
}

// SPEC §7.6 step 2 for every column of one boundary: sm.y[c] = the pooled value. All threads call it.
template <int K, int D>
V4_FN void pool_row(const CompressArgs& a, CompressSmem& sm, const Seq& q, int64_t i, int64_t p) {
  using G = Geo<K>;
  constexpr int kR = G::kQ * 4;                // window rows per thread
  const int tid = thread_id(), warp = tid >> 5, lane = tid & 31;
  const int cl = lane % G::kCL, pl = lane / G::kCL;
  const Win w = window_of<K>(a, q, i, p);
  const int64_t s0 = w.s0;                     // position of window row 0
  V4_NO_UNROLL   // one pass of kCols columns at a time (unrolling the passes only raises the register count)
  for (int c0 = 0; c0 < D; c0 += G::kCols) {
    if (c0 + warp * G::kCL >= D) break;        // the whole warp is past the row (D % kCL == 0)
    const int c = c0 + warp * G::kCL + cl;
    // Pass 1: sig of the thread's rows; the window max and NaN conditions.
    float v[kR];
    PoolMax st = pool_max_init();
    V4_UNROLL
    for (int qq = 0; qq < G::kQ; ++qq) {
      V4_UNROLL
      for (int r = 0; r < 4; ++r) {
        const int k = 4 * (pl + G::kPL * qq) + r;
        const int64_t s = s0 + k;
        v[4 * qq + r] = 0.0f;
        if (s >= 0) {
          v[4 * qq + r] = window_sig<K, D>(a, w, k, c);
          pool_max_add(st, v[4 * qq + r]);
        }
      }
    }
    V4_UNROLL
    for (int x = G::kCL; x < 32; x <<= 1) {    // merge the kPL slices of the column
      const float m = shfl_xor(st.m, x);
      const int f = shfl_xor_i((st.bad ? 1 : 0) | (st.live ? 2 : 0), x);
      pool_max_merge(st, m, (f & 1) != 0, (f & 2) != 0);
    }
    // Pass 2: e_k (in place of sig), S = canonical sum of e.
    float part[G::kQ];
    V4_UNROLL
    for (int qq = 0; qq < G::kQ; ++qq) {
      V4_UNROLL
      for (int r = 0; r < 4; ++r) {
        const int k = 4 * (pl + G::kPL * qq) + r;
        v[4 * qq + r] = s0 + k >= 0 ? pool_exp(v[4 * qq + r], st.m) : 0.0f;
      }
      part[qq] = canonical_partial(v[4 * qq], v[4 * qq + 1], v[4 * qq + 2], v[4 * qq + 3]);
    }
    V4_UNROLL
    for (int s = G::kQ / 2; s >= 1; s >>= 1) {   // global strides kPL*kQ/2 .. kPL: in the thread
      V4_UNROLL
      for (int qq = 0; qq < s; ++qq) part[qq] = fadd(part[qq], part[qq + s]);
    }
    float S = part[0];
    V4_UNROLL
    for (int x = G::kPL / 2; x >= 1; x >>= 1) S = fadd(S, shfl_xor(S, x * G::kCL));   // strides kPL/2 .. 1
    // Pass 3: the weights fl(e/S) (in place; first, so that few values are live across the divisions), then
    // y = canonical sum of fl(w * kv).
    V4_UNROLL
    for (int x = 0; x < kR; ++x) v[x] = pool_weight(v[x], S);
    V4_UNROLL
    for (int qq = 0; qq < G::kQ; ++qq) {
      float t[4];
      V4_UNROLL
      for (int r = 0; r < 4; ++r) {
        const int k = 4 * (pl + G::kPL * qq) + r;
        t[r] = s0 + k >= 0 ? fmul(v[4 * qq + r], window_kv<K, D>(a, w, k, c)) : 0.0f;
      }
      part[qq] = canonical_partial(t[0], t[1], t[2], t[3]);
    }
    V4_UNROLL
    for (int s = G::kQ / 2; s >= 1; s >>= 1) {
      V4_UNROLL
      for (int qq = 0; qq < s; ++qq) part[qq] = fadd(part[qq], part[qq + s]);
    }
    float y = part[0];
    V4_UNROLL
    for (int x = G::kPL / 2; x >= 1; x >>= 1) y = fadd(y, shfl_xor(y, x * G::kCL));
    if (pl == 0) sm.y[c] = pool_finish(y, st);
  }
}

// SPEC §7.6 steps 3-7 on warp 0: rounding points, RMSNorm, tail RoPE, Hadamard, quantize and store at `slot`.
template <int K, int D>
V4_FN void finish_row(const CompressArgs& a, const CompressSmem& sm, int64_t p, int64_t slot, int lane) {
  constexpr int V = D / 32;
  float x[V];
  V4_UNROLL
  for (int e = 0; e < V; ++e) x[e] = sm.y[V * lane + e];
  const int pts = a.bf16_after;
  if (pts & code(RoundPoint::pool)) warp_round_bf16(x);
  // RMSNorm (SPEC §5): inv = 1/sqrt(S(x*x)/D + eps), y = fl(w * fl(x*inv)).
  float sq[V];
  V4_UNROLL
  for (int e = 0; e < V; ++e) sq[e] = fmul(x[e], x[e]);
  // S/D as a multiply by the exact power of two 2^-log2(D): the same correctly rounded value as the division.
  const float inv = inv_sqrt_eps(fmul(warp_sum(sq), 1.0f / static_cast<float>(D)), a.eps);
  V4_UNROLL
  for (int e = 0; e < V; ++e) x[e] = rms_norm_apply(x[e], inv, load_f(a.norm_w, V * lane + e, a.norm_w_dt));
  if (pts & code(RoundPoint::norm)) warp_round_bf16(x);
  // Tail RoPE at p + 1 - ratio (>= 0), clamped into the table (reported by the caller).
  warp_rope_tail(x, lane, a.rope, rope_position(p + 1 - Geo<K>::kRatio, a.rope.max_pos, 1));
  if (pts & code(RoundPoint::rope)) warp_round_bf16(x);
  if constexpr (D == 128) {
    if (a.hadamard) {
      warp_hadamard(x, lane);
      if (pts & code(RoundPoint::hadamard)) warp_round_bf16(x);
    }
  }
  if (a.quant_mode == code(QuantMode::none) || D != 128) {      // bf16 [NB, P, D]: slot t is row t
    uint16_t* row = reinterpret_cast<uint16_t*>(a.cache) + slot * D + V * lane;
    V4_UNROLL
    for (int e = 0; e < V; ++e) row[e] = round_bf16(x[e]);
    return;
  }
  if constexpr (D == 128) {
    if (a.quant_mode == code(QuantMode::fp8)) {                // fp8_132 (SPEC §4 k rule, §6)
      const Fp8Flavour fl = static_cast<Fp8Flavour>(a.flavour);
      float am[1];
      group_amax(x, 128, am);
      const float s = fp8_row_scale(am[0], fl, Fp8Role::k, a.ue8m0);
      const float inv_s = fp8_inv_scale(s);
      V4_UNROLL
      for (int e = 0; e < V; e += 2) {
        const uint16_t two = fp8_encode2(fmul(x[e], inv_s), fmul(x[e + 1], inv_s), fl);
        a.cache[fp8_132_data_offset(slot, a.P, V * lane + e, a.preshuffle)] = static_cast<uint8_t>(two);
        a.cache[fp8_132_data_offset(slot, a.P, V * lane + e + 1, a.preshuffle)] = static_cast<uint8_t>(two >> 8);
      }
      if (lane == 0) store_u32_bytes(a.cache + fp8_132_scale_offset(slot, a.P), f2u(s));
      return;
    }
    // FP4 blocks of 32 (8 lanes): the §3 exponent by scale_rule.
    const ScaleRule rule = static_cast<ScaleRule>(a.scale_rule);
    float am[1];
    group_amax(x, 32, am);
    const int ex = ue8m0_exponent(am[0], rule);
    const int blk = lane >> 3;
    const bool first = (lane & 7) == 0;
    if (a.quant_mode == code(QuantMode::fp4_sim)) {             // §7.2 stage 1, bf16 [NB, P, 128]
      uint16_t* row = reinterpret_cast<uint16_t*>(a.cache) + slot * D + V * lane;
      V4_UNROLL
      for (int e = 0; e < V; ++e) row[e] = round_bf16(fp4_fake_quant_value_e(canon_nan(x[e]), ex));
      return;
    }
    const int exs[1] = {ex};
    uint8_t bytes[V / 2];
    fp4_encode_lane(x, exs, 32, static_cast<Rounding>(a.rounding), bytes);
    if (a.aiter_layout) {                      // aiter_fp4 (P = 64)
      V4_UNROLL
      for (int b = 0; b < V / 2; ++b) a.cache[aiter_fp4_data_offset(slot, a.P, (V / 2) * lane + b)] = bytes[b];
      if (first) a.cache_scale[aiter_fp4_scale_offset(slot, a.P, blk)] = static_cast<uint8_t>(ex);
    } else {                                   // packed68
      V4_UNROLL
      for (int b = 0; b < V / 2; ++b) a.cache[packed68_payload_offset(slot, a.P, (V / 2) * lane + b)] = bytes[b];
      if (first) a.cache[packed68_scale_offset(slot, a.P, blk)] = static_cast<uint8_t>(ex);
    }
  }
}

// One boundary (token i at position p of sequence q): pool, then warp 0 finishes and stores. Block-uniform.
template <int K, int D>
V4_FN void compress_boundary(const CompressArgs& a, CompressSmem& sm, const Seq& q, int64_t i, int64_t p) {
  const int tid = thread_id();
  // SPEC §7.5: the RoPE position p + 1 - ratio (>= 0) is clamped into the table and reported.
  if (tid == 0 && p + 1 - Geo<K>::kRatio >= a.rope.max_pos) atomic_or(a.err_flag, code(ErrFlag::position_out_of_range));
  const int64_t slot = a.out_slots[i];
  if (slot < 0) return;                        // no store (the ring update still happens)
  if (slot >= a.num_blocks * a.P) {            // never written out of bounds: skipped and reported
    if (tid == 0) atomic_or(a.err_flag, code(ErrFlag::slot_out_of_range));
    return;
  }
  pool_row<K, D>(a, sm, q, i, p);
  block_sync();
  if (tid < 32) finish_row<K, D>(a, sm, p, slot, tid);
  block_sync();                                // sm.y is free again
}

template <int K>
V4_FN bool is_boundary(int64_t p) { return p >= 0 && ((p + 1) & (Geo<K>::kRatio - 1)) == 0; }

// State update (SPEC §7.6): ring row [slot, p mod R] of each of the sequence's last K tokens (p >= 0) gets
// kv (fp32, exact) and fl(score + ape[p mod ratio]) (a NaN stored canonical), over the full width C.
template <int K, int D>
V4_FN void write_ring(const CompressArgs& a, const Seq& q) {
  constexpr int C = (Geo<K>::kOverlap ? 2 : 1) * D;
  const int64_t j0 = q.len > K ? q.len - K : 0;
  int64_t row = mod_floor(q.start + j0, a.R); // one modulo; then rows advance by one, wrapping at most once
                                               // (at most K <= R tokens)
  for (int64_t j = j0; j < q.len; ++j, row = row + 1 == a.R ? 0 : row + 1) {
    const int64_t pos = q.start + j, i = q.first + j;
    if (pos < 0) continue;
    float* skv = a.state_kv + q.slot * a.skv_s0 + row * a.skv_s1;
    float* ssc = a.state_score + q.slot * a.ssc_s0 + row * a.ssc_s1;
    const float* ape = a.ape + (pos & (Geo<K>::kRatio - 1)) * a.ape_st;
    for (int c = thread_id(); c < C; c += kThreads) {
      skv[c] = load_f(a.kv, i * a.kv_st + c, a.in_dt);
      ssc[c] = canon_nan(fadd(load_f(a.score, i * a.sc_st + c, a.in_dt), ape[c]));
    }
  }
}

// First local index j >= j_lo of sequence q that is a boundary (p = start + j >= 0, (p + 1) mod ratio == 0).
template <int K>
V4_FN int64_t first_boundary(const Seq& q, int64_t j_lo) {
  constexpr int RT = Geo<K>::kRatio;
  int64_t j = j_lo + mod_floor(-(q.start + j_lo + 1), RT);
  if (q.start + j < 0) j += ((-(q.start + j) + RT - 1) / RT) * RT;   // (a negative start_pos: p >= 0 first)
  return j;
}

// No loop runs around compress_boundary (a loop made the compilers hoist its invariants and spill): a range block has
// at most one boundary to handle, a sequence block at most two; both kinds share the first call site.
template <int K, int D>
V4_FN void compress_block(const CompressArgs& a, CompressSmem& sm) {
  constexpr int RT = Geo<K>::kRatio;
  const int64_t bid = block_id();
  const bool seq_block = bid < a.B;
  int64_t b = bid;
  if (!seq_block) {
    // Range block: tokens [i0, i0 + ratio). Its boundaries at local index >= K - 1 read only the inputs. There is
    // at most one: a sequence that starts inside the range has local indices < ratio - 1 <= K - 1 there, so only
    // the sequence holding token i0 can have one, and a sequence has one boundary every ratio positions.
    b = seq_of_token(a, (bid - a.B) * RT);
    if (b < 0) return;
  }
  const Seq q = seq_of(a, b);
  if (q.len == 0) return;
  if (q.slot < 0 || q.slot >= a.n_ring) {      // the whole sequence is skipped, and reported (once)
    if (seq_block && thread_id() == 0) atomic_or(a.err_flag, code(ErrFlag::slot_out_of_range));
    return;
  }
  // Sequence block: the boundaries at local index j < K - 1 (the only ones whose windows may reach into the ring),
  // one every ratio tokens, so one without overlap (K = ratio) and at most two with overlap (K = 2 ratio).
  const int64_t i0 = (bid - a.B) * RT;
  const int64_t j = first_boundary<K>(q, seq_block ? 0 : i0 - q.first);
  const bool mine = seq_block ? j < (q.len < K - 1 ? q.len : K - 1)
                              : (j >= K - 1 && j < q.len && q.first + j < i0 + RT);
  if (mine) compress_boundary<K, D>(a, sm, q, q.first + j, q.start + j);
  if (!seq_block) return;
  if constexpr (Geo<K>::kOverlap) {
    if (j + RT < (q.len < K - 1 ? q.len : K - 1)) compress_boundary<K, D>(a, sm, q, q.first + j + RT, q.start + j + RT);
  }
  if (a.update_state) {                        // every ring read of the sequence (above) before its writes
    block_sync();
    write_ring<K, D>(a, q);
  }
}

}  // namespace dsqv4
