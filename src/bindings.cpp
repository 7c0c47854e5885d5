// src/bindings.cpp: the pybind11 module over raw device pointers and stream handles (no libtorch).
//
// Each launcher takes a dict of plain Python ints/floats/bools (pointers as ints, strides in
// elements, dtype codes of kernels/cuda/row16.cuh) and the stream handle, fills the kernel's argument
// struct (kernels/cuda/indexer.h; the DeepSeek-V4 ops: kernels/cuda/v4_args.h) and launches. Built as dsaquant._cuda (CUDA) or dsaquant._hip (the
// hipified sources). A launch error raises RuntimeError naming the CUDA/HIP error.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "indexer.h"
#include "v4.h"

namespace py = pybind11;

namespace {

template <class T>
T get(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("dsaquant kernel argument missing: ") + key);
  return d[key].cast<T>();
}
template <class P>
P* ptr(const py::dict& d, const char* key) {
  return reinterpret_cast<P*>(static_cast<uintptr_t>(get<uint64_t>(d, key)));
}
RopeArgs rope(const py::dict& d) {
  RopeArgs r{};
  r.cos = ptr<const void>(d, "rope_cos");
  r.sin = ptr<const void>(d, "rope_sin");
  r.row_stride = get<int64_t>(d, "rope_stride");
  r.max_pos = get<int64_t>(d, "rope_max_pos");
  r.dtype = get<int>(d, "rope_dt");
  r.pairs = get<bool>(d, "rope_pairs");
  r.vec = get<bool>(d, "rope_vec");
  return r;
}
void check(int err, const char* what) {
  if (err != 0)
    throw std::runtime_error(std::string("dsaquant: launching ") + what + " failed: " +
                             cudaGetErrorString(static_cast<cudaError_t>(err)));
}
cudaStream_t stream_of(uint64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }

void indexer(const py::dict& d, uint64_t stream) {
  IndexerArgs a{};
  a.T = get<int64_t>(d, "T"); a.H = get<int64_t>(d, "H");
  a.num_blocks = get<int64_t>(d, "num_blocks"); a.P = get<int64_t>(d, "P");
  a.q = ptr<const void>(d, "q"); a.q_st = get<int64_t>(d, "q_st"); a.q_sh = get<int64_t>(d, "q_sh");
  a.q_vec = get<bool>(d, "q_vec");
  a.k = ptr<const void>(d, "k"); a.k_st = get<int64_t>(d, "k_st"); a.k_vec = get<bool>(d, "k_vec");
  a.in_dt = get<int>(d, "in_dt");
  a.w = ptr<const void>(d, "w"); a.w_st = get<int64_t>(d, "w_st"); a.w_sh = get<int64_t>(d, "w_sh");
  a.w_dt = get<int>(d, "w_dt");
  a.w_out = ptr<void>(d, "w_out"); a.w_out_dt = get<int>(d, "w_out_dt");
  a.w_out_st = get<int64_t>(d, "w_out_st"); a.w_out_sh = get<int64_t>(d, "w_out_sh");
  a.q_out = ptr<uint8_t>(d, "q_out"); a.q_scale_out = ptr<uint8_t>(d, "q_scale_out");
  a.kv_cache = ptr<uint8_t>(d, "kv_cache"); a.kv_scale = ptr<uint8_t>(d, "kv_scale");
  a.slots = ptr<const void>(d, "slots"); a.slots_dt = get<int>(d, "slots_dt");
  a.positions = ptr<const void>(d, "positions"); a.pos_dt = get<int>(d, "pos_dt");
  a.norm_w = ptr<const void>(d, "norm_w"); a.norm_w_dt = get<int>(d, "norm_w_dt");
  a.norm_b = ptr<const void>(d, "norm_b"); a.norm_b_dt = get<int>(d, "norm_b_dt");
  a.rope = rope(d);
  a.eps = get<float>(d, "eps"); a.weights_scale = get<float>(d, "weights_scale");
  a.fp4 = get<bool>(d, "fp4"); a.neox = get<bool>(d, "neox"); a.compute_all = get<bool>(d, "compute_all");
  a.preshuffle = get<bool>(d, "preshuffle"); a.ue8m0 = get<bool>(d, "ue8m0");
  a.rounding = get<int>(d, "rounding"); a.flavour = get<int>(d, "flavour");
  a.err_flag = ptr<int>(d, "err_flag");
  check(dsq_indexer_launch(a, stream_of(stream)), "indexer_qk_rope_quant_and_cache");
}

