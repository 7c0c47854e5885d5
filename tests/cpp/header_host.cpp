// Host test harness for the shared header: thin, vectorised pybind11 wrappers over numpy arrays.
// Every wrapper only loops and calls src/include/dsaquant functions; no format math lives here.
// Built by tests/conftest.py with g++ -O2 -std=c++17 -ffp-contract=off -fno-fast-math.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <vector>

#include "dsaquant/dsaquant.h"

namespace py = pybind11;
template <class T>
using arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

namespace {

template <class T>
arr<T> like(py::ssize_t n) { return arr<T>(n); }

template <class T>
arr<T> shaped(std::vector<py::ssize_t> shape) { return arr<T>(shape); }

// Elementwise map over one input array.
template <class Out, class In, class F>
arr<Out> map1(const arr<In>& x, F f) {
  auto out = arr<Out>(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
  const In* xi = x.data();
  Out* o = out.mutable_data();
  const py::ssize_t n = x.size();
  for (py::ssize_t i = 0; i < n; ++i) o[i] = f(xi[i]);
  return out;
}

void need(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

dsq::Rounding rounding(int r) { need(r >= 0 && r <= 2, "rounding 0..2"); return static_cast<dsq::Rounding>(r); }
dsq::ScaleRule rule(int r) { need(r == 0 || r == 1, "rule 0..1"); return static_cast<dsq::ScaleRule>(r); }
dsq::Fp8Flavour flavour(int f) { need(f == 0 || f == 1, "flavour 0..1"); return static_cast<dsq::Fp8Flavour>(f); }

// Row-wise call on a 2-D float array [R, n], in place on a copy.
template <class F>
arr<float> rows_inplace(const arr<float>& x, F f) {
  need(x.ndim() == 2, "x must be 2-D");
  arr<float> out(std::vector<py::ssize_t>{x.shape(0), x.shape(1)});
  std::copy(x.data(), x.data() + x.size(), out.mutable_data());
  for (py::ssize_t r = 0; r < x.shape(0); ++r) f(out.mutable_data() + r * x.shape(1), r);
  return out;
}

}  // namespace

PYBIND11_MODULE(dsq_header_host, m) {
  m.attr("kFp8132Rows16") = dsq::kFp8132Rows16;
  m.doc() = "Vectorised host wrappers over the dsaquant shared header (tests only)";

  // ---- arith (SPEC §0) ----
  m.def("pow2", [](const arr<int32_t>& e) { return map1<float>(e, [](int32_t v) { return dsq::pow2(v); }); });
  m.def("ceil_exp", [](const arr<float>& f) { return map1<int32_t>(f, [](float v) { return dsq::ceil_exp(v); }); });
  m.def("round_bf16", [](const arr<float>& x) { return map1<uint16_t>(x, [](float v) { return dsq::round_bf16(v); }); });
  m.def("round_fp16", [](const arr<float>& x) { return map1<uint16_t>(x, [](float v) { return dsq::round_fp16(v); }); });
  m.def("bf16_to_f32", [](const arr<uint16_t>& h) { return map1<float>(h, [](uint16_t v) { return dsq::bf16_to_f32(v); }); });
  m.def("fp16_to_f32", [](const arr<uint16_t>& h) { return map1<float>(h, [](uint16_t v) { return dsq::fp16_to_f32(v); }); });
  m.def("exp_ds", [](const arr<float>& x) { return map1<float>(x, [](float v) { return dsq::exp_ds(v); }); });
  m.def("nan_amax", [](const arr<float>& x) {
    need(x.ndim() == 2, "x must be 2-D");
    auto out = like<float>(x.shape(0));
    for (py::ssize_t r = 0; r < x.shape(0); ++r)
      out.mutable_data()[r] = dsq::nan_amax(x.data() + r * x.shape(1), static_cast<int>(x.shape(1)));
    return out;
  });
  // Canonical sum of each row: serial runtime-n, the templated one-thread version (n = 8, 128, 512),
  // and the lane butterfly emulated with an array of lanes.
  m.def("canonical_sum", [](const arr<float>& x, int variant) {
    need(x.ndim() == 2, "x must be 2-D");
    const int n = static_cast<int>(x.shape(1)), mp = n / 4;
    need(n >= 4 && n % 4 == 0 && (mp & (mp - 1)) == 0 && mp <= 256, "n = 4 * 2^k <= 1024");
    auto out = like<float>(x.shape(0));
    for (py::ssize_t r = 0; r < x.shape(0); ++r) {
      const float* row = x.data() + r * n;
      float s = 0;
      if (variant == 0) {
        s = dsq::canonical_sum_n(row, n);
      } else if (variant == 1) {
        if (n == 8) s = dsq::canonical_sum<8>(row);
        else if (n == 128) s = dsq::canonical_sum<128>(row);
        else if (n == 512) s = dsq::canonical_sum<512>(row);
        else throw std::invalid_argument("templated variant: n in 8, 128, 512");
      } else {
        float lanes[256], next[256];
        for (int i = 0; i < mp; ++i) lanes[i] = dsq::canonical_partial(row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]);
        // Every lane runs canonical_reduce_lanes one step at a time, as a warp would.
        for (int step = mp >> 1; step >= 1; step >>= 1) {
          for (int i = 0; i < mp; ++i)
            next[i] = dsq::canonical_reduce_lanes(lanes[i], 2, [&](float, int) { return lanes[i ^ step]; });
          std::copy(next, next + mp, lanes);
        }
        s = lanes[0];
      }
      out.mutable_data()[r] = s;
    }
    return out;
  }, py::arg("x"), py::arg("variant") = 0);

  // ---- FP4 (SPEC §1-§3, §7.2) ----
  m.def("e2m1_encode", [](const arr<float>& v, int r) {
    const auto rr = rounding(r);
    return map1<uint8_t>(v, [rr](float x) { return dsq::e2m1_encode(x, rr); });
  });
  m.def("e2m1_decode", [](const arr<uint8_t>& c) { return map1<float>(c, [](uint8_t v) { return dsq::e2m1_decode(v); }); });
  // Codes of x[j] at every exponent es[i]: out [len(es), len(x)], through e2m1_encode_pair.
  m.def("e2m1_encode_grid", [](const arr<float>& x, const arr<int32_t>& es, int r) {
    const auto rr = rounding(r);
    const py::ssize_t n = x.size(), ne = es.size();
    need(n % 2 == 0, "even length");
    auto out = shaped<uint8_t>({ne, n});
    uint8_t* o = out.mutable_data();
    for (py::ssize_t i = 0; i < ne; ++i)
      for (py::ssize_t j = 0; j < n; j += 2) {
        const uint8_t b = dsq::e2m1_encode_pair(x.data()[j], x.data()[j + 1], es.data()[i], rr);
        o[i * n + j] = b & 0xF;
        o[i * n + j + 1] = b >> 4;
      }
    return out;
  });
  // The packed bf16 encoder (e2m1x8.h): x = bf16 bits, groups of 8 values of one block, at every
  // exponent es[i] -> packed bytes [len(es), len(x)/2].
  m.def("e2m1_encode8_bf16_grid", [](const arr<uint16_t>& x, const arr<int32_t>& es, int r) {
    const auto rr = rounding(r);
    const py::ssize_t n = x.size(), ne = es.size();
    need(n % 8 == 0, "length a multiple of 8");
    auto out = shaped<uint8_t>({ne, n / 2});
    uint8_t* o = out.mutable_data();
    for (py::ssize_t i = 0; i < ne; ++i)
      for (py::ssize_t g = 0; g < n; g += 8) {
        uint32_t w[4], aw[4];
        for (int j = 0; j < 4; ++j) {
          w[j] = x.data()[g + j] | (static_cast<uint32_t>(x.data()[g + j + 4]) << 16);
          aw[j] = dsq::bf16x2_abs(w[j]);
        }
        const int e = es.data()[i];
        const uint32_t b = rr == dsq::Rounding::threshold ? dsq::e2m1_encode8_bf16<dsq::Rounding::threshold>(w, aw, e)
                           : rr == dsq::Rounding::rne     ? dsq::e2m1_encode8_bf16<dsq::Rounding::rne>(w, aw, e)
                                                          : dsq::e2m1_encode8_bf16<dsq::Rounding::hardware>(w, aw, e);
        for (int k = 0; k < 4; ++k) o[i * (n / 2) + g / 2 + k] = static_cast<uint8_t>(b >> (8 * k));
      }
    return out;
  });
  // The fp32 encoder (e2m1x8.h): blocks of 8 values x[8b .. 8b+7], block b at exponent es[b] -> packed bytes
  // [len(x)/2].
  m.def("e2m1_encode8_f32", [](const arr<float>& x, const arr<int32_t>& es, int r) {
    const auto rr = rounding(r);
    const py::ssize_t n = x.size();
    need(n % 8 == 0 && es.size() == n / 8, "8 values a block, one exponent a block");
    auto out = shaped<uint8_t>({n / 2});
    uint8_t* o = out.mutable_data();
    for (py::ssize_t g = 0; g < n; g += 8) {
      float v[8];
      for (int j = 0; j < 8; ++j) v[j] = x.data()[g + j];
      const int e = es.data()[g / 8];
      const uint32_t b = rr == dsq::Rounding::threshold ? dsq::e2m1_encode8_f32<dsq::Rounding::threshold>(v, e)
                         : rr == dsq::Rounding::rne     ? dsq::e2m1_encode8_f32<dsq::Rounding::rne>(v, e)
                                                        : dsq::e2m1_encode8_f32<dsq::Rounding::hardware>(v, e);
      for (int k = 0; k < 4; ++k) o[g / 2 + k] = static_cast<uint8_t>(b >> (8 * k));
    }
    return out;
  });
  m.def("div128", [](const arr<float>& x) { return map1<float>(x, [](float v) { return dsq::div128(v); }); });
  m.def("ue8m0_recip_exponent_bf16", [](const arr<uint16_t>& b) {
    return map1<int32_t>(b, [](uint16_t v) { return dsq::ue8m0_recip_exponent_bf16(v); });
  });
  // Two blocks' exponents and encoder multipliers from their packed amax (e2m1x8.h) -> [n, 6] int64:
  // e_a, e_b, s_a, s_b, nan_a, nan_b.
  m.def("ue8m0_recip_scales_bf16x2", [](const arr<uint32_t>& mw) {
    auto out = shaped<int64_t>({mw.size(), 6});
    for (py::ssize_t i = 0; i < mw.size(); ++i) {
      const dsq::Bf16x2Scales sc = dsq::ue8m0_recip_scales_bf16x2(mw.data()[i]);
      int64_t* o = out.mutable_data() + 6 * i;
      o[0] = sc.e_a;
      o[1] = sc.e_b;
      o[2] = sc.s_a;
      o[3] = sc.s_b;
      o[4] = sc.nan_a;
      o[5] = sc.nan_b;
    }
    return out;
  });
  m.def("ue8m0_pack_exponent_bf16", [](const arr<uint16_t>& b) {
    return map1<int32_t>(b, [](uint16_t v) { return dsq::ue8m0_pack_exponent_bf16(v); });
  });

  // ---- SPEC §7.2 for bf16 inputs (two_stage_x8.h) ----
  // Stage 1 of the pairs (x[2i], x[2i+1]) (bf16 bits) at every exponent es[k] -> bf16 bits [len(es), len(x)].
  m.def("fake_quant_bf16x2_grid", [](const arr<uint16_t>& x, const arr<int32_t>& es) {
    const py::ssize_t n = x.size(), ne = es.size();
    need(n % 2 == 0, "even length");
    auto out = shaped<uint16_t>({ne, n});
    uint16_t* o = out.mutable_data();
    for (py::ssize_t k = 0; k < ne; ++k) {
      const dsq::FakeQuantBf16x2 c = dsq::fake_quant_consts_bf16x2(es.data()[k]);
      for (py::ssize_t j = 0; j < n; j += 2) {
        const uint32_t w = x.data()[j] | (static_cast<uint32_t>(x.data()[j + 1]) << 16);
        const uint32_t v = dsq::fake_quant_bf16x2(w, dsq::bf16x2_abs(w), c);
        o[k * n + j] = static_cast<uint16_t>(v & 0xFFFFu);
        o[k * n + j + 1] = static_cast<uint16_t>(v >> 16);
      }
    }
    return out;
  });
  // Exact exponents of a block from its amax bits -> [n, 2] int32 (e1, e2).
  m.def("two_stage_exponents_bf16", [](const arr<uint16_t>& b) {
    auto out = shaped<int32_t>({b.size(), 2});
    for (py::ssize_t i = 0; i < b.size(); ++i) {
      int e1, e2;
      dsq::two_stage_exponents_bf16(b.data()[i], e1, e2);
      out.mutable_data()[2 * i] = e1;
      out.mutable_data()[2 * i + 1] = e2;
    }
    return out;
  });
  // The fast path's parameters of two blocks from their packed amax -> [n, 11] int64: inv, clamp, kr, thr
  // (a then b), e2 of a, e2 of b, fast_a, fast_b... as listed in the Python test.
  m.def("two_stage_params_bf16x2", [](const arr<uint32_t>& mw) {
    auto out = shaped<int64_t>({mw.size(), 12});
    for (py::ssize_t i = 0; i < mw.size(); ++i) {
      const dsq::TwoStageBf16x2 p = dsq::two_stage_params_bf16x2(mw.data()[i]);
      int64_t* o = out.mutable_data() + 12 * i;
      const uint32_t v[12] = {p.inv_a, p.inv_b, p.clamp_a, p.clamp_b, p.kr_a, p.kr_b, p.thr_a, p.thr_b,
                              p.e2 & 0xFFFFu, p.e2 >> 16, p.fast_a, p.fast_b};
      for (int k = 0; k < 12; ++k) o[k] = v[k];
    }
    return out;
  });
  // Groups of 8 values (x bf16 bits, value j and j + 4 paired as the kernels pair them) of blocks whose amax
  // has the bits b (the values are the caller's; |x| <= amax or NaN), every policy -> (fast bytes, general
  // bytes), each [3, len(x) / 2]: two_stage8_bf16_fast with two_stage_params_bf16x2's block a, and
  // two_stage8_bf16.
  m.def("two_stage8_fast_and_general", [](const arr<uint16_t>& x, uint16_t b) {
    const py::ssize_t n = x.size();
    need(n % 8 == 0, "length a multiple of 8");
    auto fast = shaped<uint8_t>({3, n / 2});
    auto general = shaped<uint8_t>({3, n / 2});
    const dsq::TwoStageBf16x2 p = dsq::two_stage_params_bf16x2(b);
    for (int r = 0; r < 3; ++r)
      for (py::ssize_t g = 0; g < n; g += 8) {
        uint32_t w[4], aw[4];
        for (int j = 0; j < 4; ++j) {
          w[j] = x.data()[g + j] | (static_cast<uint32_t>(x.data()[g + j + 4]) << 16);
          aw[j] = dsq::bf16x2_abs(w[j]);
        }
        int e2;
        const uint32_t f = dsq::two_stage8_bf16_fast(w, aw, p.inv_a, p.clamp_a, p.kr_a, p.thr_a, rounding(r));
        const uint32_t q = dsq::two_stage8_bf16(w, aw, b, rounding(r), e2);
        for (int k = 0; k < 4; ++k) {
          fast.mutable_data()[r * (n / 2) + g / 2 + k] = static_cast<uint8_t>(f >> (8 * k));
          general.mutable_data()[r * (n / 2) + g / 2 + k] = static_cast<uint8_t>(q >> (8 * k));
        }
      }
    return py::make_tuple(fast, general);
  });
  // Rows of 128 bf16 values through the CUDA q packer's steps (kernels/cuda/qpack.cu, bf16 inputs): lane l of
  // 8 holds values 8l..8l+7 (block l/4) and 64+8l..64+8l+7 (block 2 + l/4), paired j with j + 4; a block's
  // amax is the bf16x2 max of its 4 lanes' words (a NaN ignored, all-NaN: 0); blocks (0, 2) and (1, 3) get
  // their parameters together; a fast block takes two_stage8_bf16_fast, any other two_stage8_bf16.
  // -> (payload u8 [R, 64], exponents u8 [R, 4], fast blocks).
  m.def("two_stage_rows_bf16", [](const arr<uint16_t>& x, int r) {
    need(x.ndim() == 2 && x.shape(1) == 128, "x [R, 128] bf16 bits");
    const auto rr = rounding(r);
    const py::ssize_t R = x.shape(0);
    auto payload = shaped<uint8_t>({R, 64});
    auto exps = shaped<uint8_t>({R, 4});
    int64_t n_fast = 0;
    for (py::ssize_t i = 0; i < R; ++i) {
      const uint16_t* row = x.data() + i * 128;
      uint32_t w[8][2][4], aw[8][2][4];   // [lane][a / b][j]
      for (int l = 0; l < 8; ++l)
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 4; ++j) {
            const uint16_t* v = row + 64 * h + 8 * l;
            w[l][h][j] = v[j] | (static_cast<uint32_t>(v[j + 4]) << 16);
            aw[l][h][j] = dsq::bf16x2_abs(w[l][h][j]);
          }
      for (int lb = 0; lb < 2; ++lb) {   // lanes 4 lb .. 4 lb + 3: blocks lb (a) and 2 + lb (b)
        uint32_t m2[2];
        for (int h = 0; h < 2; ++h) {
          uint32_t m = 0;
          for (int l = 4 * lb; l < 4 * lb + 4; ++l)
            for (int j = 0; j < 4; ++j) m = dsq::bf16x2_max_nn(m, aw[l][h][j]);
          m = dsq::bf16x2_max_nn(m, m >> 16) & 0xFFFFu;   // both halves of the words
          m2[h] = dsq::bf16x2_max_nn(m, 0u) & 0xFFFFu;
        }
        const dsq::TwoStageBf16x2 p = dsq::two_stage_params_bf16x2(m2[0] | (m2[1] << 16));
        for (int h = 0; h < 2; ++h) {
          const bool fast = h ? p.fast_b : p.fast_a;
          int e2 = static_cast<int>(h ? p.e2 >> 16 : p.e2 & 0xFFFFu);
          n_fast += fast;
          for (int l = 4 * lb; l < 4 * lb + 4; ++l) {
            const uint32_t bytes = fast ? dsq::two_stage8_bf16_fast(w[l][h], aw[l][h], h ? p.inv_b : p.inv_a,
                                                                    h ? p.clamp_b : p.clamp_a, h ? p.kr_b : p.kr_a,
                                                                    h ? p.thr_b : p.thr_a, rr)
                                        : dsq::two_stage8_bf16(w[l][h], aw[l][h], m2[h], rr, e2);
            for (int k = 0; k < 4; ++k) payload.mutable_data()[i * 64 + 32 * h + 4 * l + k] = static_cast<uint8_t>(bytes >> (8 * k));
          }
          exps.mutable_data()[i * 4 + 2 * h + lb] = static_cast<uint8_t>(e2);
        }
      }
    }
    return py::make_tuple(payload, exps, n_fast);
  });
  m.def("pack_nibbles", [](const arr<uint8_t>& c) {
    need(c.ndim() == 2 && c.shape(1) % 2 == 0, "codes [R, even]");
    auto out = shaped<uint8_t>({c.shape(0), c.shape(1) / 2});
    for (py::ssize_t i = 0; i < out.size(); ++i) out.mutable_data()[i] = dsq::pack_nibbles(c.data()[2 * i], c.data()[2 * i + 1]);
    return out;
  });
  m.def("ue8m0_exponent", [](const arr<float>& amax, int ru) {
    const auto rr = rule(ru);
    return map1<int32_t>(amax, [rr](float a) { return dsq::ue8m0_exponent(a, rr); });
  });
  // x [R, n] (n % 32 == 0) -> (packed u8 [R, n/2], exponents u8 [R, n/32]).
  m.def("fp4_quantize", [](const arr<float>& x, int r, int ru) {
    need(x.ndim() == 2 && x.shape(1) % 32 == 0, "x [R, 32k]");
    const auto rr = rounding(r);
    const auto sr = rule(ru);
    const py::ssize_t R = x.shape(0), n = x.shape(1), nb = n / 32;
    auto packed = shaped<uint8_t>({R, n / 2});
    auto exps = shaped<uint8_t>({R, nb});
    for (py::ssize_t i = 0; i < R * nb; ++i) {
      const float* blk = x.data() + i * 32;
      const int e = dsq::fp4_block_exponent(blk, 32, sr);
      exps.mutable_data()[i] = static_cast<uint8_t>(e);
      dsq::fp4_encode_block32(blk, e, rr, packed.mutable_data() + i * 16);
    }
    return py::make_tuple(packed, exps);
  });
  // §7.2 stage 1 (blocks of 32, rule recip), fp32 result (callers round). by_exponent: the kernels'
  // form (multiply by the exact reciprocal of 2^(e-127)) instead of the division by s.
  m.def("fp4_fake_quant", [](const arr<float>& x, bool by_exponent) {
    return rows_inplace(x, [&](float* row, py::ssize_t) {
      need(x.shape(1) % 32 == 0, "x [R, 32k]");
      for (py::ssize_t b = 0; b < x.shape(1); b += 32) {
        const int e = dsq::fp4_block_exponent(row + b, 32, dsq::ScaleRule::recip);
        for (int i = 0; i < 32; ++i)
          row[b + i] = by_exponent ? dsq::fp4_fake_quant_value_e(row[b + i], e)
                                   : dsq::fp4_fake_quant_value(row[b + i], dsq::pow2(e));
      }
    });
  }, py::arg("x"), py::arg("by_exponent") = false);

