// topk: the k elements of largest magnitude, ties broken toward the lower index, sent as
// [u32 tag][u32 k][i32 indices, ascending, padded to 8 bytes][k values in the gradient dtype].
// Selection: a threshold from a strided sample, one pass collecting the elements at or above
// it, then an exact selection among those few candidates (no sort of the whole gradient).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace hvdc {
namespace topk {
namespace {

constexpr int64_t kHeader = 8;
int64_t index_bytes(int64_t k) { return (k * 4 + 7) / 8 * 8; }

// Selection by key_of (hvdc/element.h): NaN ranks above inf, so it gets sent.
template <class T> auto key_at(const T* x, int64_t i) { return key_of(to_acc(x[i])); }

__attribute__((target("avx2"))) void collect_f32_avx2(const float* x, int64_t n, uint32_t t,
                                                      std::vector<int32_t>& out) {
  // keys are below 2^31, so a signed compare against t - 1 is the unsigned test key >= t.
  const __m256i thr = _mm256_set1_epi32(static_cast<int32_t>(t) - 1);
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(x + i);
    prefetch_ahead(x + i + 16);
    uint32_t m = 0;
    for (int u = 0; u < 4; ++u) {
      __m256i k = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8 * u)),
                                   absmask);
      m |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, thr))))
           << (8 * u);
    }
    while (m) {
      out.push_back(static_cast<int32_t>(i + __builtin_ctz(m)));
      m &= m - 1;
    }
  }
  for (; i < n; ++i)
    if (key_of(x[i]) >= t) out.push_back(static_cast<int32_t>(i));
}

template <class T, class K>
void collect(const T* x, int64_t n, K t, std::vector<int32_t>& out) {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_f16c() && t > 0) return collect_f32_avx2(x, n, t, out);
  }
  for (int64_t i = 0; i < n; ++i)
    if (key_at(x, i) >= t) out.push_back(static_cast<int32_t>(i));
}

// Writes the indices of the top k (ascending) to idx. 0 < k < n.
template <class T>
void select(const T* x, int64_t n, int64_t k, int32_t* idx) {
  using K = decltype(key_at(x, 0));
  std::vector<int32_t> cand;
  bool have = false;
  if (n > 16384 && k * 16 < n) {
    const int64_t m = std::min<int64_t>(n, 65536);
    const int64_t stride = n / m;
    std::vector<K> sample(static_cast<size_t>(m));
    for (int64_t j = 0; j < m; ++j) sample[j] = key_at(x, j * stride);
    // Aim a little above k so one pass usually suffices; widen if the sample was unlucky.
    for (double want = 1.25 * k + 64; !have && want * m / n < m; want *= 4) {
      const int64_t r = static_cast<int64_t>(want * m / n);
      std::nth_element(sample.begin(), sample.begin() + r, sample.end(), std::greater<K>());
      cand.clear();
      cand.reserve(static_cast<size_t>(want * 1.5));
      collect(x, n, sample[r], cand);
      have = static_cast<int64_t>(cand.size()) >= k;
    }
  }
  if (!have) {
    cand.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) cand[i] = static_cast<int32_t>(i);
  }
  // Exact k-th among candidates under (key descending, index ascending).
  std::vector<std::pair<K, int32_t>> ranked(cand.size());
  for (size_t j = 0; j < cand.size(); ++j) ranked[j] = {key_at(x, cand[j]), cand[j]};
  auto before = [](const std::pair<K, int32_t>& a, const std::pair<K, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::nth_element(ranked.begin(), ranked.begin() + (k - 1), ranked.end(), before);
  const auto kth = ranked[k - 1];
  int64_t w = 0;
  for (int32_t i : cand) {  // candidates are in index order, so the output is too
    const K key = key_at(x, i);
    if (key > kth.first || (key == kth.first && i <= kth.second)) idx[w++] = i;
  }
}

struct Layout {
  uint32_t* head;
  int32_t* idx;
  uint8_t* values;
};
Layout layout(void* payload, int64_t k) {
  auto* b = static_cast<uint8_t*>(payload);
  return {reinterpret_cast<uint32_t*>(b), reinterpret_cast<int32_t*>(b + kHeader),
          b + kHeader + index_bytes(k)};
}
const int32_t* indices_of(const void* payload) {
  return reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(payload) + kHeader);
}

void check_k(const void* payload, int64_t k, int64_t rank) {
  uint32_t got;
  std::memcpy(&got, static_cast<const uint8_t*>(payload) + 4, 4);
  if (got != static_cast<uint64_t>(k))
    throw KernelError("topk payload" + (rank >= 0 ? " from rank " + std::to_string(rank) : "") +
                      " carries k=" + std::to_string(got) + " but this rank expects k=" +
                      std::to_string(k) + " (ranks configured with different k or ratio?)");
}

template <class T, class O>
void scatter(const void* payload, int64_t n, int64_t k, double alpha, O* out) {
  const int32_t* idx = indices_of(payload);
  const T* vals = reinterpret_cast<const T*>(static_cast<const uint8_t*>(payload) + kHeader +
                                              index_bytes(k));
  using A = typename Acc<T>::type;
  const A a = static_cast<A>(alpha);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = idx[j];
    if (i < 0 || i >= n)
      throw KernelError("topk payload index " + std::to_string(i) + " outside a tensor of " +
                        std::to_string(n) + " elements (corrupt or mismatched payload)");
    if constexpr (std::is_same_v<O, A>) out[i] += a * to_acc(vals[j]);
    else out[i] = from_acc<T>(to_acc(out[i]) + a * to_acc(vals[j]));
  }
}

}  // namespace

int64_t payload_bytes(DType d, int64_t k) { return kHeader + index_bytes(k) + k * dtype_size(d); }

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  const int64_t k = p.k;
  Layout L = layout(payload, k);
  L.head[0] = payload_tag(kTopK, d);
  L.head[1] = static_cast<uint32_t>(k);
  if (k % 2) L.idx[k] = 0;  // padding to 8 bytes: payloads are deterministic bytes
  if (k == 0) return;
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    if (k == n) {
      for (int64_t i = 0; i < n; ++i) L.idx[i] = static_cast<int32_t>(i);
    } else {
      select(xs, n, k, L.idx);
    }
    T* vals = reinterpret_cast<T*>(L.values);
    for (int64_t j = 0; j < k; ++j) vals[j] = xs[L.idx[j]];
  });
}

void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc) {
  check_tag(payload, kTopK, d, -1);
  check_k(payload, p.k, -1);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = static_cast<T*>(out);
    if (!acc) std::fill(o, o + n, from_acc<T>(0));
    scatter<T, T>(payload, n, p.k, alpha, o);
  });
}

void aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  for (int64_t r = 0; r < ranks; ++r) {
    check_tag(base + r * stride, kTopK, d, r);
    check_k(base + r * stride, p.k, r);
  }
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    if constexpr (std::is_same_v<T, A>) {
      std::fill(o, o + n, A(0));
      for (int64_t r = 0; r < ranks; ++r) scatter<T, A>(base + r * stride, n, p.k, alpha, o);
    } else {
      std::vector<A> accum(static_cast<size_t>(n), A(0));
      for (int64_t r = 0; r < ranks; ++r)
        scatter<T, A>(base + r * stride, n, p.k, alpha, accum.data());
      for (int64_t i = 0; i < n; ++i) o[i] = from_acc<T>(accum[i]);
    }
  });
}

}  // namespace topk
}  // namespace hvdc
