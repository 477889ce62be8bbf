// none / fp16 / bf16 casts, randomk's gather and scatter, and the element-wise helpers
// (error-feedback sum, Nesterov momentum). One thread per element, grid-stride; per element the
// same arithmetic as csrc/cpu/cast.cc and randomk.cc (hvdc/element.h).
#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

template <class W> HVDC_HD uint16_t to_wire(float v);
template <> HVDC_HD uint16_t to_wire<half_t>(float v) { return f32_to_f16_bits(v); }
template <> HVDC_HD uint16_t to_wire<bf16_t>(float v) { return f32_to_bf16_bits(v); }
template <class W> HVDC_HD float from_wire(uint16_t v);
template <> HVDC_HD float from_wire<half_t>(uint16_t v) { return f16_bits_to_f32(v); }
template <> HVDC_HD float from_wire<bf16_t>(uint16_t v) { return bf16_bits_to_f32(v); }

template <class W, class T> __device__ uint16_t encode_one(T x, double prescale, float s) {
  if constexpr (std::is_same_v<T, double>) return to_wire<W>(f64_to_f32_round_odd(x * prescale));
  else return to_wire<W>(to_acc(x) * s);
}

// float32 -> 16 bits, four elements per thread with 16-byte loads and 8-byte stores: the cast
// is memory bound, and wide accesses keep it near copy bandwidth.
template <class W>
__global__ void encode16_f32x4(const float4* x, uint2* y, int64_t n4, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    uint2 o;
    o.x = uint32_t(to_wire<W>(v.x * s)) | (uint32_t(to_wire<W>(v.y * s)) << 16);
    o.y = uint32_t(to_wire<W>(v.z * s)) | (uint32_t(to_wire<W>(v.w * s)) << 16);
    y[i] = o;
  }
}

template <class W, class T>
__global__ void encode16(const T* x, uint16_t* y, int64_t begin, int64_t n, double prescale, float s) {
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = encode_one<W>(x[i], prescale, s);
}

template <class W>
__global__ void decode16_f32x4(const uint2* h, float4* out, int64_t n4, float a, bool acc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint2 w = h[i];
    float4 d = make_float4(a * from_wire<W>(uint16_t(w.x)), a * from_wire<W>(uint16_t(w.x >> 16)),
                           a * from_wire<W>(uint16_t(w.y)), a * from_wire<W>(uint16_t(w.y >> 16)));
    if (acc) {
      const float4 o = out[i];
      d = make_float4(o.x + d.x, o.y + d.y, o.z + d.z, o.w + d.w);
    }
    out[i] = d;
  }
}

template <class W, class T>
__global__ void decode16(const uint16_t* h, T* out, int64_t begin, int64_t n, double alpha, bool acc) {
  using A = typename Acc<T>::type;
  const A a = static_cast<A>(alpha);
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const A d = a * static_cast<A>(from_wire<W>(h[i]));
    out[i] = from_acc<T>(acc ? to_acc(out[i]) + d : d);
  }
}

template <class T>
__global__ void scale_none(const T* x, T* y, int64_t n, double factor, const T* base, bool acc) {
  using A = typename Acc<T>::type;
  const A f = static_cast<A>(factor);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const A d = acc ? to_acc(base[i]) + f * to_acc(x[i]) : to_acc(x[i]) * f;
    y[i] = from_acc<T>(d);
  }
}

template <class W, class T>
__global__ void aggregate16(const uint8_t* base, int64_t ranks, int64_t stride, int64_t n, T* out,
                            double alpha) {
  using A = typename Acc<T>::type;
  const A a = static_cast<A>(alpha);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    A sum = A(0);
    for (int64_t r = 0; r < ranks; ++r)
      sum = sum + a * static_cast<A>(from_wire<W>(reinterpret_cast<const uint16_t*>(base + r * stride)[i]));
    out[i] = from_acc<T>(sum);
  }
}

