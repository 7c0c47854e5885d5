// kernels/cuda/scorer_body.cuh: the block body of the paged MQA logits (SPEC §7.4) for the fp8_132, packed68 and
// aiter_fp4 layouts (SPEC §6), written once against a layer that its includer defines, so that the same code runs
// on the GPU (kernels/cuda/scorer.cu: cp.async, sm_90a wgmma) and under the host emulator of the tests
// (tests/cpp/scorer_host.cpp), which holds it to the reference.
//
// logits[b*N + n, p] = weight_scale * sum_h w[b*N + n, h] * relu(q[b, n, h, :] . k[p, :])
// for p < len(b, n), with q and k dequantized. One block = one warpgroup (128 threads) owns sequence b,
// a group of NQ queries (the matrix product's N side is NT = NQ * H query rows) and a range of 64-position tiles
// of the context (a split: small batches still fill every SM). Tiles go in pairs:
//   * asynchronous copies bring a pair's keys into shared memory (kAhead pairs ahead of the one computed), fp8
//     rows in the 128-byte swizzle that the matrix unit reads; positions past the context or whose page is out of
//     range are zero-filled, never read; a packed68 tile inside one page comes by two bulk copies (its payload and
//     exponent bytes are contiguous there) on a barrier of its pair of stages;
//   * the products (K = 128) go into two accumulator sets, so that one set's product runs while the other's
//     epilogue does: the two tiles of a pair (NT <= 64; FP4 NT <= 32), or the two halves of the q rows of a tile
//     (FP4 NT = 128); other tiles keep one set (more blocks an SM hide their epilogue). The
//     epilogue: relu (NaN kept) times the head weight, summed over the heads of each query (in the thread, then
//     across the four lanes of a row), times the row scale and weight_scale, stored; -inf past the context;
//   * FP4 layouts feed the product's A operand from registers: lane q of a quad expands block q (32 codes, one
//     16-byte load) of each of the quad's two rows to e4m3 (a byte-permute table lookup; every E2M1 value is exact
//     in e4m3), with a row's four UE8M0 block exponents folded into the values relative to the row's largest
//     (value * 2^(6 - (emax - e))): exact while a row's exponents span at most 14 binades (the usual case by
//     far; beyond that the small blocks round to e4m3 subnormals), and the row keeps one power-of-two scale
//     2^(emax - 133), the role the fp32 scale plays in fp8_132. Once folded, the 128 values of a row may go to
//     the product in any order that q shares (the FP4 product order): each lane's block spans the four 32-wide
//     steps. q rows get the same treatment once per block (in shared memory, in that order); their scale goes
//     into the weights.
// The work split depends on the shapes, max_seq_len and the device only, so one captured CUDA graph serves any
// context lengths.
//
// The includer defines, in namespace dsqsc, before including this file:
//   SC_FN                                   function qualifiers (__device__ __forceinline__, or inline)
//   int thread_id(); void block_sync();     thread index in the block, the block barrier
//   float shfl_xor(float v, int m);         32-lane butterfly exchange
//   bool any_sync(bool p);                  whether p holds on any lane of the warp
//   void flag_or(int32_t* p, int v);        atomic or into global memory (the error flag)
//   void cp16(void* smem, const void* g); void cp_commit(); template <int N> void cp_wait();
//                                           asynchronous 16-byte copies into shared memory, committed in groups;
//                                           cp_wait<N> returns when at most N of this thread's groups are pending
//   void async_fence();                     this thread's shared-memory writes made visible to the matrix unit
//   void bar_init(uint64_t* b);             a shared-memory barrier of one arrival a phase (then a block barrier)
//   void bulk_copy(void* smem, const void* g, int bytes, uint64_t* b);
//                                           `bytes` (a multiple of 16, 16-byte aligned) copied by the copy engine,
//                                           landing with b's current phase
//   void bar_arrive(uint64_t* b); void bar_wait(uint64_t* b, int parity);
//                                           completes b's phase; returns when the phase of that parity completed
//                                           and its copies landed
//   float relu_nan(float x);                max(x, 0), NaN kept
//   template <int NT> void mma_ss(float (&acc)[NT / 2], const uint8_t* k_tile, const uint8_t* q_rows);
//   template <int NT> void mma_rs(float (&acc)[NT / 2], const uint32_t (&a)[4][4], const uint8_t* q_rows);
//                                           start acc = K . Q^T over K = 128 (four 32-wide steps) for a tile of 64
//                                           key rows and NT q rows, all 128 threads together, as one group. Both
//                                           operands K-major, 128-byte rows with the 128-byte swizzle (16-byte chunk
//                                           c of row r at chunk c ^ (r % 8)) at 1024-aligned addresses; mma_rs takes
//                                           K from registers instead: a[s][i] holds k = 32 s + 16 (i / 2) + 4 (l % 4)
//                                           + 0..3 of row 16 w + l / 4 + 8 (i % 2) (warp w, lane l). Thread t holds
//                                           row 16 w + l / 4 + 8 i, column 8 c + 2 (l % 4) + j at acc[4 c + 2 i + j].
//                                           acc and the operands are the matrix unit's until the group is waited for
//   template <int N> void mma_wait();       returns when at most N started groups are running
//   template <int NT> void mma_done(float (&acc)[NT / 2]);   after the wait that retired acc's group: acc is read
//   void frag_done(uint32_t (&a)[4][4]);    after the wait that retired the group that read a: a may change
//   void prefetch_l2(const void* p, int bytes);
//                                           `bytes` (a multiple of 16, 16-byte aligned) fetched into L2, not waited for
//   int64_t peek_index(const void* p, int64_t i, bool i64);
//                                           element i of an int32 / int64 array, read through L2 only (prefetch_block)
//   SC_PHASE(k), SC_PHASE_END()             optional: phase boundary k of the block, the block's end (a build that
//                                           records them for dev/scorer_phases.py; nothing otherwise)
#pragma once

#include <cstdint>
#include <type_traits>

#ifndef SC_PHASE
#define SC_PHASE(k)
#endif
#ifndef SC_PHASE_END
#define SC_PHASE_END()
#endif

#include "dsaquant/arith.h"
#include "dsaquant/codes.h"
#include "dsaquant/fp4_fold.h"
#include "dsaquant/fp8.h"
#include "dsaquant/layouts.h"
#include "quad.cuh"
#include "scorer.h"

