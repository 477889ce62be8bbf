// The kernels a TF op runs, chosen by the device its kernel is registered for: CpuLaunch calls
// the CPU library (hvdc/kernels.h), GpuLaunch the CUDA launchers (hvdc/cuda.h) on the op's
// compute stream. The op bodies in ops.cc are templates over the two, so both devices share every
// check, shape and allocation and differ only in the calls below.
//
// PowerSGD is batched here as in the CUDA launchers (host arrays of per-matrix pointers, factors
// stacked), because that is the form one launch per pass needs; the CPU side loops.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "hvdc/kernels.h"
#include "tensorflow/core/framework/op_kernel.h"

#if GOOGLE_CUDA
#include <cuda_runtime_api.h>

#include "hvdc/cuda.h"
#include "unsupported/Eigen/CXX11/Tensor"
#endif

namespace hvdc_tf {

// Bytes of one PowerSGD factor element: float64 factors for float64 matrices, else float32.
inline int64_t factor_bytes(hvdc::DType d) { return d == hvdc::kF64 ? 8 : 4; }

#define HVDC_TF_FORWARD(name)                                          \
  template <class... A>                                                \
  void name(A&&... a) const {                                          \
    HVDC_TF_NS::name(std::forward<A>(a)... HVDC_TF_STREAM);            \
  }

struct CpuLaunch {
  explicit CpuLaunch(tensorflow::OpKernelContext*) {}

  void copy(void* dst, const void* src, size_t bytes) const { std::memcpy(dst, src, bytes); }

#define HVDC_TF_NS hvdc
#define HVDC_TF_STREAM
  HVDC_TF_FORWARD(encode)
  HVDC_TF_FORWARD(decode)
  HVDC_TF_FORWARD(aggregate)
  HVDC_TF_FORWARD(aggregate_pair)
  HVDC_TF_FORWARD(ef_encode)
  HVDC_TF_FORWARD(ef_settle)
  HVDC_TF_FORWARD(encode_with_state)
  HVDC_TF_FORWARD(nesterov)
  HVDC_TF_FORWARD(heavy_ball)
  HVDC_TF_FORWARD(homo_block_absmax)
  HVDC_TF_FORWARD(homo_encode)
  HVDC_TF_FORWARD(homo_decode)
#undef HVDC_TF_STREAM
#undef HVDC_TF_NS

  void powersgd_project(hvdc::DType d, const void* const* g, const void* const* e_in,
                        void* const* e, bool ef, int64_t batch, int64_t rows, int64_t cols,
                        const void* qt, int64_t r, void* p) const {
    const int64_t f = factor_bytes(d);
    for (int64_t i = 0; i < batch; ++i)
      hvdc::powersgd_project(d, g[i], e_in[i], e[i], ef, rows, cols, at(qt, i * r * cols * f), r,
                             at(p, i * rows * r * f));
  }
  void powersgd_orthogonalize(hvdc::DType d, void* p, int64_t batch, int64_t rows, int64_t r,
                              double eps) const {
    for (int64_t i = 0; i < batch; ++i)
      hvdc::powersgd_orthogonalize(d, at(p, i * rows * r * factor_bytes(d)), rows, r, eps);
  }
  void powersgd_back_project(hvdc::DType d, const void* const* m, int64_t batch, int64_t rows,
                             int64_t cols, const void* p, int64_t r, void* qt) const {
    const int64_t f = factor_bytes(d);
    for (int64_t i = 0; i < batch; ++i)
      hvdc::powersgd_back_project(d, m[i], rows, cols, at(p, i * rows * r * f), r,
                                  at(qt, i * r * cols * f));
  }
  void powersgd_reconstruct(hvdc::DType d, const void* p, const void* qt, int64_t batch,
                            int64_t rows, int64_t cols, int64_t r, void* const* out, double alpha,
                            bool subtract) const {
    const int64_t f = factor_bytes(d);
    for (int64_t i = 0; i < batch; ++i)
      hvdc::powersgd_reconstruct(d, at(p, i * rows * r * f), at(qt, i * r * cols * f), rows, cols,
                                 r, out[i], alpha, subtract);
  }

 private:
  static const void* at(const void* base, int64_t offset) {
    return static_cast<const char*>(base) + offset;
  }
  static void* at(void* base, int64_t offset) { return static_cast<char*>(base) + offset; }
};

#if GOOGLE_CUDA
// The stream is TF's compute stream for the op, so the launches are ordered after the kernels
// that produced the inputs and before those that read the outputs, with no synchronisation.
struct GpuLaunch {
  explicit GpuLaunch(tensorflow::OpKernelContext* ctx)
      : stream_(ctx->eigen_gpu_device().stream()) {}

  void copy(void* dst, const void* src, size_t bytes) const {
    const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                            static_cast<cudaStream_t>(stream_));
    if (err != cudaSuccess)
      throw hvdc::KernelError(std::string("state copy: ") + cudaGetErrorString(err));
  }

#define HVDC_TF_NS hvdc::gpu
#define HVDC_TF_STREAM , stream_
  HVDC_TF_FORWARD(encode)
  HVDC_TF_FORWARD(decode)
  HVDC_TF_FORWARD(aggregate)
  HVDC_TF_FORWARD(aggregate_pair)
  HVDC_TF_FORWARD(ef_encode)
  HVDC_TF_FORWARD(ef_settle)
  HVDC_TF_FORWARD(encode_with_state)
  HVDC_TF_FORWARD(nesterov)
  HVDC_TF_FORWARD(heavy_ball)
  HVDC_TF_FORWARD(homo_block_absmax)
  HVDC_TF_FORWARD(homo_encode)
  HVDC_TF_FORWARD(homo_decode)
  HVDC_TF_FORWARD(powersgd_project)
  HVDC_TF_FORWARD(powersgd_orthogonalize)
  HVDC_TF_FORWARD(powersgd_back_project)
  HVDC_TF_FORWARD(powersgd_reconstruct)
#undef HVDC_TF_STREAM
#undef HVDC_TF_NS

 private:
  void* stream_;
};
#endif

#undef HVDC_TF_FORWARD

}  // namespace hvdc_tf
