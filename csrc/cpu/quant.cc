// Stochastic quantisers: random dithering (Horvath et al. 2019) with its parametrisations QSGD
// (Alistarh et al. 2017, linear levels, L2 norm) and TernGrad (Wen et al. 2017, one level,
// clipped max norm), and natural compression (stochastic rounding to a power of two).
//
// dither payload: [u32 tag][u8 s][u8 partition][u8 normalize][u8 0][f32 norm][u32 0]
//   then one code per element, code = s + sign * level in [0, 2s], packed `bits` = bit width of
//   2s per code, 8 codes in `bits` bytes (little-endian), padded to 8 bytes.
//   level l of a = |x| / norm (at most 1): linear levels l/s, natural levels 0 and 2^(l-s).
//   Rounding is stochastic and unbiased: up with probability equal to the distance from the
//   lower level over the gap, from a counter-based hash of (seed, element index) (see uniform()).
// natural payload: [u32 tag][i32 top][u8 code per element, padded to 8]
//   code = sign << 7 | c, c = 0 is zero, else 2^(top - 127 + c); top is one above the exponent
//   of max|x|, so 127 binades below it are kept; smaller magnitudes round to 0 or the lowest.
// A non-finite norm (or max) is stored as NaN (INT32_MIN for natural): everything decodes to
// NaN, so a broken gradient is never hidden.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace hvdc {
namespace quant {
namespace {

constexpr int64_t kDitherHeader = 16;
constexpr int64_t kNaturalHeader = 8;
constexpr int64_t kSumLanes = 16;  // fixed summation order for the norms (SIMD = scalar)

int bits_for(int64_t s) { return dither_bits(s); }

int64_t code_bytes(int64_t n, int b) { return ((n + 7) / 8 * b + 7) / 8 * 8; }

// Norm statistics of a float32 view of x: max|x|, and sums of x and x^2 in double over 16
// lanes (lane = index mod 16) added pairwise at the end, so the result is one defined number.
struct Stats {
  float maxabs = 0.0f;
  double sum = 0.0, sumsq = 0.0;
  bool finite = true;
};

double tree16(const double* v) {
  double a[8];
  for (int i = 0; i < 8; ++i) a[i] = v[2 * i] + v[2 * i + 1];
  for (int i = 0; i < 4; ++i) a[i] = a[2 * i] + a[2 * i + 1];
  return (a[0] + a[1]) + (a[2] + a[3]);
}

__attribute__((target("avx2"))) void stats_f32_avx2(const float* x, int64_t n, bool sums,
                                                    Stats* st, int64_t* done, double* s1,
                                                    double* s2, float* mx) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  __m256d q[4] = {a[0], a[0], a[0], a[0]};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(x + i);
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    // max_ps returns its second operand when either is NaN: keep NaNs visible separately.
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, _mm256_and_ps(v0, absmask));
    m = _mm256_max_ps(m, _mm256_and_ps(v1, absmask));
    if (sums) {
      const __m256d d[4] = {_mm256_cvtps_pd(_mm256_castps256_ps128(v0)),
                            _mm256_cvtps_pd(_mm256_extractf128_ps(v0, 1)),
                            _mm256_cvtps_pd(_mm256_castps256_ps128(v1)),
                            _mm256_cvtps_pd(_mm256_extractf128_ps(v1, 1))};
      for (int u = 0; u < 4; ++u) {
        a[u] = _mm256_add_pd(a[u], d[u]);
        q[u] = _mm256_add_pd(q[u], _mm256_mul_pd(d[u], d[u]));
      }
    }
  }
  alignas(32) float mm[8];
  _mm256_store_ps(mm, m);
  for (int u = 0; u < 8; ++u) *mx = std::max(*mx, mm[u]);
  for (int u = 0; u < 4; ++u) {
    _mm256_storeu_pd(s1 + 4 * u, a[u]);
    _mm256_storeu_pd(s2 + 4 * u, q[u]);
  }
  if (_mm256_movemask_ps(bad)) st->finite = false;
  *done = i;
}

