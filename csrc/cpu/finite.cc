// Whether every element of a gradient is finite: the check that decides, once per step, whether
// the step's compression state is kept. It looks at the exponent bits alone (all ones is inf or
// NaN in every IEEE format), so it reads the tensor once and writes nothing; torch.aminmax, the
// same answer by value, ran at a third of the read bandwidth on one CPU thread.
#include <immintrin.h>

#include <algorithm>

#include "common.h"

namespace hvdc {
namespace {

template <class U> bool finite_scalar(const U* x, int64_t n, U exponent) {
  U any = 0;
  for (int64_t i = 0; i < n; ++i) any |= static_cast<U>((x[i] & exponent) == exponent);
  return any == 0;
}

template <class U> __attribute__((target("avx2"))) inline __m256i splat(U e) {
  if constexpr (sizeof(U) == 2) return _mm256_set1_epi16(static_cast<int16_t>(e));
  else if constexpr (sizeof(U) == 4) return _mm256_set1_epi32(static_cast<int32_t>(e));
  else return _mm256_set1_epi64x(static_cast<int64_t>(e));
}

template <class U> __attribute__((target("avx2"))) inline __m256i inf_or_nan(__m256i v, __m256i e) {
  const __m256i m = _mm256_and_si256(v, e);
  if constexpr (sizeof(U) == 2) return _mm256_cmpeq_epi16(m, e);
  else if constexpr (sizeof(U) == 4) return _mm256_cmpeq_epi32(m, e);
  else return _mm256_cmpeq_epi64(m, e);
}

// 128 bytes a step; the running OR of the comparisons is tested once per 16 KiB, so a
// non-finite tensor stops early without a branch per vector. Returns the bytes it looked at
// (a multiple of 128, all of them once it found a non-finite element).
template <class U>
__attribute__((target("avx2"))) int64_t finite_avx2(const char* p, int64_t bytes, U exponent,
                                                    bool* finite) {
  const __m256i e = splat(exponent);
  constexpr int64_t kCheck = 16384;
  int64_t at = 0;
  __m256i any = _mm256_setzero_si256();
  while (at + 128 <= bytes) {
    const int64_t stop = std::min(bytes, at + kCheck) / 128 * 128;
    for (; at < stop; at += 128) {
      prefetch_ahead(p + at);
      const __m256i* v = reinterpret_cast<const __m256i*>(p + at);
      const __m256i a = _mm256_or_si256(inf_or_nan<U>(_mm256_loadu_si256(v), e),
                                        inf_or_nan<U>(_mm256_loadu_si256(v + 1), e));
      const __m256i b = _mm256_or_si256(inf_or_nan<U>(_mm256_loadu_si256(v + 2), e),
                                        inf_or_nan<U>(_mm256_loadu_si256(v + 3), e));
      any = _mm256_or_si256(any, _mm256_or_si256(a, b));
    }
    if (!_mm256_testz_si256(any, any)) {
      *finite = false;
      return bytes;
    }
  }
  *finite = true;
  return at;
}

// exponent: the bits that are all ones in inf and NaN, and in nothing else.
template <class U> bool finite_of(const void* x, int64_t n, U exponent) {
  int64_t done = 0;
  if (cpu_has_avx2_f16c()) {
    bool finite = true;
    done = finite_avx2(static_cast<const char*>(x), n * static_cast<int64_t>(sizeof(U)),
                       exponent, &finite) / static_cast<int64_t>(sizeof(U));
    if (!finite) return false;
  }
  return finite_scalar(static_cast<const U*>(x) + done, n - done, exponent);
}

}  // namespace

bool all_finite(DType d, const void* x, int64_t n) {
  if (n < 0) throw KernelError("element count must be >= 0, got " + std::to_string(n));
  switch (d) {
    case kF32:
      return finite_of<uint32_t>(x, n, 0x7f800000u);
    case kF64:
      return finite_of<uint64_t>(x, n, 0x7ff0000000000000ull);
    case kF16:
      return finite_of<uint16_t>(x, n, 0x7c00);
    case kBF16:
      return finite_of<uint16_t>(x, n, 0x7f80);
  }
  throw KernelError("unsupported gradient dtype code " + std::to_string(static_cast<int>(d)) +
                    " (valid: float32, float16, bfloat16, float64)");
}

}  // namespace hvdc
