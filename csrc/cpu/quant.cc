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

// With y, the statistics of x + y (error feedback's sum, never stored).
__attribute__((target("avx2"))) void stats_f32_avx2(const float* x, const float* y, int64_t n,
                                                    bool sums, Stats* st, int64_t* done,
                                                    double* s1, double* s2, float* mx) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  __m256d q[4] = {a[0], a[0], a[0], a[0]};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(x + i);
    __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    if (y) {
      prefetch_ahead(y + i);
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(y + i));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(y + i + 8));
    }
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
Stats stats(const T* x, const T* y, int64_t n, bool sums) {
  Stats st;
  double s1[kSumLanes] = {0}, s2[kSumLanes] = {0};
  float mx = 0.0f;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c()) stats_f32_avx2(x, y, n, sums, &st, &i, s1, s2, &mx);
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(to_acc(y ? ef_sum(x[i], y[i]) : x[i]));
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
// With y, codes x + y. With resid, also resid = v + alpha * values[code] for the coded v
// (error feedback's decode, fused: the rounding of dither_aggregate's accumulation for one
// rank); resid may be x or y. A linear level's value is computed, not looked up: code - s as a
// float times q = norm / s is the table's l * q with its sign, bit for bit, and a gather costs
// more than the multiply. B, the code width, is a template argument: its shifts are then
// immediates and the group offsets constant multiples, which frees the registers the loop spilled.
template <int B>
__attribute__((target("avx2"))) int64_t dither_linear_f32_avx2(const float* x, const float* y,
                                                               int64_t n, float scale, int64_t s,
                                                               uint64_t seed, int64_t cap,
                                                               uint8_t* codes, float* resid,
                                                               float q, float alpha) {
  // A residual that fills no cache is written past it: no read for ownership.
  const bool stream = resid && stream_later(resid, 4 * n);
  const __m256 valpha = _mm256_set1_ps(alpha), vq = _mm256_set1_ps(q);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 vscale = _mm256_set1_ps(scale), sf = _mm256_set1_ps(static_cast<float>(s));
  const __m256i vs = _mm256_set1_epi32(static_cast<int32_t>(s));
  const __m256i m1 = _mm256_set1_epi64x(0x00ff00ff00ff00ffLL);
  const __m256i m2 = _mm256_set1_epi64x(0x0000ffff0000ffffLL);
  const __m256i m3 = _mm256_set1_epi64x(0x00000000ffffffffLL);
  const __m256i step8 = _mm256_set1_epi32(static_cast<int32_t>(8u * 0x9e3779b1u));
  __m256i key = uniform_keys8(seed, 0);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(x + i);
    if (y) prefetch_ahead(y + i);
    __m256i c[4];
    __m256 us[4];
    uniform16(seed, key, &us[0], &us[1]);
    key = _mm256_add_epi32(key, step8);
    uniform16(seed, key, &us[2], &us[3]);
    key = _mm256_add_epi32(key, step8);
    for (int u = 0; u < 4; ++u) {
      __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      if (y) v = _mm256_add_ps(v, _mm256_loadu_ps(y + i + 8 * u));
      const __m256 t = _mm256_min_ps(_mm256_mul_ps(_mm256_and_ps(v, absmask), vscale), sf);
      const __m256 f = _mm256_floor_ps(t);
      const __m256 up = _mm256_cmp_ps(us[u], _mm256_sub_ps(t, f), _CMP_LT_OQ);
      // level = f + up (up is all-ones = -1 as an integer); code = s +- level by the sign bit
      // (-0 has level 0, so either choice is s).
      const __m256i l = _mm256_sub_epi32(_mm256_cvttps_epi32(f), _mm256_castps_si256(up));
      c[u] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_add_epi32(vs, l)),
                                                  _mm256_castsi256_ps(_mm256_sub_epi32(vs, l)), v));
      if (resid) {
        const __m256 dv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c[u], vs)), vq);
        const __m256 r = _mm256_add_ps(v, _mm256_mul_ps(valpha, dv));
        if (stream) _mm256_stream_ps(resid + i + 8 * u, r);
        else _mm256_storeu_ps(resid + i + 8 * u, r);
      }
    }
    __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    w = _mm256_or_si256(_mm256_and_si256(w, m1), _mm256_srli_epi64(_mm256_andnot_si256(m1, w), 8 - B));
    w = _mm256_or_si256(_mm256_and_si256(w, m2),
                        _mm256_srli_epi64(_mm256_andnot_si256(m2, w), 16 - 2 * B));
    w = _mm256_or_si256(_mm256_and_si256(w, m3),
                        _mm256_srli_epi64(_mm256_andnot_si256(m3, w), 32 - 4 * B));
    alignas(32) uint64_t g[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(g), w);
    for (int u = 0; u < 4; ++u) put_group(codes, i / 8 + u, B, cap, g[u]);
  }
  if (stream) _mm_sfence();
  return i;
}

