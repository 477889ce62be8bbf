// Per-element arithmetic shared by the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda):
// 16-bit conversions, the counter-based hashes behind the stochastic codecs and the dithering
// levels. Both sides compile these same functions, so a CUDA kernel differs from its CPU twin
// only in how the work is split, never in what one element computes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "hvdc/kernels.h"

#if defined(__CUDACC__)
#define HVDC_HD __host__ __device__ __forceinline__
#else
#define HVDC_HD inline
#endif

namespace hvdc {

HVDC_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
HVDC_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
HVDC_HD uint64_t f64_bits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
#endif
}
HVDC_HD double bits_f64(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, 8);
  return d;
#endif
}

// Magnitude as an unsigned key with the order of |x|, NaN above inf: the sparsifiers select by
// it, so a NaN is always among the elements sent and never hidden.
HVDC_HD uint32_t key_of(float v) { return f32_bits(v) & 0x7fffffffu; }
HVDC_HD uint64_t key_of(double v) { return f64_bits(v) & 0x7fffffffffffffffull; }

// Conversions are written out bit by bit (round to nearest even, NaN kept quiet) so results do
// not depend on the compiler's, the GPU's or the framework's half-precision support.
HVDC_HD uint16_t f32_to_f16_bits(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)  // inf stays inf, NaN stays a quiet NaN with its top payload bits
    return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (ax < 0x38800000u) {
    // Half subnormal: adding 0.5f (ulp 2^-24) lets the FPU round to a multiple of 2^-24.
    float a = bits_f32(ax) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(a) - f32_bits(0.5f)));
  }
  ax += 0xc8000fffu + ((ax >> 13) & 1u);  // rebias exponent by -112, round to nearest even
  return static_cast<uint16_t>(sign | (ax >> 13));
}

HVDC_HD float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_f32(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return bits_f32(sign | ((em << 13) + 0x38000000u));
  float f = static_cast<float>(em) * 5.9604644775390625e-08f;  // exact: em * 2^-24
  return bits_f32(f32_bits(f) | sign);
}

HVDC_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

HVDC_HD float bf16_bits_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

// double -> float rounded to odd. Rounding that result to 16 bits (RNE) equals rounding the
// double directly (24 >= 11 + 2 and 24 >= 8 + 2), so f64 inputs are rounded once, as numpy does.
HVDC_HD float f64_to_f32_round_odd(double d) {
  float f = static_cast<float>(d);
  const bool inf = (f32_bits(f) & 0x7fffffffu) == 0x7f800000u;
  if (d != d || inf || static_cast<double>(f) == d) return f;
  uint32_t b = f32_bits(f);
  if (fabs(static_cast<double>(f)) > fabs(d)) b -= 1;  // step toward zero
  return bits_f32(b | 1u);
}

// 16-bit storage types, and the type each element type is accumulated in: float for 32-bit and
// narrower, double for float64.
struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

template <class T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

HVDC_HD float to_acc(float v) { return v; }
HVDC_HD double to_acc(double v) { return v; }
HVDC_HD float to_acc(half_t v) { return f16_bits_to_f32(v.bits); }
HVDC_HD float to_acc(bf16_t v) { return bf16_bits_to_f32(v.bits); }

template <class T> HVDC_HD T from_acc(typename Acc<T>::type v);
template <> HVDC_HD float from_acc<float>(float v) { return v; }
template <> HVDC_HD double from_acc<double>(double v) { return v; }
template <> HVDC_HD half_t from_acc<half_t>(float v) { return half_t{f32_to_f16_bits(v)}; }
template <> HVDC_HD bf16_t from_acc<bf16_t>(float v) { return bf16_t{f32_to_bf16_bits(v)}; }

// p = x + e, what error feedback compresses, rounded once to the element type: the generic
// error-feedback pass and top-k's fused one must agree to the bit.
template <class T> HVDC_HD T ef_sum(T x, T e) { return from_acc<T>(to_acc(x) + to_acc(e)); }

// Calls fn with a null pointer of the storage type of `dtype` (host code).
template <class F> auto dispatch_dtype(DType dtype, F&& fn) {
  switch (dtype) {
    case kF32: return fn(static_cast<float*>(nullptr));
    case kF64: return fn(static_cast<double*>(nullptr));
    case kF16: return fn(static_cast<half_t*>(nullptr));
    case kBF16: return fn(static_cast<bf16_t*>(nullptr));
  }
  throw KernelError("unsupported gradient dtype code " + std::to_string(static_cast<int>(dtype)) +
                    " (valid: float32, float16, bfloat16, float64)");
}

// Payload header of the allgather codecs: lets a receiver refuse a payload that was made by a
// different codec or dtype (ranks configured differently) instead of decoding garbage.
constexpr uint32_t kTagMagic = 0x48430000u;  // "HC"
HVDC_HD uint32_t payload_tag(CodecId c, DType d) {
  return kTagMagic | (static_cast<uint32_t>(c) << 8) | static_cast<uint32_t>(d);
}

// Uniform in [0, 1) on a 2^-16 grid, from element index i and the step's seed. One hash gives
// two draws: murmur3's 32-bit finaliser (full avalanche; two rounds left nearby seeds visibly
// correlated) of key = (h * 0x9e3779b1 + low32(seed)) ^ high32(seed), h = (i / 16) * 8 + i % 8;
// elements i % 16 < 8 take its low 16 bits, the others its high 16 bits, so SIMD code hashes 8
// lanes for 16 elements without shuffling. Rounding up when u < frac is then unbiased to
// within 2^-16 of a level gap.
HVDC_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

