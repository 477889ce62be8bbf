// Homomorphic quantisation (THC, Li et al., NSDI 2024): unsigned codes on per-block scales that
// all ranks agreed on, packed into int32 lanes wide enough for the sum of every rank's codes, so
// Horovod's int32 allreduce adds the payloads lane by lane. Arithmetic and layout are defined in
// hvdc/kernels.h; the per-element functions are in hvdc/element.h, shared with csrc/cuda.
//
// Encode and decode walk the tensor in chunks of whole words: codes (or lane sums) go through a
// buffer that stays in L1, between the arithmetic and the packing (or unpacking), so each half
// has one loop per lane count. The AVX2 paths compute the same operations in the same order as
// the scalar ones, so the payload and the decoded values are the same bits on both.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace hvdc {
namespace homo {
namespace {

// Elements per chunk: a multiple of 32 (the SIMD step) and of the lane count, at most 1024.
constexpr int64_t kMaxChunk = 1024;
int64_t chunk_for(int lanes) { return int64_t{32} * lanes * std::max(1, 32 / lanes); }

// Decoded ratios by lane sum come from a table when it is small and the tensor large enough to
// repay building it: one multiply per element instead of a division.
constexpr int64_t kMaxTable = 1 << 16;

constexpr uint32_t kCanonicalNaN = 0x7fc00000u;

// Eight elements as float32 (f16 and bf16 exactly, f64 rounded to nearest as static_cast does).
template <class T> __attribute__((target("avx2,f16c"))) inline __m256 load8(const T* p);
template <> __attribute__((target("avx2,f16c"))) inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <> __attribute__((target("avx2,f16c"))) inline __m256 load8<double>(const double* p) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)),
                         _mm256_cvtpd_ps(_mm256_loadu_pd(p)));
}
template <> __attribute__((target("avx2,f16c"))) inline __m256 load8<half_t>(const half_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <> __attribute__((target("avx2,f16c"))) inline __m256 load8<bf16_t>(const bf16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

template <class T> inline float as_f32(T v) { return static_cast<float>(to_acc(v)); }

// max |x| over n elements, whole groups of 8 only; returns how many it took.
template <class T>
__attribute__((target("avx2,f16c"))) int64_t absmax_avx2(const T* x, int64_t n, float* mx,
                                                          bool* nan) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    prefetch_ahead(x + i);
    const __m256 v = load8(x + i);
    // max_ps passes a NaN on from its second operand only: NaNs are tracked on the side.
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, _mm256_and_ps(v, absmask));
  }
  alignas(32) float mm[8];
  _mm256_store_ps(mm, m);
  for (int u = 0; u < 8; ++u) *mx = std::max(*mx, mm[u]);
  if (_mm256_movemask_ps(bad)) *nan = true;
  return i;
}

// Codes of x[i0, i0 + count) for one usable scale m, i0 and count multiples of 32 (uniform()
// hashes 16 elements at a time). Same operations as homo_code(): max_ps(t, 0) gives 0 for a NaN
// t as `t > 0 ? t : 0` does, and min_ps(t, L) is `t < L ? t : L` for the t left.
template <class T>
__attribute__((target("avx2,f16c"))) void codes_avx2(const T* x, int64_t i0, int64_t count,
                                                      float m, float h, float lf, uint64_t seed,
                                                      uint32_t* codes) {
  const __m256 vm = _mm256_set1_ps(m), vh = _mm256_set1_ps(h), vl = _mm256_set1_ps(lf);
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256i step8 = _mm256_set1_epi32(static_cast<int32_t>(8u * 0x9e3779b1u));
  __m256i key = uniform_keys8(seed, (i0 >> 4) << 3);
  for (int64_t j = 0; j < count; j += 32) {
    // every cache line the step reads (1 to 4 of them, by dtype), not just the first
    const char* lines = reinterpret_cast<const char*>(x + i0 + j);
    for (size_t b = 0; b < 32 * sizeof(T); b += 64) prefetch_ahead(lines + b);
    __m256 us[4];
    uniform16(seed, key, &us[0], &us[1]);
    key = _mm256_add_epi32(key, step8);
    uniform16(seed, key, &us[2], &us[3]);
    key = _mm256_add_epi32(key, step8);
    for (int u = 0; u < 4; ++u) {
      const __m256 v = load8(x + i0 + j + 8 * u);
      __m256 t = _mm256_mul_ps(_mm256_add_ps(_mm256_div_ps(v, vm), one), vh);
      t = _mm256_min_ps(_mm256_max_ps(t, zero), vl);
      const __m256 f = _mm256_floor_ps(t);
      const __m256 up = _mm256_cmp_ps(us[u], _mm256_sub_ps(t, f), _CMP_LT_OQ);
      // floor + 1 where rounding up (the compare mask is -1 as an integer)
      const __m256i c = _mm256_sub_epi32(_mm256_cvttps_epi32(f), _mm256_castps_si256(up));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j + 8 * u), c);
    }
  }
}

