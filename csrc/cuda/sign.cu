// onebit / signsgd / efsignsgd (layout in csrc/cpu/sign.cc): sign bits packed with warp ballots,
// 64 elements per word, and |x| summed in double in the same pass. The scale needs the whole
// tensor's sum: per-block partial sums, then one small kernel adds them in a fixed order and
// writes the header, so no value goes back to the host.
#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

constexpr int64_t kHeader = 8;

__device__ inline const uint64_t* words_of(const void* payload) {
  return reinterpret_cast<const uint64_t*>(static_cast<const uint8_t*>(payload) + kHeader);
}
__device__ inline float scale_of(const void* payload) {
  return reinterpret_cast<const float*>(payload)[1];
}

// One warp per 64-element word. With `lazy_ef`, e holds the previous step's p and carry its
// scale: the residual is formed, p = x + residual is stored back into e and packed (the
// arithmetic of sign::ef_encode in csrc/cpu/sign.cc).
template <class T, bool lazy_ef>
__global__ void pack(const T* x, const T* e_in, T* e, const float* carry, int64_t n,
                     uint64_t* words, double* partial) {
  using A = typename Acc<T>::type;
  __shared__ double smem[kThreads / 32];
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t nwords = (n + 63) / 64;
  A sa = A(0);
  if constexpr (lazy_ef) sa = static_cast<A>(*carry);
  double sum = 0.0;
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; w < nwords; w += warps) {
    uint32_t half[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t i = w * 64 + h * 32 + lane;
      bool neg = false;
      if (i < n) {
        A v;
        if constexpr (lazy_ef) {
          const A q = to_acc(e_in[i]);
          const T residual = from_acc<T>(q - (q < 0 ? -sa : sa));
          const T pv = from_acc<T>(to_acc(x[i]) + to_acc(residual));
          e[i] = pv;
          v = to_acc(pv);
        } else {
          v = to_acc(x[i]);
        }
        neg = v < 0;
        sum += fabs(static_cast<double>(v));
      }
      half[h] = __ballot_sync(0xffffffffu, neg);
    }
    if (lane == 0) words[w] = uint64_t(half[0]) | (uint64_t(half[1]) << 32);
  }
  const double b = block_sum(sum, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = b;
}

// scale = mean|x| (or 1), into the header and, for error feedback, into the carry.
__global__ void finish(const double* partial, int64_t parts, int64_t n, bool scaling, uint32_t tag,
                       void* payload, float* carry) {
  __shared__ double smem[kThreads / 32];
  double s = 0.0;
  for (int64_t j = threadIdx.x; j < parts; j += blockDim.x) s += partial[j];
  s = block_sum(s, smem);
  if (threadIdx.x == 0) {
    const float scale = !scaling ? 1.0f : n > 0 ? static_cast<float>(s / static_cast<double>(n)) : 0.0f;
    put_u32(payload, 0, tag);
    reinterpret_cast<float*>(payload)[1] = scale;
    if (carry) *carry = scale;
  }
}

__device__ inline bool bit(const uint64_t* words, int64_t i) { return (words[i >> 6] >> (i & 63)) & 1u; }

template <class T>
__global__ void decode_k(const void* payload, int64_t n, double alpha, T* out, bool acc) {
  using A = typename Acc<T>::type;
  const A v = static_cast<A>(alpha) * static_cast<A>(scale_of(payload));
  const uint64_t* words = words_of(payload);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const A d = bit(words, i) ? -v : v;
    out[i] = from_acc<T>(acc ? to_acc(out[i]) + d : d);
  }
}

template <class T>
__global__ void aggregate_k(const uint8_t* base, int64_t ranks, int64_t stride, int64_t n,
                            double alpha, bool vote, T* out) {
  using A = typename Acc<T>::type;
  A vote_v = A(0);
  if (vote) {  // majority vote at the ranks' mean scale (csrc/cpu/sign.cc)
    double scale_sum = 0.0;
    for (int64_t r = 0; r < ranks; ++r) scale_sum += scale_of(base + r * stride);
    const float mean_scale = static_cast<float>(scale_sum / ranks);
    vote_v = static_cast<A>(mean_scale) * static_cast<A>(alpha * static_cast<double>(ranks));
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (vote) {
      int32_t votes = 0;
      for (int64_t r = 0; r < ranks; ++r) votes += bit(words_of(base + r * stride), i) ? -1 : 1;
      out[i] = from_acc<T>(votes > 0 ? vote_v : votes < 0 ? -vote_v : A(0));
    } else {
      A sum = A(0);
      for (int64_t r = 0; r < ranks; ++r) {
        const void* pr = base + r * stride;
        const A v = static_cast<A>(alpha) * static_cast<A>(scale_of(pr));
        sum = sum + (bit(words_of(pr), i) ? -v : v);
      }
      out[i] = from_acc<T>(sum);
    }
  }
}

template <class T>
__global__ void settle_k(T* e, const float* carry, int64_t n) {
  using A = typename Acc<T>::type;
  const A sa = static_cast<A>(*carry);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const A q = to_acc(e[i]);
    e[i] = from_acc<T>(q - (q < 0 ? -sa : sa));
  }
}

template <bool lazy_ef>
void encode_impl(CodecId c, DType d, const void* x, const void* e_in, void* e, float* carry,
                 int64_t n, const Params& p, void* payload, cudaStream_t s) {
  const bool scaling = (c == kEFSignSGD) ? true : p.scaling;
  const unsigned blocks = blocks_for((n + 63) / 64 * 32);
  Scratch partial(blocks * sizeof(double), s);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* words = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(payload) + kHeader);
    pack<T, lazy_ef><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x),
                                                 static_cast<const T*>(e_in), static_cast<T*>(e),
                                                 carry, n, words, partial.as<double>());
  });
  finish<<<1, kThreads, 0, s>>>(partial.as<double>(), blocks, n, scaling, payload_tag(c, d),
                                payload, lazy_ef ? carry : nullptr);
  check_launch("sign encode");
}

}  // namespace

namespace sign {

void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload,
            cudaStream_t s) {
  encode_impl<false>(c, d, x, nullptr, nullptr, nullptr, n, p, payload, s);
}

void ef_encode(CodecId c, DType d, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload, cudaStream_t s) {
  encode_impl<true>(c, d, x, e_in, e, carry, n, p, payload, s);
}

void ef_settle(DType d, void* e, float* carry, int64_t n, cudaStream_t s) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (n) settle_k<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(e), carry, n);
  });
  check(cudaMemsetAsync(carry, 0, sizeof(float), s), "memset");
  check_launch("sign settle");
}

void decode(DType d, const void* payload, int64_t n, void* out, double alpha, bool acc,
            cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    decode_k<T><<<blocks_for(n), kThreads, 0, s>>>(payload, n, alpha, static_cast<T*>(out), acc);
  });
  check_launch("sign decode");
}

void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    aggregate_k<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const uint8_t*>(payloads), ranks,
                                                      stride, n, alpha, c == kSignSGD,
                                                      static_cast<T*>(out));
  });
  check_launch("sign aggregate");
}

}  // namespace sign
}  // namespace gpu
}  // namespace hvdc