void kstore(const py::dict& d, uint64_t stream) {
  KStoreArgs a{};
  a.T = get<int64_t>(d, "T"); a.num_blocks = get<int64_t>(d, "num_blocks"); a.P = get<int64_t>(d, "P");
  a.k = ptr<const void>(d, "k"); a.k_st = get<int64_t>(d, "k_st"); a.k_vec = get<bool>(d, "k_vec");
  a.in_dt = get<int>(d, "in_dt");
  a.norm_w = ptr<const void>(d, "norm_w"); a.norm_w_dt = get<int>(d, "norm_w_dt");
  a.positions = ptr<const void>(d, "positions"); a.pos_dt = get<int>(d, "pos_dt");
  a.slots = ptr<const void>(d, "slots"); a.slots_dt = get<int>(d, "slots_dt");
  a.rope = rope(d);
  a.compress_ratio = get<int64_t>(d, "compress_ratio");
  a.eps = get<float>(d, "eps"); a.rounding = get<int>(d, "rounding"); a.mode = get<int>(d, "mode");
  a.hadamard = get<bool>(d, "hadamard");
  a.cache = ptr<uint8_t>(d, "cache"); a.cache_scale = ptr<uint8_t>(d, "cache_scale");
  a.err_flag = ptr<int>(d, "err_flag");
  check(dsq_kstore_launch(a, stream_of(stream)), "k store");
}

void qpack(const py::dict& d, uint64_t stream) {
  QPackArgs a{};
  a.T = get<int64_t>(d, "T"); a.H = get<int64_t>(d, "H");
  a.q = ptr<const void>(d, "q"); a.q_st = get<int64_t>(d, "q_st"); a.q_sh = get<int64_t>(d, "q_sh");
  a.q_vec = get<bool>(d, "q_vec"); a.in_dt = get<int>(d, "in_dt");
  a.positions = ptr<const void>(d, "positions"); a.pos_dt = get<int>(d, "pos_dt");
  a.rope = rope(d);
  a.compress_ratio = get<int64_t>(d, "compress_ratio");
  a.rounding = get<int>(d, "rounding"); a.mode = get<int>(d, "mode");
  a.w = ptr<const void>(d, "w"); a.w_st = get<int64_t>(d, "w_st"); a.w_sh = get<int64_t>(d, "w_sh");
  a.w_dt = get<int>(d, "w_dt"); a.weight_scale = get<float>(d, "weight_scale");
  a.payload = ptr<uint8_t>(d, "payload"); a.exps = ptr<int32_t>(d, "exps"); a.w_out = ptr<float>(d, "w_out");
  a.fq_out = ptr<uint16_t>(d, "fq_out");
  a.err_flag = ptr<int>(d, "err_flag");
  check(dsq_qpack_launch(a, stream_of(stream)), "q pack");
}

// Key-value source for the fillers of kernels/cuda/v4_args.h (one definition of the V4 ops' keys).
struct DictSrc {
  const py::dict& d;
  int64_t i64(const char* k) const { return get<int64_t>(d, k); }
  double f64(const char* k) const { return get<double>(d, k); }
  bool flag(const char* k) const { return get<bool>(d, k); }
  void* ptr(const char* k) const { return ::ptr<void>(d, k); }
};

void compress_kv(const py::dict& d, uint64_t stream) {
  check(dsq_compress_kv_launch(dsqv4::compress_args_from(DictSrc{d}), stream_of(stream)), "compress_kv");
}

void rope_rotate_quant(const py::dict& d, uint64_t stream) {
  check(dsq_rope_rotate_launch(dsqv4::rotate_args_from(DictSrc{d}), stream_of(stream)), "rope_rotate_quant");
}

void fp8_selfcheck(uint64_t start, uint64_t count, uint64_t out, uint64_t stream) {
  check(dsq_fp8_selfcheck_launch(start, count, reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(out)),
                                 stream_of(stream)),
        "fp8_selfcheck");
}

void exp_ds(uint64_t x, uint64_t y, int64_t n, uint64_t stream) {
  check(dsq_exp_ds_launch(reinterpret_cast<const float*>(static_cast<uintptr_t>(x)),
                          reinterpret_cast<float*>(static_cast<uintptr_t>(y)), n, stream_of(stream)),
        "exp_ds");
}

}  // namespace

#ifndef DSQ_MODULE_NAME
#define DSQ_MODULE_NAME _cuda
#endif

PYBIND11_MODULE(DSQ_MODULE_NAME, m) {
  m.doc() = "dsaquant compiled kernels over raw device pointers (see python/dsaquant/backends/compiled.py)";
  m.def("indexer", &indexer, "SPEC §7.1", py::arg("args"), py::arg("stream"));
  m.def("kstore", &kstore, "SPEC §7.2 k writer and §7.3", py::arg("args"), py::arg("stream"));
  m.def("qpack", &qpack, "SPEC §7.2 q packer and rope_fake_quant_fp4", py::arg("args"), py::arg("stream"));
  m.def("compress_kv", &compress_kv, "SPEC §7.6 (the DeepSeek-V4 compressor)", py::arg("args"), py::arg("stream"));
  m.def("rope_rotate_quant", &rope_rotate_quant, "SPEC §7.7", py::arg("args"), py::arg("stream"));
  m.def("fp8_selfcheck", &fp8_selfcheck, "hardware vs software e4m3fn encoder over fp32 patterns [start, start+count)",
        py::arg("start"), py::arg("count"), py::arg("out_ptr"), py::arg("stream"));
  m.def("exp_ds", &exp_ds, "SPEC §0.7 exp_ds of n fp32 values (device pointers x -> y)", py::arg("x_ptr"),
        py::arg("y_ptr"), py::arg("n"), py::arg("stream"));
}