// Two ranks' payloads from the wrapping sum of their words: the other rank's word is
// summed - own word, and row 0 then row 1 accumulate as aggregate16 does.
template <class W, class T>
__global__ void aggregate_pair16(const uint16_t* own, const uint32_t* summed, int64_t rank,
                                 int64_t n, T* out, double alpha) {
  using A = typename Acc<T>::type;
  const A a = static_cast<A>(alpha);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    // This rank's word, zero-padded past an odd count as the words summed were.
    const int64_t lo = i & ~int64_t(1);
    const uint32_t mine = uint32_t(own[lo]) | (lo + 1 < n ? uint32_t(own[lo + 1]) << 16 : 0u);
    const uint16_t other = uint16_t((summed[i / 2] - mine) >> (16 * (i & 1)));
    const uint16_t h0 = rank == 0 ? own[i] : other, h1 = rank == 0 ? other : own[i];
    A sum = A(0) + a * static_cast<A>(from_wire<W>(h0));
    sum = sum + a * static_cast<A>(from_wire<W>(h1));
    out[i] = from_acc<T>(sum);
  }
}

template <class T> __global__ void add_into_k(const T* x, const T* e_in, T* e, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    e[i] = from_acc<T>(to_acc(x[i]) + to_acc(e_in[i]));
}

template <class T> __global__ void nesterov_k(T* x, T* m, int64_t n, double mu) {
  using A = typename Acc<T>::type;
  const A u = static_cast<A>(mu);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    m[i] = from_acc<T>(u * to_acc(m[i]) + to_acc(x[i]));
    x[i] = from_acc<T>(u * to_acc(m[i]) + to_acc(x[i]));
  }
}

template <class T>
__global__ void heavy_ball_k(const T* x, const T* m, T* out, int64_t n, double factor) {
  using A = typename Acc<T>::type;
  const A f = static_cast<A>(factor);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_acc<T>(to_acc(from_acc<T>(f * to_acc(m[i]))) + to_acc(x[i]));
}

bool aligned16(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

template <class W, class T>
void encode_w(const T* x, int64_t n, double prescale, uint16_t* y, cudaStream_t s) {
  const float sf = static_cast<float>(prescale);
  int64_t done = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (aligned16(x, y) && n >= 4) {
      const int64_t n4 = n / 4;
      encode16_f32x4<W><<<blocks_for(n4), kThreads, 0, s>>>(reinterpret_cast<const float4*>(x),
                                                             reinterpret_cast<uint2*>(y), n4, sf);
      done = n4 * 4;
    }
  }
  if (done < n) encode16<W, T><<<blocks_for(n - done), kThreads, 0, s>>>(x, y, done, n, prescale, sf);
}

template <class W, class T>
void decode_w(const uint16_t* h, int64_t n, T* out, double alpha, bool acc, cudaStream_t s) {
  int64_t done = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (aligned16(h, out) && n >= 4) {
      const int64_t n4 = n / 4;
      decode16_f32x4<W><<<blocks_for(n4), kThreads, 0, s>>>(reinterpret_cast<const uint2*>(h),
                                                             reinterpret_cast<float4*>(out), n4,
                                                             static_cast<float>(alpha), acc);
      done = n4 * 4;
    }
  }
  if (done < n) decode16<W, T><<<blocks_for(n - done), kThreads, 0, s>>>(h, out, done, n, alpha, acc);
}

// randomk: stratum j of n cut into k starts at j*q + floor(j*r/k), q = n/k, r = n%k
// (j*r < k^2 < 2^62), which is where csrc/cpu/randomk.cc's running walk puts it.
struct Stratum {
  int64_t lo, size;
};
__device__ Stratum stratum(int64_t j, int64_t n, int64_t k) {
  const int64_t q = n / k, r = n % k;
  const int64_t lo = j * q + (j * r) / k;
  const int64_t hi = (j + 1) * q + ((j + 1) * r) / k;
  return {lo, hi - lo};
}

template <class T>
__global__ void randomk_gather(const T* x, int64_t n, int64_t k, uint64_t seed, T* vals) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < k;
       j += int64_t(gridDim.x) * blockDim.x) {
    const Stratum st = stratum(j, n, k);
    vals[j] = x[stratum_pick(st.lo, st.size, seed, j)];
  }
}

template <class T>
__global__ void randomk_scatter(const T* vals, int64_t n, int64_t k, uint64_t seed, bool rescale,
                                double alpha, T* out) {
  using A = typename Acc<T>::type;
  const A a = static_cast<A>(alpha);
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < k;
       j += int64_t(gridDim.x) * blockDim.x) {
    const Stratum st = stratum(j, n, k);
    const int64_t i = stratum_pick(st.lo, st.size, seed, j);
    A v = to_acc(vals[j]);
    if (rescale) v = v * static_cast<A>(st.size);
    out[i] = from_acc<T>(to_acc(out[i]) + a * v);  // strata are disjoint: no two j share an i
  }
}

}  // namespace