// Packing `nw` words from lanes * nw codes: code k of a word at bit k * w.
template <int Lanes> void pack_scalar(const uint32_t* codes, int64_t nw, int w, int32_t* words) {
  for (int64_t j = 0; j < nw; ++j) {
    uint32_t word = 0;
    for (int k = 0; k < Lanes; ++k) word |= codes[j * Lanes + k] << (k * w);
    words[j] = static_cast<int32_t>(word);
  }
}

// Two lanes (9 <= w <= 16), 8 words per step: in each 64-bit pair of codes (lo, hi), a 64-bit
// shift right by 32 - w puts hi at bit w of the low half (lo < 2^w shifts out to nothing);
// the low halves are then gathered in order.
__attribute__((target("avx2"))) int64_t pack2_avx2(const uint32_t* codes, int64_t nw, int w,
                                                   int32_t* words) {
  const __m128i sh = _mm_cvtsi32_si128(32 - w);
  int64_t j = 0;
  for (; j + 8 <= nw; j += 8) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 2 * j));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 2 * j + 8));
    a = _mm256_or_si256(a, _mm256_srl_epi64(a, sh));
    b = _mm256_or_si256(b, _mm256_srl_epi64(b, sh));
    const __m256 lo = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b),
                                        _MM_SHUFFLE(2, 0, 2, 0));
    const __m256i r = _mm256_permute4x64_epi64(_mm256_castps_si256(lo), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + j), r);
  }
  return j;
}

// Four lanes (w = 7 or 8), 8 words per step: codes < 2^8 narrow to bytes, four to a word in
// order; for w = 7 two shift-and-merge rounds close the gaps (byte pairs, then 16-bit halves).
__attribute__((target("avx2"))) int64_t pack4_avx2(const uint32_t* codes, int64_t nw, int w,
                                                   int32_t* words) {
  const __m128i r1 = _mm_cvtsi32_si128(8 - w), r2 = _mm_cvtsi32_si128(16 - 2 * w);
  const __m256i m1 = _mm256_set1_epi32(0x00ff00ff), m2 = _mm256_set1_epi32(0x0000ffff);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t j = 0;
  for (; j + 8 <= nw; j += 8) {
    const __m256i* c = reinterpret_cast<const __m256i*>(codes + 4 * j);
    const __m256i c0 = _mm256_loadu_si256(c), c1 = _mm256_loadu_si256(c + 1);
    const __m256i c2 = _mm256_loadu_si256(c + 2), c3 = _mm256_loadu_si256(c + 3);
    __m256i v = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    v = _mm256_permutevar8x32_epi32(v, order);
    v = _mm256_or_si256(_mm256_and_si256(v, m1), _mm256_srl_epi32(_mm256_andnot_si256(m1, v), r1));
    v = _mm256_or_si256(_mm256_and_si256(v, m2), _mm256_srl_epi32(_mm256_andnot_si256(m2, v), r2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + j), v);
  }
  return j;
}

