// minmax8 (Bagua's ByteGrad): per chunk of `chunk` elements, the min and max (as float32) and
// one uint8 code per element on 256 evenly spaced levels between them, rounded to nearest:
// [u32 tag][u32 chunk][f32 min, f32 max per chunk][u8 codes, padded to 8 bytes].
// A chunk holding a NaN decodes to NaN, so a NaN gradient is never hidden.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace hvdc {
namespace minmax8 {
namespace {

constexpr int64_t kHeader = 8;
int64_t chunks(int64_t n, int64_t c) { return (n + c - 1) / c; }

struct Layout {
  uint32_t* head;
  float* bounds;
  uint8_t* codes;
};
Layout layout(void* payload, int64_t n, int64_t c) {
  auto* b = static_cast<uint8_t*>(payload);
  return {reinterpret_cast<uint32_t*>(b), reinterpret_cast<float*>(b + kHeader),
          b + kHeader + 8 * chunks(n, c)};
}

void check_chunk(const void* payload, int64_t c, int64_t rank) {
  uint32_t got;
  std::memcpy(&got, static_cast<const uint8_t*>(payload) + 4, 4);
  if (got != static_cast<uint64_t>(c))
    throw KernelError("minmax8 payload" + (rank >= 0 ? " from rank " + std::to_string(rank) : "") +
                      " uses chunk=" + std::to_string(got) + ", this rank chunk=" +
                      std::to_string(c));
}

// Level spacing of a chunk, and its reciprocal scaled for encoding: q = (x - lo) * inv.
struct Grid {
  float lo, step, inv;
};
Grid grid(float lo, float hi) {
  const float range = hi - lo;
  if (!(range > 0.0f)) return {lo, 0.0f, 0.0f};
  return {lo, range / 255.0f, 255.0f / range};
}

// Bounds of one float chunk; NaN anywhere gives NaN bounds. -0 becomes +0 so that which zero
// a min/max returns (order-dependent) never shows in the payload.
__attribute__((target("avx2"))) void bounds_f32_avx2(const float* x, int64_t len, float* lo,
                                                     float* hi) {
  __m256 mn = _mm256_set1_ps(x[0]), mx = mn, bad = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    mn = _mm256_min_ps(mn, v);
    mx = _mm256_max_ps(mx, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float a[8], b[8];
  _mm256_store_ps(a, mn);
  _mm256_store_ps(b, mx);
  float l = a[0], h = b[0];
  for (int u = 1; u < 8; ++u) {
    l = a[u] < l ? a[u] : l;
    h = b[u] > h ? b[u] : h;
  }
  bool nan = _mm256_movemask_ps(bad) != 0;
  for (; j < len; ++j) {
    nan |= std::isnan(x[j]);
    l = x[j] < l ? x[j] : l;
    h = x[j] > h ? x[j] : h;
  }
  *lo = nan ? std::nanf("") : l + 0.0f;
  *hi = nan ? std::nanf("") : h + 0.0f;
}

__attribute__((target("avx2"))) void codes_f32_avx2(const float* x, int64_t len, float lo,
                                                    float inv, uint8_t* codes) {
  const __m256 vlo = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv);
  const __m256 half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(255.0f), zero = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= len; j += 32) {
    __m256i q[4];
    for (int u = 0; u < 4; ++u) {
      __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * u), vlo), vinv);
      v = _mm256_floor_ps(_mm256_add_ps(v, half));
      v = _mm256_max_ps(_mm256_min_ps(v, top), zero);
      q[u] = _mm256_cvttps_epi32(v);
    }
    // 32-bit -> 16 -> 8 with the lane shuffles undone by one permute.
    __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j), w);
  }
  for (; j < len; ++j) codes[j] = minmax8_code(x[j], lo, inv);
}

// out[j0, len) (+)= sum over ranks of alpha * (lo_r + code_r * step_r), rank 0 first, per
// element in the accumulator type: what every decode and aggregation of minmax8 computes.
// Returns seen folded with the largest |out| bit pattern (see seen_abs) for float32 out.
template <class T>
uint32_t sum_chunk(const uint8_t* const* codes, const Grid* g, int64_t ranks, int64_t j0,
                   int64_t len, double alpha, bool acc, T* out, uint32_t seen) {
  using A = typename Acc<T>::type;
  const A al = static_cast<A>(alpha);
  for (int64_t j = j0; j < len; ++j) {
    A sum = acc ? to_acc(out[j]) : A(0);
    for (int64_t r = 0; r < ranks; ++r)
      sum += al * static_cast<A>(g[r].lo + static_cast<float>(codes[r][j]) * g[r].step);
    out[j] = from_acc<T>(sum);
    if constexpr (std::is_same_v<T, float>) seen = seen_abs(seen, out[j]);
  }
  return seen;
}