namespace cast {

void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload,
            cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    if (c == kNone) {
      if (p.prescale == 1.0)
        check(cudaMemcpyAsync(payload, x, n * sizeof(T), cudaMemcpyDeviceToDevice, s), "copy");
      else
        scale_none<T><<<blocks_for(n), kThreads, 0, s>>>(xs, static_cast<T*>(payload), n,
                                                         p.prescale, nullptr, false);
    } else if (c == kFP16) {
      encode_w<half_t>(xs, n, p.prescale, static_cast<uint16_t*>(payload), s);
    } else {
      encode_w<bf16_t>(xs, n, p.prescale, static_cast<uint16_t*>(payload), s);
    }
  });
  check_launch("cast encode");
}

void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc,
            cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = static_cast<T*>(out);
    if (c == kNone) {
      if (!acc && alpha == 1.0) {
        if (out != payload)
          check(cudaMemcpyAsync(out, payload, n * sizeof(T), cudaMemcpyDeviceToDevice, s), "copy");
      } else {
        scale_none<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const T*>(payload), o, n,
                                                         alpha, o, acc);
      }
    } else if (c == kFP16) {
      decode_w<half_t>(static_cast<const uint16_t*>(payload), n, o, alpha, acc, s);
    } else {
      decode_w<bf16_t>(static_cast<const uint16_t*>(payload), n, o, alpha, acc, s);
    }
  });
  check_launch("cast decode");
}

void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto* base = static_cast<const uint8_t*>(payloads);
    if (c == kFP16)
      aggregate16<half_t, T><<<blocks_for(n), kThreads, 0, s>>>(base, ranks, stride, n,
                                                                static_cast<T*>(out), alpha);
    else
      aggregate16<bf16_t, T><<<blocks_for(n), kThreads, 0, s>>>(base, ranks, stride, n,
                                                                static_cast<T*>(out), alpha);
  });
  check_launch("cast aggregate");
}

void aggregate_pair(CodecId c, DType d, const void* own, const int32_t* summed, int64_t rank,
                    int64_t n, void* out, double alpha, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto* h = static_cast<const uint16_t*>(own);
    const auto* w = reinterpret_cast<const uint32_t*>(summed);
    if (c == kFP16)
      aggregate_pair16<half_t, T><<<blocks_for(n), kThreads, 0, s>>>(h, w, rank, n,
                                                                     static_cast<T*>(out), alpha);
    else
      aggregate_pair16<bf16_t, T><<<blocks_for(n), kThreads, 0, s>>>(h, w, rank, n,
                                                                     static_cast<T*>(out), alpha);
  });
  check_launch("cast aggregate_pair");
}

void add_into(DType d, const void* x, const void* e_in, void* e, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_into_k<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<const T*>(x),
                                                     static_cast<const T*>(e_in),
                                                     static_cast<T*>(e), n);
  });
  check_launch("error-feedback sum");
}

void nesterov(DType d, void* x, void* m, int64_t n, double mu, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    nesterov_k<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(x), static_cast<T*>(m), n, mu);
  });
  check_launch("nesterov");
}

void heavy_ball(DType d, const void* x, const void* m, void* out, int64_t n, double factor,
                cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    heavy_ball_k<T><<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(m), static_cast<T*>(out), n, factor);
  });
  check_launch("heavy_ball");
}

}  // namespace cast

namespace randomk {

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s) {
  if (p.k == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    randomk_gather<T><<<blocks_for(p.k), kThreads, 0, s>>>(static_cast<const T*>(x), n, p.k, p.seed,
                                                          static_cast<T*>(payload));
  });
  check_launch("randomk encode");
}

void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc, cudaStream_t s) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (!acc && n) check(cudaMemsetAsync(out, 0, n * sizeof(T), s), "memset");  // +0 in every dtype
    if (p.k == 0) return;
    randomk_scatter<T><<<blocks_for(p.k), kThreads, 0, s>>>(static_cast<const T*>(payload), n, p.k,
                                                           p.seed, p.rescale, alpha,
                                                           static_cast<T*>(out));
  });
  check_launch("randomk decode");
}

}  // namespace randomk
}  // namespace gpu
}  // namespace hvdc