template <class T>
Stats stats(const T* x, int64_t n, bool sums) {
  Stats st;
  double s1[kSumLanes] = {0}, s2[kSumLanes] = {0};
  float mx = 0.0f;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c()) stats_f32_avx2(x, n, sums, &st, &i, s1, s2, &mx);
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(to_acc(x[i]));
    if (std::isnan(v)) st.finite = false;
    mx = std::max(mx, std::fabs(v));
    if (sums) {
      const double d = v;
      s1[i % kSumLanes] += d;
      s2[i % kSumLanes] += d * d;
    }
  }
  if (!std::isfinite(mx)) st.finite = false;
  st.maxabs = mx;
  st.sum = tree16(s1);
  st.sumsq = tree16(s2);
  return st;
}

float dither_norm(const Stats& st, int64_t n, const Params& p) {
  if (!st.finite) return std::numeric_limits<float>::quiet_NaN();
  if (p.normalize == kL2) return static_cast<float>(std::sqrt(st.sumsq));
  if (p.normalize == kClipSigma && n > 0) {
    const double mean = st.sum / static_cast<double>(n);
    const double var = std::max(0.0, st.sumsq / static_cast<double>(n) - mean * mean);
    // clip is taken at float precision, as the TF op attribute holds it.
    const float bound = static_cast<float>(static_cast<double>(static_cast<float>(p.clip)) * std::sqrt(var));
    return bound > 0.0f ? std::min(st.maxabs, bound) : st.maxabs;  // constant x: nothing to clip
  }
  return st.maxabs;
}

inline void put_group(uint8_t* codes, int64_t g, int b, int64_t cap, uint64_t w) {
  uint8_t* dst = codes + g * b;
  // Whole-word stores run ahead into the next group, which is written after this one.
  if (g * b + 8 <= cap) std::memcpy(dst, &w, 8);
  else std::memcpy(dst, &w, static_cast<size_t>(b));
}

inline uint64_t get_group(const uint8_t* codes, int64_t g, int b, int64_t cap) {
  uint64_t w = 0;
  if (g * b + 8 <= cap) std::memcpy(&w, codes + g * b, 8);
  else std::memcpy(&w, codes + g * b, static_cast<size_t>(b));
  return b == 8 ? w : w & ((uint64_t{1} << (8 * b)) - 1);
}

// Linear levels, float32 input: 32 codes per step, same arithmetic as linear_level(). Codes are
// narrowed to bytes, then each 64-bit lane's 8 bytes are squeezed to 8 * bits bits by three
// shift-and-merge rounds (pairs, quads, octets), so only one store per 8 codes leaves SIMD.
__attribute__((target("avx2"))) int64_t dither_linear_f32_avx2(const float* x, int64_t n, float scale,
                                                               int64_t s, uint64_t seed, int b,
                                                               int64_t cap, uint8_t* codes) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 vscale = _mm256_set1_ps(scale), sf = _mm256_set1_ps(static_cast<float>(s));
  const __m256i vs = _mm256_set1_epi32(static_cast<int32_t>(s));
  const __m256i m1 = _mm256_set1_epi64x(0x00ff00ff00ff00ffLL);
  const __m256i m2 = _mm256_set1_epi64x(0x0000ffff0000ffffLL);
  const __m256i m3 = _mm256_set1_epi64x(0x00000000ffffffffLL);
  const __m128i r1 = _mm_cvtsi32_si128(8 - b), r2 = _mm_cvtsi32_si128(16 - 2 * b),
                r3 = _mm_cvtsi32_si128(32 - 4 * b);
  const __m256i step8 = _mm256_set1_epi32(static_cast<int32_t>(8u * 0x9e3779b1u));
  __m256i key = uniform_keys8(seed, 0);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(x + i);
    __m256i c[4];
    __m256 us[4];
    uniform16(seed, key, &us[0], &us[1]);
    key = _mm256_add_epi32(key, step8);
    uniform16(seed, key, &us[2], &us[3]);
    key = _mm256_add_epi32(key, step8);
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      const __m256 t = _mm256_min_ps(_mm256_mul_ps(_mm256_and_ps(v, absmask), vscale), sf);
      const __m256 f = _mm256_floor_ps(t);
      const __m256 up = _mm256_cmp_ps(us[u], _mm256_sub_ps(t, f), _CMP_LT_OQ);
      // level = f + up (up is all-ones = -1 as an integer); code = s +- level by the sign bit
      // (-0 has level 0, so either choice is s).
      const __m256i l = _mm256_sub_epi32(_mm256_cvttps_epi32(f), _mm256_castps_si256(up));
      c[u] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_add_epi32(vs, l)),
                                                  _mm256_castsi256_ps(_mm256_sub_epi32(vs, l)), v));
    }
    __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    w = _mm256_or_si256(_mm256_and_si256(w, m1), _mm256_srl_epi64(_mm256_andnot_si256(m1, w), r1));
    w = _mm256_or_si256(_mm256_and_si256(w, m2), _mm256_srl_epi64(_mm256_andnot_si256(m2, w), r2));
    w = _mm256_or_si256(_mm256_and_si256(w, m3), _mm256_srl_epi64(_mm256_andnot_si256(m3, w), r3));
    alignas(32) uint64_t g[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(g), w);
    for (int u = 0; u < 4; ++u) put_group(codes, i / 8 + u, b, cap, g[u]);
  }
  return i;
}

}  // namespace