  // ---- FP8 (SPEC §4) ----
  m.def("fp8_encode", [](const arr<float>& x, int f) {
    const auto fl = flavour(f);
    return map1<uint8_t>(x, [fl](float v) { return dsq::fp8_encode(v, fl); });
  });
  m.def("fp8_decode", [](const arr<uint8_t>& c, int f) {
    const auto fl = flavour(f);
    return map1<float>(c, [fl](uint8_t v) { return dsq::fp8_decode(v, fl); });
  });
  m.def("fp8_row_scale", [](const arr<float>& amax, int f, int role, bool ue8m0) {
    const auto fl = flavour(f);
    const auto ro = static_cast<dsq::Fp8Role>(role);
    return map1<float>(amax, [=](float a) { return dsq::fp8_row_scale(a, fl, ro, ue8m0); });
  });
  // x [R, n] -> (codes u8 [R, n], scales f32 [R, n/128]).
  m.def("fp8_quantize", [](const arr<float>& x, int f, int role, bool ue8m0) {
    need(x.ndim() == 2 && x.shape(1) % 128 == 0, "x [R, 128k]");
    const auto fl = flavour(f);
    const py::ssize_t R = x.shape(0), n = x.shape(1), nb = n / 128;
    auto codes = shaped<uint8_t>({R, n});
    auto scales = shaped<float>({R, nb});
    for (py::ssize_t i = 0; i < R * nb; ++i)
      scales.mutable_data()[i] = dsq::fp8_quantize_row(x.data() + i * 128, 128, fl, static_cast<dsq::Fp8Role>(role), ue8m0,
                                                       codes.mutable_data() + i * 128);
    return py::make_tuple(codes, scales);
  });