// dither_linear_f32_avx2 by code width b (2 to 8: s from 1 to 127).
using LinearCoder = int64_t (*)(const float*, const float*, int64_t, float, int64_t, uint64_t,
                                int64_t, uint8_t*, float*, float, float);
constexpr LinearCoder kLinearCoders[9] = {
    nullptr, nullptr, dither_linear_f32_avx2<2>, dither_linear_f32_avx2<3>,
    dither_linear_f32_avx2<4>, dither_linear_f32_avx2<5>, dither_linear_f32_avx2<6>,
    dither_linear_f32_avx2<7>, dither_linear_f32_avx2<8>};

// Elements per chunk of the float32 natural encoder (see natural_encode_f32): its input stays
// in L1 between the max and the coding pass.
constexpr int64_t kNaturalChunk = 4096;

// natural, float32 input: max|x| as the largest magnitude bit pattern. For non-negative floats
// integer order is value order, and NaN and Inf patterns lie above every finite one, so one
// integer max gives both the maximum and whether everything is finite.
__attribute__((target("avx2"))) uint32_t natural_max_bits_f32_avx2(const float* x, int64_t n) {
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  __m256i m[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                  _mm256_setzero_si256()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(x + i);
    prefetch_ahead(x + i + 16);
    for (int u = 0; u < 4; ++u) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8 * u));
      m[u] = _mm256_max_epi32(m[u], _mm256_and_si256(v, absmask));
    }
  }
  alignas(32) uint32_t mm[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(mm),
                     _mm256_max_epi32(_mm256_max_epi32(m[0], m[1]), _mm256_max_epi32(m[2], m[3])));
  uint32_t mx = 0;
  for (int u = 0; u < 8; ++u) mx = std::max(mx, mm[u]);
  for (; i < n; ++i) mx = std::max(mx, f32_bits(x[i]) & 0x7fffffffu);
  return mx;
}

// natural_code() for finite float32 x with max|x| > 0, 32 codes per step. On a normal float
// the double arithmetic of natural_code() is exact in its bits: frexp's exponent is the biased
// exponent E - 126 and 2m - 1 is the mantissa field M / 2^23, so c = E - top + (u < 2m - 1),
// and with u = k / 2^16 from the hash, u < 2m - 1 is k * 128 < M. Zeros code as 0 (whatever
// their sign). A group of 8 holding any other value below the lowest binade (rounded between 0
// and the lowest level, or a float subnormal) is redone by natural_code(): gradients hold
// hardly any. Codes elements [i0, i1); i0 is a multiple of 32.
__attribute__((target("avx2"))) void natural_codes_f32_avx2(const float* x, int64_t i0, int64_t i1,
                                                           uint64_t seed, int32_t top,
                                                           uint8_t* codes) {
  const int32_t lowest = top - 126;  // above -1022 for any float32 maximum
  const double lowest_v = std::ldexp(1.0, lowest);
  // Bits of lowest_v when it is a normal float; else of the smallest normal float.
  const __m256i binade_from = _mm256_set1_epi32(lowest >= -126 ? (lowest + 127) << 23 : 0x00800000);
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff), mant = _mm256_set1_epi32(0x7fffff);
  const __m256i kmask = _mm256_set1_epi32(0xffff << 7), vtop = _mm256_set1_epi32(top);
  const __m256i signbit = _mm256_set1_epi32(0x80), zero = _mm256_setzero_si256();
  const __m256i step8 = _mm256_set1_epi32(static_cast<int32_t>(8u * 0x9e3779b1u));
  __m256i key = uniform_keys8(seed, (i0 >> 4) << 3);
  int64_t i = i0;
  for (; i + 32 <= i1; i += 32) {
    // The next chunk, so that memory keeps streaming while this one is coded.
    __builtin_prefetch(x + i + kNaturalChunk, 0, 3);
    __builtin_prefetch(x + i + kNaturalChunk + 16, 0, 3);
    __m256i k7[4];  // k * 128 of each element's u = k / 2^16
    for (int h = 0; h < 2; ++h) {
      const __m256i w = uniform_hash8(seed, key);
      key = _mm256_add_epi32(key, step8);
      k7[2 * h] = _mm256_and_si256(_mm256_slli_epi32(w, 7), kmask);
      k7[2 * h + 1] = _mm256_and_si256(_mm256_srli_epi32(w, 9), kmask);
    }
    __m256i c[4], low[4];
    for (int u = 0; u < 4; ++u) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8 * u));
      const __m256i a = _mm256_and_si256(v, absmask);
      const __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(a, mant), k7[u]);
      const __m256i binade = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_srli_epi32(a, 23), vtop), up);
      const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(v, 24), signbit);
      const __m256i is_zero = _mm256_cmpeq_epi32(a, zero);
      c[u] = _mm256_andnot_si256(is_zero, _mm256_or_si256(binade, sign));
      low[u] = _mm256_andnot_si256(is_zero, _mm256_cmpgt_epi32(binade_from, a));
    }
    __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), w);
    const __m256i any_low =
        _mm256_or_si256(_mm256_or_si256(low[0], low[1]), _mm256_or_si256(low[2], low[3]));
    if (!_mm256_testz_si256(any_low, any_low)) {
      for (int u = 0; u < 4; ++u) {
        if (_mm256_testz_si256(low[u], low[u])) continue;
        for (int64_t j = i + 8 * u; j < i + 8 * u + 8; ++j)
          codes[j] = natural_code(x[j], uniform(seed, j), top, lowest, lowest_v);
      }
    }
  }
  for (; i < i1; ++i) codes[i] = natural_code(x[i], uniform(seed, i), top, lowest, lowest_v);
}

