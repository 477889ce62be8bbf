// Homomorphic quantisation (layout and arithmetic in hvdc/kernels.h, CPU twin in
// csrc/cpu/homomorphic.cc). Encode and decode take one thread per int32 word, so a word is
// packed (or unpacked) in registers and written once; each element's code and value come from
// the functions of hvdc/element.h, as on the CPU. The CPU decode reads its ratios from a table
// of homo_ratio(); here they are computed, which is the same double division.
#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

constexpr uint32_t kCanonicalNaN = 0x7fc00000u;

// Blocks this long or longer get a CUDA block each; shorter ones a thread each.
constexpr int64_t kWideBlock = kThreads;

template <class T>
__global__ void absmax_wide_k(const T* x, int64_t n, int64_t block, int64_t blocks, float* out) {
  __shared__ float smem[kThreads / 32];
  __shared__ int bad;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    const int64_t lo = b * block, hi = n - lo < block ? n : lo + block;
    float mx = 0.0f;
    bool nan = false;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const float v = static_cast<float>(to_acc(x[i]));
      if (v != v) nan = true;
      else mx = fmaxf(mx, fabsf(v));
    }
    if (nan) bad = 1;
    const float bm = block_max(mx, smem);
    if (threadIdx.x == 0) out[b] = bad ? bits_f32(kCanonicalNaN) : bm;
    __syncthreads();  // thread 0 has read `bad` and smem before the next block reuses them
  }
}

template <class T>
__global__ void absmax_narrow_k(const T* x, int64_t n, int64_t block, int64_t blocks, float* out) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t lo = b * block, hi = n - lo < block ? n : lo + block;
    float mx = 0.0f;
    bool nan = false;
    for (int64_t i = lo; i < hi; ++i) {
      const float v = static_cast<float>(to_acc(x[i]));
      if (v != v) nan = true;
      else mx = fmaxf(mx, fabsf(v));
    }
    out[b] = nan ? bits_f32(kCanonicalNaN) : mx;
  }
}

template <class T>
__global__ void encode_k(const T* x, int64_t n, int64_t block, const float* scales, int w,
                         int lanes, float h, float lf, uint64_t seed, int64_t nw, int32_t* words) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < nw;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i0 = j * lanes;
    int64_t b = i0 / block, next = i0 - i0 % block + block;  // the block and where it ends
    float m = scales[b];
    uint32_t word = 0;
    for (int k = 0; k < lanes && i0 + k < n; ++k) {
      const int64_t i = i0 + k;
      if (i == next) {
        m = scales[++b];
        next += block;
      }
      if (homo_scale_usable(m)) {
        const float v = static_cast<float>(to_acc(x[i]));
        word |= static_cast<uint32_t>(homo_code(v, m, h, lf, uniform(seed, i))) << (k * w);
      }
    }
    words[j] = static_cast<int32_t>(word);
  }
}

template <class T>
__global__ void decode_k(const int32_t* words, int64_t n, int64_t block, const float* scales,
                         int w, int lanes, int64_t sl, int64_t levels, double alpha, bool acc,
                         int64_t nw, T* out) {
  using A = typename Acc<T>::type;
  const A al = static_cast<A>(alpha);
  const uint32_t mask = w == 32 ? 0xffffffffu : (1u << w) - 1;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < nw;
       j += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t word = static_cast<uint32_t>(words[j]);
    const int64_t i0 = j * lanes;
    int64_t b = i0 / block, next = i0 - i0 % block + block;
    float m = scales[b];
    for (int k = 0; k < lanes && i0 + k < n; ++k) {
      const int64_t i = i0 + k;
      if (i == next) {
        m = scales[++b];
        next += block;
      }
      const A v = al * static_cast<A>(homo_value((word >> (k * w)) & mask, sl, levels, m));
      out[i] = from_acc<T>(acc ? to_acc(out[i]) + v : v);
    }
  }
}

}  // namespace

namespace homo {

void block_absmax(DType d, const void* x, int64_t n, int64_t block, float* out, cudaStream_t s) {
  if (n == 0) return;
  const int64_t blocks = n / block + (n % block != 0);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    if (block >= kWideBlock)
      absmax_wide_k<T><<<blocks_for(blocks, 1), kThreads, 0, s>>>(xs, n, block, blocks, out);
    else
      absmax_narrow_k<T><<<blocks_for(blocks), kThreads, 0, s>>>(xs, n, block, blocks, out);
  });
  check_launch("homomorphic block max");
}

void encode(DType d, const void* x, int64_t n, int64_t block, const float* scales, int64_t levels,
            int64_t lane_ranks, uint64_t seed, int32_t* words, cudaStream_t s) {
  if (n == 0) return;
  const int w = homo_bits(levels, lane_ranks), lanes = 32 / w;
  const int64_t nw = n / lanes + (n % lanes != 0);
  const float lf = static_cast<float>(levels), h = lf * 0.5f;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    encode_k<T><<<blocks_for(nw), kThreads, 0, s>>>(static_cast<const T*>(x), n, block, scales, w,
                                                    lanes, h, lf, seed, nw, words);
  });
  check_launch("homomorphic encode");
}

void decode(DType d, const int32_t* words, int64_t n, int64_t block, const float* scales,
            int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
            bool acc, cudaStream_t s) {
  if (n == 0) return;
  const int w = homo_bits(levels, lane_ranks), lanes = 32 / w;
  const int64_t nw = n / lanes + (n % lanes != 0);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    decode_k<T><<<blocks_for(nw), kThreads, 0, s>>>(words, n, block, scales, w, lanes,
                                                    summands * levels, levels, alpha, acc, nw,
                                                    static_cast<T*>(out));
  });
  check_launch("homomorphic decode");
}

}  // namespace homo
}  // namespace gpu
}  // namespace hvdc
