// Dithering (QSGD, TernGrad) and natural compression (layouts in csrc/cpu/quant.cc). The norm
// is a reduction over the whole tensor: per-block partials, then one small kernel finishes it
// and writes the header; the code kernels read the norm from the header on the device. Each
// element's code is computed by the functions of hvdc/element.h, as on the CPU.
#include <climits>

#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

constexpr int64_t kDitherHeader = 16;
constexpr int64_t kNaturalHeader = 8;

int64_t code_bytes(int64_t n, int b) { return ((n + 7) / 8 * b + 7) / 8 * 8; }

struct Partial {
  double sum, sumsq, maxabs;
  int nonfinite;
};

// max|x| (as float for dithering, double for natural), sum and sum of squares in double.
template <class T>
__global__ void stats_k(const T* x, int64_t n, bool as_double, Partial* partial) {
  __shared__ double smem[kThreads / 32];
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  double s1 = 0.0, s2 = 0.0, mx = 0.0;
  bool nonfinite = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = as_double ? static_cast<double>(to_acc(x[i]))
                               : static_cast<double>(static_cast<float>(to_acc(x[i])));
    const double a = fabs(v);
    if (!(a <= 1.79769313486231570815e+308)) nonfinite = true;  // NaN or inf
    else mx = a > mx ? a : mx;
    s1 += v;
    s2 += v * v;
  }
  __syncthreads();
  if (nonfinite) bad = 1;
  const double b1 = block_sum(s1, smem);
  const double b2 = block_sum(s2, smem);
  const double bm = block_max(mx, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = {b1, b2, bm, bad};
}

__device__ Partial reduce_partials(const Partial* partial, int64_t parts) {
  __shared__ double smem[kThreads / 32];
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  double s1 = 0.0, s2 = 0.0, mx = 0.0;
  bool nonfinite = false;
  for (int64_t j = threadIdx.x; j < parts; j += blockDim.x) {
    s1 += partial[j].sum;
    s2 += partial[j].sumsq;
    mx = partial[j].maxabs > mx ? partial[j].maxabs : mx;
    nonfinite |= partial[j].nonfinite != 0;
  }
  __syncthreads();
  if (nonfinite) bad = 1;
  const double b1 = block_sum(s1, smem);
  const double b2 = block_sum(s2, smem);
  const double bm = block_max(mx, smem);
  return {b1, b2, bm, bad};
}

// The norm of csrc/cpu/quant.cc's dither_norm, into the 16-byte header.
__global__ void dither_finish(const Partial* partial, int64_t parts, int64_t n, int64_t s,
                              int64_t partition, int64_t normalize, double clip, uint32_t tag,
                              uint8_t* payload) {
  const Partial st = reduce_partials(partial, parts);
  if (threadIdx.x != 0) return;
  const float maxabs = static_cast<float>(st.maxabs);
  float norm;
  if (st.nonfinite) {
    norm = nanf("");
  } else if (normalize == kL2) {
    norm = static_cast<float>(sqrt(st.sumsq));
  } else if (normalize == kClipSigma && n > 0) {
    const double mean = st.sum / static_cast<double>(n);
    const double var = fmax(0.0, st.sumsq / static_cast<double>(n) - mean * mean);
    const float bound = static_cast<float>(static_cast<double>(static_cast<float>(clip)) * sqrt(var));
    norm = bound > 0.0f ? fminf(maxabs, bound) : maxabs;
  } else {
    norm = maxabs;
  }
  put_u32(payload, 0, tag);
  payload[4] = static_cast<uint8_t>(s);
  payload[5] = static_cast<uint8_t>(partition);
  payload[6] = static_cast<uint8_t>(normalize);
  payload[7] = 0;
  reinterpret_cast<float*>(payload)[2] = norm;
  put_u32(payload, 3, 0);
}