// natural codes of float32 x in about one pass: each chunk (cache-resident) takes its max, then
// is coded with the top of the max so far. Chunks coded before the last change of top are coded
// again once it is final; a gradient usually reaches its top binade within its first chunks,
// and at worst x is read twice, as with a separate max pass. Returns top (see natural_encode).
int32_t natural_encode_f32(const float* x, int64_t n, uint64_t seed, uint8_t* codes) {
  uint32_t mx = 0;  // max |x| so far, as bits
  int32_t top = 0;
  int64_t stale = 0;  // elements before this were coded with an older top
  for (int64_t s = 0; s < n; s += kNaturalChunk) {
    const int64_t e = std::min(n, s + kNaturalChunk);
    const uint32_t m = natural_max_bits_f32_avx2(x + s, e - s);
    if (m >= 0x7f800000u) {
      std::fill(codes, codes + n, uint8_t(0));
      return std::numeric_limits<int32_t>::min();
    }
    if (m > mx) {
      mx = m;
      const int32_t t = std::ilogb(static_cast<double>(bits_f32(mx))) + 1;
      if (t != top) stale = s;
      top = t;
    }
    if (mx == 0) std::fill(codes + s, codes + e, uint8_t(0));  // zeros code as 0 for any top
    else natural_codes_f32_avx2(x, s, e, seed, top, codes);
  }
  if (stale > 0) natural_codes_f32_avx2(x, 0, stale, seed, top, codes);
  return top;
}

// The tops for which natural_bits8() gives every code's table value: 2^(top - 127 + c) of
// c <= 127 stays at or under 2^128, whose float is inf, and top - 127 + c cannot overflow.
constexpr int32_t kNaturalTopLo = -1000, kNaturalTopHi = 128;

// The float bits of the table value of 8 codes under top (in kNaturalTop*): the float of
// 2^(e - 127), e = top + c, is e << 23 when normal (e >= 1; e = 255 is inf), else the
// subnormal 2^(e + 22) ulps, and 0 from e = -23 on down (2^-150 ties to even); sllv gives 0
// for those counts. c = 0 is a zero with the code's sign.
__attribute__((target("avx2"))) inline __m256 natural_bits8(__m256i code, __m256i vtop) {
  const __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  const __m256i e = _mm256_add_epi32(vtop, mag);
  const __m256i normal = _mm256_slli_epi32(e, 23);
  const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(e, _mm256_set1_epi32(22)));
  __m256i bits = _mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(e, _mm256_setzero_si256()));
  bits = _mm256_andnot_si256(_mm256_cmpeq_epi32(mag, _mm256_setzero_si256()), bits);
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

