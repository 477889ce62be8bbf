// Pieces shared by the CPU kernels; element types and per-element arithmetic are in
// hvdc/element.h, shared with the CUDA kernels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "hvdc/element.h"
#include "hvdc/kernels.h"

namespace hvdc {

inline int64_t dtype_size(DType d) { return (d == kF32) ? 4 : (d == kF64) ? 8 : 2; }

void check_tag(const void* payload, CodecId c, DType d, int64_t rank);

bool cpu_has_avx2_f16c();

// Runs fn() with everything it calls compiled for AVX2 where the CPU has it (and
// HVDC_FORCE_SCALAR is not set): for loops whose order of operations is fixed by their code,
// wider registers give the scalar path's results bit for bit, without intrinsics.
template <class F> __attribute__((target("avx2"), flatten)) void run_avx2(F& fn) { fn(); }
template <class F> void with_avx2(F&& fn) {
  if (cpu_has_avx2_f16c())
    run_avx2(fn);
  else
    fn();
}

// Streaming loops touch memory this far ahead of use: measured on the development VM, the
// hardware prefetcher alone leaves one core ~15% short of its read bandwidth.
constexpr int64_t kPrefetchBytes = 8192;
template <class T> inline void prefetch_ahead(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, 0, 3);
}

// Payloads larger than this bypass the cache (non-temporal stores): they would not fit anyway,
// and skipping the read-for-ownership saves a third of the memory traffic of a cast. Smaller
// ones stay cached for Horovod, which reads them as soon as they are written.
constexpr int64_t kStreamingBytes = 8 << 20;
inline bool stream_to(const void* y, int64_t bytes) {
  return bytes >= kStreamingBytes && (reinterpret_cast<uintptr_t>(y) & 31) == 0;
}

// Results that nothing reads again within the step (a reduced gradient, read by the
// optimizer's update after the step's other buckets; a residual, read at the next step) go
// around the cache from this size, a core's L2 on the development VM.
constexpr int64_t kLaterBytes = 2 << 20;
inline bool stream_later(const void* y, int64_t bytes) {
  return bytes >= kLaterBytes && (reinterpret_cast<uintptr_t>(y) & 31) == 0;
}

// dst[0, bytes) = src[0, bytes), by non-temporal stores from dst's first 32-byte boundary on
// (a bucket that starts inside a parameter's gradient is rarely aligned).
__attribute__((target("avx2"))) inline void stream_copy_avx2(void* dst, const void* src,
                                                            int64_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  int64_t i = std::min<int64_t>(bytes, (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31);
  std::memcpy(d, s, static_cast<size_t>(i));
  for (; i + 32 <= bytes; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
  std::memcpy(d + i, s + i, static_cast<size_t>(bytes - i));
}

// The step's finiteness check of float32 results, made as they are stored instead of by a pass
// that reads them back (from memory, where they were streamed): the largest |v| bit pattern
// stored, above which lie the patterns of Inf and NaN only. The aggregations of fp16, bf16,
// minmax8, dithering and natural set their `finite` (hvdc/kernels.h) so for float32 out.
constexpr uint32_t kInfBits = 0x7f800000u;
inline uint32_t seen_abs(uint32_t seen, float v) { return std::max(seen, f32_bits(v) & 0x7fffffffu); }
__attribute__((target("avx2"))) inline __m256i seen_abs8(__m256i seen, __m256 v) {
  return _mm256_max_epi32(seen, _mm256_and_si256(_mm256_castps_si256(v),
                                                 _mm256_set1_epi32(0x7fffffff)));
}
__attribute__((target("avx2"))) inline uint32_t seen_max8(uint32_t seen, __m256i v) {
  alignas(32) uint32_t m[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(m), v);
  for (int u = 0; u < 8; ++u) seen = std::max(seen, m[u]);
  return seen;
}

// aggregate_pair of the quantisers reduces a block of this many codes at a time: the other
// rank's are taken off the word sum into a buffer (at most 4 KiB) first, then read like a
// gathered payload's. Reading each SIMD step's straight after computing it stalls on store
// forwarding instead.
constexpr int64_t kPairBlock = 4096;

// dst[0, bytes) = the int32 words of sum minus those of mine (bytes a multiple of 4).
inline void subtract_words(const uint8_t* sum, const uint8_t* mine, int64_t bytes, uint8_t* dst) {
  for (int64_t w = 0; w < bytes; w += 4) {
    uint32_t a, m;
    std::memcpy(&a, sum + w, 4);
    std::memcpy(&m, mine + w, 4);
    const uint32_t t = a - m;
    std::memcpy(dst + w, &t, 4);
  }
}

// AVX2 draws of uniform(), shared by the stochastic quantisers (quant.cc, homomorphic.cc).
// Keys of hash indices h..h+7 (see uniform() in hvdc/element.h); walking the gradient,
// callers advance them by 8 * 0x9e3779b1 rather than multiply again.
__attribute__((target("avx2"))) inline __m256i uniform_keys8(uint64_t seed, int64_t h) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(h)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_add_epi32(_mm256_mullo_epi32(idx, _mm256_set1_epi32(0x9e3779b1u)),
                          _mm256_set1_epi32(static_cast<int32_t>(seed)));
}

// The hashes of keys `key`: low 16 bits are uniform() * 2^16 of the first 8 of their 16
// elements, high 16 bits of the next 8.
__attribute__((target("avx2"))) inline __m256i uniform_hash8(uint64_t seed, __m256i key) {
  __m256i h = _mm256_xor_si256(key, _mm256_set1_epi32(static_cast<int32_t>(seed >> 32)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x85ebca6bu));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0xc2b2ae35u));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// uniform() of the 16 elements whose hash keys are `key`: first 8 in *lo, next 8 in *hi.