void pack(const uint32_t* codes, int64_t nw, int w, int lanes, bool simd, int32_t* words) {
  int64_t j = 0;
  if (simd && lanes == 2) j = pack2_avx2(codes, nw, w, words);
  if (simd && lanes == 4) j = pack4_avx2(codes, nw, w, words);
  codes += j * lanes;
  words += j;
  nw -= j;
  switch (lanes) {
    case 1: return pack_scalar<1>(codes, nw, w, words);
    case 2: return pack_scalar<2>(codes, nw, w, words);
    case 3: return pack_scalar<3>(codes, nw, w, words);
    case 4: return pack_scalar<4>(codes, nw, w, words);
    case 5: return pack_scalar<5>(codes, nw, w, words);
    case 6: return pack_scalar<6>(codes, nw, w, words);
    case 8: return pack_scalar<8>(codes, nw, w, words);
    case 10: return pack_scalar<10>(codes, nw, w, words);
    case 16: return pack_scalar<16>(codes, nw, w, words);
    default: return pack_scalar<32>(codes, nw, w, words);  // w = 1
  }
}

template <int Lanes>
void unpack_scalar(const int32_t* words, int64_t nw, int w, uint32_t mask, uint32_t* sums) {
  for (int64_t j = 0; j < nw; ++j) {
    const uint32_t word = static_cast<uint32_t>(words[j]);
    for (int k = 0; k < Lanes; ++k) sums[j * Lanes + k] = (word >> (k * w)) & mask;
  }
}

// Two lanes, 8 words per step: low and high fields, interleaved back into element order.
__attribute__((target("avx2"))) int64_t unpack2_avx2(const int32_t* words, int64_t nw, int w,
                                                     uint32_t mask, uint32_t* sums) {
  const __m128i sh = _mm_cvtsi32_si128(w);
  const __m256i vmask = _mm256_set1_epi32(static_cast<int32_t>(mask));
  int64_t j = 0;
  for (; j + 8 <= nw; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + j));
    const __m256i lo = _mm256_and_si256(v, vmask);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(v, sh), vmask);
    const __m256i a = _mm256_unpacklo_epi32(lo, hi), b = _mm256_unpackhi_epi32(lo, hi);
    auto* out = reinterpret_cast<__m256i*>(sums + 2 * j);
    _mm256_storeu_si256(out, _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(a, b, 0x31));
  }
  return j;
}

// Four lanes (w <= 8), 8 words per step: each field is moved to its own byte (the inverse of
// pack4_avx2's merges), then the bytes widen to 32 bits in order.
__attribute__((target("avx2"))) int64_t unpack4_avx2(const int32_t* words, int64_t nw, int w,
                                                     uint32_t mask, uint32_t* sums) {
  const __m128i s1 = _mm_cvtsi32_si128(8 - w), s2 = _mm_cvtsi32_si128(16 - 2 * w);
  const __m256i first2 = _mm256_set1_epi32(static_cast<int32_t>((mask << w) | mask));
  const __m256i even = _mm256_set1_epi32(static_cast<int32_t>(mask * 0x00010001u));
  const __m256i bytes = _mm256_set1_epi32(static_cast<int32_t>(mask * 0x01010101u));
  const __m256i m2 = _mm256_set1_epi32(0x0000ffff), m1 = _mm256_set1_epi32(0x00ff00ff);
  int64_t j = 0;
  for (; j + 8 <= nw; j += 8) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + j));
    // fields 2 and 3 up to bit 16, then fields 1 and 3 up to bits 8 and 24; the last mask drops
    // what unused high bits of a word would have carried along
    v = _mm256_or_si256(_mm256_and_si256(v, first2),
                        _mm256_andnot_si256(m2, _mm256_sll_epi32(v, s2)));
    v = _mm256_or_si256(_mm256_and_si256(v, even),
                        _mm256_andnot_si256(m1, _mm256_sll_epi32(v, s1)));
    v = _mm256_and_si256(v, bytes);
    auto* out = reinterpret_cast<__m256i*>(sums + 4 * j);
    const __m128i l = _mm256_castsi256_si128(v), h = _mm256_extracti128_si256(v, 1);
    _mm256_storeu_si256(out, _mm256_cvtepu8_epi32(l));
    _mm256_storeu_si256(out + 1, _mm256_cvtepu8_epi32(_mm_srli_si128(l, 8)));
    _mm256_storeu_si256(out + 2, _mm256_cvtepu8_epi32(h));
    _mm256_storeu_si256(out + 3, _mm256_cvtepu8_epi32(_mm_srli_si128(h, 8)));
  }
  return j;
}

