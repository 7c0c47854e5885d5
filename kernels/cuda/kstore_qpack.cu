// kernels/cuda/kstore_qpack.cu: the kernels of SPEC §7.2's k writer (sglang-v41: index_k_norm_rope_pack_store,
// cache packed68) and §7.3 (aiter's DeepSeek-V4 k writer: rmsnorm_rope_rotate_fp4quant_kvcache), whose row body
// and layout are kernels/cuda/kstore_body.cuh. (§7.2's q writers: qpack.cu.)
#include "kstore_body.cuh"
#include "launch.cuh"

namespace dsqk {
namespace {

template <int IN_DT, int CDT, int MODE>
__global__ void __launch_bounds__(kBlockThreads) kstore_kernel(KStoreArgs a) {
  dsq_launch::dependent_entry();
  kstore_thread<IN_DT, CDT, MODE>(a, blockIdx.x, static_cast<int>(threadIdx.x));
}

}  // namespace
}  // namespace dsqk

int dsq_kstore_launch(const KStoreArgs& a, cudaStream_t stream) {
  if (a.T == 0) return 0;
  using namespace dsqk;
  const unsigned blocks = static_cast<unsigned>((a.T + kRowsPerBlock - 1) / kRowsPerBlock);
  kstore_dispatch(a, [&](auto in_dt, auto cdt, auto mode) {
    auto kernel = kstore_kernel<decltype(in_dt)::value, decltype(cdt)::value, decltype(mode)::value>;
    static_cast<void>(dsq_launch::launch(kernel, {dim3(blocks), dim3(kBlockThreads)}, stream, dsq_launch::kWriters, a));
  });
  return static_cast<int>(cudaGetLastError());
}