// One thread per group of 8 codes, written as the group's `b` bytes.
template <class T>
__global__ void dither_codes(const T* x, int64_t n, int64_t s, bool natural, uint64_t seed, int b,
                             int64_t cap, uint8_t* payload) {
  const float norm = reinterpret_cast<const float*>(payload)[2];
  uint8_t* codes = payload + kDitherHeader;
  const bool flat = !(norm > 0.0f) || !(norm <= 3.40282347e+38f);
  const float sf = static_cast<float>(s), inv = 1.0f / norm, scale = sf / norm;
  const int64_t groups = (n + 7) / 8;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    uint64_t w = 0;
    const int64_t end = g * 8 + 8 < n ? g * 8 + 8 : n;
    for (int64_t j = g * 8; j < end; ++j) {
      int64_t c = s;
      if (!flat) {
        const float v = static_cast<float>(to_acc(x[j]));
        const float u = uniform(seed, j);
        const int32_t l = natural ? natural_level(fminf(fabsf(v) * inv, 1.0f), u, s)
                                  : linear_level(fminf(fabsf(v) * scale, sf), u);
        c = v < 0.0f ? s - l : s + l;
      }
      w |= static_cast<uint64_t>(c) << ((j - g * 8) * b);
    }
    for (int byte = 0; byte < b; ++byte) codes[g * b + byte] = static_cast<uint8_t>(w >> (8 * byte));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0)  // padding: payloads are deterministic bytes
    for (int64_t byte = groups * b; byte < cap; ++byte) codes[byte] = 0;
}

template <class T>
__global__ void dither_aggregate_k(const uint8_t* base, int64_t ranks, int64_t stride, int64_t n,
                                   int64_t s, bool natural, int b, double alpha, bool acc, T* out) {
  using A = typename Acc<T>::type;
  const A al = static_cast<A>(alpha);
  const uint64_t mask = (uint64_t{1} << b) - 1;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    A sum = acc ? to_acc(out[i]) : A(0);
    for (int64_t r = 0; r < ranks; ++r) {
      const uint8_t* h = base + r * stride;
      const float norm = reinterpret_cast<const float*>(h)[2];
      const uint8_t* group = h + kDitherHeader + (i / 8) * b;
      uint64_t w = 0;
      for (int byte = 0; byte < b; ++byte) w |= static_cast<uint64_t>(group[byte]) << (8 * byte);
      const int64_t c = static_cast<int64_t>((w >> ((i % 8) * b)) & mask);
      // A code above 2s (a damaged payload; no encoder makes one) decodes to NaN, as on the CPU.
      const float m = c > 2 * s ? __int_as_float(0x7fc00000)
                                : dither_magnitude(c >= s ? c - s : s - c, s, natural, norm);
      sum += al * static_cast<A>(c < s ? -m : m);
    }
    out[i] = from_acc<T>(sum);
  }
}

// natural: top = one above the exponent of max|x| (INT32_MIN when not finite), see quant.cc.
__global__ void natural_finish(const Partial* partial, int64_t parts, uint32_t tag, uint8_t* payload,
                               int* flat) {
  const Partial st = reduce_partials(partial, parts);
  if (threadIdx.x != 0) return;
  int32_t top = 0;
  if (st.nonfinite) top = INT_MIN;
  else if (st.maxabs > 0.0) top = ilogb(st.maxabs) + 1;
  put_u32(payload, 0, tag);
  reinterpret_cast<int32_t*>(payload)[1] = top;
  *flat = st.nonfinite || st.maxabs == 0.0;
}

template <class T>
__global__ void natural_codes(const T* x, int64_t n, uint64_t seed, const int* flat, uint8_t* payload) {
  const int32_t top = reinterpret_cast<const int32_t*>(payload)[1];
  const int32_t lowest = top - 126 > -1022 ? top - 126 : -1022;
  const double lowest_v = ldexp(1.0, lowest);
  uint8_t* codes = payload + kNaturalHeader;
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < padded;
       i += int64_t(gridDim.x) * blockDim.x) {
    codes[i] = (i >= n || *flat) ? uint8_t(0)
                                 : natural_code(static_cast<double>(to_acc(x[i])), uniform(seed, i),
                                                top, lowest, lowest_v);
  }
}