// out (+)= sum over ranks of alpha * lv_r[code], rank 0 first, per element as the scalar loop
// does; codes[r] is rank r's first code. kBits: each value is made from tops[r] by
// natural_bits8() (a gather costs more), else looked up in lv, each rank's 256-entry decode
// table. Covers whole steps up to n; returns how far it got.
template <bool kBits>
__attribute__((target("avx2"))) int64_t natural_sum_f32_avx2(const uint8_t* const* codes,
                                                            int64_t ranks, int64_t n,
                                                            const float* lv, const int32_t* tops,
                                                            float al, bool acc, bool stream,
                                                            float* out, uint32_t* seen) {
  const __m256 va = _mm256_set1_ps(al);
  __m256i sv = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 s[4];
    for (int u = 0; u < 4; ++u) s[u] = acc ? _mm256_loadu_ps(out + i + 8 * u) : _mm256_setzero_ps();
    for (int64_t r = 0; r < ranks; ++r) {
      const uint8_t* step = codes[r] + i;
      prefetch_ahead(step);
      const __m256i vtop = _mm256_set1_epi32(kBits ? tops[r] : 0);
      for (int u = 0; u < 4; ++u) {
        const __m256i c =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(step + 8 * u)));
        const __m256 v = kBits ? natural_bits8(c, vtop) : _mm256_i32gather_ps(lv + 256 * r, c, 4);
        s[u] = _mm256_add_ps(s[u], _mm256_mul_ps(va, v));
      }
    }
    for (int u = 0; u < 4; ++u) {
      sv = seen_abs8(sv, s[u]);
      if (stream) _mm256_stream_ps(out + i + 8 * u, s[u]);
      else _mm256_storeu_ps(out + i + 8 * u, s[u]);
    }
  }
  *seen = seen_max8(*seen, sv);
  return i;
}

}  // namespace

int64_t dither_payload_bytes(int64_t n, int64_t s) { return kDitherHeader + code_bytes(n, bits_for(s)); }

