// onebit / signsgd / efsignsgd: one bit per element (1 where x < 0, so zero and NaN count as +),
// packed little-endian into 64-bit words, behind an 8-byte header [u32 tag][f32 scale].
// scale = mean|x| (accumulated in double) when `scaling` is on, else 1.
#include <immintrin.h>

#include <vector>

#include "common.h"

namespace hvdc {
namespace sign {
namespace {

constexpr int64_t kHeader = 8;

struct View {
  uint32_t* tag;
  float* scale;
  uint64_t* words;
};
View view(void* payload) {
  auto* b = static_cast<uint8_t*>(payload);
  return {reinterpret_cast<uint32_t*>(b), reinterpret_cast<float*>(b + 4),
          reinterpret_cast<uint64_t*>(b + kHeader)};
}
const uint64_t* words_of(const void* payload) {
  return reinterpret_cast<const uint64_t*>(static_cast<const uint8_t*>(payload) + kHeader);
}
float scale_of(const void* payload) {
  float s;
  std::memcpy(&s, static_cast<const uint8_t*>(payload) + 4, 4);
  return s;
}

float finish_scale(double abs_sum, int64_t n, bool scaling) {
  if (!scaling) return 1.0f;
  return n > 0 ? static_cast<float>(abs_sum / static_cast<double>(n)) : 0.0f;
}

// Packs the sign bits of 64 floats into one word and adds |x| to four double accumulators.
__attribute__((target("avx2"))) inline uint64_t pack64_avx2(const __m256 x[8], __m256d acc[4]) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  uint64_t w = 0;
  for (int u = 0; u < 8; ++u) {
    const __m256 v = x[u];
    w |= static_cast<uint64_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ))) << (8 * u);
    __m256 a = _mm256_and_ps(v, absmask);
    acc[(u & 1) * 2] = _mm256_add_pd(acc[(u & 1) * 2], _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
    acc[(u & 1) * 2 + 1] =
        _mm256_add_pd(acc[(u & 1) * 2 + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
  }
  return w;
}

__attribute__((target("avx2"))) double hsum(__m256d acc[4]) {
  __m256d s = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  alignas(32) double t[4];
  _mm256_store_pd(t, s);
  return (t[0] + t[1]) + (t[2] + t[3]);
}

__attribute__((target("avx2"))) double encode_f32_avx2(const float* x, int64_t n, uint64_t* words) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int l = 0; l < 4; ++l) prefetch_ahead(x + i + 16 * l);
    __m256 v[8];
    for (int u = 0; u < 8; ++u) v[u] = _mm256_loadu_ps(x + i + 8 * u);
    words[i / 64] = pack64_avx2(v, acc);
  }
  double sum = hsum(acc);
  if (i < n) {
    uint64_t w = 0;
    for (int64_t j = i; j < n; ++j) {
      w |= static_cast<uint64_t>(x[j] < 0.0f) << (j - i);
      sum += std::fabs(static_cast<double>(x[j]));
    }
    words[i / 64] = w;
  }
  return sum;
}