template <class T>
__global__ void natural_aggregate_k(const uint8_t* base, int64_t ranks, int64_t stride, int64_t n,
                                    double alpha, bool acc, T* out) {
  using A = typename Acc<T>::type;
  const A al = static_cast<A>(alpha);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    A sum = acc ? to_acc(out[i]) : A(0);
    for (int64_t r = 0; r < ranks; ++r) {
      const uint8_t* h = base + r * stride;
      const int32_t top = reinterpret_cast<const int32_t*>(h)[1];
      const uint8_t c = h[kNaturalHeader + i];
      const int mag = c & 0x7f;
      const A m = top == INT_MIN ? static_cast<A>(nan(""))
                  : mag == 0     ? A(0)
                                 : static_cast<A>(ldexp(1.0, top - 127 + mag));
      sum += al * (c & 0x80 ? -m : m);
    }
    out[i] = from_acc<T>(sum);
  }
}

template <class T>
unsigned launch_stats(const T* x, int64_t n, bool as_double, const Scratch& scratch, cudaStream_t s) {
  const unsigned blocks = blocks_for(n);
  stats_k<T><<<blocks, kThreads, 0, s>>>(x, n, as_double, scratch.as<Partial>());
  return blocks;
}

}  // namespace

namespace quant {

void dither_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s) {
  auto* out = static_cast<uint8_t*>(payload);
  const int b = dither_bits(p.s);
  Scratch scratch(kMaxBlocks * sizeof(Partial), s);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    const unsigned parts = launch_stats(xs, n, false, scratch, s);
    dither_finish<<<1, kThreads, 0, s>>>(scratch.as<Partial>(), parts, n, p.s, p.partition,
                                         p.normalize, p.clip, payload_tag(kDither, d), out);
    dither_codes<T><<<blocks_for((n + 7) / 8), kThreads, 0, s>>>(
        xs, n, p.s, p.partition == kNaturalLevels, p.seed, b, code_bytes(n, b), out);
  });
  check_launch("dither encode");
}

void dither_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                      const Params& p, void* out, double alpha, bool acc, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dither_aggregate_k<T><<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<const uint8_t*>(payloads), ranks, stride, n, p.s,
        p.partition == kNaturalLevels, dither_bits(p.s), alpha, acc, static_cast<T*>(out));
  });
  check_launch("dither aggregate");
}

__global__ void pair_rows_k(const uint8_t* own, const uint32_t* summed, int64_t rank,
                            int64_t words, uint8_t* rows) {
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < words;
       w += int64_t(gridDim.x) * blockDim.x) {
    uint32_t mine = 0;  // own is only known to be 2-aligned: byte by byte
    for (int k = 0; k < 4; ++k) mine |= static_cast<uint32_t>(own[4 * w + k]) << (8 * k);
    const uint32_t theirs = summed[w] - mine;
    for (int k = 0; k < 4; ++k) {
      rows[rank * 4 * words + 4 * w + k] = own[4 * w + k];
      rows[(1 - rank) * 4 * words + 4 * w + k] = static_cast<uint8_t>(theirs >> (8 * k));
    }
  }
}

void pair_rows(const void* own, const int32_t* summed, int64_t rank, int64_t bytes, uint8_t* rows,
               cudaStream_t s) {
  if (bytes == 0) return;
  pair_rows_k<<<blocks_for(bytes / 4), kThreads, 0, s>>>(
      static_cast<const uint8_t*>(own), reinterpret_cast<const uint32_t*>(summed), rank,
      bytes / 4, rows);
  check_launch("pair rows");
}

void natural_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s) {
  auto* out = static_cast<uint8_t*>(payload);
  Scratch scratch(kMaxBlocks * sizeof(Partial) + sizeof(int), s);
  int* flat = scratch.as<int>(kMaxBlocks * sizeof(Partial));
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    const unsigned parts = launch_stats(xs, n, true, scratch, s);
    natural_finish<<<1, kThreads, 0, s>>>(scratch.as<Partial>(), parts, payload_tag(kNatural, d),
                                          out, flat);
    natural_codes<T><<<blocks_for((n + 7) / 8 * 8), kThreads, 0, s>>>(xs, n, p.seed, flat, out);
  });
  check_launch("natural encode");
}

void natural_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                       void* out, double alpha, bool acc, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    natural_aggregate_k<T><<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<const uint8_t*>(payloads), ranks, stride, n, alpha, acc, static_cast<T*>(out));
  });
  check_launch("natural aggregate");
}

}  // namespace quant
}  // namespace gpu
}  // namespace hvdc