namespace {
// The decoded value of every code 0..2s under this norm.
void dither_values(float norm, const Params& p, float* values) {
  for (int64_t c = 0; c <= 2 * p.s; ++c) {
    const int64_t l = c >= p.s ? c - p.s : p.s - c;
    const float m = dither_magnitude(l, p.s, p.partition == kNaturalLevels, norm);
    values[c] = c < p.s ? -m : m;
  }
}

// dither_encode of x, or with y of ef_sum(x, y); with resid, also resid = that + alpha *
// D(payload) as it codes, to the bits of dither_aggregate(payload, ranks 1, acc) into it.
void dither_code(DType d, const void* x, const void* y, int64_t n, const Params& p,
                 void* payload, void* resid, double alpha) {
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
    const T* ys = static_cast<const T*>(y);
    using A = typename Acc<T>::type;
    T* rs = static_cast<T*>(resid);
    const A al = static_cast<A>(alpha);
    auto value = [&](int64_t j) { return ys ? ef_sum(xs[j], ys[j]) : xs[j]; };
    const Stats st = stats(xs, ys, n, p.normalize != kMax);
    float norm = dither_norm(st, n, p);
    std::memcpy(out + 8, &norm, 4);
    std::vector<float> values(rs ? static_cast<size_t>(2 * p.s + 1) : 0);
    if (rs) dither_values(norm, p, values.data());
    auto settle = [&](int64_t j, T v, int64_t c) {
      rs[j] = from_acc<T>(to_acc(v) + al * static_cast<A>(values[c]));
    };
    if (!(norm > 0.0f) || !std::isfinite(norm)) {  // zero or broken: every code is level 0
      uint64_t w = 0;
      for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>(p.s) << (j * b);
      for (int64_t g = 0; g < (n + 7) / 8; ++g) {
        const int64_t k = std::min<int64_t>(8, n - g * 8);  // past n, codes stay 0
        put_group(codes, g, b, cap, k == 8 ? w : w & ((uint64_t{1} << (k * b)) - 1));
      }
      if (rs)
        for (int64_t j = 0; j < n; ++j) settle(j, value(j), p.s);
    } else {
      const float sf = static_cast<float>(p.s), inv = 1.0f / norm, scale = sf / norm;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {
        if (!natural && cpu_has_avx2_f16c())
          i = kLinearCoders[b](xs, ys, n, scale, p.s, p.seed, cap, codes, rs, norm / sf, al);
      }
      for (; i < n; i += 8) {
        uint64_t w = 0;
        for (int64_t j = i; j < std::min(n, i + 8); ++j) {
          const T xv = value(j);
          const float v = static_cast<float>(to_acc(xv));
          const float u = uniform(p.seed, j);
          const int32_t l = natural ? natural_level(std::min(std::fabs(v) * inv, 1.0f), u, p.s)
                                    : linear_level(std::min(std::fabs(v) * scale, sf), u);
          const int64_t c = v < 0.0f ? p.s - l : p.s + l;
          w |= static_cast<uint64_t>(c) << ((j - i) * b);
          if (rs) settle(j, xv, c);
        }
        put_group(codes, i / 8, b, cap, w);
      }
    }
    std::fill(codes + (n + 7) / 8 * b, codes + cap, uint8_t(0));
  });
}
// dither_sum for float32, 32 elements per step, each element as its scalar loop does (rank 0
// first; alpha * value, then the add); codes[r] is rank r's first group. Codes are unpacked
// without leaving SIMD: a code of b <= 8 bits at bit j * b of its group lies in the two bytes
// from (j * b) / 8, which a byte shuffle moves into lane j, and a variable shift by (j * b) % 8
// aligns. Natural levels are looked up in lv, 1 << b values per rank. Linear levels are
// computed from each rank's q[r] = norm / s (as in dither_linear_f32_avx2), and a code above 2s,
// which no encoder makes, decodes to NaN as lv has it, so that a damaged payload shows. Each
// group is read as 8 bytes: covers the whole steps up to `whole` elements, which the caller
// bounds; returns how far it got.
template <bool kLinear>
__attribute__((target("avx2"))) int64_t dither_sum_f32_avx2(const uint8_t* const* codes,
                                                           int64_t ranks, int64_t whole, int b,
                                                           int64_t s, const float* lv,
                                                           const float* q, float al, bool acc,
                                                           bool stream, float* out,
                                                           uint32_t* seen) {
  alignas(32) int8_t pick[32];
  alignas(32) int32_t shift[8];
  for (int j = 0; j < 8; ++j) {
    for (int k = 0; k < 4; ++k)
      pick[(j / 4) * 16 + (j % 4) * 4 + k] = static_cast<int8_t>(k < 2 ? (j * b) / 8 + k : -1);
    shift[j] = (j * b) % 8;
  }
  const __m256i vpick = _mm256_load_si256(reinterpret_cast<const __m256i*>(pick));
  const __m256i vshift = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift));
  const __m256i mask = _mm256_set1_epi32((1 << b) - 1);
  const __m256 va = _mm256_set1_ps(al);
  const __m256i vs = _mm256_set1_epi32(static_cast<int32_t>(s)),
                top = _mm256_set1_epi32(static_cast<int32_t>(2 * s));
  __m256i sv = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= whole; i += 32) {
    __m256 sum[4];
    for (int u = 0; u < 4; ++u) sum[u] = acc ? _mm256_loadu_ps(out + i + 8 * u) : _mm256_setzero_ps();
    for (int64_t r = 0; r < ranks; ++r) {
      const uint8_t* step = codes[r] + i / 8 * b;
      prefetch_ahead(step);
      const __m256 vq = _mm256_set1_ps(kLinear ? q[r] : 0.0f);
      for (int u = 0; u < 4; ++u) {
        const __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(step + u * b));
        __m256i c = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(w), vpick);
        c = _mm256_and_si256(_mm256_srlv_epi32(c, vshift), mask);
        __m256 v;
        if constexpr (kLinear) {
          v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, vs)), vq);
          v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, top)));
        } else {
          v = _mm256_i32gather_ps(lv + (r << b), c, 4);
        }
        sum[u] = _mm256_add_ps(sum[u], _mm256_mul_ps(va, v));
      }
    }
    for (int u = 0; u < 4; ++u) {
      sv = seen_abs8(sv, sum[u]);
      if (stream) _mm256_stream_ps(out + i + 8 * u, sum[u]);
      else _mm256_storeu_ps(out + i + 8 * u, sum[u]);
    }
  }
  *seen = seen_max8(*seen, sv);
  return i;
}