namespace dsqsc {

constexpr int kThreads = 128;
constexpr int kTile = 64;          // KV positions per tile: the product's M side
// Tile stages in shared memory, per key format: pairs of tiles, stages / 2 - 1 pairs in flight ahead of the one
// computed. More stages measured slower on the H100 (dev/tune_scorer.py): FP4 with 6 or 8 (packed68 at (64, 1,
// 8192) 34.3 µs against 31.5; the FP4 tiles are bound by their expansion, not by the bytes in flight), fp8_132
// with 6 (31.1 against 29.6); also where tiles of 128 q rows leave room for more stages at no cost in resident
// blocks: fp8_132 (4, 4, 32768) 17.3 µs with 6 and 19.5 with 8 against 16.7, (64, 2, 8192) 31.0 and 35.6 against
// 30.1 (those blocks wait on their own serial product and epilogue, at three warps a scheduler, not on copies).
#ifndef DSQ_SCORER_STAGES_FP8
#define DSQ_SCORER_STAGES_FP8 4
#endif
#ifndef DSQ_SCORER_STAGES_FP4
#define DSQ_SCORER_STAGES_FP4 4
#endif
DSQ_HD constexpr int stages_of(bool fp4) { return fp4 ? DSQ_SCORER_STAGES_FP4 : DSQ_SCORER_STAGES_FP8; }
static_assert(DSQ_SCORER_STAGES_FP8 % 2 == 0 && DSQ_SCORER_STAGES_FP8 >= 4, "DSQ_SCORER_STAGES_FP8: an even number >= 4");
static_assert(DSQ_SCORER_STAGES_FP4 % 2 == 0 && DSQ_SCORER_STAGES_FP4 >= 4, "DSQ_SCORER_STAGES_FP4: an even number >= 4");
// The widest tile (query rows) that keeps two accumulator sets (the second tile's product overlaps the first's
// epilogue); wider tiles keep one set, which leaves room for more resident blocks. 128 is a variant to time
// (dev/cuda_variants.sh). Capping a block at 64 query rows instead (one query a block at H = 64, two sets, the
// keys read again from L2 by each query's block) measured slower on the H100: fp8_132 (4, 4, 32768) 18.3 µs
// against 16.6 and (64, 2, 8192) 33.4 against 30.0; the FP4 layouts, which expand the keys again in every
// block, 30 to 50 % slower.
// FP4 tiles of 64 rows keep one set (96 registers, five blocks an SM), which measured faster than two (four blocks
// an SM) on the H100: packed68 (64, 1, 8192) 25.9 µs against 26.6, aiter_fp4 31.3 against 31.9 and (1, 1, 65536)
// 8.1 against 8.6; four blocks of one set (80 registers) spilled and measured slower at (4, 1, 32768) (9.5 against
// 8.9).
#ifndef DSQ_SCORER_DUAL_MAX_ROWS
#define DSQ_SCORER_DUAL_MAX_ROWS 64
#endif
#ifndef DSQ_SCORER_DUAL_MAX_ROWS_FP4
#define DSQ_SCORER_DUAL_MAX_ROWS_FP4 32
#endif
DSQ_HD constexpr int dual_max_rows(bool fp4) { return fp4 ? DSQ_SCORER_DUAL_MAX_ROWS_FP4 : DSQ_SCORER_DUAL_MAX_ROWS; }
constexpr int kPageOutOfRange = dsq::code(dsq::ErrFlag::page_out_of_range);
static_assert(DSQ_SCORER_FP8_132 == dsq::code(dsq::Layout::fp8_132) && DSQ_SCORER_PACKED68 == dsq::code(dsq::Layout::packed68) &&
                  DSQ_SCORER_AITER_FP4 == dsq::code(dsq::Layout::aiter_fp4),
              "scorer.h layout codes are dsaquant/codes.h's");
// Bytes of one cache slot in kv_cache (aiter_fp4: its payload; the exponents are in kv_scale, 4 a slot) and of one
// q row (SPEC §6).
DSQ_HD constexpr int64_t kv_slot_bytes(int layout) {
  return layout == DSQ_SCORER_FP8_132 ? dsq::kFp8132Row : layout == DSQ_SCORER_PACKED68 ? dsq::kPacked68Row : 64;
}
DSQ_HD constexpr int64_t q_row_bytes(int layout) { return layout == DSQ_SCORER_FP8_132 ? 128 : 64; }
constexpr int kLutEntries = 33;    // exponent distances 0..31 (31: every value rounds to zero), 32: a zero scale

// Shared memory of one block, in bytes from a 1024-aligned base.
struct SmemPlan {
  int q, k, raw, scales, lut, w, pages, bad, bars, total;
};
DSQ_HD SmemPlan smem_plan(int nt, bool fp4, int n_pages) {
  const int kStages = stages_of(fp4);
  SmemPlan s{};
  s.q = 0;
  s.k = nt * 128;                                      // a multiple of 1024 (nt >= 16)
  if (fp4) {
    s.raw = s.k;                                       // kStages x 64 x 64 payload bytes
    s.scales = s.raw + kStages * kTile * 64;           // kStages x 512 exponent bytes
    s.lut = s.scales + kStages * 512;                  // kLutEntries e4m3 magnitude tables (8 bytes each)
    s.w = s.lut + kLutEntries * 8;
  } else {
    s.raw = s.lut = 0;
    s.scales = s.k + kStages * kTile * 128;            // kStages x 64 fp32 scales
    s.w = s.scales + kStages * kTile * 4;
  }
  s.pages = s.w + nt * 4;
  s.bad = s.pages + n_pages * 4;                       // one int: some page of the read range is out of range
  s.bars = (s.bad + 4 + 7) / 8 * 8;                    // one barrier per pair of stages (bulk copies)
  s.total = s.bars + kStages / 2 * 8;
  return s;
}

SC_FN int imin(int x, int y) { return x < y ? x : y; }
// 2 relu(x) for a finite x or NaN (NaN kept): x + |x| is +0 for x <= 0 and exactly 2x above, one add on the FMA
// pipe where max takes the ALU pipe, which the FP4 expansion keeps busy (the FP4 epilogue sums 2 relu and halves
// the sums, exactly; fp8_132 tiles measured faster with max). Accumulators of e4m3 products are finite or NaN.
SC_FN float relu2(float x) { return x + fabsf(x); }
SC_FN int imax(int x, int y) { return x > y ? x : y; }

// 16 and 8 bytes, aligned as such: one vector load or store each.
struct alignas(16) U32x4 {
  uint32_t x, y, z, w;
};
struct alignas(8) U32x2 {
  uint32_t x, y;
};

SC_FN int64_t load_index(const void* p, int64_t i, int dtype) {
  return dtype == dsq::kI64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}
SC_FN float load_float(const void* p, int64_t i, int dtype) {
  if (dtype == dsq::kBF16) return dsq::bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
SC_FN U32x4 load16(const void* p) { return *static_cast<const U32x4*>(p); }
SC_FN void zero16(void* p) { *static_cast<U32x4*>(p) = U32x4{0u, 0u, 0u, 0u}; }

// ---- FP4 -> e4m3 expansion (dsaquant/fp4_fold.h) ------------------------------------------------
SC_FN U32x2 expand8(uint32_t w, uint32_t lo, uint32_t hi) {
  U32x2 r;
  dsq::fold_expand8(w, lo, hi, r.x, r.y);
  return r;
}
// The magnitude table of exponent distance d = emax - e (fp4 rows fold their block exponents relative
// to the row's largest): the eight E2M1 magnitudes times 2^(6 - d), i.e. dsq::fold_table of a block d binades
// below its row's largest; d = 32 is a zero-scale block.
SC_FN void fp4_table(int d, uint32_t& lo, uint32_t& hi) {
  if (d >= 32) {
    lo = hi = 0;
  } else {
    dsq::fold_table(1, 1 + d, lo, hi);
  }
}
// The table entry of a block with exponent e in a row whose largest exponent is emax.
SC_FN int lut_index(int e, int emax) { return e == 0 ? 32 : imin(emax - e, 31); }
// Byte offset of block j of row m in a stage of packed E2M1 rows (64 bytes a row): eight lanes reading one
// block each of two rows read 128 contiguous bytes.
SC_FN int raw_chunk(int m, int j) { return m * 64 + j * 16; }
// The FP4 product order: element 32 j + 8 s + 4 h + c of a folded row (block j, word s, c < 4) goes to k = 32 s
// + 16 h + 4 j + c, the k that lane j of a quad holds in its A fragments of step s (mma_rs) when it expands
// block j; q rows are stored in the same order.
// 16 bytes into chunk c of swizzled 128-byte row `row` of shared memory.
SC_FN void store_chunk(uint8_t* tile, int row, int c, U32x4 v) {
  *reinterpret_cast<U32x4*>(tile + row * 128 + ((c ^ (row & 7)) << 4)) = v;
}
// One q row: four packed E2M1 blocks (64 bytes) with exponents e (block j in byte j) -> a swizzled e4m3
// row in the FP4 product order: 16-byte chunk 2 s + h holds elements 8 s + 4 h + 0..3 of blocks 0..3.
// Returns the row's scale.
SC_FN float expand_q_row(const U32x4 (&raw)[4], uint32_t e, uint8_t* tile, int row) {
  const int emax = dsq::fold_emax(e);
  U32x2 p[4][4];   // [block][word]
  DSQ_UNROLL
  for (int j = 0; j < 4; ++j) {
    uint32_t lo, hi;
    dsq::fold_table(static_cast<int>((e >> (8 * j)) & 255), emax, lo, hi);
    p[j][0] = expand8(raw[j].x, lo, hi);
    p[j][1] = expand8(raw[j].y, lo, hi);
    p[j][2] = expand8(raw[j].z, lo, hi);
    p[j][3] = expand8(raw[j].w, lo, hi);
  }
  DSQ_UNROLL
  for (int w = 0; w < 4; ++w) {
    store_chunk(tile, row, 2 * w, U32x4{p[0][w].x, p[1][w].x, p[2][w].x, p[3][w].x});
    store_chunk(tile, row, 2 * w + 1, U32x4{p[0][w].y, p[1][w].y, p[2][w].y, p[3][w].y});
  }
  return dsq::fold_scale(emax);
}

struct Geometry {
  int P, p_shift;  // page size; log2(P) when P is a power of two, else -1
  // p >= 0, P > 0: unsigned division where P is not a power of two
  SC_FN int page_of(int p) const {
    return p_shift >= 0 ? p >> p_shift : static_cast<int>(static_cast<unsigned>(p) / static_cast<unsigned>(P));
  }
  SC_FN int in_page(int p) const {
    return p_shift >= 0 ? p & (P - 1) : static_cast<int>(static_cast<unsigned>(p) % static_cast<unsigned>(P));
  }
};

// Block (split, group, b): sequence b, queries group * NQ .., tiles [split * tiles_per_block, ..) of the context.
// smem: smem_plan(H * NQ, FP4, n_pages).total bytes, 1024-aligned; n_pages covers the block-table entries of the
// split's tiles.
template <int H, int NQ, int LAYOUT>
SC_FN void paged_logits_block(const DsqPagedLogitsArgs& a, int split, int group, int64_t b, int tiles_per_block,
                              int n_pages, int p_shift, uint8_t* smem) {
  constexpr bool FP4 = LAYOUT != DSQ_SCORER_FP8_132;
  constexpr bool packed68 = LAYOUT == DSQ_SCORER_PACKED68, aiter = LAYOUT == DSQ_SCORER_AITER_FP4;
  constexpr int NT = H * NQ;
  constexpr int kStages = stages_of(FP4);
  constexpr int kAhead = kStages / 2 - 1;   // pairs in flight ahead of the one computed
  const SmemPlan plan = smem_plan(NT, FP4, n_pages);
  uint8_t* sq = smem + plan.q;
  float* sw = reinterpret_cast<float*>(smem + plan.w);
  int* spages = reinterpret_cast<int*>(smem + plan.pages);
  int* sbad = reinterpret_cast<int*>(smem + plan.bad);

  const int tid = thread_id(), lane = tid & 31, warp = tid >> 5;
  SC_PHASE(0);
  const Geometry geo{static_cast<int>(a.page_size), p_shift};
  const int P = geo.P;
  const int max_seq = static_cast<int>(a.max_seq_len);

  const int n_tiles_all = (max_seq + kTile - 1) / kTile;
  const int t0 = split * tiles_per_block;
  const int t1 = imin(t0 + tiles_per_block, n_tiles_all);
  if (t0 >= t1) return;

  // ---- q rows and head weights into registers first: they depend on nothing below, so their loads are in
  // flight with those of the block table and the context lengths (written to shared memory once the first
  // copies are issued) ------------------------------------------------------------------------------------
  static_assert(NT <= kThreads, "at most one q row a thread");
  constexpr int kPer = FP4 ? 4 : NT * 8 / kThreads;   // 16-byte chunks a thread loads
  U32x4 qv[kPer];
  uint32_t qe = 0;      // FP4: the block exponents of q row tid (block j in byte j)
  float qw = 0.f;       // the head weight of q row tid
  bool q_ok = false;    // q row tid exists (tid < NT, its query < N)
  DSQ_UNROLL
  for (int k = 0; k < kPer; ++k) qv[k] = U32x4{0, 0, 0, 0};
  if constexpr (!FP4) {
    DSQ_UNROLL
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + k * kThreads, r = i >> 3, c = i & 7, qi = r / H, h = r % H;
      if (static_cast<int64_t>(group) * NQ + qi < a.N) {
        const int64_t row = (b * a.N + static_cast<int64_t>(group) * NQ + qi) * H + h;
        qv[k] = load16(static_cast<const uint8_t*>(a.q) + row * 128 + c * 16);
      }
    }
  }
  if (tid < NT) {
    const int qi = tid / H, h = tid % H;
    const int64_t n = static_cast<int64_t>(group) * NQ + qi;
    q_ok = n < a.N;
    if (q_ok) {
      const int64_t t = b * a.N + n;
      qw = load_float(a.weights, t * a.w_row + h * a.w_head, a.w_dtype);
      if constexpr (FP4) {
        const int64_t row = t * H + h;
        const uint8_t* src = static_cast<const uint8_t*>(a.q) + row * 64;
        DSQ_UNROLL
        for (int j = 0; j < 4; ++j) qv[j] = load16(src + 16 * j);
        const uint8_t* qs = static_cast<const uint8_t*>(a.q_scale);
        if constexpr (packed68) {
          qe = *reinterpret_cast<const uint32_t*>(qs + row * 4);
        } else {
          DSQ_UNROLL
          for (int j = 0; j < 4; ++j) qe |= static_cast<uint32_t>(qs[dsq::aiter_q_scale_offset(t, h, j, H)]) << (8 * j);
        }
      }
    }
  }

  // ---- the block-table entries of [t0*64, t1*64) into shared memory (-1: out of range), loaded
  // together with the context lengths: those are loaded first and used after the table's stores (a load after
  // a store would wait for it: the compiler cannot tell the table's shared memory from the lengths) --------
  bool valid[NQ];
  int64_t ctx_raw[NQ];
  DSQ_UNROLL
  for (int qi = 0; qi < NQ; ++qi) {
    const int64_t n = static_cast<int64_t>(group) * NQ + qi;
    valid[qi] = n < a.N;
    ctx_raw[qi] = valid[qi] ? load_index(a.context_lens, b * a.ctx_b + n * a.ctx_n, a.ctx_dtype) : 0;
  }
  const int e0 = geo.page_of(t0 * kTile);
  const int e_all = geo.page_of(imin(t1 * kTile, max_seq) - 1) + 1;
  // packed68 tiles that lie whole in one page come by two bulk copies (payload, exponents) that one thread issues,
  // completing on the barrier of their pair of stages; other tiles by 16-byte copies of every thread.
  constexpr int kPairs = kStages / 2;
  uint64_t* sbars = reinterpret_cast<uint64_t*>(smem + plan.bars);
  SC_PHASE(1);   // the first loads issued
  if (tid == 0) {
    *sbad = 0;
    if (packed68)
      for (int i = 0; i < kPairs; ++i) bar_init(sbars + i);
  }
  for (int e = e0 + tid; e < e_all; e += kThreads) {
    int64_t pg = e < a.max_blocks ? load_index(a.block_table, b * a.bt_b + static_cast<int64_t>(e) * a.bt_k, a.bt_dtype)
                                  : -1;
    spages[e - e0] = pg < 0 || pg >= a.num_blocks ? -1 : static_cast<int>(pg);
  }
  SC_PHASE(2);   // the table's entries stored
  int len[NQ];
  int ctx_max = 0;
  DSQ_UNROLL
  for (int qi = 0; qi < NQ; ++qi) {
    int64_t c = ctx_raw[qi];
    c = c < 0 ? 0 : (c > max_seq ? max_seq : c);
    len[qi] = static_cast<int>(c);
    ctx_max = imax(ctx_max, len[qi]);
  }
  const int tc = imax(t0, imin((ctx_max + kTile - 1) / kTile, t1));   // tiles [t0, tc) read keys
  const int read_end = imin(tc * kTile, ctx_max);                      // positions [t0*64, read_end) are read
  const int e1 = read_end > t0 * kTile ? geo.page_of(read_end - 1) + 1 : e0;
  block_sync();   // spages
  SC_PHASE(3);
  for (int e = e0 + tid; e < e1; e += kThreads)
    if (spages[e - e0] < 0) {
      flag_or(a.err_flag, kPageOutOfRange);
      *sbad = 1;   // read after the barrier that publishes the q rows
    }

  uint8_t* sk = smem + plan.k;
  float* sscale = reinterpret_cast<float*>(smem + plan.scales);
  uint8_t* sraw = smem + plan.raw;
  uint8_t* sexp = smem + plan.scales;
  U32x2* slut = reinterpret_cast<U32x2*>(smem + plan.lut);
  const uint8_t* kv = a.kv_cache;
  // Page id of position p (>= 0), or -1 (out of range, past the context, or past the table).
  auto page_at = [&](int p) -> int { return p < read_end ? spages[geo.page_of(p) - e0] : -1; };

  // ---- copies of tile t into stage s -------------------------------------------------------------
  // The page of tile t when the whole tile lies in one page that is read (inside one page, inside the read
  // range, a valid entry), else -1: such tiles take the copy path without per-row checks.
  const bool tiles_in_pages = P % kTile == 0;
  auto whole_tile_page = [&](int t) -> int {
    const int base = t * kTile;
    return (tiles_in_pages || geo.in_page(base) + kTile <= P) && base + kTile <= read_end ? spages[geo.page_of(base) - e0]
                                                                                          : -1;
  };
  // A whole tile at row o0 of its page is a fixed pattern of 16-byte copies (packed68: two bulk copies): thread tid
  // copies the same chunks of every whole tile, at fixed offsets from the stage and from row o0 of the page (o0 % 16
  // = 0 where the fp8 rows are preshuffled: P % 16 = 0 and tiles start at multiples of 64). fp8_132: chunk tid % 8
  // of rows tid / 8 + 16 u (2048 bytes apart in both orders), the scales of rows 4 tid .. 4 tid + 3 (tid < 16);
  // aiter_fp4: chunk tid % 4 of rows tid / 4 and tid / 4 + 32.
  const int64_t page_bytes = static_cast<int64_t>(P) * kv_slot_bytes(LAYOUT);
  const int row_bytes = FP4 ? 16 : 128;   // aiter_fp4, fp8_132: from the data of row o of a page to row o + 1's
  int wt_dst;                 // in a stage: the thread's first chunk
  int64_t wt_src, wt_ssrc;    // in a page, for o0 = 0: the thread's first chunk, its scale chunk (fp8_132)
  if constexpr (!FP4) {
    wt_dst = (tid >> 3) * 128 + (((tid & 7) ^ ((tid >> 3) & 7)) << 4);
    wt_src = dsq::fp8_132_data_offset_at(dsq::SlotPos{0, tid >> 3}, P, (tid & 7) * 16, a.preshuffle != 0);
    wt_ssrc = dsq::fp8_132_scale_offset_at(dsq::SlotPos{0, tid * 4}, P);
  } else {
    wt_dst = raw_chunk(tid >> 2, tid & 3);
    wt_src = dsq::aiter_fp4_data_offset_at(dsq::SlotPos{0, tid >> 2}, P, (tid & 3) * 16);
    wt_ssrc = 0;
  }
  auto issue = [&](int t, int s) {
    const int base = t * kTile;
    const int wpg = whole_tile_page(t);
    if (wpg >= 0) {
      const int o0 = geo.in_page(base);
      const uint8_t* page = kv + static_cast<int64_t>(wpg) * page_bytes;
      const uint8_t* src = page + o0 * row_bytes + wt_src;
      if constexpr (!FP4) {
        uint8_t* dst = sk + s * (kTile * 128) + wt_dst;
        DSQ_UNROLL
        for (int u = 0; u < 4; ++u) cp16(dst + u * 2048, src + u * dsq::kFp8132Rows16);
        if (tid < kTile / 4) cp16(sscale + s * kTile + tid * 4, page + 4 * o0 + wt_ssrc);
      } else if constexpr (packed68) {   // 16-byte aligned: P and o0 are multiples of 4
        if (tid == 0) {
          uint64_t* bar = sbars + s / 2;   // stages 2i, 2i + 1 hold pair slot i
          const dsq::SlotPos sp{0, o0};
          bulk_copy(sraw + s * (kTile * 64), page + dsq::packed68_payload_offset_at(sp, P, 0), kTile * 64, bar);
          bulk_copy(sexp + s * 512, page + dsq::packed68_scale_offset_at(sp, P, 0), kTile * 4, bar);
        }
      } else {
        uint8_t* dst = sraw + s * (kTile * 64) + wt_dst;
        cp16(dst, src);
        cp16(dst + 32 * 64, src + 32 * row_bytes);   // row m + 32: the same swizzle, 2048 bytes on
        if (tid < P / 4) {   // the page's 4 P exponent bytes (aiter_fp4)
          cp16(sexp + s * 512 + tid * 16, a.kv_scale + static_cast<int64_t>(wpg) * 4 * P + tid * 16);
        }
      }
      return;
    }
    if constexpr (!FP4) {
      uint8_t* dst_tile = sk + s * (kTile * 128);
      DSQ_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int q = tid + kThreads * i, m = q >> 3, c = q & 7, p = base + m;
        uint8_t* dst = dst_tile + m * 128 + ((c ^ (m & 7)) << 4);
        const int pg = page_at(p);
        if (pg >= 0)
          cp16(dst, kv + dsq::fp8_132_data_offset_at(dsq::SlotPos{pg, geo.in_page(p)}, P, c * 16, a.preshuffle != 0));
        else
          zero16(dst);
      }
      if (tid < kTile / 4) {
        const int m = tid * 4, p = base + m;
        uint8_t* dst = reinterpret_cast<uint8_t*>(sscale + s * kTile + m);
        const int pg = page_at(p);
        if (pg >= 0)
          cp16(dst, kv + dsq::fp8_132_scale_offset_at(dsq::SlotPos{pg, geo.in_page(p)}, P));
        else
          zero16(dst);
      }
    } else {
      uint8_t* dst_tile = sraw + s * (kTile * 64);
      DSQ_UNROLL
      for (int i = 0; i < 2; ++i) {
        const int q = tid + kThreads * i, m = q >> 2, c = q & 3, p = base + m;
        uint8_t* dst = dst_tile + raw_chunk(m, c);
        const int pg = page_at(p);
        if (pg >= 0) {
          const dsq::SlotPos sp{pg, geo.in_page(p)};
          cp16(dst, kv + (aiter ? dsq::aiter_fp4_data_offset_at(sp, P, c * 16) : dsq::packed68_payload_offset_at(sp, P, c * 16)));
        } else {
          zero16(dst);
        }
      }
      uint8_t* dst_exp = sexp + s * 512;
      if constexpr (packed68) {
        if (tid < kTile / 4) {
          const int m = tid * 4, p = base + m;
          const int pg = page_at(p);
          if (pg >= 0)
            cp16(dst_exp + m * 4, kv + dsq::packed68_scale_offset_at(dsq::SlotPos{pg, geo.in_page(p)}, P, 0));
          else
            zero16(dst_exp + m * 4);
        }
      } else {
        // The 4*P exponent bytes of each page the tile touches ([block][interleaved position]).
        const int per_page = P / 4;                          // 16-byte chunks per page
        const int chunks = P >= kTile ? per_page : kTile / 4;
        if (tid < chunks) {
          const int pi = P >= kTile ? 0 : tid / per_page, k = P >= kTile ? tid : tid % per_page;
          const int p = P >= kTile ? base : base + pi * P;
          const int pg = page_at(p);
          uint8_t* dst = dst_exp + pi * 4 * P + k * 16;
          if (pg >= 0)
            cp16(dst, a.kv_scale + static_cast<int64_t>(pg) * 4 * P + k * 16);
          else
            zero16(dst);
        }
      }
    }
  };