int64_t dither_payload_bytes(int64_t n, int64_t s) { return kDitherHeader + code_bytes(n, bits_for(s)); }

void dither_encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  auto* out = static_cast<uint8_t*>(payload);
  const int b = bits_for(p.s);
  const int64_t cap = code_bytes(n, b);
  uint8_t* codes = out + kDitherHeader;
  std::memset(out, 0, kDitherHeader);
  const uint32_t t = payload_tag(kDither, d);
  std::memcpy(out, &t, 4);
  out[4] = static_cast<uint8_t>(p.s);
  out[5] = static_cast<uint8_t>(p.partition);
  out[6] = static_cast<uint8_t>(p.normalize);
  const bool natural = p.partition == kNaturalLevels;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    const Stats st = stats(xs, n, p.normalize != kMax);
    float norm = dither_norm(st, n, p);
    std::memcpy(out + 8, &norm, 4);
    if (!(norm > 0.0f) || !std::isfinite(norm)) {  // zero or broken: every code is level 0
      uint64_t w = 0;
      for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>(p.s) << (j * b);
      for (int64_t g = 0; g < (n + 7) / 8; ++g) put_group(codes, g, b, cap, w);
    } else {
      const float sf = static_cast<float>(p.s), inv = 1.0f / norm, scale = sf / norm;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {
        if (!natural && cpu_has_avx2_f16c())
          i = dither_linear_f32_avx2(xs, n, scale, p.s, p.seed, b, cap, codes);
      }
      for (; i < n; i += 8) {
        uint64_t w = 0;
        for (int64_t j = i; j < std::min(n, i + 8); ++j) {
          const float v = static_cast<float>(to_acc(xs[j]));
          const float u = uniform(p.seed, j);
          const int32_t l = natural ? natural_level(std::min(std::fabs(v) * inv, 1.0f), u, p.s)
                                    : linear_level(std::min(std::fabs(v) * scale, sf), u);
          const int64_t c = v < 0.0f ? p.s - l : p.s + l;
          w |= static_cast<uint64_t>(c) << ((j - i) * b);
        }
        put_group(codes, i / 8, b, cap, w);
      }
    }
    std::fill(codes + (n + 7) / 8 * b, codes + cap, uint8_t(0));
  });
}

