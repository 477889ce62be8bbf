// none / fp16 / bf16: element-wise casts, the linear codecs that travel by allreduce.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace hvdc {
namespace cast {
namespace {

__attribute__((target("avx2,f16c"))) void f32_to_f16_avx2(const float* x, uint16_t* y, int64_t n,
                                                          float s) {
  const __m256 vs = _mm256_set1_ps(s);
  const bool stream = stream_to(y, 2 * n);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(x + i);
    prefetch_ahead(x + i + 16);
    for (int u = 0; u < 4; u += 2) {
      __m128i a = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * u), vs),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m128i b = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * u + 8), vs),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256i ab = _mm256_set_m128i(b, a);
      auto* dst = reinterpret_cast<__m256i*>(y + i + 8 * u);
      if (stream) _mm256_stream_si256(dst, ab);
      else _mm256_storeu_si256(dst, ab);
    }
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) y[i] = f32_to_f16_bits(x[i] * s);
}

// y = h, or y = a * h (one rounding, as the scalar loop's float product): an average decoded
// after Horovod's allreduce took the scalar loop's software conversion, 5x slower.
template <bool kScale>
__attribute__((target("avx2,f16c"))) void f16_to_f32_avx2(const uint16_t* h, float* y, int64_t n,
                                                          float a) {
  const bool stream = stream_later(y, 4 * n);
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(h + i);
    for (int u = 0; u < 4; ++u) {
      __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i + 8 * u)));
      if (kScale) v = _mm256_mul_ps(va, v);
      if (stream) _mm256_stream_ps(y + i + 8 * u, v);
      else _mm256_storeu_ps(y + i + 8 * u, v);
    }
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) y[i] = kScale ? a * f16_bits_to_f32(h[i]) : f16_bits_to_f32(h[i]);
}

// out += a * h, as the scalar loop rounds it (a product, then a sum: no fused multiply-add);
// the software half conversion kept that loop scalar (a third of bf16's speed in aggregate).
__attribute__((target("avx2,f16c"))) void f16_acc_f32_avx2(const uint16_t* h, float* out,
                                                           int64_t n, float a) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_mul_ps(va, v)));
  }
  for (; i < n; ++i) out[i] = out[i] + a * f16_bits_to_f32(h[i]);
}

// Round to nearest even by adding 0x7fff + lsb. NaNs would carry into the exponent, so a block
// holding any NaN is redone by the scalar rounding, which keeps them quiet NaNs.
__attribute__((target("avx2"))) inline __m256i bf16_round_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}

__attribute__((target("avx2"))) void f32_to_bf16_avx2(const float* x, uint16_t* y, int64_t n,
                                                      float s) {
  const __m256 vs = _mm256_set1_ps(s);
  const bool stream = stream_to(y, 2 * n);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(x + i);
    __m256 va = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
    __m256 vb = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vs);
    // packus works per 128-bit lane; the permute restores element order.
    __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(bf16_round_avx2(va), bf16_round_avx2(vb)), 0xD8);
    if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(va, va, _CMP_UNORD_Q),
                                        _mm256_cmp_ps(vb, vb, _CMP_UNORD_Q)))) {
      alignas(32) uint16_t t[16];
      for (int j = 0; j < 16; ++j) t[j] = f32_to_bf16_bits(x[i + j] * s);
      packed = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
    }
    auto* dst = reinterpret_cast<__m256i*>(y + i);
    if (stream) _mm256_stream_si256(dst, packed);
    else _mm256_storeu_si256(dst, packed);
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) y[i] = f32_to_bf16_bits(x[i] * s);
}

__attribute__((target("avx2"))) void bf16_to_f32_avx2(const uint16_t* h, float* y, int64_t n) {
  const bool stream = stream_later(y, 4 * n);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    auto* dst = reinterpret_cast<__m256i*>(y + i);
    if (stream) _mm256_stream_si256(dst, _mm256_slli_epi32(v, 16));
    else _mm256_storeu_si256(dst, _mm256_slli_epi32(v, 16));
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) y[i] = bf16_bits_to_f32(h[i]);
}

// One element of x, pre-scaled, rounded once to the 16-bit wire format W.
template <class W> uint16_t to_wire(float v);
template <> uint16_t to_wire<half_t>(float v) { return f32_to_f16_bits(v); }
template <> uint16_t to_wire<bf16_t>(float v) { return f32_to_bf16_bits(v); }
template <class W> float from_wire(uint16_t v);
template <> float from_wire<half_t>(uint16_t v) { return f16_bits_to_f32(v); }
template <> float from_wire<bf16_t>(uint16_t v) { return bf16_bits_to_f32(v); }