  // ---- the pipeline --------------------------------------------------------------------------------
  const int n_tiles = tc - t0;
  const int m0 = warp * 16 + (lane >> 2);   // this thread's accumulator rows: m0 and m0 + 8
  const float wscale = a.weight_scale;
  // Tiles go in pairs: pair p = tiles 2p, 2p + 1 in stages 2p % kStages, 2p % kStages + 1; one copy group
  // per pair, kAhead pairs in flight ahead of the one computed.
  auto issue_pair = [&](int p) {
    DSQ_UNROLL
    for (int k = 0; k < 2; ++k)
      if (2 * p + k < n_tiles) issue(t0 + 2 * p + k, (2 * p + k) % kStages);
    if (packed68 && tid == 0) bar_arrive(sbars + p % kPairs);   // every pair completes a phase, copies or none
    cp_commit();
  };
  DSQ_UNROLL
  for (int p = 0; p < kAhead; ++p) issue_pair(p);
  SC_PHASE(4);   // the first pairs' copies issued

  // ---- q rows (NT x 128 e4m3, swizzled) and head weights, once per block ---------------------------
  if constexpr (!FP4) {
    DSQ_UNROLL
    for (int k = 0; k < kPer; ++k) store_chunk(sq, (tid + k * kThreads) >> 3, (tid + k * kThreads) & 7, qv[k]);
    if (tid < NT) sw[tid] = qw;   // 0 where the row does not exist
  } else {
    if (tid < kLutEntries) {   // the magnitude table of each exponent distance (fp4_table)
      uint32_t lo, hi;
      fp4_table(tid, lo, hi);
      slut[tid] = U32x2{lo, hi};
    }
    if (tid < NT) {   // rows that do not exist: zero codes, a zero weight
      const float s = expand_q_row(qv, qe, sq, tid);
      sw[tid] = q_ok ? qw * s : 0.f;
    }
  }
  SC_PHASE(5);     // the q rows stored
  async_fence();   // q rows written with plain stores, read by the matrix unit
  block_sync();    // q rows, weights, the FP4 table
  SC_PHASE(6);
  float wr[NT / 4];   // this thread's head weights: columns 8c + 2(lane%4) + j at 2c + j
  DSQ_UNROLL
  for (int c = 0; c < NT / 8; ++c) {
    wr[2 * c] = sw[8 * c + 2 * (lane & 3)];
    wr[2 * c + 1] = sw[8 * c + 2 * (lane & 3) + 1];
  }