// sum_chunk for float32, 8 elements per step; stream: out is 32-byte aligned and not read.
__attribute__((target("avx2"))) int64_t sum_chunk_f32_avx2(const uint8_t* const* codes,
                                                          const Grid* g, int64_t ranks,
                                                          int64_t len, float alpha, bool acc,
                                                          bool stream, float* out,
                                                          uint32_t* seen) {
  const __m256 va = _mm256_set1_ps(alpha);
  __m256i sv = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    __m256 sum = acc ? _mm256_loadu_ps(out + j) : _mm256_setzero_ps();
    for (int64_t r = 0; r < ranks; ++r) {
      const __m256 c = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes[r] + j))));
      const __m256 v = _mm256_add_ps(_mm256_set1_ps(g[r].lo), _mm256_mul_ps(c, _mm256_set1_ps(g[r].step)));
      sum = _mm256_add_ps(sum, _mm256_mul_ps(va, v));
    }
    sv = seen_abs8(sv, sum);
    if (stream) _mm256_stream_ps(out + j, sum);
    else _mm256_storeu_ps(out + j, sum);
  }
  *seen = seen_max8(*seen, sv);
  return j;
}

// As sum_chunk, seen included.
template <class T>
uint32_t add_chunk(const uint8_t* const* codes, const Grid* g, int64_t ranks, int64_t len,
                   double alpha, bool acc, bool stream, T* out, uint32_t seen = 0) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c())
      j = sum_chunk_f32_avx2(codes, g, ranks, len, static_cast<float>(alpha), acc, stream, out,
                             &seen);
  }
  return sum_chunk(codes, g, ranks, j, len, alpha, acc, out, seen);
}

// Bounds and codes of one chunk, [lo, hi] into bounds.
template <class T>
void encode_chunk(const T* xs, int64_t len, float* bounds, uint8_t* codes) {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c()) {
      bounds_f32_avx2(xs, len, &bounds[0], &bounds[1]);
      const Grid g = grid(bounds[0], bounds[1]);
      codes_f32_avx2(xs, len, g.lo, g.inv, codes);
      return;
    }
  }
  float lo = static_cast<float>(to_acc(xs[0])), hi = lo;
  bool nan = std::isnan(lo);
  for (int64_t j = 1; j < len; ++j) {
    const float v = static_cast<float>(to_acc(xs[j]));
    nan |= std::isnan(v);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  if (nan) lo = hi = std::nanf("");
  lo += 0.0f;  // -0 -> +0, see bounds_f32_avx2
  hi += 0.0f;
  bounds[0] = lo;
  bounds[1] = hi;
  const Grid g = grid(lo, hi);
  for (int64_t j = 0; j < len; ++j)
    codes[j] = minmax8_code(static_cast<float>(to_acc(xs[j])), g.lo, g.inv);
}

Layout start_payload(void* payload, DType d, int64_t n, int64_t c) {
  Layout L = layout(payload, n, c);
  L.head[0] = payload_tag(kMinMax8, d);
  L.head[1] = static_cast<uint32_t>(c);
  std::fill(L.codes + n, L.codes + (n + 7) / 8 * 8, uint8_t(0));
  return L;
}

}  // namespace

int64_t payload_bytes(int64_t n, int64_t c) {
  return kHeader + 8 * chunks(n, c) + (n + 7) / 8 * 8;
}

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  const int64_t c = p.chunk;
  const Layout L = start_payload(payload, d, n, c);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    for (int64_t k = 0; k * c < n; ++k)
      encode_chunk(xs + k * c, std::min(c, n - k * c), L.bounds + 2 * k, L.codes + k * c);
  });
}

// One pass, chunk by chunk while the chunk is in cache: e = ef_sum(x, e_in), its bounds and
// codes, then e += alpha * D(chunk). The bits of the generic sum, encode and decode.
void ef_encode(DType d, const void* x, const void* e_in, void* e, int64_t n, const Params& p,
               void* payload, double alpha) {
  const int64_t c = p.chunk;
  const Layout L = start_payload(payload, d, n, c);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    const T* ein = static_cast<const T*>(e_in);
    T* es = static_cast<T*>(e);
    for (int64_t k = 0; k * c < n; ++k) {
      const int64_t s = k * c, len = std::min(c, n - s);
      for (int64_t j = s; j < s + len; ++j) es[j] = ef_sum(xs[j], ein[j]);
      encode_chunk(es + s, len, L.bounds + 2 * k, L.codes + s);
      const uint8_t* codes = L.codes + s;
      const Grid g = grid(L.bounds[2 * k], L.bounds[2 * k + 1]);
      add_chunk(&codes, &g, 1, len, alpha, true, false, es + s);
    }
  });
}