void check_dither_header(const uint8_t* h, DType d, const Params& p, int64_t r) {
  check_tag(h, kDither, d, r);
  if (h[4] != p.s || h[5] != p.partition || h[6] != p.normalize)
    throw KernelError("dithering payload from rank " + std::to_string(r) + " has s=" +
                      std::to_string(h[4]) + " partition=" + std::to_string(h[5]) +
                      " normalize=" + std::to_string(h[6]) + ", this rank s=" +
                      std::to_string(p.s) + " partition=" + std::to_string(p.partition) +
                      " normalize=" + std::to_string(p.normalize));
}

// Sum over ranks of alpha * D(payload_r) from rows[r], accumulated in the gradient's
// accumulator type. With summed (two ranks, gather_rows' int32 sum of both payloads' words),
// rank `other`'s payload is that sum minus the other rank's: rows[other] then holds only its
// 16-byte header, and its codes are taken off the sum where they are read. Returns the largest
// |out| bit pattern (see seen_abs) for float32 out, else 0.
uint32_t dither_sum(DType d, const uint8_t* const* rows, int64_t ranks, const uint8_t* summed,
                int64_t other, int64_t n, const Params& p, void* out, double alpha, bool acc) {
  const int b = bits_for(p.s);
  const int64_t cap = code_bytes(n, b);
  for (int64_t r = 0; r < ranks; ++r) check_dither_header(rows[r], d, p, r);
  // Decoded value of every code, per rank (its norm scales the levels), made once up front. A
  // rank's row has all 1 << b codes a payload can hold: those above 2s, which no encoder
  // makes, decode to NaN, so that a damaged payload shows.
  const int64_t nc = int64_t{1} << b;
  std::vector<float> table(static_cast<size_t>(ranks * nc), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> q(static_cast<size_t>(ranks));
  for (int64_t r = 0; r < ranks; ++r) {
    float norm;
    std::memcpy(&norm, rows[r] + 8, 4);
    dither_values(norm, p, table.data() + r * nc);
    q[r] = norm / static_cast<float>(p.s);
  }
  uint32_t seen = 0;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    const A al = static_cast<A>(alpha);
    int64_t done = 0;
    if constexpr (std::is_same_v<T, float>) {
      if (cpu_has_avx2_f16c()) {
        const bool linear = p.partition != kNaturalLevels;
        auto sum_f32 = [&](const uint8_t* const* c, int64_t k, int64_t len, bool stream, float* to) {
          return linear ? dither_sum_f32_avx2<true>(c, k, len, b, p.s, table.data(), q.data(), al,
                                                    acc, stream, to, &seen)
                        : dither_sum_f32_avx2<false>(c, k, len, b, p.s, table.data(), q.data(), al,
                                                     acc, stream, to, &seen);
        };
        // The steps whose groups' 8-byte loads stay inside the codes.
        const int64_t whole = std::min(n, (cap - 8) / b * 8 + 8);
        const bool stream = !acc && stream_later(o, 4 * whole);
        std::vector<const uint8_t*> codes(static_cast<size_t>(ranks));
        for (int64_t r = 0; r < ranks; ++r) codes[r] = rows[r] + kDitherHeader;
        if (!summed) {
          done = sum_f32(codes.data(), ranks, whole, stream, o);
        } else {
          alignas(32) uint8_t theirs[kPairBlock + 8] = {};  // + a group's 8-byte load past b bytes
          for (int64_t s0 = 0; s0 + 32 <= whole; s0 += kPairBlock) {
            const int64_t len = std::min(kPairBlock, (whole - s0) / 32 * 32);
            const int64_t at = kDitherHeader + s0 / 8 * b;
            subtract_words(summed + at, rows[1 - other] + at, len / 8 * b, theirs);
            codes[1 - other] = rows[1 - other] + at;
            codes[other] = theirs;
            done += sum_f32(codes.data(), 2, len, stream, o + s0);
          }
        }
        if (stream) _mm_sfence();
      }
    }
    // The rest from each rank's codes of group done / 8 on; the other rank's taken off the sum
    // here (from a whole word: done / 8 * b is a multiple of 4).
    const int64_t from = kDitherHeader + done / 8 * b, left = cap - done / 8 * b;
    std::vector<const uint8_t*> codes(static_cast<size_t>(ranks));
    std::vector<uint8_t> theirs;
    for (int64_t r = 0; r < ranks; ++r) codes[r] = rows[r] + from;
    if (summed && left > 0) {
      theirs.resize(static_cast<size_t>(left));
      subtract_words(summed + from, rows[1 - other] + from, left, theirs.data());
      codes[other] = theirs.data();
    }
    const int64_t g0 = done / 8;
    const uint64_t mask = (uint64_t{1} << b) - 1;
    std::vector<A> sum(8 * 512);
    for (int64_t s0 = done; s0 < n; s0 += static_cast<int64_t>(sum.size())) {
      const int64_t len = std::min<int64_t>(static_cast<int64_t>(sum.size()), n - s0);
      for (int64_t j = 0; j < len; ++j) sum[j] = acc ? to_acc(o[s0 + j]) : A(0);
      for (int64_t r = 0; r < ranks; ++r) {
        const float* lv = table.data() + r * nc;
        for (int64_t g = s0 / 8; g * 8 < s0 + len; ++g) {
          const uint64_t w = get_group(codes[r], g - g0, b, left);
          const int64_t lim = std::min<int64_t>(8, s0 + len - g * 8);
          for (int64_t j = 0; j < lim; ++j) {
            const uint64_t c = (w >> (j * b)) & mask;
            sum[g * 8 + j - s0] += al * static_cast<A>(lv[c]);
          }
        }
      }
      for (int64_t j = 0; j < len; ++j) {
        o[s0 + j] = from_acc<T>(sum[j]);
        if constexpr (std::is_same_v<T, float>) seen = seen_abs(seen, o[s0 + j]);
      }
    }
  });
  return seen;
}
}  // namespace