  // Two accumulator sets of NS q rows each:
  //   * dual (NT <= dual_max_rows(FP4)): a set per tile of a pair, tile 2p + 1's product running while tile
  //     2p's epilogue does (FP4: two sets of A fragments as well, read by the instruction until it completes);
  //   * split (NT = 128, FP4: 64 accumulator registers): a set per half of the q rows (64 each) of one tile, the
  //     second half's product running while the first half's head sums do (the tile's A fragments built once for
  //     both halves);
  //   * single (NT = 128 fp8_132, NT = 64 FP4): one set of all NT rows, the tiles one after the other (fp8_132
  //     split like FP4's reads the key tile twice from shared memory and measured within 1 % of this on the H100).
  // Two sets of 128 rows would halve the resident blocks (DSQ_SCORER_DUAL_MAX_ROWS = 128 is a variant to time).
  constexpr bool kDual = NT <= dual_max_rows(FP4);
  constexpr bool kSplit = !kDual && NT == 128 && FP4;
  constexpr int NS = kSplit ? 64 : NT;
  float acc[2][NS / 2];
  uint32_t frag[2][FP4 ? 4 : 1][4];
  float rscale[2][2];   // the row scales of rows m0 and m0 + 8 (fp32 scales, or the FP4 fold scales)
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;