void unpack(const int32_t* words, int64_t nw, int w, int lanes, bool simd, uint32_t* sums) {
  const uint32_t mask = w == 32 ? 0xffffffffu : (1u << w) - 1;
  int64_t j = 0;
  if (simd && lanes == 2) j = unpack2_avx2(words, nw, w, mask, sums);
  if (simd && lanes == 4) j = unpack4_avx2(words, nw, w, mask, sums);
  words += j;
  sums += j * lanes;
  nw -= j;
  switch (lanes) {
    case 1: return unpack_scalar<1>(words, nw, w, mask, sums);
    case 2: return unpack_scalar<2>(words, nw, w, mask, sums);
    case 3: return unpack_scalar<3>(words, nw, w, mask, sums);
    case 4: return unpack_scalar<4>(words, nw, w, mask, sums);
    case 5: return unpack_scalar<5>(words, nw, w, mask, sums);
    case 6: return unpack_scalar<6>(words, nw, w, mask, sums);
    case 8: return unpack_scalar<8>(words, nw, w, mask, sums);
    case 10: return unpack_scalar<10>(words, nw, w, mask, sums);
    case 16: return unpack_scalar<16>(words, nw, w, mask, sums);
    default: return unpack_scalar<32>(words, nw, w, mask, sums);
  }
}

// float32 output of a block with a usable scale m, 8 elements per step: ratio from the table
// (the last entry, NaN, stands for every sum above summands * levels), times m in double,
// rounded to float, times alpha (plus out).
__attribute__((target("avx2"))) int64_t values_f32_avx2(const uint32_t* sums, int64_t count,
                                                        const double* table, uint32_t last,
                                                        float m, float al, bool acc, float* o) {
  const __m256d vm = _mm256_set1_pd(static_cast<double>(m));
  const __m256 va = _mm256_set1_ps(al);
  const __m256i vlast = _mm256_set1_epi32(static_cast<int32_t>(last));
  // the masked form with a defined fallback keeps GCC from warning about the plain one
  const __m256d zero = _mm256_setzero_pd(), all = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256i s = _mm256_min_epu32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + j)), vlast);
    const __m128i s0 = _mm256_castsi256_si128(s), s1 = _mm256_extracti128_si256(s, 1);
    const __m256d r0 = _mm256_mask_i32gather_pd(zero, table, s0, all, 8);
    const __m256d r1 = _mm256_mask_i32gather_pd(zero, table, s1, all, 8);
    const __m256 v = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_mul_pd(vm, r1)),
                                     _mm256_cvtpd_ps(_mm256_mul_pd(vm, r0)));
    __m256 r = _mm256_mul_ps(va, v);
    if (acc) r = _mm256_add_ps(_mm256_loadu_ps(o + j), r);
    _mm256_storeu_ps(o + j, r);
  }
  return j;
}

}  // namespace

void block_absmax(DType d, const void* x, int64_t n, int64_t block, float* out) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    const bool simd = cpu_has_avx2_f16c();
    for (int64_t b = 0, lo = 0; lo < n; ++b, lo += std::min(block, n - lo)) {
      const int64_t len = std::min(block, n - lo);
      float mx = 0.0f;
      bool nan = false;
      int64_t i = simd ? absmax_avx2(xs + lo, len, &mx, &nan) : 0;
      for (; i < len; ++i) {
        const float v = as_f32(xs[lo + i]);
        if (v != v) nan = true;
        mx = std::max(mx, std::fabs(v));
      }
      out[b] = nan ? bits_f32(kCanonicalNaN) : mx;
    }
  });
}

