// Pieces shared by the CPU kernels; element types and per-element arithmetic are in
// hvdc/element.h, shared with the CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "hvdc/element.h"
#include "hvdc/kernels.h"

namespace hvdc {

inline int64_t dtype_size(DType d) { return (d == kF32) ? 4 : (d == kF64) ? 8 : 2; }

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