// Sum over ranks of alpha * D(payload_r), accumulated in the gradient's accumulator type.
void dither_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                      const Params& p, void* out, double alpha, bool acc) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  const int b = bits_for(p.s);
  const int64_t cap = code_bytes(n, b);
  for (int64_t r = 0; r < ranks; ++r) {
    const uint8_t* h = base + r * stride;
    check_tag(h, kDither, d, r);
    if (h[4] != p.s || h[5] != p.partition || h[6] != p.normalize)
      throw KernelError("dithering payload from rank " + std::to_string(r) + " has s=" +
                        std::to_string(h[4]) + " partition=" + std::to_string(h[5]) +
                        " normalize=" + std::to_string(h[6]) + ", this rank s=" +
                        std::to_string(p.s) + " partition=" + std::to_string(p.partition) +
                        " normalize=" + std::to_string(p.normalize));
  }
  // Decoded value of every code, per rank (its norm scales the levels), made once up front.
  const int64_t nc = 2 * p.s + 1;
  std::vector<float> table(static_cast<size_t>(ranks * nc));
  for (int64_t r = 0; r < ranks; ++r) {
    float norm;
    std::memcpy(&norm, base + r * stride + 8, 4);
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t l = c >= p.s ? c - p.s : p.s - c;
      const float m = dither_magnitude(l, p.s, p.partition == kNaturalLevels, norm);
      table[r * nc + c] = c < p.s ? -m : m;
    }
  }
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    const A al = static_cast<A>(alpha);
    std::vector<A> sum(8 * 512);
    for (int64_t s0 = 0; s0 < n; s0 += static_cast<int64_t>(sum.size())) {
      const int64_t len = std::min<int64_t>(static_cast<int64_t>(sum.size()), n - s0);
      for (int64_t j = 0; j < len; ++j) sum[j] = acc ? to_acc(o[s0 + j]) : A(0);
      for (int64_t r = 0; r < ranks; ++r) {
        const uint8_t* h = base + r * stride;
        const float* lv = table.data() + r * nc;
        const uint8_t* codes = h + kDitherHeader;
        const uint64_t mask = (uint64_t{1} << b) - 1;
        for (int64_t g = s0 / 8; g * 8 < s0 + len; ++g) {
          const uint64_t w = get_group(codes, g, b, cap);
          const int64_t lim = std::min<int64_t>(8, s0 + len - g * 8);
          for (int64_t j = 0; j < lim; ++j) {
            const uint64_t c = (w >> (j * b)) & mask;
            sum[g * 8 + j - s0] += al * static_cast<A>(lv[c]);
          }
        }
      }
      for (int64_t j = 0; j < len; ++j) o[s0 + j] = from_acc<T>(sum[j]);
    }
  });
}

int64_t natural_payload_bytes(int64_t n) { return kNaturalHeader + (n + 7) / 8 * 8; }

void natural_encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  auto* out = static_cast<uint8_t*>(payload);
  uint8_t* codes = out + kNaturalHeader;
  const uint32_t t = payload_tag(kNatural, d);
  std::memcpy(out, &t, 4);
  std::fill(codes + n, codes + (n + 7) / 8 * 8, uint8_t(0));
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    double mx = 0.0;
    bool finite = true;
    for (int64_t i = 0; i < n; ++i) {
      const double v = std::fabs(static_cast<double>(to_acc(xs[i])));
      if (!std::isfinite(v)) finite = false;
      mx = v > mx ? v : mx;
    }
    int32_t top = 0;
    if (!finite) top = std::numeric_limits<int32_t>::min();
    else if (mx > 0.0) top = std::ilogb(mx) + 1;
    std::memcpy(out + 4, &top, 4);
    if (!finite || mx == 0.0) {
      std::fill(codes, codes + n, uint8_t(0));
      return;
    }
    const int32_t lowest = std::max(top - 126, -1022);
    const double lowest_v = std::ldexp(1.0, lowest);
    for (int64_t i = 0; i < n; ++i)
      codes[i] = natural_code(static_cast<double>(to_acc(xs[i])), uniform(p.seed, i), top, lowest,
                              lowest_v);
  });
}

void natural_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                       void* out, double alpha, bool acc) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  for (int64_t r = 0; r < ranks; ++r) check_tag(base + r * stride, kNatural, d, r);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    const A al = static_cast<A>(alpha);
    std::vector<A> sum(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) sum[j] = acc ? to_acc(o[j]) : A(0);
    A lv[256];
    for (int64_t r = 0; r < ranks; ++r) {
      const uint8_t* h = base + r * stride;
      int32_t top;
      std::memcpy(&top, h + 4, 4);
      for (int c = 0; c < 256; ++c) {
        const int mag = c & 0x7f;
        A m = top == std::numeric_limits<int32_t>::min()
                  ? std::numeric_limits<A>::quiet_NaN()
                  : mag == 0 ? A(0) : static_cast<A>(std::ldexp(1.0, top - 127 + mag));
        lv[c] = c & 0x80 ? -m : m;
      }
      const uint8_t* codes = h + kNaturalHeader;
      for (int64_t j = 0; j < n; ++j) sum[j] += al * lv[codes[j]];
    }
    for (int64_t j = 0; j < n; ++j) o[j] = from_acc<T>(sum[j]);
  });
}

}  // namespace quant
}  // namespace hvdc
