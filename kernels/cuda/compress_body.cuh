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
//   void prefetch_l1(const void*) a hint: the line holding the address into the SM's L1 (may do nothing)
//   void ld16(const void* p, uint32_t (&w)[4]), ld8(const void* p, uint32_t (&w)[2])
//                              the 16 / 8 bytes at p (aligned to their size), little endian words
//   void st16(void* p, const uint32_t (&w)[4]) the 16 bytes at p (16-byte aligned)
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

// The cos/sin a lane needs for warp_rope_tail at table row p, loaded ahead of use (c[j], s[j] for the lane's
// pair j; zeros on lanes outside the tail).
template <int V>
struct RopeIn {
  float c[V / 2], s[V / 2];
};
template <int V>
V4_FN RopeIn<V> rope_in(const RopeTable& t, int64_t p, int lane) {
  constexpr int n = 32 * V;
  RopeIn<V> r;
  V4_UNROLL
  for (int e = 0; e < V; e += 2) {
    r.c[e / 2] = 0.0f;
    r.s[e / 2] = 0.0f;
    if (V * lane >= n - 64) rope_cs(t, p, (V * lane + e - (n - 64)) / 2, r.c[e / 2], r.s[e / 2]);
  }
  return r;
}
// warp_rope_tail with the table values already in registers.
template <int V>
V4_FN void warp_rope_tail_in(float (&x)[V], int lane, const RopeIn<V>& r) {
  constexpr int n = 32 * V;
  if (V * lane < n - 64) return;
  V4_UNROLL
  for (int e = 0; e < V; e += 2) rope_pair(x[e], x[e + 1], r.c[e / 2], r.s[e / 2]);
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
// One launch, kThreads threads a block, grid = B + the range blocks (compress_args.h compress_grid):
//   - blocks [0, B), one per sequence b ("sequence blocks"): the boundaries among the sequence's first K-1
//     tokens of the call (the whole block pools each one, warp 0 finishes it), then __syncthreads, then
//     (update_state) the ring rows of its last K tokens, spread over all threads;
//   - blocks [B, ...) ("range blocks"): every other boundary (at most one per range of `ratio` consecutive
//     tokens). Range mode `block`: one range a block, pooled by the whole block (few ranges: the latency of
//     each boundary is what counts). Range mode `warp` (K <= 8, D = 128, many ranges): kWarps ranges a block,
//     one a warp, each warp pooling its boundary's whole window in registers (lane l: columns 4l .. 4l+3, every
//     window row) and finishing it in place, without shared memory or block barriers.
// Why this orders every ring read before every ring write of the call (SPEC §7.6 "State update") without a
// grid barrier or a second launch: a window row comes from the ring only when its position s < start_pos[b],
// and the window of a boundary at local index j (p = start_pos[b] + j) covers s >= p - K + 1, so only
// boundaries with j < K - 1 read the ring at all. Those are exactly the ones the sequence block handles, and
// the same block writes the sequence's ring rows only after them (block barrier). Range blocks read nothing
// but this call's inputs (kv, score, ape), which no block writes. A ring row of sequence b is read and written
// only by sequence b's block, since sequences own distinct state slots (two non-empty sequences sharing a slot
// in one call are the caller's error: the reference's own writes are then ambiguous).
// Every pooled value is computed in the SPEC's order whatever the mode (the modes only move the same fp32
// operations between threads), so the bytes do not depend on the range mode nor on the order of blocks.
// =========================================================================================================

#ifndef DSQ_COMPRESS_WARP_COLS
#define DSQ_COMPRESS_WARP_COLS 4   // columns a trip of the warp pool's column loop (1, 2 or 4: one trip, unrolled)
#endif
// Window slices of a warp for K = 128 and 256 (build options): a thread holds K / (4 * slices) canonical partials of
// 4 rows. Measured on an H100, ratio 128, T = 8192 (column split): 8 slices (16 rows a thread, about 200
// registers, one block an SM) 35.9 µs, 16 slices (8 rows, about 125 registers, two blocks an SM, kv loaded with
// sig) 27.2 µs, 32 slices (4 rows, every butterfly level across lanes) 34.9 µs; with the branch-free pool, 16 slices
// 23.5 µs (clusters of 4) and 23.3 (of 8), 32 slices 32.9 and 35.2, 8 slices 48.6 (of 8).
#ifndef DSQ_COMPRESS_SLICES_128
#define DSQ_COMPRESS_SLICES_128 16
#endif
#ifndef DSQ_COMPRESS_SLICES_256
#define DSQ_COMPRESS_SLICES_256 32
#endif

// Compile-time geometry by window size K (ratio in {4, 128}, so K determines ratio and overlap).
template <int K>
struct Geo {
  static constexpr int kRatio = K <= 8 ? 4 : 128;
  static constexpr bool kOverlap = K == 8 || K == 256;
  static constexpr int kM = K / 4;                                 // canonical partials of the window
  // Pool: a warp covers kCL consecutive columns x kPL window slices. Lane = pl * kCL + cl holds column cl
  // and partials i = pl + kPL * q, q < kQ (window rows 4i .. 4i+3): loads of one row are kCL consecutive
  // floats, and the butterfly's strides >= kPL stay in the thread, the smaller ones cross lanes (xor s*kCL).
  static constexpr int kPL =
      K == 256 ? DSQ_COMPRESS_SLICES_256 : (K == 128 ? DSQ_COMPRESS_SLICES_128 : (K == 8 ? 2 : 1));
  static_assert(kPL >= 1 && kPL <= 32 && (kPL & (kPL - 1)) == 0 && kPL <= K / 4, "slices: a power of two <= 32");
  // Few rows a thread also leave the registers to load every row's kv with its sig (one wait for memory a pass).
  static constexpr bool kKvEarly = kM / kPL <= 2;
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

// Whether every row compress_kv reads or writes with vector accesses is 16-byte aligned (the pointers and row
// strides of kv, score, ape and the ring), for the vector paths of the ring update and the warp pool.
V4_FN bool window_vec(const CompressArgs& a) {
  const int esz = a.in_dt == kF32 ? 4 : 2;
  const uint64_t bits = reinterpret_cast<uintptr_t>(a.kv) | reinterpret_cast<uintptr_t>(a.score) |
                        reinterpret_cast<uintptr_t>(a.ape) | reinterpret_cast<uintptr_t>(a.state_kv) |
                        reinterpret_cast<uintptr_t>(a.state_score) |
                        static_cast<uint64_t>(a.kv_st * esz) | static_cast<uint64_t>(a.sc_st * esz) |
                        static_cast<uint64_t>(a.ape_st * 4) | static_cast<uint64_t>(a.skv_s0 * 4) |
                        static_cast<uint64_t>(a.skv_s1 * 4) | static_cast<uint64_t>(a.ssc_s0 * 4) |
                        static_cast<uint64_t>(a.ssc_s1 * 4);
  return (bits & 15u) == 0;
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
// RING false: a window that never reaches the ring (a range's), whose ring0 is not computed.
template <int K, bool RING = true>
V4_FN Win window_of(const CompressArgs& a, const Seq& q, int64_t i, int64_t p) {
  Win w;
  w.i = i;
  w.s0 = p - (K - 1);
  w.start = q.start;
  w.slot = q.slot;
  w.ring0 = RING ? mod_floor(w.s0, a.R) : 0;
  return w;
}
V4_FN int64_t ring_row(const CompressArgs& a, const Win& w, int k) {
  const int64_t r = w.ring0 + k;
  return r >= a.R ? r - a.R : r;
}
// sig_k = fl(score[r] + ape[s mod ratio]) from the inputs, else the ring row as stored. s = s0 + k >= 0.
// DT: the inputs' dtype (kF32 or kBF16). RING: whether the window may reach into the ring; a range block's never
// does (see above), and its code then has no branch a value.
template <int K, int D, int DT, bool RING>
V4_FN float window_sig(const CompressArgs& a, const Win& w, int k, int c) {
  const int col = window_col<K, D>(k, c);
  const int64_t s = w.s0 + k;
  if (!RING || s >= w.start) {
    const int64_t r = w.i - (K - 1 - k);
    return fadd(load_f(a.score, r * a.sc_st + col, DT), a.ape[(s & (Geo<K>::kRatio - 1)) * a.ape_st + col]);
  }
  return a.state_score[w.slot * a.ssc_s0 + ring_row(a, w, k) * a.ssc_s1 + col];
}
template <int K, int D, int DT, bool RING>
V4_FN float window_kv(const CompressArgs& a, const Win& w, int k, int c) {
  const int col = window_col<K, D>(k, c);
  if (!RING || w.s0 + k >= w.start) return load_f(a.kv, (w.i - (K - 1 - k)) * a.kv_st + col, DT);
  return a.state_kv[w.slot * a.skv_s0 + ring_row(a, w, k) * a.skv_s1 + col];
}

// A hint only (no byte depends on it): the lines of the window's input rows (kv and score) go to L1 before the first
// pass of pool_row, so that the later passes (D / kCols of them: 4 for K = 128) find their rows in L1 instead of
// waiting for L2 or HBM once a pass. A row's D values span D*size/128 lines, plus one where the row does not start
// on a line; ring rows are left alone.
template <int K, int D>
V4_FN void prefetch_window(const CompressArgs& a, const Win& w) {
  const int esz = a.in_dt == kF32 ? 4 : 2;
  const int per_line = 128 / esz;
  const int lines = D / per_line + 1;
  const int n = 2 * K * lines;
  for (int t = thread_id(); t < n; t += kThreads) {
    const int k = (t >> 1) / lines, l = (t >> 1) % lines;
    if (w.s0 + k < 0 || w.s0 + k < w.start) continue;
    const int col = window_col<K, D>(k, l < lines - 1 ? l * per_line : D - 1);
    const int64_t r = w.i - (K - 1 - k);
    const char* p = (t & 1) ? static_cast<const char*>(a.kv) + (r * a.kv_st + col) * esz
                            : static_cast<const char*>(a.score) + (r * a.sc_st + col) * esz;
    prefetch_l1(p);
  }
}

// SPEC §7.6 step 2 for every column of one boundary: sm.y[c] = the pooled value. All threads call it.
// Columns [c_lo, c_hi) only (a multiple of kCL each; the whole row by default, a cluster block's share in the
// column-split mode).
template <int K, int D, int DT, bool RING>
V4_FN void pool_row_dt(const CompressArgs& a, CompressSmem& sm, const Seq& q, int64_t i, int64_t p, int c_lo,
                       int c_hi) {
  using G = Geo<K>;
  constexpr int kR = G::kQ * 4;                // window rows per thread
  const int tid = thread_id(), warp = tid >> 5, lane = tid & 31;
  const int cl = lane % G::kCL, pl = lane / G::kCL;
  const Win w = window_of<K, RING>(a, q, i, p);
  const int64_t s0 = w.s0;                     // position of window row 0
  if constexpr (D > G::kCols) {
    if (c_hi - c_lo > G::kCols) prefetch_window<K, D>(a, w);
  }
  V4_NO_UNROLL   // one pass of kCols columns at a time (unrolling the passes only raises the register count)
  for (int c0 = c_lo; c0 < c_hi; c0 += G::kCols) {
    if (c0 + warp * G::kCL >= c_hi) break;     // the whole warp is past the columns (a multiple of kCL)
    const int c = c0 + warp * G::kCL + cl;
    // Pass 1: sig of the thread's rows (and their kv, kKvEarly); the window max. Rows before position 0 are
    // excluded: sig -Inf and kv 0, which pool.h's pool turns into the +0 terms of excluded rows with no test.
    float v[kR], kvv[G::kKvEarly ? kR : 1];
    PoolMax st = pool_max_init();
    V4_UNROLL
    for (int qq = 0; qq < G::kQ; ++qq) {
      V4_UNROLL
      for (int r = 0; r < 4; ++r) {
        const int k = 4 * (pl + G::kPL * qq) + r;
        const int64_t s = s0 + k;
        v[4 * qq + r] = u2f(0xFF800000u);
        if constexpr (G::kKvEarly) kvv[4 * qq + r] = 0.0f;
        if (s >= 0) {
          v[4 * qq + r] = window_sig<K, D, DT, RING>(a, w, k, c);
          if constexpr (G::kKvEarly) kvv[4 * qq + r] = window_kv<K, D, DT, RING>(a, w, k, c);
        }
        pool_max_add(st, v[4 * qq + r]);
      }
    }
    V4_UNROLL
    for (int x = G::kCL; x < 32; x <<= 1) pool_max_merge(st, shfl_xor(st.m, x));   // merge the column's slices
    // Pass 2: e_k (in place of sig), S = canonical sum of e.
    float part[G::kQ];
    V4_UNROLL
    for (int qq = 0; qq < G::kQ; ++qq) {
      V4_UNROLL
      for (int r = 0; r < 4; ++r) v[4 * qq + r] = pool_exp(v[4 * qq + r], st.m);
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
    pool_weights(v, S);
    V4_UNROLL
    for (int qq = 0; qq < G::kQ; ++qq) {
      float t[4];
      V4_UNROLL
      for (int r = 0; r < 4; ++r) {
        const int k = 4 * (pl + G::kPL * qq) + r;
        if constexpr (G::kKvEarly) t[r] = fmul(v[4 * qq + r], kvv[4 * qq + r]);
        else t[r] = s0 + k >= 0 ? fmul(v[4 * qq + r], window_kv<K, D, DT, RING>(a, w, k, c)) : 0.0f;
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
template <int K, int D, bool RING = true>
V4_FN void pool_row(const CompressArgs& a, CompressSmem& sm, const Seq& q, int64_t i, int64_t p, int c_lo = 0,
                    int c_hi = D) {
  if (a.in_dt == kF32) pool_row_dt<K, D, kF32, RING>(a, sm, q, i, p, c_lo, c_hi);
  else pool_row_dt<K, D, kBF16, RING>(a, sm, q, i, p, c_lo, c_hi);
}

// What warp 0 (or a range warp) needs besides the pooled row, loaded before the pool so that its loads overlap
// the window's: the lane's norm weights and RoPE table values (lane l holds dims V*l .. V*l + V-1).
template <int D>
struct FinishIn {
  float w[D / 32];
  RopeIn<D / 32> rope;
};
template <int K, int D>
V4_FN FinishIn<D> finish_in(const CompressArgs& a, int64_t p, int lane) {
  constexpr int V = D / 32;
  FinishIn<D> f;
  V4_UNROLL
  for (int e = 0; e < V; ++e) f.w[e] = load_f(a.norm_w, V * lane + e, a.norm_w_dt);
  // Tail RoPE at p + 1 - ratio (>= 0), clamped into the table (reported by the caller).
  f.rope = rope_in<V>(a.rope, rope_position(p + 1 - Geo<K>::kRatio, a.rope.max_pos, 1), lane);
  return f;
}

// SPEC §7.6 steps 3-7 on one warp whose lane l holds the pooled values x = y[V*l .. V*l + V-1]: rounding points,
// RMSNorm, tail RoPE, Hadamard, quantize and store at `slot`.
template <int K, int D>
V4_FN void finish_values(const CompressArgs& a, float (&x)[D / 32], const FinishIn<D>& f, int64_t slot, int lane) {
  constexpr int V = D / 32;
  const int pts = a.bf16_after;
  if (pts & code(RoundPoint::pool)) warp_round_bf16(x);
  // RMSNorm (SPEC §5): inv = 1/sqrt(S(x*x)/D + eps), y = fl(w * fl(x*inv)).
  float sq[V];
  V4_UNROLL
  for (int e = 0; e < V; ++e) sq[e] = fmul(x[e], x[e]);
  // S/D as a multiply by the exact power of two 2^-log2(D): the same correctly rounded value as the division.
  const float inv = inv_sqrt_eps(fmul(warp_sum(sq), 1.0f / static_cast<float>(D)), a.eps);
  V4_UNROLL
  for (int e = 0; e < V; ++e) x[e] = rms_norm_apply(x[e], inv, f.w[e]);
  if (pts & code(RoundPoint::norm)) warp_round_bf16(x);
  warp_rope_tail_in(x, lane, f.rope);
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

// The checks of one boundary (SPEC §7.5): the RoPE position p + 1 - ratio (>= 0) is clamped into the table and
// reported; a negative out slot means no store (the ring update still happens); a slot past the capacity is
// skipped and reported. Returns the slot to store at, or -1. `leader`: the one thread that reports. Callers pool
// before they test the result, so that the window's loads need not wait for the slot's (a skipped boundary's
// pool is wasted work, never a byte written).
template <int K>
V4_FN int64_t boundary_slot(const CompressArgs& a, int64_t i, int64_t p, bool leader) {
  if (leader && p + 1 - Geo<K>::kRatio >= a.rope.max_pos) atomic_or(a.err_flag, code(ErrFlag::position_out_of_range));
  const int64_t slot = a.out_slots[i];
  if (slot < 0) return -1;
  if (slot >= a.num_blocks * a.P) {            // never written out of bounds
    if (leader) atomic_or(a.err_flag, code(ErrFlag::slot_out_of_range));
    return -1;
  }
  return slot;
}

// One boundary (token i at position p of sequence q) on the whole block: pool, then warp 0 finishes and stores.
// Block-uniform.
template <int K, int D, bool RING>
V4_FN void compress_boundary(const CompressArgs& a, CompressSmem& sm, const Seq& q, int64_t i, int64_t p) {
  const int tid = thread_id();
  const int64_t slot = boundary_slot<K>(a, i, p, tid == 0);
  FinishIn<D> f;
  if (tid < 32) f = finish_in<K, D>(a, p, tid);
  pool_row<K, D, RING>(a, sm, q, i, p);
  block_sync();                                // every window read of the boundary done, sm.y complete
  if (slot >= 0 && tid < 32) {
    constexpr int V = D / 32;
    float x[V];
    V4_UNROLL
    for (int e = 0; e < V; ++e) x[e] = sm.y[V * tid + e];
    finish_values<K, D>(a, x, f, slot, tid);
  }
  // No barrier here: warp 0 is still reading sm.y; a caller that pools again into it passes a barrier first.
}

// 4 consecutive elements of type DT (fp32 / bf16) from p as fp32 (exact): one 16-byte (fp32) or 8-byte (bf16) load
// when VEC (p aligned so).
template <int DT, bool VEC>
V4_FN void load4_f(const void* p, float (&x)[4]) {
  if constexpr (!VEC) {
    V4_UNROLL
    for (int e = 0; e < 4; ++e) x[e] = load_f(p, e, DT);
  } else if constexpr (DT == kF32) {
    uint32_t u[4];
    ld16(p, u);
    V4_UNROLL
    for (int e = 0; e < 4; ++e) x[e] = u2f(u[e]);
  } else {
    uint32_t u[2];
    ld8(p, u);
    V4_UNROLL
    for (int e = 0; e < 4; ++e) x[e] = bf16_to_f32(static_cast<uint16_t>(u[e / 2] >> (16 * (e & 1))));
  }
}

// The window of one boundary for columns c0 .. c0+3 (K <= 8, D = 128): sig[k][e] and kv[k][e] of window row k,
// column c0 + e (rows before position 0, excluded: not read, sig -Inf and kv 0, see pool_row_dt). The source of a
// row (this call's inputs or the ring) is decided once a row, and each row is one vector load a tensor.
template <int K, int DT, bool VEC, bool RING>
V4_FN void window4(const CompressArgs& a, const Win& w, int c0, float (&sig)[K][4], float (&kv)[K][4]) {
  constexpr int esz = DT == kF32 ? 4 : 2;
  V4_UNROLL
  for (int k = 0; k < K; ++k) {
    const int64_t s = w.s0 + k;
    const int col = window_col<K, 128>(k, c0);
    V4_UNROLL
    for (int e = 0; e < 4; ++e) {
      sig[k][e] = u2f(0xFF800000u);
      kv[k][e] = 0.0f;
    }
    if (s < 0) continue;
    if (!RING || s >= w.start) {
      const int64_t r = w.i - (K - 1 - k);
      float ap[4];
      load4_f<DT, VEC>(static_cast<const char*>(a.score) + (r * a.sc_st + col) * esz, sig[k]);
      load4_f<DT, VEC>(static_cast<const char*>(a.kv) + (r * a.kv_st + col) * esz, kv[k]);
      load4_f<kF32, VEC>(a.ape + (s & (Geo<K>::kRatio - 1)) * a.ape_st + col, ap);
      V4_UNROLL
      for (int e = 0; e < 4; ++e) sig[k][e] = fadd(sig[k][e], ap[e]);
    } else {
      const int64_t rr = ring_row(a, w, k);
      load4_f<kF32, VEC>(a.state_score + w.slot * a.ssc_s0 + rr * a.ssc_s1 + col, sig[k]);
      load4_f<kF32, VEC>(a.state_kv + w.slot * a.skv_s0 + rr * a.skv_s1 + col, kv[k]);
    }
  }
}

// SPEC §7.6 step 2 of one boundary on one warp (K <= 8, D = 128): lane l pools columns 4l .. 4l+3 over the whole
// window in its registers, in the order of pool.h's pool_window (one thread, the canonical sums in place).
template <int K, int DT, bool VEC, bool RING>
V4_FN void pool_warp_dt(const CompressArgs& a, const Win& w, int lane, float (&y)[4]) {
  static_assert(K <= 8, "a lane holds every window row");
  float sig[K][4], kv[K][4];
  window4<K, DT, VEC, RING>(a, w, 4 * lane, sig, kv);
  // kCols columns a trip, in a loop that is not unrolled where it has more than one trip (docs/compress_kv.md,
  // "Short code"): each trip pools columns 0 .. kCols-1 of the arrays, then shifts every array (and y) down by
  // kCols columns (register moves) and puts its results last, so that after the trips y holds the four columns
  // in order.
  constexpr int kCols = DSQ_COMPRESS_WARP_COLS;
  static_assert(kCols == 1 || kCols == 2 || kCols == 4, "columns a trip: 1, 2 or 4");
  V4_NO_UNROLL
  for (int e = 0; e < 4; e += kCols) {
    float res[kCols];
    V4_UNROLL
    for (int j = 0; j < kCols; ++j) {
      float v[K];
      PoolMax st = pool_max_init();
      V4_UNROLL
      for (int k = 0; k < K; ++k) pool_max_add(st, sig[k][j]);
      V4_UNROLL
      for (int k = 0; k < K; ++k) v[k] = pool_exp(sig[k][j], st.m);
      const float S = canonical_sum<K>(v);
      pool_weights(v, S);
      const float yv = canonical_sum_map<K>([&](int k) { return fmul(v[k], kv[k][j]); });
      res[j] = pool_finish(yv, st);
    }
    V4_UNROLL
    for (int j = 0; j + kCols < 4; ++j) {
      V4_UNROLL
      for (int k = 0; k < K; ++k) {
        sig[k][j] = sig[k][j + kCols];
        kv[k][j] = kv[k][j + kCols];
      }
      y[j] = y[j + kCols];
    }
    V4_UNROLL
    for (int j = 0; j < kCols; ++j) y[4 - kCols + j] = res[j];
  }
}

template <int K, bool RING = true>
V4_FN void pool_warp(const CompressArgs& a, const Win& w, int lane, float (&y)[4]) {
  if (window_vec(a)) {
    if (a.in_dt == kF32) pool_warp_dt<K, kF32, true, RING>(a, w, lane, y);
    else pool_warp_dt<K, kBF16, true, RING>(a, w, lane, y);
  } else {
    if (a.in_dt == kF32) pool_warp_dt<K, kF32, false, RING>(a, w, lane, y);
    else pool_warp_dt<K, kBF16, false, RING>(a, w, lane, y);
  }
}

// One boundary on one warp (range mode `warp`): pool in registers, finish in place. Warp-uniform.
template <int K>
V4_FN void compress_boundary_warp(const CompressArgs& a, const Seq& q, int64_t i, int64_t p, int lane) {
  const int64_t slot = boundary_slot<K>(a, i, p, lane == 0);
  FinishIn<128> f = finish_in<K, 128>(a, p, lane);
  float y[4];
  pool_warp<K, false>(a, window_of<K, false>(a, q, i, p), lane, y);   // a range's window: this call's inputs only
  if (slot >= 0) finish_values<K, 128>(a, y, f, slot, lane);
}

template <int K>
V4_FN bool is_boundary(int64_t p) { return p >= 0 && ((p + 1) & (Geo<K>::kRatio - 1)) == 0; }

// State update (SPEC §7.6): ring row [slot, p mod R] of each of the sequence's last K tokens (p >= 0) gets
// kv (fp32, exact) and fl(score + ape[p mod ratio]) (a NaN stored canonical), over the full width C.
// The n <= K rows x C columns are cut into units of 8 consecutive columns of one row (16-byte loads and stores),
// thread t taking units t + kThreads*u; the units go in batches of kU a thread, all loads of a batch before its
// stores (a store may alias a later load for all the compiler knows, so a unit at a time would wait for memory
// once per unit), the batches in a loop that is not unrolled: a short kernel runs its code once, from a cold
// instruction cache, so the code it runs is kept short. Inputs or ring rows that are not 16-byte aligned take
// the same loop with scalar loads and stores.
// S: the blocks that share the update (the cluster of the column-split mode; else 1), block r taking the units
// r*kThreads + t + kThreads*S*u, t counted from the block's last thread (so that warp 0, which finishes the last
// boundary meanwhile, gets its units last).
template <int K, int D, int S = 1>
struct Ring {
  static constexpr int kC = (Geo<K>::kOverlap ? 2 : 1) * D;
  static constexpr int kUnits = K * kC / 8;                               // units of the K rows
  static constexpr int kPerThread = (kUnits + kThreads * S - 1) / (kThreads * S);
  static constexpr int kU = kPerThread < 4 ? kPerThread : 4;              // (kPerThread: 1, 2 or a multiple of 4)
  static constexpr int kBatches = kPerThread / kU;
  // The first batch is loaded before the sequence block's boundaries (it only reads inputs) and stored after them,
  // so that a decode step waits for memory once: ratio 4, where the whole ring is one batch of a few registers.
  static constexpr bool kEarly = K <= 8 && kBatches == 1 && kU <= 2;
};
template <int U>
struct RingBatch {
  float kv[U][8], sc[U][8];
};
// 8 consecutive elements of type DT (fp32 / bf16) from p as fp32 (exact): 16-byte loads when VEC.
template <int DT, bool VEC>
V4_FN void load8_f(const void* p, float (&x)[8]) {
  static_assert(DT == kF32 || DT == kBF16, "fp32 or bf16 rows");
  uint32_t w[4];
  if constexpr (!VEC) {
    V4_UNROLL
    for (int e = 0; e < 8; ++e) x[e] = load_f(p, e, DT);
  } else if constexpr (DT == kF32) {
    V4_UNROLL
    for (int h = 0; h < 2; ++h) {
      ld16(static_cast<const float*>(p) + 4 * h, w);
      V4_UNROLL
      for (int e = 0; e < 4; ++e) x[4 * h + e] = u2f(w[e]);
    }
  } else {
    ld16(p, w);
    V4_UNROLL
    for (int e = 0; e < 4; ++e) {
      x[2 * e] = bf16_to_f32(static_cast<uint16_t>(w[e]));
      x[2 * e + 1] = bf16_to_f32(static_cast<uint16_t>(w[e] >> 16));
    }
  }
}
template <bool VEC>
V4_FN void store8_f(float* p, const float (&x)[8]) {
  if constexpr (!VEC) {
    V4_UNROLL
    for (int e = 0; e < 8; ++e) p[e] = x[e];
  } else {
    V4_UNROLL
    for (int h = 0; h < 2; ++h) {
      const uint32_t w[4] = {f2u(x[4 * h]), f2u(x[4 * h + 1]), f2u(x[4 * h + 2]), f2u(x[4 * h + 3])};
      st16(p + 4 * h, w);
    }
  }
}
// Unit u of the thread's batch `batch` in block `rank` of S: its row (0 .. n-1 of the sequence's last n <= K tokens)
// and first column.
template <int K, int D, int S>
V4_FN void ring_unit(int batch, int u, int rank, int& row, int& c) {
  using RG = Ring<K, D, S>;
  const int unit = ((batch * RG::kU + u) * S + rank) * kThreads + (kThreads - 1 - thread_id());
  row = unit / (RG::kC / 8);
  c = 8 * (unit % (RG::kC / 8));
}
template <int K, int D, int S, int DT, bool VEC>
V4_FN void ring_load_dt(const CompressArgs& a, const Seq& q, int batch, int rank, RingBatch<Ring<K, D, S>::kU>& rb) {
  using RG = Ring<K, D, S>;
  constexpr int esz = DT == kF32 ? 4 : 2;
  const int64_t j0 = q.len > K ? q.len - K : 0;
  const int64_t n = q.len - j0;
  V4_UNROLL
  for (int u = 0; u < RG::kU; ++u) {
    int row, c;
    ring_unit<K, D, S>(batch, u, rank, row, c);
    const int64_t pos = q.start + j0 + row, i = q.first + j0 + row;
    if (row < n && pos >= 0) {
      float ap[8];
      load8_f<DT, VEC>(static_cast<const char*>(a.kv) + (i * a.kv_st + c) * esz, rb.kv[u]);
      load8_f<DT, VEC>(static_cast<const char*>(a.score) + (i * a.sc_st + c) * esz, rb.sc[u]);
      load8_f<kF32, VEC>(a.ape + (pos & (Geo<K>::kRatio - 1)) * a.ape_st + c, ap);
      V4_UNROLL
      for (int e = 0; e < 8; ++e) rb.sc[u][e] = canon_nan(fadd(rb.sc[u][e], ap[e]));
    }
  }
}
template <int K, int D, int S>
V4_FN void ring_load(const CompressArgs& a, const Seq& q, int batch, int rank, bool vec,
                     RingBatch<Ring<K, D, S>::kU>& rb) {
  if (vec) {
    if (a.in_dt == kF32) ring_load_dt<K, D, S, kF32, true>(a, q, batch, rank, rb);
    else ring_load_dt<K, D, S, kBF16, true>(a, q, batch, rank, rb);
  } else {
    if (a.in_dt == kF32) ring_load_dt<K, D, S, kF32, false>(a, q, batch, rank, rb);
    else ring_load_dt<K, D, S, kBF16, false>(a, q, batch, rank, rb);
  }
}
template <int K, int D, int S, bool VEC>
V4_FN void ring_store_v(const CompressArgs& a, const Seq& q, int batch, int rank,
                        const RingBatch<Ring<K, D, S>::kU>& rb) {
  using RG = Ring<K, D, S>;
  const int64_t j0 = q.len > K ? q.len - K : 0;
  const int64_t n = q.len - j0;
  const int64_t ring0 = mod_floor(q.start + j0, a.R);   // then rows advance by one, wrapping at most once (n <= R)
  V4_UNROLL
  for (int u = 0; u < RG::kU; ++u) {
    int row, c;
    ring_unit<K, D, S>(batch, u, rank, row, c);
    if (row < n && q.start + j0 + row >= 0) {
      const int64_t r = ring0 + row >= a.R ? ring0 + row - a.R : ring0 + row;
      store8_f<VEC>(a.state_kv + q.slot * a.skv_s0 + r * a.skv_s1 + c, rb.kv[u]);
      store8_f<VEC>(a.state_score + q.slot * a.ssc_s0 + r * a.ssc_s1 + c, rb.sc[u]);
    }
  }
}
template <int K, int D, int S>
V4_FN void ring_store(const CompressArgs& a, const Seq& q, int batch, int rank, bool vec,
                      const RingBatch<Ring<K, D, S>::kU>& rb) {
  if (vec) ring_store_v<K, D, S, true>(a, q, batch, rank, rb);
  else ring_store_v<K, D, S, false>(a, q, batch, rank, rb);
}
// Every ring row of sequence q (update_state), block `rank` of S's share; `rb` holds batch 0 when kEarly.
template <int K, int D, int S>
V4_FN void ring_update(const CompressArgs& a, const Seq& q, int rank, bool vec, RingBatch<Ring<K, D, S>::kU>& rb) {
  using RG = Ring<K, D, S>;
  V4_NO_UNROLL
  for (int bt = 0; bt < RG::kBatches; ++bt) {
    if (!(RG::kEarly && bt == 0)) ring_load<K, D, S>(a, q, bt, rank, vec, rb);
    ring_store<K, D, S>(a, q, bt, rank, vec, rb);
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

// The sequence holding token i0 (one that has no ring slot counts as none: its sequence block reports it).
// A single sequence needs no search.
V4_FN bool range_seq(const CompressArgs& a, int64_t i0, Seq& q) {
  const int64_t b = a.B == 1 ? 0 : seq_of_token(a, i0);
  if (b < 0) return false;
  q = seq_of(a, b);
  if (i0 < q.first || i0 >= q.first + q.len) return false;
  return q.slot >= 0 && q.slot < a.n_ring;
}

// The boundary of the range of `ratio` tokens from i0 that is not a sequence block's, if any: at local index
// >= K - 1 (only inputs in its window). There is at most one: a sequence that starts inside the range has local
// indices < ratio - 1 <= K - 1 there, so only the sequence holding token i0 can have one, and a sequence has one
// boundary every ratio positions. Returns its local index, or -1.
template <int K>
V4_FN int64_t range_boundary(const Seq& q, int64_t i0) {
  const int64_t j = first_boundary<K>(q, i0 - q.first);
  return (j >= K - 1 && j < q.len && q.first + j < i0 + Geo<K>::kRatio) ? j : -1;
}

// The sequence block of sequence b: its boundaries at local index j < K - 1 (the only ones whose windows may reach
// into the ring), one every ratio tokens, so one without overlap (K = ratio) and at most two with overlap
// (K = 2 ratio); then its ring rows. No loop runs around compress_boundary (a loop made the compilers hoist its
// invariants and spill).
template <int K, int D>
V4_FN void sequence_block(const CompressArgs& a, CompressSmem& sm, int64_t b) {
  using RG = Ring<K, D>;
  constexpr int RT = Geo<K>::kRatio;
  const Seq q = seq_of(a, b);
  if (q.len == 0) return;
  if (q.slot < 0 || q.slot >= a.n_ring) {      // the whole sequence is skipped, and reported (once)
    if (thread_id() == 0) atomic_or(a.err_flag, code(ErrFlag::slot_out_of_range));
    return;
  }
  RingBatch<RG::kU> rb;
  const bool vec = window_vec(a);
  if (RG::kEarly && a.update_state) ring_load<K, D, 1>(a, q, 0, 0, vec, rb);
  const int64_t lim = q.len < K - 1 ? q.len : K - 1;
  const int64_t j = first_boundary<K>(q, 0);
  if (j < lim) compress_boundary<K, D, true>(a, sm, q, q.first + j, q.start + j);
  if constexpr (Geo<K>::kOverlap) {
    if (j + RT < lim) {
      block_sync();                            // warp 0 done with sm.y
      compress_boundary<K, D, true>(a, sm, q, q.first + j + RT, q.start + j + RT);
    }
  }
  // Every ring read of the sequence (the pools above) came before the barrier that ends its boundary's pool, so the
  // ring rows may be written now, while warp 0 finishes the last boundary (ring_unit gives warp 0 its units last).
  if (a.update_state) ring_update<K, D, 1>(a, q, 0, vec, rb);
}

// Range modes (compress_args.h compress_warp_ranges, compress_split_blocks): kRangeBlock, one range a block;
// kRangeWarp, kWarps ranges a block, one a warp (K <= 8, D = 128); kSplit4 and kSplit8, each sequence and each range
// a cluster of S = 4 or 8 blocks (K >= 128, NVIDIA sm_90 on), block r pooling the columns [r D/S, (r+1) D/S).
constexpr int kRangeBlock = 0;
constexpr int kRangeWarp = 1;
constexpr int kSplit4 = 2;
constexpr int kSplit8 = 3;
template <int MODE>
constexpr int kSplitOf = MODE == kSplit8 ? 8 : (MODE == kSplit4 ? 4 : 1);   // blocks a cluster of MODE

#if defined(DSQ_V4_CLUSTERS)
// The column-split mode. The includer defines, besides the list above: void cluster_sync() (the barrier of every
// thread of the cluster, ordering shared-memory accesses across its blocks), T* cluster_peer(T* p, int r) (the
// address in block r's shared memory of the object at p in the caller's), int cluster_rank(); thread_id() is the
// thread's index in its own block.
//
// A window of K >= 128 rows is an exp and a division per value, 16K of each for K = 128: one block a window leaves
// most SMs idle when a call has fewer windows than SMs, and the window's latency is that of one SM. Here the
// cluster's S blocks pool D/S columns each into their own sm.y; after a cluster barrier (every window
// read of the cluster done) block 0's warp 0 reads the row across the cluster and finishes it, and every block
// writes its share of the ring rows (sequence clusters). A last cluster barrier keeps each block's shared memory
// alive until block 0 has read it, and before a second boundary pools into it. The bytes are those of the other
// modes (the same operations, in the same order, column by column).
template <int K, int D, int S, bool RING>
V4_FN void compress_boundary_split(const CompressArgs& a, CompressSmem& sm, const Seq& q, int64_t i, int64_t p,
                                   int rank) {
  constexpr int kPart = D / S;
  const int tid = thread_id();
  const bool finisher = rank == 0 && tid < 32;
  const int64_t slot = boundary_slot<K>(a, i, p, rank == 0 && tid == 0);
  FinishIn<D> f;
  if (finisher) f = finish_in<K, D>(a, p, tid);
  pool_row<K, D, RING>(a, sm, q, i, p, rank * kPart, (rank + 1) * kPart);
  cluster_sync();                              // every window read of the cluster done, every block's sm.y complete
  if (finisher && slot >= 0) {
    constexpr int V = D / 32;
    float x[V];
    V4_UNROLL
    for (int e = 0; e < V; ++e) x[e] = *cluster_peer(&sm.y[V * tid + e], (V * tid + e) / kPart);
    finish_values<K, D>(a, x, f, slot, tid);
  }
}

// The cluster of sequence b: sequence_block's work, pooled and written by the cluster's blocks.
template <int K, int D, int S>
V4_FN void sequence_split(const CompressArgs& a, CompressSmem& sm, int64_t b, int rank) {
  using RG = Ring<K, D, S>;
  constexpr int RT = Geo<K>::kRatio;
  const Seq q = seq_of(a, b);
  if (q.len == 0) return;
  if (q.slot < 0 || q.slot >= a.n_ring) {
    if (rank == 0 && thread_id() == 0) atomic_or(a.err_flag, code(ErrFlag::slot_out_of_range));
    return;
  }
  RingBatch<RG::kU> rb;
  const bool vec = window_vec(a);
  const int64_t lim = q.len < K - 1 ? q.len : K - 1;
  const int64_t j = first_boundary<K>(q, 0);
  const bool pooled = j < lim;                 // the same in every block of the cluster
  if (pooled) compress_boundary_split<K, D, S, true>(a, sm, q, q.first + j, q.start + j, rank);
  if constexpr (Geo<K>::kOverlap) {
    if (j + RT < lim) {
      cluster_sync();                          // block 0 done with every sm.y
      compress_boundary_split<K, D, S, true>(a, sm, q, q.first + j + RT, q.start + j + RT, rank);
    }
  }
  if (a.update_state) ring_update<K, D, S>(a, q, rank, vec, rb);
  if (pooled) cluster_sync();                  // every sm.y alive until block 0 has read it
}

template <int K, int D, int S>
V4_FN void compress_split(const CompressArgs& a, CompressSmem& sm) {
  static_assert(K >= 128 && D % (S * Geo<K>::kCL) == 0, "split: windows of K >= 128 rows");
  constexpr int RT = Geo<K>::kRatio;
  const int64_t item = block_id() / S;
  const int rank = cluster_rank();
  if (item < a.B) return sequence_split<K, D, S>(a, sm, item, rank);
  const int64_t i0 = (item - a.B) * RT;
  Seq q;
  if (!range_seq(a, i0, q)) return;
  const int64_t j = range_boundary<K>(q, i0);
  if (j < 0) return;
  compress_boundary_split<K, D, S, false>(a, sm, q, q.first + j, q.start + j, rank);
  cluster_sync();                              // every sm.y alive until block 0 has read it
}
#endif

template <int K, int D, int MODE>
V4_FN void compress_block(const CompressArgs& a, CompressSmem& sm) {
  constexpr int RT = Geo<K>::kRatio;
  const int64_t bid = block_id();
#if defined(DSQ_V4_CLUSTERS)
  if constexpr (kSplitOf<MODE> > 1) {
    compress_split<K, D, kSplitOf<MODE>>(a, sm);
    return;
  }
#endif
  if (bid < a.B) return sequence_block<K, D>(a, sm, bid);
  if constexpr (MODE == kRangeWarp) {
    static_assert(K <= 8 && D == 128, "warp ranges: K <= 8, D = 128");
    const int lane = thread_id() & 31;
    const int64_t i0 = ((bid - a.B) * kWarps + (thread_id() >> 5)) * RT;
    Seq q;
    if (i0 >= a.T || !range_seq(a, i0, q)) return;
    const int64_t j = range_boundary<K>(q, i0);
    if (j >= 0) compress_boundary_warp<K>(a, q, q.first + j, q.start + j, lane);
  } else {
    const int64_t i0 = (bid - a.B) * RT;
    Seq q;
    if (!range_seq(a, i0, q)) return;
    const int64_t j = range_boundary<K>(q, i0);
    if (j >= 0) compress_boundary<K, D, false>(a, sm, q, q.first + j, q.start + j);
  }
}

}  // namespace dsqv4
