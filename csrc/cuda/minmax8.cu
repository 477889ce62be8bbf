// minmax8 (layout in csrc/cpu/minmax8.cc): one block per chunk finds its bounds (NaN-aware,
// -0 folded to +0 as on the CPU, so the order of the min/max reduction never shows), then
// writes the codes; aggregation decodes every rank's code of an element in rank order.
#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

constexpr int64_t kHeader = 8;

struct Grid {
  float lo, step, inv;
};
__device__ inline Grid grid_of(float lo, float hi) {
  const float range = hi - lo;
  if (!(range > 0.0f)) return {lo, 0.0f, 0.0f};
  return {lo, range / 255.0f, 255.0f / range};
}

template <class T>
__global__ void encode_k(const T* x, int64_t n, int64_t c, uint8_t* payload) {
  __shared__ float s_lo[kThreads / 32], s_hi[kThreads / 32];
  __shared__ int s_nan;
  __shared__ float s_bounds[2];
  const int64_t nchunks = (n + c - 1) / c;
  float* bounds = reinterpret_cast<float*>(payload + kHeader);
  uint8_t* codes = payload + kHeader + 8 * nchunks;
  for (int64_t k = blockIdx.x; k < nchunks; k += gridDim.x) {
    const int64_t s = k * c, len = c < n - s ? c : n - s;
    float lo = INFINITY, hi = -INFINITY;
    bool nan = false;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
      const float v = static_cast<float>(to_acc(x[s + j]));
      nan |= v != v;
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
    }
    if (threadIdx.x == 0) s_nan = 0;
    __syncthreads();
    if (nan) s_nan = 1;
    const float blo = -block_max(-lo, s_lo);
    const float bhi = block_max(hi, s_hi);
    if (threadIdx.x == 0) {
      const bool bad = s_nan != 0;
      s_bounds[0] = bad ? nanf("") : blo + 0.0f;
      s_bounds[1] = bad ? nanf("") : bhi + 0.0f;
      bounds[2 * k] = s_bounds[0];
      bounds[2 * k + 1] = s_bounds[1];
    }
    __syncthreads();
    const Grid g = grid_of(s_bounds[0], s_bounds[1]);
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x)
      codes[s + j] = minmax8_code(static_cast<float>(to_acc(x[s + j])), g.lo, g.inv);
    __syncthreads();  // s_bounds is rewritten by the next chunk
  }
  if (blockIdx.x == 0 && threadIdx.x < 8) {  // padding to 8 bytes: payloads are deterministic
    const int64_t pad = n + threadIdx.x;
    if (pad < (n + 7) / 8 * 8) codes[pad] = 0;
  }
}

__global__ void header_k(uint8_t* payload, uint32_t tag, uint32_t chunk) {
  put_u32(payload, 0, tag);
  put_u32(payload, 1, chunk);
}

template <class T>
__global__ void aggregate_k(const uint8_t* base, int64_t ranks, int64_t stride, int64_t n,
                            int64_t c, double alpha, bool acc, T* out) {
  using A = typename Acc<T>::type;
  const int64_t nchunks = (n + c - 1) / c;
  const A al = static_cast<A>(alpha);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = i / c;
    A sum = acc ? to_acc(out[i]) : A(0);
    for (int64_t r = 0; r < ranks; ++r) {
      const uint8_t* h = base + r * stride;
      const float* bounds = reinterpret_cast<const float*>(h + kHeader);
      const Grid g = grid_of(bounds[2 * k], bounds[2 * k + 1]);
      const uint8_t code = h[kHeader + 8 * nchunks + i];
      sum += al * static_cast<A>(g.lo + static_cast<float>(code) * g.step);
    }
    out[i] = from_acc<T>(sum);
  }
}

}  // namespace

namespace minmax8 {

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s) {
  auto* out = static_cast<uint8_t*>(payload);
  const int64_t nchunks = (n + p.chunk - 1) / p.chunk;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    encode_k<T><<<blocks_for(nchunks, 1), kThreads, 0, s>>>(static_cast<const T*>(x), n, p.chunk, out);
  });
  header_k<<<1, 1, 0, s>>>(out, payload_tag(kMinMax8, d), static_cast<uint32_t>(p.chunk));
  check_launch("minmax8 encode");
}

void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, bool acc, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    aggregate_k<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const uint8_t*>(payloads), ranks,
                                                      stride, n, p.chunk, alpha, acc,
                                                      static_cast<T*>(out));
  });
  check_launch("minmax8 aggregate");
}

}  // namespace minmax8
}  // namespace gpu
}  // namespace hvdc
