// kernels/cuda/prefill_body.cuh: the block body of the ragged prefill logits (docs/prefill.md `mqa_logits`, FP8
// layout), written once against a layer that its includer defines, so that the same code runs on the GPU
// (kernels/cuda/prefill.cu: cp.async, sm_90a wgmma) and under the host emulator of the tests
// (tests/cpp/prefill_host.cpp), which holds it to the reference.
//
//   logits[i, j] = k_scale[j] * sum_h w[i, h] * relu(q[i, h, :] . k[j, :])   for lo[i] <= j < hi[i]
//
// A block of kThreads = 128 threads (one warpgroup) owns the NQ = 128 / H query rows i0 .. i0 + NQ - 1 (the
// NT = 128 rows (i, h) of the matrix product's N side) and a split of the 64-key tiles; it scores the tiles
// that meet the union of its rows' ranges:
//   * the q rows are loaded once into shared memory (e4m3, 128-byte rows, 16-byte chunk c of row r at
//     c ^ (r % 8): the layout of the MMA's K-major operands); each thread keeps the head weights of its
//     accumulator columns in registers;
//   * key tiles (64 rows of 128 bytes, and their 64 scales) stream into kStages shared-memory stages by
//     16-byte asynchronous copies, kStages - 1 tiles ahead of the one computed; keys past SKV are zero-filled;
//   * per tile acc[64 keys x 128 rows] = K_tile . Q^T (fp32 accumulation), then the epilogue in registers:
//     relu (NaN kept) times the head weight, summed over each row's H heads (in the thread, then over the 4
//     lanes that share an accumulator row), times the key's scale, stored: full output (every key j < SKV:
//     the logit inside the row's range, -inf outside with `clean`, untouched without) or compressed (column
//     j - base[i] where it lies in [0, W)). FP4 fold mode (q_scale given): the q rows are packed E2M1, folded
//     into e4m3 as they are loaded (dsaquant/fp4_fold.h), the keys were folded by a pre-pass; the logits of
//     queries and keys that do not fold are left to another launch (prefill.h).
// Tiles of the split outside the union of the rows' ranges are only filled with -inf (full output, `clean`).
//
// The includer defines, in namespace dsqpf, before including this file:
//   PF_FN                                  function qualifiers (__device__ __forceinline__, or inline)
//   int thread_id(); void block_sync();    thread index in the block, the block barrier
//   float shfl_xor(float v, int m);        32-lane butterfly exchange
//   void cp16(void* smem, const void* g); void cp_commit(); template <int N> void cp_wait();
//                                          asynchronous 16-byte copies into shared memory, committed in groups;
//                                          cp_wait<N> returns when at most N of this thread's groups are pending
//   void async_fence();                    this thread's shared-memory writes (copies and stores) made visible
//                                          to the matrix unit (before the barrier that publishes them)
//   template <int NT> void mma_ss(float (&acc)[NT / 2], const uint8_t* k_tile, const uint8_t* q_rows);
//                                          starts acc = K . Q^T over K = 128 for a tile (64 rows) and NT q rows,
//                                          both in the layout above at 1024-byte aligned addresses, all 128 threads
//                                          together, as one group; acc and the operands are the matrix unit's until
//                                          the group is waited for. Thread t (warp w, lane l) holds row
//                                          16 w + l / 4 + 8 i, column 8 c + 2 (l % 4) + j at acc[4 c + 2 i + j]
//   template <int N> void mma_wait();      returns when at most N started groups are running
//   template <int NT> void mma_done(float (&acc)[NT / 2]);   after the wait that retired acc's group: acc is read
//   float relu_nan(float x);               max(x, 0), NaN kept
#pragma once

#include <cmath>
#include <cstdint>

#include "dsaquant/dsaquant.h"
#include "dsaquant/fp4_fold.h"
#include "prefill.h"
#include "quad.cuh"