__attribute__((target("avx2"))) inline void uniform16(uint64_t seed, __m256i key, __m256* lo,
                                                      __m256* hi) {
  const __m256i h = uniform_hash8(seed, key);
  const __m256 unit = _mm256_set1_ps(1.0f / 65536.0f);
  *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(h, _mm256_set1_epi32(0xffff))), unit);
  *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 16)), unit);
}

// Per-codec entry points (one file each).
namespace cast {
int64_t payload_bytes(CodecId c, DType d, int64_t n);
void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc);
void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha);
void aggregate_pair(CodecId c, DType d, const void* own, const int32_t* summed, int64_t rank,
                    int64_t n, void* out, double alpha, bool* finite);
}  // namespace cast
namespace sign {
int64_t payload_bytes(int64_t n);
void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(CodecId c, DType d, const void* payload, int64_t n, void* out, double alpha, bool acc);
void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               void* out, double alpha);
void ef_encode(CodecId c, DType d, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload);
void ef_settle(DType d, void* e, float* carry, int64_t n);
}  // namespace sign
namespace topk {
int64_t payload_bytes(DType d, int64_t k);
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
// e = x + e_in (e_in may be e), then encode(e): in one pass over memory where the generic path
// takes two.
void ef_accumulate_encode(DType d, const void* x, const void* e_in, void* e, int64_t n,
                          const Params& p, void* payload);
// Appends the i with key_of(x[i]) >= t to out, ascending; with e given, the i with
// key_of(e[i]) >= t over e = x + e_in as it writes it. AVX2 where the CPU has it (DGC's
// candidate pass uses it too).
void collect_at_least(const float* x, const float* e_in, float* e, int64_t n, uint32_t t,
                      std::vector<int32_t>& out);
// The top k by (key descending, index ascending) when only the ascending indices `nonzero`
// (fewer than k) have a key above 0: those and the lowest indices of the zeros, ascending, to
// idx. A gradient that is mostly zeros (an embedding's unused rows) is then never collected or
// ranked element by element.
void take_zeros(const std::vector<int32_t>& nonzero, int64_t k, int32_t* idx);
void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc);
void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, bool* finite);
}  // namespace topk
namespace randomk {
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc);
}  // namespace randomk
namespace minmax8 {
int64_t payload_bytes(int64_t n, int64_t chunk);
void encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
// e = ef_sum(x, e_in), encode(e), e += alpha * D(payload), in one pass; e may be e_in.
void ef_encode(DType d, const void* x, const void* e_in, void* e, int64_t n, const Params& p,
               void* payload, double alpha);
void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc);
void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, bool acc, bool* finite = nullptr);
void aggregate_pair(DType d, const void* own, const int32_t* summed, int64_t rank, int64_t n,
                    const Params& p, void* out, double alpha, bool* finite);
}  // namespace minmax8
namespace quant {
int64_t dither_payload_bytes(int64_t n, int64_t s);
void dither_encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
// Error feedback in two passes over x and e_in (the norm, then the codes): dither_encode of
// p = ef_sum(x, e_in), and e = p + alpha * D(payload) as it codes, to the bits of
// dither_aggregate(payload, 1 rank, accumulating into p). e may be e_in.
void dither_ef_encode(DType d, const void* x, const void* e_in, void* e, int64_t n,
                      const Params& p, void* payload, double alpha);
void dither_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                      const Params& p, void* out, double alpha, bool acc,
                      bool* finite = nullptr);
