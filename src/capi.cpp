// src/capi.cpp: the C interface of the compiled library (dsaquant/abi.h): one entry point per op over its
// argument struct, and the layout self-description that tests hold the ctypes mirror to. Plain C++ over the
// CUDA runtime (or, hipified, the HIP runtime): no Python headers, so one library serves every Python.
//
// Each entry point checks the struct pointer and its device index, makes that device current for the launch
// (kernels/cuda/device.h, restored afterwards) and returns the launcher's error code (0: launched).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dsaquant/abi.h"
#include "device.h"
#include "indexer.h"
#include "compress.h"

#ifndef DSQ_DEVICE_CODE
#define DSQ_DEVICE_CODE ""   // set by the build (tools/build_native.py, tools/build_hip.py): its targets
#endif

namespace {

cudaStream_t stream_of(void* stream) { return static_cast<cudaStream_t>(stream); }

template <class Args, class Launch>
int on_device(const Args* a, Launch&& launch) {
  if (a == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (a->device < 0 || a->device >= dsqdev::kMaxDevices) return static_cast<int>(cudaErrorInvalidDevice);
  const dsqdev::DeviceScope scope(a->device);
  if (scope.error() != 0) return scope.error();
  return launch();
}

struct Field {
  const char* name;
  int64_t offset, size;
};
struct StructLayout {
  const char* name;
  int64_t size;
  const Field* fields;
  int n;
};

#define DSQ_FIELD_ROW_(type, name) \
  {#name, static_cast<int64_t>(offsetof(S_, name)), static_cast<int64_t>(sizeof(S_::name))},
#define DSQ_LAYOUT_ROW_(S)                                                                                  \
  [] {                                                                                                      \
    using S_ = S;                                                                                           \
    static const Field fields[] = {DSQ_FIELDS_##S(DSQ_FIELD_ROW_)};                                         \
    const int n = static_cast<int>(sizeof(fields) / sizeof(Field));                                         \
    return StructLayout{#S, static_cast<int64_t>(sizeof(S)), fields, n};                                    \
  }(),

const StructLayout* find_layout(const char* name) {
  static const StructLayout layouts[] = {DSQ_ABI_STRUCTS(DSQ_LAYOUT_ROW_)};
  if (name == nullptr) return nullptr;
  for (const auto& l : layouts)
    if (std::strcmp(l.name, name) == 0) return &l;
  return nullptr;
}
#undef DSQ_LAYOUT_ROW_
#undef DSQ_FIELD_ROW_

}  // namespace

extern "C" {

int dsq_indexer(const DsqIndexerArgs* a, void* stream) {
  return on_device(a, [&] { return dsq_indexer_launch(*a, stream_of(stream)); });
}
int dsq_kstore(const DsqKStoreArgs* a, void* stream) {
  return on_device(a, [&] { return dsq_kstore_launch(*a, stream_of(stream)); });
}
int dsq_qpack(const DsqQPackArgs* a, void* stream) {
  return on_device(a, [&] { return dsq_qpack_launch(*a, stream_of(stream)); });
}
int dsq_compress_kv(const DsqCompressArgs* a, void* stream) {
  return on_device(a, [&] { return dsq_compress_kv_launch(*a, stream_of(stream)); });
}
int dsq_rope_rotate_quant(const DsqRotateArgs* a, void* stream) {
  return on_device(a, [&] { return dsq_rope_rotate_launch(*a, stream_of(stream)); });
}
int dsq_fp8_selfcheck(const DsqSelfcheckArgs* a, void* stream) {
  return on_device(a, [&] { return dsq_fp8_selfcheck_launch(a->start, a->count, a->out, stream_of(stream)); });
}
int dsq_exp_ds(const DsqExpDsArgs* a, void* stream) {
  return on_device(a, [&] { return dsq_exp_ds_launch(a->x, a->y, a->n, stream_of(stream)); });
}

int dsq_abi_version(void) { return DSQ_ABI_VERSION; }

int64_t dsq_abi_sizeof(const char* struct_name) {
  const StructLayout* l = find_layout(struct_name);
  return l ? l->size : -1;
}

const char* dsq_abi_field(const char* struct_name, int i, int64_t* offset, int64_t* size) {
  const StructLayout* l = find_layout(struct_name);
  if (l == nullptr || i < 0 || i >= l->n) return nullptr;
  if (offset) *offset = l->fields[i].offset;
  if (size) *size = l->fields[i].size;
  return l->fields[i].name;
}

const char* dsq_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

const char* dsq_device_code(void) { return DSQ_DEVICE_CODE; }

int dsq_kernel_code(int device, int* ptx, int* binary) {
  if (ptx == nullptr || binary == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (device < 0 || device >= dsqdev::kMaxDevices) return static_cast<int>(cudaErrorInvalidDevice);
  const dsqdev::DeviceScope scope(device);
  if (scope.error() != 0) return scope.error();
  return dsq_kernel_code_query(ptx, binary);
}

}  // extern "C"