template <class W, class T>
void encode16(const T* x, int64_t n, double prescale, uint16_t* y) {
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t i = 0; i < n; ++i) y[i] = to_wire<W>(f64_to_f32_round_odd(x[i] * prescale));
  } else {
    const float s = static_cast<float>(prescale);
    if constexpr (std::is_same_v<T, float>) {
      if (cpu_has_avx2_f16c()) {
        if constexpr (std::is_same_v<W, half_t>) return f32_to_f16_avx2(x, y, n, s);
        else return f32_to_bf16_avx2(x, y, n, s);
      }
    }
    for (int64_t i = 0; i < n; ++i) y[i] = to_wire<W>(to_acc(x[i]) * s);
  }
}

template <class W, class T>
void decode16(const uint16_t* h, int64_t n, T* out, double alpha, bool acc) {
  using A = typename Acc<T>::type;
  if constexpr (std::is_same_v<T, float>) {
    if (!acc && alpha == 1.0 && cpu_has_avx2_f16c()) {
      if constexpr (std::is_same_v<W, half_t>) return f16_to_f32_avx2<false>(h, out, n, 1.0f);
      else return bf16_to_f32_avx2(h, out, n);
    }
    if constexpr (std::is_same_v<W, half_t>) {
      if (!acc && cpu_has_avx2_f16c())
        return f16_to_f32_avx2<true>(h, out, n, static_cast<float>(alpha));
    }
    if constexpr (std::is_same_v<W, half_t>) {
      if (acc && cpu_has_avx2_f16c()) return f16_acc_f32_avx2(h, out, n, static_cast<float>(alpha));
    }
  }
  const A a = static_cast<A>(alpha);
  if (acc) {
    for (int64_t i = 0; i < n; ++i)
      out[i] = from_acc<T>(to_acc(out[i]) + a * static_cast<A>(from_wire<W>(h[i])));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = from_acc<T>(a * static_cast<A>(from_wire<W>(h[i])));
  }
}

template <class T>
void encode_none(const T* x, int64_t n, double prescale, T* y) {
  if (prescale == 1.0) {
    std::memcpy(y, x, static_cast<size_t>(n) * sizeof(T));
    return;
  }
  using A = typename Acc<T>::type;
  const A s = static_cast<A>(prescale);
  for (int64_t i = 0; i < n; ++i) y[i] = from_acc<T>(to_acc(x[i]) * s);
}

template <class T>
void decode_none(const T* y, int64_t n, T* out, double alpha, bool acc) {
  using A = typename Acc<T>::type;
  const A a = static_cast<A>(alpha);
  if (acc) {
    for (int64_t i = 0; i < n; ++i) out[i] = from_acc<T>(to_acc(out[i]) + a * to_acc(y[i]));
  } else if (alpha == 1.0) {
    if (out != y) std::memcpy(out, y, static_cast<size_t>(n) * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = from_acc<T>(a * to_acc(y[i]));
  }
}

// 16 wire halves to 16 floats, in two registers of 8.
template <class W> __attribute__((target("avx2,f16c"))) inline __m256 widen8(__m128i h);
template <> __attribute__((target("avx2,f16c"))) inline __m256 widen8<half_t>(__m128i h) {
  return _mm256_cvtph_ps(h);
}
template <> __attribute__((target("avx2,f16c"))) inline __m256 widen8<bf16_t>(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// aggregate_pair for float gradients, 16 elements (8 words) at a time: (0 + a * row 0) +
// a * row 1, as aggregate's accumulation rounds it.
template <class W>
__attribute__((target("avx2,f16c"))) int64_t pair16_avx2(const uint16_t* own,
                                                         const uint32_t* summed, int64_t rank,
                                                         int64_t n, float* out, float a,
                                                         uint32_t* seen) {
  const __m256 va = _mm256_set1_ps(a);
  const __m256 zero = _mm256_setzero_ps();
  const bool stream = stream_later(out, 4 * n);
  __m256i sv = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(own + i);
    prefetch_ahead(summed + i / 2);
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(own + i));
    const __m256i t = _mm256_sub_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(summed + i / 2)), o);
    const __m256i r0 = rank == 0 ? o : t, r1 = rank == 0 ? t : o;
    for (int h = 0; h < 2; ++h) {
      const __m128i h0 = h ? _mm256_extracti128_si256(r0, 1) : _mm256_castsi256_si128(r0);
      const __m128i h1 = h ? _mm256_extracti128_si256(r1, 1) : _mm256_castsi256_si128(r1);
      const __m256 acc = _mm256_add_ps(_mm256_add_ps(zero, _mm256_mul_ps(va, widen8<W>(h0))),
                                       _mm256_mul_ps(va, widen8<W>(h1)));
      sv = seen_abs8(sv, acc);
      if (stream) _mm256_stream_ps(out + i + 8 * h, acc);
      else _mm256_storeu_ps(out + i + 8 * h, acc);
    }
  }
  if (stream) _mm_sfence();
  *seen = seen_max8(*seen, sv);
  return i;
}