// One pass of lazy error feedback: the residual e = q - (q < 0 ? -s : s) of the previous step is
// formed from q (held in e_in) and its scale s, then p = x + e is stored into e (which may be
// e_in), packed and summed. Each value is rounded to float exactly where the eager definition rounds it.
// e is read again only at the next step, so it goes around the cache and is packed from the
// registers.
__attribute__((target("avx2"))) double ef_pass_f32_avx2(const float* x, const float* e_in,
                                                        float* e, float s, int64_t n,
                                                        uint64_t* words) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  const __m256 zero = _mm256_setzero_ps();
  const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
  const bool stream = stream_later(e, 4 * n);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int l = 0; l < 4; ++l) {
      prefetch_ahead(x + i + 16 * l);
      prefetch_ahead(e_in + i + 16 * l);
    }
    __m256 p[8];
    for (int u = 0; u < 8; ++u) {
      __m256 q = _mm256_loadu_ps(e_in + i + 8 * u);
      __m256 corr = _mm256_blendv_ps(pos, neg, _mm256_cmp_ps(q, zero, _CMP_LT_OQ));
      p[u] = _mm256_add_ps(_mm256_loadu_ps(x + i + 8 * u), _mm256_sub_ps(q, corr));
      if (stream) _mm256_stream_ps(e + i + 8 * u, p[u]);
      else _mm256_storeu_ps(e + i + 8 * u, p[u]);
    }
    words[i / 64] = pack64_avx2(p, acc);
  }
  if (stream) _mm_sfence();
  double sum = hsum(acc);
  if (i < n) {
    uint64_t w = 0;
    for (int64_t j = i; j < n; ++j) {
      const float q = e_in[j];
      e[j] = x[j] + (q - (q < 0.0f ? -s : s));
      w |= static_cast<uint64_t>(e[j] < 0.0f) << (j - i);
      sum += std::fabs(static_cast<double>(e[j]));
    }
    words[i / 64] = w;
  }
  return sum;
}

// out = alpha*(+-scale) or out += alpha*(+-scale), eight elements per byte of sign bits.
__attribute__((target("avx2"))) void decode_f32_avx2(const uint64_t* words, int64_t n, float v,
                                                     float* out, bool acc) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 pos = _mm256_set1_ps(v), neg = _mm256_set1_ps(-v);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
  const bool stream = !acc && stream_later(out, 4 * n);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i b = _mm256_set1_epi32(bytes[i / 8]);
    __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, sel), sel));
    __m256 d = _mm256_blendv_ps(pos, neg, m);
    if (acc) d = _mm256_add_ps(_mm256_loadu_ps(out + i), d);
    if (stream) _mm256_stream_ps(out + i, d);
    else _mm256_storeu_ps(out + i, d);
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) {
    float d = ((bytes[i / 8] >> (i % 8)) & 1) ? -v : v;
    out[i] = acc ? out[i] + d : d;
  }
}

inline bool bit(const uint64_t* words, int64_t i) { return (words[i >> 6] >> (i & 63)) & 1u; }

template <class T>
double encode_scalar(const T* x, int64_t n, uint64_t* words) {
  double sum = 0.0;
  for (int64_t w = 0; w * 64 < n; ++w) {
    uint64_t word = 0;
    const int64_t end = std::min<int64_t>(64, n - w * 64);
    for (int64_t j = 0; j < end; ++j) {
      auto v = to_acc(x[w * 64 + j]);
      word |= static_cast<uint64_t>(v < 0) << j;
      sum += std::fabs(static_cast<double>(v));
    }
    words[w] = word;
  }
  return sum;
}

template <class T>
void decode_scalar(const uint64_t* words, int64_t n, float scale, double alpha, T* out, bool acc) {
  using A = typename Acc<T>::type;
  const A v = static_cast<A>(alpha) * static_cast<A>(scale);
  for (int64_t i = 0; i < n; ++i) {
    A d = bit(words, i) ? -v : v;
    out[i] = from_acc<T>(acc ? to_acc(out[i]) + d : d);
  }
}

template <class T>
void decode_t(const uint64_t* words, int64_t n, float scale, double alpha, T* out, bool acc) {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c())
      return decode_f32_avx2(words, n, static_cast<float>(alpha) * scale, out, acc);
  }
  decode_scalar(words, n, scale, alpha, out, acc);
}

template <class T>
double encode_t(const T* x, int64_t n, uint64_t* words) {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c()) return encode_f32_avx2(x, n, words);
  }
  return encode_scalar(x, n, words);
}

}  // namespace

int64_t payload_bytes(int64_t n) { return kHeader + 8 * ((n + 63) / 64); }

