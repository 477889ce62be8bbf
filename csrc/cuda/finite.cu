// The finiteness check of hvdc/kernels.h on device memory, by the same exponent bits as the CPU
// one. Each block ORs its threads' findings (__syncthreads_or) into one flag that any number of
// tensors share, so a step's check waits for the device once.
#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

template <class U>
__global__ void nonfinite_kernel(const U* x, int64_t n, U exponent, unsigned* flag) {
  int any = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    any |= (x[i] & exponent) == exponent;
  if (__syncthreads_or(any) && threadIdx.x == 0) atomicOr(flag, 1u);
}

template <class U> void launch(const void* x, int64_t n, U exponent, unsigned* flag, cudaStream_t s) {
  nonfinite_kernel<U><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const U*>(x), n, exponent,
                                                         flag);
}

}  // namespace

void flag_nonfinite(DType d, const void* x, int64_t n, unsigned* flag, void* stream) {
  if (n < 0) throw KernelError("element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  const cudaStream_t s = as_stream(stream);
  switch (d) {
    case kF32: launch<uint32_t>(x, n, 0x7f800000u, flag, s); break;
    case kF64: launch<uint64_t>(x, n, 0x7ff0000000000000ull, flag, s); break;
    case kF16: launch<uint16_t>(x, n, 0x7c00, flag, s); break;
    case kBF16: launch<uint16_t>(x, n, 0x7f80, flag, s); break;
    default:
      throw KernelError("unsupported gradient dtype code " + std::to_string(static_cast<int>(d)) +
                        " (valid: float32, float16, bfloat16, float64)");
  }
  check_launch("flag_nonfinite");
}

namespace {
__global__ void flag_to_finite_kernel(const unsigned* flag, bool* finite) { *finite = *flag == 0; }
}  // namespace

void flag_to_finite(const unsigned* flag, bool* finite, void* stream) {
  flag_to_finite_kernel<<<1, 1, 0, as_stream(stream)>>>(flag, finite);
  check_launch("flag_to_finite");
}

}  // namespace gpu
}  // namespace hvdc
