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

// Decoded value of one code: lo + code * step.
template <class A>
void add_chunk(const uint8_t* codes, int64_t len, float lo, float hi, A alpha, A* acc) {
  const Grid g = grid(lo, hi);
  for (int64_t j = 0; j < len; ++j)
    acc[j] += alpha * static_cast<A>(g.lo + static_cast<float>(codes[j]) * g.step);
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

}  // namespace

int64_t payload_bytes(int64_t n, int64_t c) {
  return kHeader + 8 * chunks(n, c) + (n + 7) / 8 * 8;
}

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  const int64_t c = p.chunk;
  Layout L = layout(payload, n, c);
  L.head[0] = payload_tag(kMinMax8, d);
  L.head[1] = static_cast<uint32_t>(c);
  std::fill(L.codes + n, L.codes + (n + 7) / 8 * 8, uint8_t(0));
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    for (int64_t k = 0; k * c < n; ++k) {
      const int64_t s = k * c, len = std::min(c, n - s);
      if constexpr (std::is_same_v<T, float>) {
        if (cpu_has_avx2_f16c()) {
          float lo, hi;
          bounds_f32_avx2(xs + s, len, &lo, &hi);
          L.bounds[2 * k] = lo;
          L.bounds[2 * k + 1] = hi;
          codes_f32_avx2(xs + s, len, grid(lo, hi).lo, grid(lo, hi).inv, L.codes + s);
          continue;
        }
      }
      float lo = static_cast<float>(to_acc(xs[s])), hi = lo;
      bool nan = std::isnan(lo);
      for (int64_t j = 1; j < len; ++j) {
        const float v = static_cast<float>(to_acc(xs[s + j]));
        nan |= std::isnan(v);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
      if (nan) lo = hi = std::nanf("");
      lo += 0.0f;  // -0 -> +0, see bounds_f32_avx2
      hi += 0.0f;
      L.bounds[2 * k] = lo;
      L.bounds[2 * k + 1] = hi;
      const Grid g = grid(lo, hi);
      for (int64_t j = 0; j < len; ++j) {
        L.codes[s + j] = minmax8_code(static_cast<float>(to_acc(xs[s + j])), g.lo, g.inv);
      }
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
               const Params& p, void* out, double alpha, bool acc) {
  const int64_t c = p.chunk;
  const auto* base = static_cast<const uint8_t*>(payloads);
  for (int64_t r = 0; r < ranks; ++r) {
    check_tag(base + r * stride, kMinMax8, d, r);
    check_chunk(base + r * stride, c, r);
  }
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    std::vector<A> sum(static_cast<size_t>(std::min(n, c)));
    for (int64_t k = 0; k * c < n; ++k) {
      const int64_t s = k * c, len = std::min(c, n - s);
      for (int64_t j = 0; j < len; ++j) sum[j] = acc ? to_acc(o[s + j]) : A(0);
      for (int64_t r = 0; r < ranks; ++r) {
        const Layout L = layout(const_cast<uint8_t*>(base + r * stride), n, c);
        add_chunk(L.codes + s, len, L.bounds[2 * k], L.bounds[2 * k + 1], static_cast<A>(alpha),
                  sum.data());
      }
      for (int64_t j = 0; j < len; ++j) o[s + j] = from_acc<T>(sum[j]);
    }
  });
}

}  // namespace minmax8
}  // namespace hvdc