  // Tile i (its stage landed and visible): its row scales into rscale[PB] (FP4: its A fragments into frag[PB]).
  auto prepare = [&](auto par, int i) {
    constexpr int PB = decltype(par)::value;
    const int stage = i % kStages;
    if constexpr (!FP4) {
      rscale[PB][0] = sscale[stage * kTile + m0];
      rscale[PB][1] = sscale[stage * kTile + m0 + 8];
    } else {
      const uint8_t* raw = sraw + stage * (kTile * 64);
      const uint8_t* ex = sexp + stage * 512;
      const int tq = lane & 3;
      DSQ_UNROLL
      for (int hr = 0; hr < 2; ++hr) {
        const int m = m0 + 8 * hr;
        uint32_t e;
        if constexpr (packed68) {
          e = *reinterpret_cast<const uint32_t*>(ex + m * 4);
        } else {
          const int o = geo.in_page((t0 + i) * kTile + m);
          const uint8_t* region = ex + (P >= kTile ? 0 : (m / P) * 4 * P);
          const int sf = static_cast<int>(dsq::aiter_sflat(o, P));
          e = region[sf] | (region[P + sf] << 8) | (region[2 * P + sf] << 16) |
              (static_cast<uint32_t>(region[3 * P + sf]) << 24);
        }
        const int emax = dsq::fold_emax(e);
        rscale[PB][hr] = dsq::fold_scale(emax);
        const U32x2 tab = slut[lut_index(static_cast<int>((e >> (8 * tq)) & 255), emax)];
        const U32x4 w = load16(raw + raw_chunk(m, tq));   // block tq of row m
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
        DSQ_UNROLL
        for (int s = 0; s < 4; ++s) {
          const U32x2 x = expand8(words[s], tab.x, tab.y);
          frag[PB][s][hr] = x.x;        // k 32 s + 4 tq + 0..3:      elements 8 s + 0..3 of block tq
          frag[PB][s][2 + hr] = x.y;    // k 32 s + 16 + 4 tq + 0..3: elements 8 s + 4..7
        }
      }
    }
  };
  // Starts acc[PA] = tile i's keys times q rows r0 .. r0 + NS - 1 (FP4: the keys from frag[PB]).
  auto product = [&](auto pa, auto pb, int i, int r0) {
    constexpr int PA = decltype(pa)::value;
    if constexpr (!FP4)
      mma_ss<NS>(acc[PA], sk + (i % kStages) * (kTile * 128), sq + r0 * 128);
    else
      mma_rs<NS>(acc[PA], frag[decltype(pb)::value], sq + r0 * 128);
  };