// Returns the largest |out| bit pattern (see seen_abs) for float32 out, else 0.
template <class W, class T>
uint32_t aggregate_pair16(const uint16_t* own, const uint32_t* summed, int64_t rank, int64_t n,
                          T* out, double alpha) {
  using A = typename Acc<T>::type;
  int64_t i = 0;
  uint32_t seen = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c())
      i = pair16_avx2<W>(own, summed, rank, n, out, static_cast<float>(alpha), &seen);
  }
  const A a = static_cast<A>(alpha);
  for (; i < n; ++i) {
    // This rank's word, zero-padded past an odd count as the words summed were.
    const int64_t lo = i & ~int64_t(1);
    const uint32_t word = uint32_t(own[lo]) | (lo + 1 < n ? uint32_t(own[lo + 1]) << 16 : 0u);
    const uint16_t mine = own[i], other = uint16_t((summed[i / 2] - word) >> (16 * (i & 1)));
    const uint16_t h0 = rank == 0 ? mine : other, h1 = rank == 0 ? other : mine;
    A acc = A(0) + a * static_cast<A>(from_wire<W>(h0));
    acc = acc + a * static_cast<A>(from_wire<W>(h1));
    out[i] = from_acc<T>(acc);
    if constexpr (std::is_same_v<T, float>) seen = seen_abs(seen, out[i]);
  }
  return seen;
}

}  // namespace

int64_t payload_bytes(CodecId c, DType d, int64_t n) {
  return n * (c == kNone ? dtype_size(d) : 2);
}

void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    if (c == kNone) encode_none(xs, n, p.prescale, static_cast<T*>(payload));
    else if (c == kFP16) encode16<half_t>(xs, n, p.prescale, static_cast<uint16_t*>(payload));
    else encode16<bf16_t>(xs, n, p.prescale, static_cast<uint16_t*>(payload));
  });
}

void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = static_cast<T*>(out);
    if (c == kNone) decode_none(static_cast<const T*>(payload), n, o, alpha, acc);
    else if (c == kFP16) decode16<half_t>(static_cast<const uint16_t*>(payload), n, o, alpha, acc);
    else decode16<bf16_t>(static_cast<const uint16_t*>(payload), n, o, alpha, acc);
  });
}

// fp16 / bf16 payloads gathered from every rank (Horovod 0.28.1 cannot sum bfloat16), reduced
// in float (double for f64 gradients) block by block, rank 0 first.
void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    constexpr int64_t kBlock = 4096;
    std::vector<A> accum(static_cast<size_t>(std::min(n, kBlock)));
    T* o = static_cast<T*>(out);
    for (int64_t s = 0; s < n; s += kBlock) {
      const int64_t len = std::min(kBlock, n - s);
      std::fill(accum.begin(), accum.begin() + len, A(0));
      for (int64_t r = 0; r < ranks; ++r) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(base + r * stride) + s;
        if (c == kFP16) decode16<half_t>(h, len, accum.data(), alpha, true);
        else decode16<bf16_t>(h, len, accum.data(), alpha, true);
      }
      for (int64_t j = 0; j < len; ++j) o[s + j] = from_acc<T>(accum[j]);
    }
  });
}

void aggregate_pair(CodecId c, DType d, const void* own, const int32_t* summed, int64_t rank,
                    int64_t n, void* out, double alpha, bool* finite) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto* h = static_cast<const uint16_t*>(own);
    const auto* w = reinterpret_cast<const uint32_t*>(summed);
    const uint32_t seen =
        c == kFP16 ? aggregate_pair16<half_t>(h, w, rank, n, static_cast<T*>(out), alpha)
                   : aggregate_pair16<bf16_t>(h, w, rank, n, static_cast<T*>(out), alpha);
    if (finite)
      *finite = std::is_same_v<T, float> ? seen < kInfBits : all_finite(d, out, n);
  });
}

}  // namespace cast
}  // namespace hvdc