HVDC_HD float uniform(uint64_t seed, int64_t i) {
  const uint32_t hidx = static_cast<uint32_t>(((i >> 4) << 3) | (i & 7));
  const uint32_t h = mix32((hidx * 0x9e3779b1u + static_cast<uint32_t>(seed)) ^
                           static_cast<uint32_t>(seed >> 32));
  return static_cast<float>((i & 8) ? h >> 16 : h & 0xffffu) * (1.0f / 65536.0f);
}

HVDC_HD uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// randomk: stratum j of n elements cut into k is [floor(j*n/k), floor((j+1)*n/k)); the element
// drawn from it is at the top 32 bits of a hash of (seed, j) scaled to the stratum's size
// (size < 2^31, so the product fits 64 bits).
HVDC_HD int64_t stratum_pick(int64_t lo, int64_t size, uint64_t seed, int64_t j) {
  const uint64_t h = mix64(seed + static_cast<uint64_t>(j + 1) * 0x9e3779b97f4a7c15ull);
  return lo + static_cast<int64_t>(((h >> 32) * static_cast<uint64_t>(size)) >> 32);
}

// Dithering level before the sign. Linear levels take t = min(|x| * s / norm, s), natural ones
// a = min(|x| / norm, 1); u is the element's uniform().
HVDC_HD int32_t linear_level(float t, float u) {
  const float f = floorf(t);
  return static_cast<int32_t>(f) + (u < t - f ? 1 : 0);
}
HVDC_HD int32_t natural_level(float a, float u, int64_t s) {
  const float lowest = ldexpf(1.0f, static_cast<int>(1 - s));
  if (a < lowest) return u < a * ldexpf(1.0f, static_cast<int>(s - 1)) ? 1 : 0;
  const uint32_t b = f32_bits(a);
  const int32_t e = static_cast<int32_t>(b >> 23) - 127;
  const float frac = bits_f32((b & 0x7fffffu) | 0x3f800000u) - 1.0f;
  return e + static_cast<int32_t>(s) + (u < frac ? 1 : 0);
}

// Decoded magnitude of dithering level l: linear l * (norm / s), natural 0 and 2^(l-s) * norm.
HVDC_HD float dither_magnitude(int64_t l, int64_t s, bool natural, float norm) {
  if (natural) return (l == 0 ? 0.0f : ldexpf(1.0f, static_cast<int>(l - s))) * norm;
  return static_cast<float>(l) * (norm / static_cast<float>(s));
}

// Bit width of a dithering code in [0, 2s].
HVDC_HD int dither_bits(int64_t s) {
  int b = 0;
  while ((int64_t{1} << b) <= 2 * s) ++b;
  return b;
}

// natural compression of one value: code = sign << 7 | c, c = 0 is zero, else 2^(top - 127 + c).
// lowest = max(top - 126, -1022), lowest_v = 2^lowest.
HVDC_HD uint8_t natural_code(double v, double u, int32_t top, int32_t lowest, double lowest_v) {
  const double a = fabs(v);
  int32_t c;
  if (a == 0.0) {
    c = 0;
  } else if (a < lowest_v) {
    c = u < ldexp(a, -lowest) ? lowest - (top - 127) : 0;
  } else {
    int e;
    const double m = frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    c = (e - 1) - (top - 127) + (u < 2.0 * m - 1.0 ? 1 : 0);
  }
  return static_cast<uint8_t>((v < 0.0 ? 0x80 : 0) | c);
}

// minmax8 code of v in a chunk with bounds lo and inv = 255 / (hi - lo) (0 for a flat chunk).
HVDC_HD uint8_t minmax8_code(float v, float lo, float inv) {
  const float r = floorf((v - lo) * inv + 0.5f);
  return static_cast<uint8_t>(r >= 255.0f ? 255.0f : r > 0.0f ? r : 0.0f);
}

// Homomorphic quantisation (arithmetic in hvdc/kernels.h). A scale is usable for encoding when
// 0 < m < inf; other blocks encode every code as 0.
HVDC_HD bool homo_scale_usable(float m) { return m > 0.0f && m <= 3.40282347e+38f; }

// Code in [0, levels] of v for a usable scale m; h = levels / 2 and lf = levels as floats.
HVDC_HD int32_t homo_code(float v, float m, float h, float lf, float u) {
  float t = (v / m + 1.0f) * h;
  t = t > 0.0f ? t : 0.0f;  // a NaN v (only possible if m is not v's block max) codes as 0
  t = t < lf ? t : lf;
  return linear_level(t, u);
}

// Lane bits for levels * lane_ranks (<= 2^32 - 1 once checked): smallest w with 2^w > it.
HVDC_HD int homo_bits(int64_t levels, int64_t lane_ranks) {
  const uint64_t top = static_cast<uint64_t>(levels) * static_cast<uint64_t>(lane_ranks);
  int w = 0;
  while (w < 64 && (top >> w) != 0) ++w;
  return w;
}

HVDC_HD double homo_nan() { return bits_f64(0x7ff8000000000000ull); }

// (2s - sl) / levels for a lane sum s of `summands` codes, sl = summands * levels; the integer
// difference is exact in double (|2s - sl| < 2^34).
HVDC_HD double homo_ratio(uint32_t s, int64_t sl, int64_t levels) {
  return static_cast<double>(2 * static_cast<int64_t>(s) - sl) / static_cast<double>(levels);
}

// Decoded value (before alpha) of lane sum s in a block with agreed scale m.
HVDC_HD double homo_value(uint32_t s, int64_t sl, int64_t levels, float m) {
  if (!(m >= 0.0f && m <= 3.40282347e+38f) || s > static_cast<uint64_t>(sl)) return homo_nan();
  if (m == 0.0f) return 0.0;
  return static_cast<double>(m) * homo_ratio(s, sl, levels);
}

}  // namespace hvdc