  // ---- RoPE, norms, Hadamard (SPEC §5) ----
  m.def("rope_pair", [](const arr<float>& a, const arr<float>& b, const arr<float>& c, const arr<float>& s) {
    const py::ssize_t n = a.size();
    need(b.size() == n && c.size() == n && s.size() == n, "equal sizes");
    auto oa = like<float>(n), ob = like<float>(n);
    for (py::ssize_t i = 0; i < n; ++i) {
      float x = a.data()[i], y = b.data()[i];
      dsq::rope_pair(x, y, c.data()[i], s.data()[i]);
      oa.mutable_data()[i] = x;
      ob.mutable_data()[i] = y;
    }
    return py::make_tuple(oa, ob);
  });
  m.def("rope_row", [](const arr<float>& x, const arr<float>& cos, const arr<float>& sin, bool neox, bool tail) {
    need(x.ndim() == 2 && x.shape(1) == 128 && cos.size() == x.shape(0) * 32 && sin.size() == cos.size(), "x [R,128], cos/sin [R,32]");
    return rows_inplace(x, [&](float* row, py::ssize_t r) { dsq::rope_row128(row, cos.data() + 32 * r, sin.data() + 32 * r, neox, tail); });
  });
  m.def("rope_dims", [](int j, bool neox, bool tail) { return py::make_tuple(dsq::rope_dim_a(j, neox, tail), dsq::rope_dim_b(j, neox, tail)); });
  m.def("rope_position", [](const arr<int64_t>& pos, int64_t max_pos, int64_t ratio) {
    return map1<int64_t>(pos, [=](int64_t p) { return dsq::rope_position(p, max_pos, ratio); });
  });
  m.def("layer_norm", [](const arr<float>& x, const arr<float>& w, const arr<float>& b, float eps) {
    need(x.ndim() == 2 && x.shape(1) == 128 && w.size() == 128 && b.size() == 128, "x [R,128], w, b [128]");
    return rows_inplace(x, [&](float* row, py::ssize_t) { dsq::layer_norm_row<128>(row, w.data(), b.data(), eps); });
  });
  m.def("rms_norm", [](const arr<float>& x, const arr<float>& w, float eps) {
    need(x.ndim() == 2 && w.size() == x.shape(1) && (x.shape(1) == 128 || x.shape(1) == 512), "x [R,128|512], w [n]");
    return rows_inplace(x, [&](float* row, py::ssize_t) {
      if (x.shape(1) == 128) dsq::rms_norm_row<128>(row, w.data(), eps);
      else dsq::rms_norm_row<512>(row, w.data(), eps);
    });
  });
  m.def("hadamard", [](const arr<float>& x) {
    need(x.ndim() == 2, "x [R, n]");
    const py::ssize_t n = x.shape(1);
    return rows_inplace(x, [&](float* row, py::ssize_t) {
      switch (n) {
        case 2: dsq::hadamard_inplace<2>(row); break;
        case 32: dsq::hadamard_inplace<32>(row); break;
        case 64: dsq::hadamard_inplace<64>(row); break;
        case 128: dsq::hadamard128(row); break;
        case 256: dsq::hadamard_inplace<256>(row); break;
        case 512: dsq::hadamard_inplace<512>(row); break;
        case 1024: dsq::hadamard_inplace<1024>(row); break;
        default: throw std::invalid_argument("n in 2, 32, 64, 128, 256, 512, 1024");
      }
    });
  });
  m.def("hadamard_scale", [](int n) { return dsq::hadamard_scale(n); });