namespace dsqpf {

constexpr int kThreads = 128;
constexpr int kTile = DSQ_PREFILL_TILE;   // keys per tile
constexpr int kRows = 128;                // q rows (query, head) of a block: the MMA's N side
#ifndef DSQ_PREFILL_STAGES
#define DSQ_PREFILL_STAGES 4
#endif
constexpr int kStages = DSQ_PREFILL_STAGES;
static_assert(kStages >= 2, "DSQ_PREFILL_STAGES: at least 2");

// Shared memory of a block, in bytes from a 1024-aligned base: the q rows, the key stages, the key scales; FP4
// fold mode: the q rows' weights times their fold scales, which rows and which of the block's queries fold.
constexpr int kSmemQ = 0;
constexpr int kSmemK = kRows * 128;
constexpr int kSmemScale = kSmemK + kStages * kTile * 128;
constexpr int kSmemW = kSmemScale + kStages * kTile * 4;
constexpr int kSmemRowOk = kSmemW + kRows * 4;
constexpr int kSmemFold = kSmemRowOk + kRows * 4;
constexpr int kSmemBytes = kSmemFold + 8 * 4;   // a flag for each of up to 8 queries (H = 16)

struct alignas(16) Words4 {
  uint32_t w[4];
};

// Byte offset of 16-byte chunk c of row r in a tile of 128-byte rows (the MMA's 128-byte swizzle).
PF_FN int swizzled(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// A row's range bound clamped to [0, SKV] (prefill.h: the bounds may lie outside).
PF_FN int clamp_key(int32_t v, int SKV) { return v < 0 ? 0 : (v > SKV ? SKV : v); }

PF_FN float load_weight(const DsqMqaLogitsArgs& a, int64_t i, int h) {
  const int64_t off = i * a.w_row + h * a.w_head;
  if (a.w_dtype == dsq::kBF16) return dsq::bf16_to_f32(static_cast<const uint16_t*>(a.weights)[off]);
  return static_cast<const float*>(a.weights)[off];
}

PF_FN void store_logit(const DsqMqaLogitsArgs& a, int64_t i, int64_t col, float v) {
  if (a.out_dtype == dsq::kBF16)
    static_cast<uint16_t*>(a.out)[i * a.ld + col] = dsq::round_bf16(v);
  else
    static_cast<float*>(a.out)[i * a.ld + col] = dsq::canon_nan(v);
}

// Tiles per block of rows for `splits` key splits (the host's plan; 0 < splits).
inline int64_t tiles_per_split(int64_t SKV, int64_t splits) {
  const int64_t tiles = (SKV + kTile - 1) / kTile;
  return (tiles + splits - 1) / splits;
}

// Block (qb, sp): rows qb * NQ .., key tiles [sp * tpc, (sp + 1) * tpc). smem: kSmemBytes, 1024-aligned.
template <int H>
PF_FN void mqa_logits_block(const DsqMqaLogitsArgs& a, int64_t qb, int64_t sp, int64_t tpc, uint8_t* smem) {
  constexpr int NQ = kRows / H;
  const int tid = thread_id(), lane = tid & 31, warp = tid >> 5;
  const int64_t i0 = qb * NQ;
  const int SKV = static_cast<int>(a.SKV);

  // ---- the rows' ranges and the union of the nonempty ones --------------------------------------------------
  int lo[NQ], hi[NQ];
  bool live[NQ];
  int lo_min = SKV, hi_max = 0;
  DSQ_UNROLL
  for (int qi = 0; qi < NQ; ++qi) {
    live[qi] = i0 + qi < a.S;
    lo[qi] = live[qi] ? clamp_key(a.lo[i0 + qi], SKV) : 0;
    hi[qi] = live[qi] ? clamp_key(a.hi[i0 + qi], SKV) : 0;
    if (lo[qi] < hi[qi]) {
      lo_min = lo[qi] < lo_min ? lo[qi] : lo_min;
      hi_max = hi[qi] > hi_max ? hi[qi] : hi_max;
    }
  }
  const int64_t ntiles = (a.SKV + kTile - 1) / kTile;
  const int t_begin = static_cast<int>(sp * tpc);
  const int t_end = static_cast<int>(t_begin + tpc < ntiles ? t_begin + tpc : ntiles);
  int t_lo = lo_min / kTile > t_begin ? lo_min / kTile : t_begin;
  int t_hi = (hi_max + kTile - 1) / kTile < t_end ? (hi_max + kTile - 1) / kTile : t_end;
  if (t_lo >= t_hi) t_lo = t_hi = t_end;   // nothing to score: the whole split is filled (clean)
  const int n = t_hi - t_lo;

  uint8_t* const sq = smem + kSmemQ;
  uint8_t* const sk = smem + kSmemK;
  float* const ssc = reinterpret_cast<float*>(smem + kSmemScale);
  const uint8_t* const k = static_cast<const uint8_t*>(a.k);

  // ---- tile t (keys t*64 ..) into stage s: 4 chunks of 16 bytes a thread, 16 threads copy the scales -------
  // Thread tid copies chunk tid % 8 of rows tid / 8 + 16 u (u < 4): in the swizzle, row r + 16 u sits 2048 u bytes
  // past row r, so a whole tile is four copies at fixed offsets from two per-thread bases.
  static_assert(kTile * 8 == 4 * kThreads, "four 16-byte chunks a thread per tile");
  const int cp_dst = swizzled(tid >> 3, tid & 7);
  const int64_t cp_src = static_cast<int64_t>(tid >> 3) * 128 + (tid & 7) * 16;
  auto issue = [&](int t, int s) {
    uint8_t* const dst = sk + s * (kTile * 128) + cp_dst;
    const uint8_t* const src = k + static_cast<int64_t>(t) * (kTile * 128) + cp_src;
    if ((t + 1) * kTile <= SKV) {   // the usual tile: every key exists
      DSQ_UNROLL
      for (int u = 0; u < 4; ++u) cp16(dst + u * 2048, src + u * 2048);
    } else {
      DSQ_UNROLL
      for (int u = 0; u < 4; ++u) {
        if (t * kTile + (tid >> 3) + 16 * u < SKV) {
          cp16(dst + u * 2048, src + u * 2048);
        } else {
          uint32_t* z = reinterpret_cast<uint32_t*>(dst + u * 2048);
          z[0] = z[1] = z[2] = z[3] = 0u;
        }
      }
    }
    if (tid < kTile / 4) {
      const int m = tid * 4, j = t * kTile + m;
      float* const d = ssc + s * kTile + m;
      if (j + 4 <= SKV) {
        cp16(d, a.k_scale + j);
      } else {
        DSQ_UNROLL
        for (int e = 0; e < 4; ++e) d[e] = j + e < SKV ? a.k_scale[j + e] : 0.0f;
      }
    }
  };
  DSQ_UNROLL
  for (int p = 0; p < kStages - 1; ++p) {
    if (p < n) issue(t_lo + p, p);
    cp_commit();   // one group per stage, empty or not: cp_wait counts groups
  }

  // ---- the q rows (zero for rows past S) and this thread's head weights ----------------------------------
  const uint8_t* const q = static_cast<const uint8_t*>(a.q);
  const bool fold = a.q_scale != nullptr;
  float* const sw = reinterpret_cast<float*>(smem + kSmemW);
  int* const srow_ok = reinterpret_cast<int*>(smem + kSmemRowOk);
  int* const sfold = reinterpret_cast<int*>(smem + kSmemFold);
  if (!fold) {
    DSQ_UNROLL
    for (int u = 0; u < kRows * 8 / kThreads; ++u) {
      const int idx = tid + kThreads * u, r = idx >> 3, c = idx & 7;
      uint32_t* d = reinterpret_cast<uint32_t*>(sq + swizzled(r, c));
      if (i0 + r / H < a.S) {
        const uint32_t* s = reinterpret_cast<const uint32_t*>(q + ((i0 + r / H) * H + r % H) * 128 + c * 16);
        d[0] = s[0];
        d[1] = s[1];
        d[2] = s[2];
        d[3] = s[3];
      } else {
        d[0] = d[1] = d[2] = d[3] = 0u;
      }
    }
  } else {
    // FP4 fold mode: item (row r, block j) expands the 32 codes of block j (16 bytes) into elements 32 j .. 32 j +
    // 31 of the e4m3 row (chunks 2 j and 2 j + 1); the first item of a row also keeps its weight times the fold
    // scale and whether the row folds exactly with that product a normal number or zero (the rule of the Triton
    // second pass, which scores the queries with a row that does not).
    DSQ_UNROLL
    for (int u = 0; u < kRows * 4 / kThreads; ++u) {
      const int idx = tid + kThreads * u, r = idx >> 2, j = idx & 3, qi = r / H;
      const bool live_r = i0 + qi < a.S;
      const int64_t row = (i0 + qi) * H + r % H;
      uint32_t e = 0;
      Words4 raw = {{0u, 0u, 0u, 0u}};
      if (live_r) {
        e = a.q_scale[row];
        raw = *reinterpret_cast<const Words4*>(q + row * 64 + j * 16);
      }
      const int emax = dsq::fold_emax(e);
      uint32_t lo, hi, x[8];
      dsq::fold_table(static_cast<int>((e >> (8 * j)) & 255), emax, lo, hi);
      DSQ_UNROLL
      for (int w = 0; w < 4; ++w) dsq::fold_expand8(raw.w[w], lo, hi, x[2 * w], x[2 * w + 1]);
      uint32_t* d0 = reinterpret_cast<uint32_t*>(sq + swizzled(r, 2 * j));
      uint32_t* d1 = reinterpret_cast<uint32_t*>(sq + swizzled(r, 2 * j + 1));
      d0[0] = x[0];
      d0[1] = x[1];
      d0[2] = x[2];
      d0[3] = x[3];
      d1[0] = x[4];
      d1[1] = x[5];
      d1[2] = x[6];
      d1[3] = x[7];
      if (j == 0) {
        const float w = live_r ? load_weight(a, i0 + qi, r % H) : 0.0f;
        const float wf = w * dsq::fold_scale(emax), aw = fabsf(wf);
        const bool normal = aw >= dsq::u2f(0x00800000u) && aw < dsq::u2f(0x7F800000u);
        const bool ok = dsq::fold_exact(e) && (w == 0.0f || normal);
        sw[r] = wf;
        srow_ok[r] = !live_r || ok;
      }
    }
    block_sync();   // sw, srow_ok
    if (tid < NQ) {   // query tid folds: all its H rows do
      int all = 1;
      for (int h = 0; h < H; ++h) all &= srow_ok[tid * H + h];
      sfold[tid] = all;
      if (!all && a.fold_all != nullptr) *a.fold_all = 0;
    }
    block_sync();   // sfold
  }
  float wr[kRows / 4];   // column 8 c + 2 (lane % 4) + j at wr[2 c + j]
  DSQ_UNROLL
  for (int c = 0; c < kRows / 8; ++c)
    DSQ_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int col = 8 * c + 2 * (lane & 3) + j, qi = col / H;
      wr[2 * c + j] = fold ? sw[col] : (i0 + qi < a.S ? load_weight(a, i0 + qi, col % H) : 0.0f);
    }
  async_fence();   // the q rows, written with plain stores, are read by the matrix unit

  // ---- the tiles -----------------------------------------------------------------------------------------
  const float ninf = dsq::u2f(0xFF800000u);
  const int m0 = warp * 16 + (lane >> 2);   // this thread's accumulator rows (keys): m0 and m0 + 8
  // After the in-thread head sums a thread holds V = 2 NQ partial logits, (query qi, key m0 + 8 e) at 2 qi + e; the
  // four lanes of a quad (the same keys) sum them by a reduce-scatter (quad.cuh), after which slot i of the lane
  // holds logit quad_value(lane, i). Each thread's stores, their rows and key offsets are fixed for the block.
  constexpr int V = 2 * NQ;
  constexpr int kSlots = dsq_quad::kSlots<V>;
  int slot_lo[kSlots], slot_hi[kSlots], slot_base[kSlots], slot_key[kSlots];
  bool slot_live[kSlots], slot_mine[kSlots];
  int64_t slot_row[kSlots];
  int full_lo = 0, full_hi = SKV;   // the keys inside every live row's range
  DSQ_UNROLL
  for (int qi = 0; qi < NQ; ++qi)
    if (live[qi]) {
      full_lo = lo[qi] > full_lo ? lo[qi] : full_lo;
      full_hi = hi[qi] < full_hi ? hi[qi] : full_hi;
    }
  DSQ_UNROLL
  for (int i = 0; i < kSlots; ++i) {
    const int c = dsq_quad::quad_value<V>(lane, i);
    const int qi = c >> 1;
    slot_key[i] = m0 + 8 * (c & 1);
    slot_row[i] = i0 + qi;
    slot_live[i] = i0 + qi < a.S && dsq_quad::quad_stores<V>(lane);
    slot_lo[i] = slot_live[i] ? clamp_key(a.lo[i0 + qi], SKV) : 0;
    slot_hi[i] = slot_live[i] ? clamp_key(a.hi[i0 + qi], SKV) : 0;
    slot_base[i] = slot_live[i] && a.compressed ? a.base[i0 + qi] : 0;
    slot_mine[i] = slot_live[i] && (!fold || sfold[qi] != 0);
  }
  // Tile t's epilogue: keys t*64 + m0 and t*64 + m0 + 8.
  // The head sums of an accumulator set of ns / 2 registers over q rows r0 .. r0 + ns - 1 (columns of the tile;
  // constants where it is called), added to v.
  auto add_sums = [&](float (&v)[V], const float (&acc)[kRows / 2]) {
    DSQ_UNROLL
    for (int c = 0; c < kRows / 8; ++c) {
      const int qi = c / (H / 8);
      DSQ_UNROLL
      for (int j = 0; j < 2; ++j) {
        v[2 * qi] = fmaf(wr[2 * c + j], relu_nan(acc[4 * c + j]), v[2 * qi]);
        v[2 * qi + 1] = fmaf(wr[2 * c + j], relu_nan(acc[4 * c + 2 + j]), v[2 * qi + 1]);
      }
    }
  };
  // Tile t's logits from its head sums v (stage s: its key scales).
  auto finish = [&](const float (&v)[V], int t, int s) {
    float g[kSlots];
    dsq_quad::quad_reduce_scatter<V>(v, lane, g, [](float x, int m) { return shfl_xor(x, m); });
    const int t0 = t * kTile;
    if (!a.compressed && t0 >= full_lo && t0 + kTile <= full_hi) {   // every key in every live row's range
      DSQ_UNROLL
      for (int i = 0; i < kSlots; ++i) {
        const float sc = ssc[s * kTile + slot_key[i]];
        if (slot_mine[i] && (!fold || sc > 0.0f))
          store_logit(a, slot_row[i], t0 + slot_key[i], g[i] * sc);
      }
      return;
    }
    DSQ_UNROLL
    for (int i = 0; i < kSlots; ++i) {
      const int j = t0 + slot_key[i];
      if (j >= SKV || !slot_live[i]) continue;
      const float sc = ssc[s * kTile + slot_key[i]];
      const bool in = j >= slot_lo[i] && j < slot_hi[i];
      const bool own = slot_mine[i] && (!fold || sc > 0.0f);
      if (a.compressed) {
        const int64_t col = static_cast<int64_t>(j) - slot_base[i];
        if (in && own && col >= 0 && col < a.W) store_logit(a, slot_row[i], col, g[i] * sc);
      } else if (in) {
        if (own) store_logit(a, slot_row[i], j, g[i] * sc);
      } else if (a.clean) {
        store_logit(a, slot_row[i], j, ninf);
      }
    }
  };
  // One tile an iteration: its copies landed (the oldest group), a barrier (tile it - 1 is no longer read: its
  // MMA was waited for), the refill of tile it - 1's stage, the MMA, the epilogue; other blocks on the SM
  // overlap this one's epilogue with their MMAs. Measured slower on the H100: an MMA over each half of the q rows
  // in turn, the first half's head sums under the second's (7 %: it reads the key tile twice); the next tile's MMA
  // kept in flight under this one's epilogue (two accumulator sets, so two blocks an SM: 1.7x slower, 519.9 against
  // 305.4 µs at S = 2048, SKV = 8192, H = 64: the epilogue's latency is hidden by more blocks, not by the MMA); the
  // refill issued once the MMA started instead of before it (343.0 against 307.0 µs, FP8 full ranges).
  for (int it = 0; it < n; ++it) {
    cp_wait<kStages - 2>();
    async_fence();
    block_sync();
    if (it + kStages - 1 < n) issue(t_lo + it + kStages - 1, (it + kStages - 1) % kStages);
    cp_commit();
    const int s = it % kStages;
    const uint8_t* const ktile = sk + s * (kTile * 128);
    float v[V];
    DSQ_UNROLL
    for (int e = 0; e < V; ++e) v[e] = 0.0f;
    float acc[kRows / 2];
    mma_ss<kRows>(acc, ktile, sq);
    mma_wait<0>();
    mma_done<kRows>(acc);
    add_sums(v, acc);
    finish(v, t_lo + it, s);
  }
  cp_wait<0>();   // no copy may land in the block's shared memory after it exits

  // ---- the split's tiles outside the rows' ranges: -inf (full output, clean) ------------------------------
  if (a.clean && !a.compressed) {
    const int f0 = t_begin * kTile, f1 = t_lo * kTile < SKV ? t_lo * kTile : SKV, f2 = t_hi * kTile;
    const int f3 = t_end * kTile < SKV ? t_end * kTile : SKV;
    DSQ_UNROLL
    for (int qi = 0; qi < NQ; ++qi) {
      if (!live[qi]) continue;
      for (int j = f0 + tid; j < f1; j += kThreads) store_logit(a, i0 + qi, j, ninf);
      for (int j = f2 + tid; j < f3; j += kThreads) store_logit(a, i0 + qi, j, ninf);
    }
  }
}

// The launch's shape: blocks of rows and key splits for `slots` blocks resident at once. splits <= 0: at least
// one wave's worth of blocks, and of up to 8 more split counts (each split at least 8 tiles) the one whose last
// wave is fullest (blocks / (waves * slots), the smaller count on a tie). At S = 2048, H = 64 (1024 blocks of rows,
// 528 slots on the H100) one split measured 0.5 - 2 % faster than two for full ranges and 2.5 % for causal ones,
// which two waves' worth asked for.
struct Plan {
  int64_t row_blocks, splits, tpc;
};
inline int64_t auto_splits(int64_t row_blocks, int64_t tiles, int64_t slots) {
  const int64_t first = row_blocks >= slots ? 1 : (slots + row_blocks - 1) / row_blocks;
  int64_t best = first, best_num = 0, best_den = 1;   // the fullness of `best` as a fraction
  for (int64_t s = first; s < first + 9 && (s == first || tiles >= 8 * s); ++s) {
    const int64_t blocks = row_blocks * s, den = (blocks + slots - 1) / slots * slots;
    if (blocks * best_den > best_num * den) {
      best = s;
      best_num = blocks;
      best_den = den;
    }
  }
  return best;
}
inline Plan plan(const DsqMqaLogitsArgs& a, int64_t slots) {
  Plan p;
  const int64_t nq = kRows / a.H;
  const int64_t tiles = (a.SKV + kTile - 1) / kTile;
  p.row_blocks = (a.S + nq - 1) / nq;
  int64_t splits = a.splits;
  if (splits <= 0) splits = auto_splits(p.row_blocks, tiles, slots > 0 ? slots : 1);
  splits = splits < 1 ? 1 : (splits > tiles ? (tiles > 0 ? tiles : 1) : splits);
  p.tpc = tiles_per_split(a.SKV, splits);
  p.splits = p.tpc > 0 ? (tiles + p.tpc - 1) / p.tpc : 1;
  if (p.tpc == 0) p.tpc = 1;
  return p;
}

// Argument checks made before any launch (cudaErrorInvalidValue = 1).
inline int check(const DsqMqaLogitsArgs& a) {
  if (a.H != 16 && a.H != 32 && a.H != 64 && a.H != 128) return 1;
  if ((a.w_dtype != dsq::kF32 && a.w_dtype != dsq::kBF16) || (a.out_dtype != dsq::kF32 && a.out_dtype != dsq::kBF16))
    return 1;
  if (a.S < 0 || a.SKV < 0 || a.W < 0 || a.SKV >= (int64_t{1} << 31) - kTile || a.S >= (int64_t{1} << 31)) return 1;
  return 0;
}

}  // namespace dsqpf