  // The logits a thread stores. After the in-thread head sums a thread holds V = 2 NQ partial logits, (query qi,
  // row m0 + 8 e) at 2 qi + e; the four lanes of a quad (the same rows) sum them by a reduce-scatter (quad.cuh),
  // after which slot i of the lane holds logit quad_value(lane, i). Each slot's query, row and context are fixed
  // for the block.
  constexpr int V = 2 * NQ;
  constexpr int kSlots = dsq_quad::kSlots<V>;
  int slot_key[kSlots], slot_len[kSlots];
  bool slot_live[kSlots], slot_hi[kSlots];
  int64_t slot_row[kSlots];
  int full_end = max_seq;   // positions below it are inside every query's context
  DSQ_UNROLL
  for (int qi = 0; qi < NQ; ++qi)
    if (valid[qi]) full_end = imin(full_end, len[qi]);
  DSQ_UNROLL
  for (int i = 0; i < kSlots; ++i) {
    const int c = dsq_quad::quad_value<V>(lane, i);
    const int qi = c >> 1;
    slot_hi[i] = (c & 1) != 0;
    slot_key[i] = m0 + 8 * (c & 1);
    slot_len[i] = 0;
    slot_live[i] = false;
    DSQ_UNROLL
    for (int q = 0; q < NQ; ++q)   // selects: qi depends on the lane (no indexing into len, valid)
      if (q == qi) {
        slot_len[i] = len[q];
        slot_live[i] = valid[q] && dsq_quad::quad_stores<V>(lane);
      }
    slot_row[i] = (b * a.N + static_cast<int64_t>(group) * NQ + qi) * a.ld;
  }
  const bool pages_ok = *sbad == 0;   // every page of the read range exists: every position in a context is read
  auto store = [&](int64_t at, float v) {
    if (a.out_dtype == dsq::kBF16)
      static_cast<uint16_t*>(a.logits)[at] = dsq::round_bf16(v);
    else
      static_cast<float*>(a.logits)[at] = v;
  };

