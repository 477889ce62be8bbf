// Shared pieces of the CUDA kernels: launch shapes, deterministic reductions and stream-ordered
// scratch memory (element types and arithmetic are in hvdc/element.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "hvdc/cuda.h"
#include "hvdc/element.h"
#include "hvdc/kernels.h"

namespace hvdc {
namespace gpu {

// The value as a T-typed tensor stores it.
template <class T> HVDC_HD typename Acc<T>::type round_to(typename Acc<T>::type v) {
  return to_acc(from_acc<T>(v));
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Turns a CUDA error (of the last launch or call) into the KernelError the frontends report.
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw KernelError(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err));
}
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

constexpr int kThreads = 256;
// Grid-stride loops cap the grid: enough blocks to fill any current GPU several times over.
constexpr int64_t kMaxBlocks = 4096;
inline unsigned blocks_for(int64_t items, int64_t per_block = kThreads) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

// Scratch memory for one call, from the stream-ordered pool: freed in stream order, so the
// kernels queued before the free still see it.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t s) : stream_(s) {
    if (bytes) check(cudaMallocAsync(&ptr_, bytes, s), "cudaMallocAsync (kernel scratch)");
  }
  ~Scratch() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class U> U* as(size_t byte_offset = 0) const {
    return reinterpret_cast<U*>(static_cast<char*>(ptr_) + byte_offset);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// Block-wide sum with a fixed shape (warp shuffles, then the warps' sums in order), so a given
// launch shape always adds in the same order. Every thread of the block must call it; the
// result is valid in thread 0.
template <class V>
__device__ V block_sum(V v, V* smem /* kThreads / 32 */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  V s = V(0);
  if (threadIdx.x == 0)
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += smem[w];
  return s;
}

template <class V>
__device__ V block_max(V v, V* smem) {
  for (int o = 16; o > 0; o >>= 1) {
    const V u = __shfl_down_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  V s = smem[0];
  if (threadIdx.x == 0)
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) s = smem[w] > s ? smem[w] : s;
  return s;
}

// Exclusive prefix sum over the block (values in thread order); *total gets the block's sum.
__device__ inline int64_t block_exclusive_scan(int64_t v, int64_t* smem /* 32 */, int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) smem[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      const int64_t t = smem[w];
      smem[w] = run;
      run += t;
    }
    smem[31] = run;  // 8 warps of kThreads use slots 0..7
  }
  __syncthreads();
  *total = smem[31];
  return smem[warp] + x - v;
}

// Payload header helpers (little-endian u32 words at the start of a payload).
__device__ inline void put_u32(void* payload, int word, uint32_t v) {
  static_cast<uint32_t*>(payload)[word] = v;
}
__device__ inline uint32_t get_u32(const void* payload, int word) {
  return static_cast<const uint32_t*>(payload)[word];
}


// Per-codec launchers (one file each); dispatch.cu checks arguments before calling them.
namespace cast {
void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc,
            cudaStream_t s);
void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha, cudaStream_t s);
void aggregate_pair(CodecId c, DType d, const void* own, const int32_t* summed, int64_t rank,
                    int64_t n, void* out, double alpha, cudaStream_t s);
void add_into(DType d, const void* x, const void* e_in, void* e, int64_t n, cudaStream_t s);
void nesterov(DType d, void* x, void* m, int64_t n, double mu, cudaStream_t s);
void heavy_ball(DType d, const void* x, const void* m, void* out, int64_t n, double factor,
                cudaStream_t s);
}  // namespace cast
namespace randomk {
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc, cudaStream_t s);
}  // namespace randomk
namespace sign {
void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
void decode(DType d, const void* payload, int64_t n, void* out, double alpha, bool acc, cudaStream_t s);
void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha, cudaStream_t s);
void ef_encode(CodecId c, DType d, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload, cudaStream_t s);
void ef_settle(DType d, void* e, float* carry, int64_t n, cudaStream_t s);
}  // namespace sign
namespace minmax8 {
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, bool acc, cudaStream_t s);
}  // namespace minmax8
namespace quant {
void dither_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
void dither_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                      const Params& p, void* out, double alpha, bool acc, cudaStream_t s);
// Both payloads of a pair in rank order, `bytes` (a multiple of 4) apart, from this rank's
// and the int32 sum of both payloads' words.
void pair_rows(const void* own, const int32_t* summed, int64_t rank, int64_t bytes, uint8_t* rows,
               cudaStream_t s);
void natural_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
void natural_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                       void* out, double alpha, bool acc, cudaStream_t s);
}  // namespace quant
namespace homo {
void block_absmax(DType d, const void* x, int64_t n, int64_t block, float* out, cudaStream_t s);
void encode(DType d, const void* x, int64_t n, int64_t block, const float* scales, int64_t levels,
            int64_t lane_ranks, uint64_t seed, int32_t* words, cudaStream_t s);
void decode(DType d, const int32_t* words, int64_t n, int64_t block, const float* scales,
            int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
            bool acc, cudaStream_t s);
}  // namespace homo
namespace sparse {
void topk_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
void topk_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                    const Params& p, void* out, double alpha, bool acc, cudaStream_t s);
void threshold_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s);
// offsets: host array of each rank's payload offset (from the walked headers).
void threshold_aggregate(DType d, const void* payloads, const int64_t* offsets, int64_t ranks,
                         int64_t n, void* out, double alpha, bool acc, cudaStream_t s);
void dgc_encode(DType d, const void* x, const void* u_in, const void* v_in, void* u, void* v,
                int64_t n, const Params& p, void* payload, cudaStream_t s);
void dgc_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                   const Params& p, void* out, double alpha, bool acc, cudaStream_t s);
}  // namespace sparse

}  // namespace gpu
}  // namespace hvdc