void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc) {
  check_tag(payload, kMinMax8, d, -1);
  check_chunk(payload, p.chunk, -1);
  aggregate(d, payload, 1, payload_bytes(n, p.chunk), n, p, out, alpha, acc);
}

void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, bool acc, bool* finite) {
  const int64_t c = p.chunk;
  const auto* base = static_cast<const uint8_t*>(payloads);
  std::vector<Layout> rank(static_cast<size_t>(ranks));
  for (int64_t r = 0; r < ranks; ++r) {
    check_tag(base + r * stride, kMinMax8, d, r);
    check_chunk(base + r * stride, c, r);
    rank[r] = layout(const_cast<uint8_t*>(base + r * stride), n, c);
  }
  std::vector<const uint8_t*> codes(static_cast<size_t>(ranks));
  std::vector<Grid> g(static_cast<size_t>(ranks));
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = static_cast<T*>(out);
    const bool stream = !acc && c % 8 == 0 && stream_later(out, static_cast<int64_t>(sizeof(T)) * n);
    uint32_t seen = 0;
    for (int64_t k = 0; k * c < n; ++k) {
      const int64_t s = k * c;
      for (int64_t r = 0; r < ranks; ++r) {
        codes[r] = rank[r].codes + s;
        g[r] = grid(rank[r].bounds[2 * k], rank[r].bounds[2 * k + 1]);
      }
      seen = add_chunk(codes.data(), g.data(), ranks, std::min(c, n - s), alpha, acc, stream,
                       o + s, seen);
    }
    if (stream) _mm_sfence();
    if (finite)
      *finite = std::is_same_v<T, float> ? seen < kInfBits : all_finite(d, out, n);
  });
}

void aggregate_pair(DType d, const void* own, const int32_t* summed, int64_t rank, int64_t n,
                    const Params& p, void* out, double alpha, bool* finite) {
  const int64_t c = p.chunk, bytes = payload_bytes(n, c);
  const auto* mine = static_cast<const uint8_t*>(own);
  const auto* sum = reinterpret_cast<const uint8_t*>(summed);
  if (c % 4 != 0) {  // a chunk's codes do not start on a word: the other payload written out
    std::vector<uint8_t> rows(static_cast<size_t>(2 * bytes));
    std::memcpy(rows.data() + rank * bytes, mine, static_cast<size_t>(bytes));
    subtract_words(sum, mine, bytes, rows.data() + (1 - rank) * bytes);
    return aggregate(d, rows.data(), 2, bytes, n, p, out, alpha, false, finite);
  }
  // The other rank's header and bounds (words), then its codes a block at a time.
  const int64_t head = kHeader + 8 * chunks(n, c);
  std::vector<uint8_t> theirs_head(static_cast<size_t>(head));
  subtract_words(sum, mine, head, theirs_head.data());
  Layout rank_layout[2];
  rank_layout[rank] = layout(const_cast<uint8_t*>(mine), n, c);
  rank_layout[1 - rank] = layout(theirs_head.data(), n, c);
  for (int64_t r = 0; r < 2; ++r) {
    check_tag(rank_layout[r].head, kMinMax8, d, r);
    check_chunk(rank_layout[r].head, c, r);
  }
  const int64_t at = head;  // where the codes start, in both payloads and the sum
  alignas(32) uint8_t theirs[kPairBlock];
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = static_cast<T*>(out);
    const bool stream = c % 8 == 0 && stream_later(out, static_cast<int64_t>(sizeof(T)) * n);
    Grid g[2];
    const uint8_t* codes[2];
    uint32_t seen = 0;
    for (int64_t k = 0; k * c < n; ++k) {
      const int64_t s = k * c, len = std::min(c, n - s);
      for (int64_t r = 0; r < 2; ++r)
        g[r] = grid(rank_layout[r].bounds[2 * k], rank_layout[r].bounds[2 * k + 1]);
      for (int64_t b0 = 0; b0 < len; b0 += kPairBlock) {
        const int64_t m = std::min(kPairBlock, len - b0);
        // whole words: the codes are padded to 8 bytes past n
        subtract_words(sum + at + s + b0, mine + at + s + b0, (m + 3) / 4 * 4, theirs);
        codes[rank] = mine + at + s + b0;
        codes[1 - rank] = theirs;
        seen = add_chunk(codes, g, 2, m, alpha, false, stream, o + s + b0, seen);
      }
    }
    if (stream) _mm_sfence();
    if (finite)
      *finite = std::is_same_v<T, float> ? seen < kInfBits : all_finite(d, out, n);
  });
}

}  // namespace minmax8
}  // namespace hvdc