  // The epilogue of a tile: relu, times the head weight, summed over the heads of each query (in the thread: two
  // partial sums per query and row, shorter FMA chains; then across the quad), times the row scale and
  // weight_scale, stored. relu(acc * s) = s * relu(acc) for a row scale s >= 0 (or NaN): the scale is applied once
  // per row after the head sum; a warp with a negative fp8 scale (never written by a writer) scales first.
  struct Sums {
    float s0[2 * NQ], s1[2 * NQ];   // rows m0 and m0 + 8: query qi at 2 qi and 2 qi + 1
    float sk0, sk1;
    bool scaled;
  };
  auto sums_begin = [&](auto pb) {
    constexpr int PB = decltype(pb)::value;
    Sums z;
    DSQ_UNROLL
    for (int k = 0; k < 2 * NQ; ++k) z.s0[k] = z.s1[k] = 0.f;
    z.sk0 = rscale[PB][0];
    z.sk1 = rscale[PB][1];
    z.scaled = !FP4 && any_sync(z.sk0 < 0.f || z.sk1 < 0.f);
    return z;
  };
  // Adds the head sums of acc[PA], the set of q rows r0 .. r0 + NS - 1 (R0 = r0).
  auto add_sums = [&](Sums& z, auto pa, auto r0c) {
    constexpr int PA = decltype(pa)::value, C0 = decltype(r0c)::value / 8;
    auto run = [&](auto scaled) {
      DSQ_UNROLL
      for (int c = 0; c < NS / 8; ++c) {
        const int cg = C0 + c, k = 2 * (cg / (H / 8)) + (cg & 1);
        DSQ_UNROLL
        for (int j = 0; j < 2; ++j) {
          float x0 = acc[PA][4 * c + j], x1 = acc[PA][4 * c + 2 + j];
          if constexpr (decltype(scaled)::value) {
            x0 = relu_nan(x0 * z.sk0);
            x1 = relu_nan(x1 * z.sk1);
          } else if constexpr (FP4) {
            x0 = relu2(x0);
            x1 = relu2(x1);
          } else {
            x0 = relu_nan(x0);
            x1 = relu_nan(x1);
          }
          z.s0[k] = fmaf(wr[2 * cg + j], x0, z.s0[k]);
          z.s1[k] = fmaf(wr[2 * cg + j], x1, z.s1[k]);
        }
      }
    };
    if (FP4 || !z.scaled)
      run(std::false_type{});
    else
      run(std::true_type{});   // rare
  };
  // Tile i's logits from its sums.
  auto finish = [&](const Sums& z, int i) {
    const float post0 = z.scaled ? wscale : z.sk0 * wscale, post1 = z.scaled ? wscale : z.sk1 * wscale;
    float v[V];
    DSQ_UNROLL
    for (int qi = 0; qi < NQ; ++qi) {
      v[2 * qi] = z.s0[2 * qi] + z.s0[2 * qi + 1];
      v[2 * qi + 1] = z.s1[2 * qi] + z.s1[2 * qi + 1];
      if constexpr (FP4) {   // sums of 2 relu (relu2), halved exactly
        v[2 * qi] *= 0.5f;
        v[2 * qi + 1] *= 0.5f;
      }
    }
    float g[kSlots];
    dsq_quad::quad_reduce_scatter<V>(v, lane, g, [](float x, int m) { return shfl_xor(x, m); });
    const int base = (t0 + i) * kTile;
    if (pages_ok && base + kTile <= full_end) {   // every row of the tile inside every query's context
      DSQ_UNROLL
      for (int s = 0; s < kSlots; ++s)
        if (slot_live[s]) store(slot_row[s] + base + slot_key[s], g[s] * (slot_hi[s] ? post1 : post0));
      return;
    }
    DSQ_UNROLL
    for (int s = 0; s < kSlots; ++s) {
      const int p = base + slot_key[s];
      if (!slot_live[s] || p >= max_seq) continue;
      const bool in_ctx = p < slot_len[s];
      if (!in_ctx && !a.clean_logits) continue;
      const bool ok = pages_ok || page_at(p) >= 0;
      store(slot_row[s] + p, in_ctx && ok ? g[s] * (slot_hi[s] ? post1 : post0) : dsq::u2f(0xFF800000u));
    }
  };
  // One tile on its own (split and single modes); started() runs once its products are in flight.
  auto one_tile = [&](int i, auto&& started) {
    prepare(I0{}, i);
    product(I0{}, I0{}, i, 0);
    if constexpr (kSplit) {
      product(I1{}, I0{}, i, 64);
      started();
      mma_wait<1>();
      mma_done<NS>(acc[0]);
      Sums z = sums_begin(I0{});
      add_sums(z, I0{}, std::integral_constant<int, 0>{});
      mma_wait<0>();
      mma_done<NS>(acc[1]);
      if constexpr (FP4) frag_done(frag[0]);   // the A fragments stay live until both products completed
      add_sums(z, I1{}, std::integral_constant<int, 64>{});
      finish(z, i);
    } else {
      started();
      mma_wait<0>();
      mma_done<NS>(acc[0]);
      if constexpr (FP4) frag_done(frag[0]);
      Sums z = sums_begin(I0{});
      add_sums(z, I0{}, std::integral_constant<int, 0>{});
      finish(z, i);
    }
  };

  // Pair p: wait for its copies and make them visible (the barrier also ends every read of the stages
  // of pair p - 1, so they are refilled with pair p + kAhead after it: in the split and single modes once the
  // pair's first products run, which measured faster on the H100 for tiles of 128 q rows (fp8_132 (4, 4, 32768)
  // 15.3 µs against 16.05) and for aiter_fp4 ((64, 1, 8192) 29.65 against 31.45); in dual mode before its
  // products, which measured faster there (fp8_132 (4, 1, 32768) 9.65 against 10.3)). Dual mode: start both
  // products (tile 2p + 1's operands are prepared while tile 2p's runs), then tile 2p's epilogue while tile
  // 2p + 1's product runs; a tile past the last runs its product on a stage that holds no tile and skips its
  // epilogue. No product is in flight across iterations (the compiler keeps both in flight only then).
  for (int p = 0; 2 * p < n_tiles; ++p) {
    cp_wait<kAhead - 1>();
    if (packed68) bar_wait(sbars + p % kPairs, (p / kPairs) & 1);
    if constexpr (!FP4) async_fence();
    block_sync();
    SC_PHASE(7 + 2 * p);   // pair p landed
    const int i = 2 * p;
    if constexpr (!kDual) {
      one_tile(i, [&] { issue_pair(p + kAhead); });
      if (i + 1 < n_tiles) one_tile(i + 1, [] {});
      SC_PHASE(8 + 2 * p);   // pair p's logits stored
      continue;
    }
    issue_pair(p + kAhead);
    prepare(I0{}, i);
    product(I0{}, I0{}, i, 0);
    prepare(I1{}, i + 1);
    product(I1{}, I1{}, i + 1, 0);
    mma_wait<1>();
    mma_done<NS>(acc[0]);
    {
      Sums z = sums_begin(I0{});
      add_sums(z, I0{}, std::integral_constant<int, 0>{});
      finish(z, i);
    }
    mma_wait<0>();
    mma_done<NS>(acc[1]);
    if constexpr (FP4) {   // the A fragments stay live until their product completed
      frag_done(frag[0]);
      frag_done(frag[1]);
    }
    if (i + 1 < n_tiles) {
      Sums z = sums_begin(I1{});
      add_sums(z, I1{}, std::integral_constant<int, 0>{});
      finish(z, i + 1);
    }
    SC_PHASE(8 + 2 * p);
  }
  cp_wait<0>();   // no copy may land in the block's shared memory after it exits