void dither_aggregate_pair(DType d, const void* own, const int32_t* summed, int64_t rank,
                           int64_t n, const Params& p, void* out, double alpha, bool* finite);
int64_t natural_payload_bytes(int64_t n);
void natural_encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
void natural_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                       void* out, double alpha, bool acc, bool* finite = nullptr);
void natural_aggregate_pair(DType d, const void* own, const int32_t* summed, int64_t rank,
                            int64_t n, void* out, double alpha, bool* finite);
}  // namespace quant
namespace homo {
// Arguments checked by dispatch.cc; w = homo_bits(levels, lane_ranks) <= 32.
void block_absmax(DType d, const void* x, int64_t n, int64_t block, float* out);
void encode(DType d, const void* x, int64_t n, int64_t block, const float* scales, int64_t levels,
            int64_t lane_ranks, uint64_t seed, int32_t* words);
void decode(DType d, const int32_t* words, int64_t n, int64_t block, const float* scales,
            int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
            bool acc);
}  // namespace homo
namespace sparse {
// One rank's entries of a sparse payload: count indices, ascending, and their values in the
// gradient dtype.
struct Entries {
  const int32_t* idx;
  const void* vals;
  int64_t count;
};
// out = the sum over ranks, in rank order and in the accumulator type, of alpha * each rank's
// entries, zero elsewhere. With `finite`, *finite = whether every element written is finite (in
// the output's dtype). `what` names the codec in the error for an index outside the tensor or
// out of order.
void sum_entries(DType d, const std::vector<Entries>& ranks, int64_t n, void* out, double alpha,
                 bool* finite, const char* what);
int64_t threshold_capacity(DType d, int64_t n);
int64_t threshold_used(DType d, const void* payload);
void threshold_encode(DType d, const void* x, int64_t n, const Params& p, void* payload);
// Error feedback: p = x + e_in, threshold_encode(p), e = p + alpha * D(payload) (e may be
// e_in); for float32 under AVX2 in one sweep that writes e once.
void threshold_ef_encode(DType d, const void* x, const void* e_in, void* e, int64_t n,
                         const Params& p, void* payload, double alpha);
void threshold_aggregate(DType d, const void* payloads, int64_t ranks, int64_t total, int64_t n,
                         void* out, double alpha, bool acc, bool* finite = nullptr);
int64_t dgc_payload_bytes(DType d, int64_t k);
// u_in, v_in: the state before the step; u, v: where it is written (the same buffers, or apart).
void dgc_encode(DType d, const void* x, const void* u_in, const void* v_in, void* u, void* v,
                int64_t n, const Params& p, void* payload);
void dgc_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                   const Params& p, void* out, double alpha, bool acc, bool* finite = nullptr);
}  // namespace sparse

}  // namespace hvdc