  // ---- SPEC §7.6 pool, §7.7 FP8 group scale ----
  // sig, m [N] fp32 -> pool_exp(sig, m) [N].
  m.def("pool_exp", [](const arr<float>& sig, const arr<float>& mx) {
    need(sig.ndim() == 1 && mx.ndim() == 1 && sig.shape(0) == mx.shape(0), "sig, m: [N] each");
    arr<float> out(sig.shape(0));
    for (py::ssize_t i = 0; i < sig.shape(0); ++i) out.mutable_data()[i] = dsq::pool_exp(sig.data()[i], mx.data()[i]);
    return out;
  });
  // sig, kv [N, K] fp32, incl [N, K] bool -> y [N] (pool_window<K>, K in 4, 8, 128, 256).
  m.def("pool_window", [](const arr<float>& sig, const arr<float>& kv, const arr<bool>& incl) {
    need(sig.ndim() == 2 && kv.ndim() == 2 && incl.ndim() == 2 && kv.shape(0) == sig.shape(0) &&
         incl.shape(0) == sig.shape(0) && kv.shape(1) == sig.shape(1) && incl.shape(1) == sig.shape(1),
         "sig, kv, incl [N, K]");
    const py::ssize_t N = sig.shape(0), K = sig.shape(1);
    auto out = like<float>(N);
    for (py::ssize_t r = 0; r < N; ++r) {
      const float* s = sig.data() + r * K;
      const float* k = kv.data() + r * K;
      const bool* in = incl.data() + r * K;
      float y;
      switch (K) {
        case 4: y = dsq::pool_window<4>(s, k, in); break;
        case 8: y = dsq::pool_window<8>(s, k, in); break;
        case 128: y = dsq::pool_window<128>(s, k, in); break;
        case 256: y = dsq::pool_window<256>(s, k, in); break;
        default: throw std::invalid_argument("K in 4, 8, 128, 256");
      }
      out.mutable_data()[r] = y;
    }
    return out;
  });
  m.def("fp8_group_scale", [](const arr<float>& amax, int f) {
    const auto fl = flavour(f);
    return map1<float>(amax, [fl](float a) { return dsq::fp8_group_scale(a, fl); });
  });