void encode(DType d, const void* x, int64_t n, int64_t block, const float* scales, int64_t levels,
            int64_t lane_ranks, uint64_t seed, int32_t* words) {
  const int w = homo_bits(levels, lane_ranks), lanes = 32 / w;
  const float lf = static_cast<float>(levels), h = lf * 0.5f;
  const int64_t chunk = chunk_for(lanes);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    const bool simd = cpu_has_avx2_f16c();
    alignas(32) uint32_t codes[kMaxChunk];
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      const int64_t c1 = std::min(n, c0 + chunk);
      for (int64_t i = c0; i < c1;) {  // one block's share of the chunk at a time
        const int64_t e = std::min(c1, i + (block - i % block));
        const float m = scales[i / block];
        if (!homo_scale_usable(m)) {
          std::fill(codes + (i - c0), codes + (e - c0), 0u);
          i = e;
          continue;
        }
        if (simd) {
          for (const int64_t a = std::min(e, (i + 31) / 32 * 32); i < a; ++i)
            codes[i - c0] = homo_code(as_f32(xs[i]), m, h, lf, uniform(seed, i));
          const int64_t count = (e - i) / 32 * 32;
          if (count) codes_avx2(xs, i, count, m, h, lf, seed, codes + (i - c0));
          i += count;
        }
        for (; i < e; ++i) codes[i - c0] = homo_code(as_f32(xs[i]), m, h, lf, uniform(seed, i));
      }
      const int64_t nw = (c1 - c0 + lanes - 1) / lanes;
      std::fill(codes + (c1 - c0), codes + nw * lanes, 0u);  // unused lanes of the last word
      pack(codes, nw, w, lanes, simd, words + c0 / lanes);
    }
  });
}

void decode(DType d, const int32_t* words, int64_t n, int64_t block, const float* scales,
            int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
            bool acc) {
  const int w = homo_bits(levels, lane_ranks), lanes = 32 / w;
  const int64_t chunk = chunk_for(lanes), sl = summands * levels;
  std::vector<double> table;
  if (sl + 2 <= kMaxTable && sl + 2 <= n) {
    table.resize(static_cast<size_t>(sl + 2));
    for (int64_t s = 0; s <= sl; ++s) table[s] = homo_ratio(static_cast<uint32_t>(s), sl, levels);
    table[sl + 1] = homo_nan();
  }
  const uint32_t last = static_cast<uint32_t>(sl + 1);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    const A al = static_cast<A>(alpha);
    const bool simd = cpu_has_avx2_f16c();
    alignas(32) uint32_t sums[kMaxChunk];
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      const int64_t c1 = std::min(n, c0 + chunk);
      unpack(words + c0 / lanes, (c1 - c0 + lanes - 1) / lanes, w, lanes, simd, sums);
      for (int64_t i = c0; i < c1;) {
        const int64_t e = std::min(c1, i + (block - i % block));
        const float m = scales[i / block];
        const uint32_t* s = sums + (i - c0);
        if (homo_scale_usable(m) && !table.empty()) {
          if constexpr (std::is_same_v<T, float>) {
            if (simd) i += values_f32_avx2(s, e - i, table.data(), last, m, al, acc, o + i);
          }
          const double md = static_cast<double>(m);
          for (s = sums + (i - c0); i < e; ++i, ++s) {
            const A v = al * static_cast<A>(md * table[std::min(*s, last)]);
            o[i] = from_acc<T>(acc ? to_acc(o[i]) + v : v);
          }
        } else {
          for (; i < e; ++i, ++s) {
            const A v = al * static_cast<A>(homo_value(*s, sl, levels, m));
            o[i] = from_acc<T>(acc ? to_acc(o[i]) + v : v);
          }
        }
      }
    }
  });
}

}  // namespace homo
}  // namespace hvdc