void dither_encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  dither_code(d, x, nullptr, n, p, payload, nullptr, 0.0);
}

void dither_ef_encode(DType d, const void* x, const void* e_in, void* e, int64_t n,
                      const Params& p, void* payload, double alpha) {
  dither_code(d, x, e_in, n, p, payload, e, alpha);
}

void dither_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                      const Params& p, void* out, double alpha, bool acc, bool* finite) {
  std::vector<const uint8_t*> rows(static_cast<size_t>(ranks));
  for (int64_t r = 0; r < ranks; ++r) rows[r] = static_cast<const uint8_t*>(payloads) + r * stride;
  const uint32_t seen = dither_sum(d, rows.data(), ranks, nullptr, -1, n, p, out, alpha, acc);
  if (finite) *finite = d == kF32 ? seen < kInfBits : all_finite(d, out, n);
}

void dither_aggregate_pair(DType d, const void* own, const int32_t* summed, int64_t rank,
                           int64_t n, const Params& p, void* out, double alpha, bool* finite) {
  const auto* mine = static_cast<const uint8_t*>(own);
  const auto* sum = reinterpret_cast<const uint8_t*>(summed);
  uint8_t header[kDitherHeader];
  subtract_words(sum, mine, kDitherHeader, header);
  const uint8_t* rows[2];
  rows[rank] = mine;
  rows[1 - rank] = header;
  const uint32_t seen = dither_sum(d, rows, 2, sum, 1 - rank, n, p, out, alpha, false);
  if (finite) *finite = d == kF32 ? seen < kInfBits : all_finite(d, out, n);
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
    if constexpr (std::is_same_v<T, float>) {
      if (cpu_has_avx2_f16c()) {
        const int32_t top = natural_encode_f32(xs, n, p.seed, codes);
        std::memcpy(out + 4, &top, 4);
        return;
      }
    }
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

namespace {
// Sum over ranks of alpha * D(payload_r) from rows[r], in the accumulator type; with summed, as
// dither_sum: rank `other`'s payload is the word sum minus the other rank's (rows[other] its
// 8-byte header only). Returns the largest |out| bit pattern as dither_sum does.
uint32_t natural_sum(DType d, const uint8_t* const* rows, int64_t ranks, const uint8_t* summed,
                     int64_t other, int64_t n, void* out, double alpha, bool acc) {
  for (int64_t r = 0; r < ranks; ++r) check_tag(rows[r], kNatural, d, r);
  uint32_t seen = 0;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    const A al = static_cast<A>(alpha);
    // Decoded value of every code, per rank, made once up front.
    std::vector<A> lv(static_cast<size_t>(256 * ranks));
    std::vector<int32_t> tops(static_cast<size_t>(ranks));
    bool bits = true;
    for (int64_t r = 0; r < ranks; ++r) {
      int32_t& top = tops[r];
      std::memcpy(&top, rows[r] + 4, 4);
      bits = bits && top >= kNaturalTopLo && top <= kNaturalTopHi;
      for (int c = 0; c < 256; ++c) {
        const int mag = c & 0x7f;
        A m = top == std::numeric_limits<int32_t>::min()
                  ? std::numeric_limits<A>::quiet_NaN()
                  : mag == 0 ? A(0) : static_cast<A>(std::ldexp(1.0, top - 127 + mag));
        lv[256 * r + c] = c & 0x80 ? -m : m;
      }
    }
    std::vector<const uint8_t*> codes(static_cast<size_t>(ranks));
    for (int64_t r = 0; r < ranks; ++r) codes[r] = rows[r] + kNaturalHeader;
    int64_t done = 0;
    if constexpr (std::is_same_v<T, float>) {
      if (cpu_has_avx2_f16c()) {
        const bool stream = !acc && stream_later(o, 4 * n);
        auto sum_f32 = [&](const uint8_t* const* c, int64_t k, int64_t len, float* to) {
          return bits ? natural_sum_f32_avx2<true>(c, k, len, lv.data(), tops.data(), al, acc,
                                                   stream, to, &seen)
                      : natural_sum_f32_avx2<false>(c, k, len, lv.data(), tops.data(), al, acc,
                                                    stream, to, &seen);
        };
        if (!summed) {
          done = sum_f32(codes.data(), ranks, n, o);
        } else {  // a block of the other rank's codes at a time, as in dither_sum
          alignas(32) uint8_t theirs[kPairBlock];
          const uint8_t* block[2];
          for (int64_t s0 = 0; s0 + 32 <= n; s0 += kPairBlock) {
            const int64_t len = std::min(kPairBlock, (n - s0) / 32 * 32);
            const int64_t at = kNaturalHeader + s0;
            subtract_words(summed + at, rows[1 - other] + at, len, theirs);
            block[1 - other] = rows[1 - other] + at;
            block[other] = theirs;
            done += sum_f32(block, 2, len, o + s0);
          }
        }
        if (stream) _mm_sfence();
      }
    }
    // The rest, the other rank's codes taken off the sum from a whole word (done is a multiple
    // of 32, the codes padded to 8 bytes).
    std::vector<uint8_t> theirs;
    for (int64_t r = 0; r < ranks; ++r) codes[r] += done;
    if (summed && done < n) {
      theirs.resize(static_cast<size_t>((n - done + 3) / 4 * 4));
      subtract_words(summed + kNaturalHeader + done, codes[1 - other],
                     static_cast<int64_t>(theirs.size()), theirs.data());
      codes[other] = theirs.data();
    }
    for (int64_t j = done; j < n; ++j) {
      A sum = acc ? to_acc(o[j]) : A(0);
      for (int64_t r = 0; r < ranks; ++r) sum += al * lv[256 * r + codes[r][j - done]];
      o[j] = from_acc<T>(sum);
      if constexpr (std::is_same_v<T, float>) seen = seen_abs(seen, o[j]);
    }
  });
  return seen;
}
}  // namespace

void natural_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                       void* out, double alpha, bool acc, bool* finite) {
  std::vector<const uint8_t*> rows(static_cast<size_t>(ranks));
  for (int64_t r = 0; r < ranks; ++r) rows[r] = static_cast<const uint8_t*>(payloads) + r * stride;
  const uint32_t seen = natural_sum(d, rows.data(), ranks, nullptr, -1, n, out, alpha, acc);
  if (finite) *finite = d == kF32 ? seen < kInfBits : all_finite(d, out, n);
}

void natural_aggregate_pair(DType d, const void* own, const int32_t* summed, int64_t rank,
                            int64_t n, void* out, double alpha, bool* finite) {
  const auto* mine = static_cast<const uint8_t*>(own);
  const auto* sum = reinterpret_cast<const uint8_t*>(summed);
  uint8_t header[kNaturalHeader];
  subtract_words(sum, mine, kNaturalHeader, header);
  const uint8_t* rows[2];
  rows[rank] = mine;
  rows[1 - rank] = header;
  const uint32_t seen = natural_sum(d, rows, 2, sum, 1 - rank, n, out, alpha, false);
  if (finite) *finite = d == kF32 ? seen < kInfBits : all_finite(d, out, n);
}

}  // namespace quant
}  // namespace hvdc
