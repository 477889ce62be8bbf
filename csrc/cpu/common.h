// Scalar element types and conversions shared by the CPU kernels. Conversions are written out
// bit by bit (round to nearest even, NaN kept quiet) so results do not depend on the compiler's
// or the framework's half-precision support.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "hvdc/kernels.h"

namespace hvdc {

struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline uint16_t f32_to_f16_bits(float f) {
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

inline float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_f32(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return bits_f32(sign | ((em << 13) + 0x38000000u));
  float f = static_cast<float>(em) * 5.9604644775390625e-08f;  // exact: em * 2^-24
  return bits_f32(f32_bits(f) | sign);
}

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float bf16_bits_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

// double -> float rounded to odd. Rounding that result to 16 bits (RNE) equals rounding the
// double directly (24 >= 11 + 2 and 24 >= 8 + 2), so f64 inputs are rounded once, as numpy does.
inline float f64_to_f32_round_odd(double d) {
  float f = static_cast<float>(d);
  if (std::isnan(d) || std::isinf(f) || static_cast<double>(f) == d) return f;
  uint32_t b = f32_bits(f);
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) b -= 1;  // step toward zero
  return bits_f32(b | 1u);
}

// Accumulator type: float for 32-bit and narrower inputs, double for f64.
template <class T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

inline float to_acc(float v) { return v; }
inline double to_acc(double v) { return v; }
inline float to_acc(half_t v) { return f16_bits_to_f32(v.bits); }
inline float to_acc(bf16_t v) { return bf16_bits_to_f32(v.bits); }

template <class T> T from_acc(typename Acc<T>::type v);
template <> inline float from_acc<float>(float v) { return v; }
template <> inline double from_acc<double>(double v) { return v; }
template <> inline half_t from_acc<half_t>(float v) { return half_t{f32_to_f16_bits(v)}; }
template <> inline bf16_t from_acc<bf16_t>(float v) { return bf16_t{f32_to_bf16_bits(v)}; }

inline int64_t dtype_size(DType d) { return (d == kF32) ? 4 : (d == kF64) ? 8 : 2; }

// Calls fn with a null pointer of the storage type of `dtype`.
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
inline uint32_t payload_tag(CodecId c, DType d) {
  return kTagMagic | (static_cast<uint32_t>(c) << 8) | static_cast<uint32_t>(d);
}
void check_tag(const void* payload, CodecId c, DType d, int64_t rank);

bool cpu_has_avx2_f16c();

// Streaming loops touch memory this far ahead of use: measured on the development VM, the
// hardware prefetcher alone leaves one core ~15% short of its read bandwidth.
constexpr int64_t kPrefetchBytes = 8192;
template <class T> inline void prefetch_ahead(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, 0, 3);
}

// Outputs larger than this bypass the cache (non-temporal stores): they would not fit anyway,
// and skipping the read-for-ownership saves a third of the memory traffic of a cast.
constexpr int64_t kStreamingBytes = 8 << 20;
inline bool stream_to(const void* y, int64_t bytes) {
  return bytes >= kStreamingBytes && (reinterpret_cast<uintptr_t>(y) & 31) == 0;
}

// Per-codec entry points (one file each).
namespace cast {
int64_t payload_bytes(CodecId c, DType d, int64_t n);
void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc);
void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha);
}  // namespace cast
namespace sign {
int64_t payload_bytes(int64_t n);
void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc);
void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha);
void ef_encode(CodecId c, DType d, const void* x, void* e, float* carry, int64_t n,
               const Params& p, void* payload);
void ef_settle(DType d, void* e, float* carry, int64_t n);
}  // namespace sign
namespace topk {
int64_t payload_bytes(DType d, int64_t k);
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc);
void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha);
}  // namespace topk
namespace randomk {
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc);
}  // namespace randomk
namespace minmax8 {
int64_t payload_bytes(int64_t n, int64_t chunk);
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc);
void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, bool acc);
}  // namespace minmax8
namespace quant {
int64_t dither_payload_bytes(int64_t n, int64_t s);
void dither_encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void dither_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                      const Params& p, void* out, double alpha, bool acc);
int64_t natural_payload_bytes(int64_t n);
void natural_encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void natural_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                       void* out, double alpha, bool acc);
}  // namespace quant
namespace sparse {
int64_t threshold_capacity(DType d, int64_t n);
int64_t threshold_used(DType d, const void* payload);
void threshold_encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void threshold_aggregate(DType d, const void* payloads, int64_t ranks, int64_t total, int64_t n,
                         void* out, double alpha, bool acc);
int64_t dgc_payload_bytes(DType d, int64_t k);
void dgc_encode(DType d, const void* x, void* u, void* v, int64_t n, const Params& p, void* payload);
void dgc_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                   const Params& p, void* out, double alpha, bool acc);
}  // namespace sparse

}  // namespace hvdc