  // ---- layouts (SPEC §6): elementwise over broadcast-free int64 arrays of equal size ----
  auto off3 = [](int64_t (*fn)(int64_t, int64_t, int64_t)) {
    return [fn](const arr<int64_t>& t, int64_t P, const arr<int64_t>& k) {
      need(t.size() == k.size(), "equal sizes");
      auto out = like<int64_t>(t.size());
      for (py::ssize_t i = 0; i < t.size(); ++i) out.mutable_data()[i] = fn(t.data()[i], P, k.data()[i]);
      return out;
    };
  };
  m.def("packed68_payload_offset", off3(dsq::packed68_payload_offset));
  m.def("packed68_scale_offset", off3(dsq::packed68_scale_offset));
  m.def("aiter_fp4_data_offset", off3(dsq::aiter_fp4_data_offset));
  m.def("aiter_fp4_scale_offset", off3(dsq::aiter_fp4_scale_offset));
  m.def("fp8_132_data_offset", [](const arr<int64_t>& t, int64_t P, const arr<int64_t>& d, bool pre) {
    need(t.size() == d.size(), "equal sizes");
    auto out = like<int64_t>(t.size());
    for (py::ssize_t i = 0; i < t.size(); ++i) out.mutable_data()[i] = dsq::fp8_132_data_offset(t.data()[i], P, d.data()[i], pre);
    return out;
  });
  m.def("fp8_132_scale_offset", [](const arr<int64_t>& t, int64_t P) {
    return map1<int64_t>(t, [P](int64_t v) { return dsq::fp8_132_scale_offset(v, P); });
  });
  m.def("aiter_sflat", [](const arr<int64_t>& o, int64_t P) {
    return map1<int64_t>(o, [P](int64_t v) { return dsq::aiter_sflat(v, P); });
  });
  m.def("aiter_q_scale_pad", [](int64_t H) { return dsq::aiter_q_scale_pad(H); });
  m.def("aiter_q_scale_offset", [](const arr<int64_t>& t, const arr<int64_t>& h, const arr<int64_t>& g, int64_t H) {
    need(t.size() == h.size() && t.size() == g.size(), "equal sizes");
    auto out = like<int64_t>(t.size());
    for (py::ssize_t i = 0; i < t.size(); ++i) out.mutable_data()[i] = dsq::aiter_q_scale_offset(t.data()[i], h.data()[i], g.data()[i], H);
    return out;
  });
}
