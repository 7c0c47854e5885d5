// kernels/cuda/device.h: an op runs on the device of its tensors. DeviceScope makes that device current for
// the launch (only when it is not already) and restores the caller's device afterwards; device_props() reads
// a device's properties once per device (thread-safe) for launchers that size their grids by them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>

namespace dsqdev {

constexpr int kMaxDevices = 64;   // device indices the library accepts: [0, kMaxDevices)

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    int current = 0;
    error_ = static_cast<int>(cudaGetDevice(&current));
    if (error_ == 0 && current != device) {
      error_ = static_cast<int>(cudaSetDevice(device));
      if (error_ == 0) previous_ = current;
    }
    // A failed query leaves its code as the runtime's last error; consume it, so that a later launch's
    // cudaGetLastError() does not report this refused call's error as its own.
    if (error_ != 0) static_cast<void>(cudaGetLastError());
  }
  ~DeviceScope() {
    if (previous_ >= 0) static_cast<void>(cudaSetDevice(previous_));   // nothing to report it to
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  int error() const { return error_; }   // cudaGetDevice / cudaSetDevice's code (0: the device is current)

 private:
  int previous_ = -1;
  int error_ = 0;
};

struct DeviceProps {
  int error = 0;              // the first failed query's code (0: all read)
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
};

// The properties of `device` (0 <= device < kMaxDevices), read on the first call for that device. (A mutex,
// not std::call_once: call_once's thunk for a lambda of this inline function would be a default-visibility
// std template instance, exported from the library.)
inline const DeviceProps& device_props(int device) {
  static DeviceProps props[kMaxDevices];
  static bool read[kMaxDevices] = {};
  static std::mutex mu;
  const std::lock_guard<std::mutex> lock(mu);
  if (!read[device]) {
    DeviceProps& p = props[device];
    const struct { int* out; cudaDeviceAttr attr; } queries[] = {
        {&p.sm_count, cudaDevAttrMultiProcessorCount},
        {&p.cc_major, cudaDevAttrComputeCapabilityMajor},
        {&p.cc_minor, cudaDevAttrComputeCapabilityMinor},
    };
    for (const auto& q : queries) {
      const int err = static_cast<int>(cudaDeviceGetAttribute(q.out, q.attr, device));
      if (err != 0 && p.error == 0) p.error = err;
    }
    if (p.error != 0) static_cast<void>(cudaGetLastError());   // as in DeviceScope: not a later launch's error
    read[device] = true;
  }
  return props[device];
}

}  // namespace dsqdev