void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload) {
  View v = view(payload);
  *v.tag = payload_tag(c, d);
  const bool scaling = (c == kEFSignSGD) ? true : p.scaling;
  double sum = dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return encode_t(static_cast<const T*>(x), n, v.words);
  });
  *v.scale = finish_scale(sum, n, scaling);
}

void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc) {
  check_tag(payload, c, d, -1);
  const float scale = scale_of(payload);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    decode_t(words_of(payload), n, scale, alpha, static_cast<T*>(out), acc);
  });
}

void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  for (int64_t r = 0; r < ranks; ++r) check_tag(base + r * stride, c, d, r);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    constexpr int64_t kBlock = 4096;  // a multiple of 64 so blocks start on word boundaries
    if (c == kSignSGD) {
      // Majority vote: the sign of the summed signs, at the ranks' mean scale; a tie gives 0.
      double scale_sum = 0.0;
      for (int64_t r = 0; r < ranks; ++r) scale_sum += scale_of(base + r * stride);
      const float mean_scale = ranks > 0 ? static_cast<float>(scale_sum / ranks) : 0.0f;
      const A v = static_cast<A>(mean_scale) * static_cast<A>(alpha * static_cast<double>(ranks));
      std::vector<int32_t> votes(static_cast<size_t>(std::min(n, kBlock)));
      for (int64_t s = 0; s < n; s += kBlock) {
        const int64_t len = std::min(kBlock, n - s);
        std::fill(votes.begin(), votes.begin() + len, 0);
        for (int64_t r = 0; r < ranks; ++r) {
          const uint64_t* w = words_of(base + r * stride) + s / 64;
          for (int64_t j = 0; j < len; ++j) votes[j] += bit(w, j) ? -1 : 1;
        }
        for (int64_t j = 0; j < len; ++j)
          o[s + j] = from_acc<T>(votes[j] > 0 ? v : votes[j] < 0 ? -v : A(0));
      }
      return;
    }
    std::vector<A> accum(static_cast<size_t>(std::min(n, kBlock)));
    for (int64_t s = 0; s < n; s += kBlock) {
      const int64_t len = std::min(kBlock, n - s);
      std::fill(accum.begin(), accum.begin() + len, A(0));
      for (int64_t r = 0; r < ranks; ++r) {
        const void* pr = base + r * stride;
        decode_t(words_of(pr) + s / 64, len, scale_of(pr), alpha, accum.data(), true);
      }
      for (int64_t j = 0; j < len; ++j) o[s + j] = from_acc<T>(accum[j]);
    }
  });
}

void ef_encode(CodecId c, DType d, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload) {
  View v = view(payload);
  *v.tag = payload_tag(c, d);
  const bool scaling = (c == kEFSignSGD) ? true : p.scaling;
  const float s = *carry;
  double sum = dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    const T* xs = static_cast<const T*>(x);
    const T* ein = static_cast<const T*>(e_in);
    T* es = static_cast<T*>(e);
    if constexpr (std::is_same_v<T, float>) {
      if (cpu_has_avx2_f16c()) return ef_pass_f32_avx2(xs, ein, es, s, n, v.words);
    }
    const A sa = static_cast<A>(s);
    for (int64_t i = 0; i < n; ++i) {
      const A q = to_acc(ein[i]);
      const T residual = from_acc<T>(q - (q < 0 ? -sa : sa));
      es[i] = from_acc<T>(to_acc(xs[i]) + to_acc(residual));
    }
    return encode_scalar(es, n, v.words);
  });
  *v.scale = finish_scale(sum, n, scaling);
  *carry = *v.scale;
}

void ef_settle(DType d, void* e, float* carry, int64_t n) {
  const float s = *carry;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* es = static_cast<T*>(e);
    const A sa = static_cast<A>(s);
    for (int64_t i = 0; i < n; ++i) {
      const A q = to_acc(es[i]);
      es[i] = from_acc<T>(q - (q < 0 ? -sa : sa));
    }
  });
  *carry = 0.0f;
}

}  // namespace sign
}  // namespace hvdc