  // ---- tiles past every query's context: -inf only ---------------------------------------------------
  if (a.clean_logits) {
    const int p_begin = tc * kTile, p_end = imin(t1 * kTile, max_seq);
    DSQ_UNROLL
    for (int qi = 0; qi < NQ; ++qi) {
      if (!valid[qi]) continue;
      const int64_t row = (b * a.N + static_cast<int64_t>(group) * NQ + qi) * a.ld;
      for (int p = p_begin + tid; p < p_end; p += kThreads) {
        if (a.out_dtype == dsq::kBF16)
          static_cast<uint16_t*>(a.logits)[row + p] = 0xFF80;   // bf16 -inf
        else
          static_cast<float*>(a.logits)[row + p] = dsq::u2f(0xFF800000u);
      }
    }
  }
  SC_PHASE_END();
}

// Block (split, group, b)'s first loads prefetched into L2: its q rows (payload bytes) and the cache pages of its
// first tiles (those whose copies it issues before its first product). For a CTA of a dependent launch before it
// waits for the kernel ahead, which may still be writing any input: the pages' block-table entries are read here
// (peek_index: no L1 line of them outlives the wait) and may be stale; they only choose pages to prefetch, and
// entries outside [0, num_blocks) or past the table are skipped, so every prefetch lies inside the cache.
template <int H, int NQ, int LAYOUT>
SC_FN void prefetch_block(const DsqPagedLogitsArgs& a, int split, int group, int64_t b, int tiles_per_block,
                          int p_shift) {
  constexpr bool FP4 = LAYOUT != DSQ_SCORER_FP8_132;
  const int tid = thread_id();
  const int64_t n0 = static_cast<int64_t>(group) * NQ;
  if (tid == 0 && split == 0 && n0 < a.N) {   // the q rows are the same for every split: one prefetch of them
    const int64_t nq = a.N - n0 < NQ ? a.N - n0 : NQ, row_bytes = q_row_bytes(LAYOUT);
    const uint8_t* q = static_cast<const uint8_t*>(a.q) + (b * a.N + n0) * H * row_bytes;
    prefetch_l2(q, static_cast<int>(nq * H * row_bytes));
  }
  const Geometry geo{static_cast<int>(a.page_size), p_shift};
  const int64_t first = static_cast<int64_t>(split) * tiles_per_block * kTile;
  const int64_t ahead = first + static_cast<int64_t>(stages_of(FP4) - 2) * kTile;   // the tiles of kAhead pairs
  const int64_t end = ahead < a.max_seq_len ? ahead : a.max_seq_len;
  if (first >= end) return;
  const int e = geo.page_of(static_cast<int>(first)) + tid;   // one page a thread
  if (e > geo.page_of(static_cast<int>(end - 1)) || e >= a.max_blocks) return;
  const int64_t pg = peek_index(a.block_table, b * a.bt_b + static_cast<int64_t>(e) * a.bt_k, a.bt_dtype == dsq::kI64);
  if (pg < 0 || pg >= a.num_blocks) return;
  const int64_t P = a.page_size;
  const int64_t page_bytes = P * kv_slot_bytes(LAYOUT);
  prefetch_l2(a.kv_cache + pg * page_bytes, static_cast<int>(page_bytes));
  if (LAYOUT == DSQ_SCORER_AITER_FP4) prefetch_l2(a.kv_scale + pg * 4 * P, static_cast<int>(4 * P));
}

// ---- host side: what the launch supports, its queries per block and its work split ---------------------------

// Whether the kernel takes these sizes (else the library returns "not supported" and the caller falls back).
inline bool supported(const DsqPagedLogitsArgs& a) {
  if (a.H != 16 && a.H != 32 && a.H != 64 && a.H != 128) return false;
  if (a.page_size < 4 || a.page_size % 4 || a.max_seq_len >= (int64_t{1} << 30)) return false;
  // aiter_fp4: a tile's exponents come from one page (P = 64, 128) or from whole pages (P = 16, 32)
  if (a.preshuffle && a.page_size % 16) return false;   // (the op refuses it before)
  return a.layout != DSQ_SCORER_AITER_FP4 || a.page_size == 16 || a.page_size == 32 || a.page_size == 64 ||
         a.page_size == 128;
}

// Queries per block: the next power of two >= N, up to 128 query rows (H * NQ <= 128).
inline int queries_per_block(const DsqPagedLogitsArgs& a) {
  const int64_t cap = 128 / a.H;
  int64_t nq = 1;
  while (nq < a.N && nq < cap) nq *= 2;
  return static_cast<int>(nq);
}

// The launch's grid (splits x groups x B) and the arguments of paged_logits_block, for `slots` blocks resident at
// once: splits <= 0 takes as many blocks as fit at once (one wave, no tail). Fewer or more splits measured slower
// on the H100 (fp8_132 (4, 4, 32768) at three blocks an SM: 47 splits, the one wave, 16.7 µs; 24 splits 22.9;
// 96 splits 20.3).
struct Plan {
  int splits, groups, tiles_per_block, n_pages, p_shift;
};
inline Plan plan(const DsqPagedLogitsArgs& a, int nq, int64_t slots) {
  Plan p{};
  p.groups = static_cast<int>((a.N + nq - 1) / nq);
  const int tiles = static_cast<int>((a.max_seq_len + kTile - 1) / kTile);
  int64_t splits = a.splits;
  if (splits <= 0) splits = slots / (a.B * p.groups);
  splits = splits < 1 ? 1 : (splits > tiles ? tiles : splits);
  p.tiles_per_block = static_cast<int>((tiles + splits - 1) / splits);
  p.splits = (tiles + p.tiles_per_block - 1) / p.tiles_per_block;
  const int P = static_cast<int>(a.page_size);
  p.n_pages = p.tiles_per_block * kTile / P + 2;
  p.p_shift = -1;
  if ((P & (P - 1)) == 0)
    for (p.p_shift = 0; (1 << p.p_shift) < P; ++p.p_shift) {
    }
  return p;
}

}  // namespace dsqsc
