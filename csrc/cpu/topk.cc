// topk: the k elements of largest magnitude, ties broken toward the lower index, sent as
// [u32 tag][u32 k][i32 indices, ascending, padded to 8 bytes][k values in the gradient dtype].
// Selection: a threshold from a histogram of a strided sample, one pass collecting the elements
// at or above it (with error feedback, the same pass adds the residual), then an exact radix
// selection among those few candidates (no sort of the whole gradient).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace hvdc {
namespace topk {
namespace {

constexpr int64_t kHeader = 8;
int64_t index_bytes(int64_t k) { return (k * 4 + 7) / 8 * 8; }

// Selection orders by key_of (hvdc/element.h): NaN ranks above inf, so it gets sent.

// The indices i with key >= t, appended to out in ascending order; for float under AVX2 the
// keys are the float bits without the sign, compared as integers. With kAccumulate the keys are
// those of e = x + e_in, written as it goes.
template <bool kAccumulate>
__attribute__((target("avx2"))) void collect_f32_avx2(const float* x, const float* e_in, float* e,
                                                      int64_t n, uint32_t t,
                                                      std::vector<int32_t>& out) {
  // keys are below 2^31, so a signed compare against t - 1 is the unsigned test key >= t.
  const __m256i thr = _mm256_set1_epi32(static_cast<int32_t>(t) - 1);
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(x + i);
    prefetch_ahead(x + i + 16);
    if constexpr (kAccumulate) {
      prefetch_ahead(e_in + i);
      prefetch_ahead(e_in + i + 16);
    }
    uint32_t m = 0;
    for (int u = 0; u < 4; ++u) {
      __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      if constexpr (kAccumulate) {
        v = _mm256_add_ps(v, _mm256_loadu_ps(e_in + i + 8 * u));
        _mm256_storeu_ps(e + i + 8 * u, v);
      }
      const __m256i k = _mm256_and_si256(_mm256_castps_si256(v), absmask);
      m |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, thr))))
           << (8 * u);
    }
    while (m) {
      out.push_back(static_cast<int32_t>(i + __builtin_ctz(m)));
      m &= m - 1;
    }
  }
  for (; i < n; ++i) {
    const float v = kAccumulate ? (e[i] = x[i] + e_in[i]) : x[i];
    if (key_of(v) >= t) out.push_back(static_cast<int32_t>(i));
  }
}

// collect over x, or with e given, over e = x + e_in as it is written (the error-feedback pass
// and the candidate pass in one sweep of memory).
template <class T, class K>
void collect(const T* x, const T* e_in, T* e, int64_t n, K t, std::vector<int32_t>& out) {
  if constexpr (std::is_same_v<T, float>) {
    collect_at_least(x, e_in, e, n, t, out);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T v = e ? (e[i] = ef_sum(x[i], e_in[i])) : x[i];
      if (key_of(to_acc(v)) >= t) out.push_back(static_cast<int32_t>(i));
    }
  }
}

// Keys (key_of, sign bit clear) fall into bins by their top kBinBits bits below the sign:
// for float, the exponent and 4 mantissa bits, so a bin spans 1/16 of an octave.
constexpr int kBinBits = 12;
template <class K> constexpr int bin_shift() { return 8 * sizeof(K) - 1 - kBinBits; }

// Keys in select()'s sample, taken in runs of kSampleRun (a cache line of float32).
constexpr int64_t kSample = 65536, kSampleRun = 16;

// The k candidates first under (key descending, index ascending), in index order, to idx.
// A radix selection, kBinBits of the key at a time from the top: each round counts the keys
// that share the bits found so far, which finds the k-th key exactly in a few passes over the
// candidates (a comparison selection took a third of this kernel's time).
template <class K>
void exact_top(const std::vector<K>& keys, const std::vector<int32_t>& cand, int64_t k,
               std::vector<uint32_t>& hist, int32_t* idx) {
  K prefix = 0, fixed = 0;  // the bits of the k-th key found so far, and which bits those are
  int64_t need = k;         // its rank among the keys that match prefix on those bits
  for (int top = 8 * sizeof(K) - 1; top > 0; top -= kBinBits) {
    const int shift = std::max(0, top - kBinBits);
    const K digits = (K(1) << (top - shift)) - 1;
    std::fill(hist.begin(), hist.end(), 0);
    for (K key : keys)
      if ((key & fixed) == prefix) ++hist[(key >> shift) & digits];
    K d = digits;
    for (; hist[d] < need; --d) need -= hist[d];
    prefix |= d << shift;
    fixed |= digits << shift;
  }
  // prefix is the k-th key: every key above it is taken, and of the keys equal to it the
  // `need` of lowest index.
  int64_t w = 0;
  for (size_t j = 0; j < keys.size(); ++j)
    if (keys[j] > prefix || (keys[j] == prefix && need-- > 0)) idx[w++] = cand[j];
}

}  // namespace

void take_zeros(const std::vector<int32_t>& nonzero, int64_t k, int32_t* idx) {
  int64_t zeros = k - static_cast<int64_t>(nonzero.size());
  int64_t w = 0, i = 0;
  for (const int32_t next : nonzero) {
    for (; zeros > 0 && i < next; ++i, --zeros) idx[w++] = static_cast<int32_t>(i);
    idx[w++] = next;
    i = next + 1;
  }
  for (; zeros > 0; ++i, --zeros) idx[w++] = static_cast<int32_t>(i);
}

namespace {
// Writes the indices of the top k (ascending) of x, or with e given, of e = x + e_in, which it
// writes. 0 < k < n.
template <class T>
void select(const T* x, const T* e_in, T* e, int64_t n, int64_t k, int32_t* idx) {
  using K = decltype(key_of(to_acc(x[0])));
  auto key_at = [&](int64_t i) { return key_of(to_acc(e ? ef_sum(x[i], e_in[i]) : x[i])); };
  // The threshold is the lower edge of the bin where a histogram of (a sample of) the keys
  // reaches the wanted count from the top: a histogram costs one add per key, where selecting
  // the wanted key of the sample (nth_element) cost several compares per key, which dominated
  // this kernel on tensors under a few million elements. The sample is kSampleRun consecutive
  // keys at evenly spaced places: a key every 16 read every cache line of x and e_in, and
  // cost half as much as the pass that collects the candidates.
  const int64_t m = std::min<int64_t>(n, kSample);
  std::vector<uint32_t> hist(size_t(1) << kBinBits, 0);
  if (m == n) {
    for (int64_t j = 0; j < n; ++j) ++hist[key_at(j) >> bin_shift<K>()];
  } else {
    const int64_t gap = n / (kSample / kSampleRun) / kSampleRun * kSampleRun;
    for (int64_t at = 0; at < gap * (kSample / kSampleRun); at += gap)
      for (int64_t j = at; j < at + kSampleRun; ++j) ++hist[key_at(j) >> bin_shift<K>()];
  }
  // With the whole tensor in the histogram the counts are exact, so k is enough; a sample aims
  // a little above k so one pass usually suffices, and widens if it was unlucky. Only the first
  // pass accumulates e; a widened one reads the e it left.
  std::vector<int32_t> cand;
  int64_t bin = static_cast<int64_t>(hist.size());
  int64_t above = 0;  // sample keys in bins >= bin
  const T* from = x;
  for (double want = m == n ? double(k) : 1.25 * k + 64;; want *= 4) {
    const double r = want * m / n;
    while (bin > 0 && above < r) above += hist[--bin];
    cand.clear();
    cand.reserve(static_cast<size_t>(std::min<double>(n, want * 1.5)));
    // The lowest bin collects the nonzero keys only: zeros are found by take_zeros below.
    const K t = bin > 0 ? static_cast<K>(bin) << bin_shift<K>() : K(1);
    collect(from, e_in, from == x ? e : nullptr, n, t, cand);
    if (e) from = e;
    if (static_cast<int64_t>(cand.size()) >= k || bin == 0) break;
  }
  if (static_cast<int64_t>(cand.size()) < k) return take_zeros(cand, k, idx);
  std::vector<K> keys(cand.size());
  for (size_t j = 0; j < cand.size(); ++j) keys[j] = key_of(to_acc(from[cand[j]]));
  exact_top(keys, cand, k, hist, idx);
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

void collect_at_least(const float* x, const float* e_in, float* e, int64_t n, uint32_t t,
                      std::vector<int32_t>& out) {
  if (cpu_has_avx2_f16c() && t > 0)
    return e ? collect_f32_avx2<true>(x, e_in, e, n, t, out)
             : collect_f32_avx2<false>(x, e_in, e, n, t, out);
  for (int64_t i = 0; i < n; ++i) {
    const float v = e ? (e[i] = x[i] + e_in[i]) : x[i];
    if (key_of(v) >= t) out.push_back(static_cast<int32_t>(i));
  }
}

namespace {
// The payload of x's top k; with e given, of e = x + e_in, which it writes (see ef_encode).
void encode_top(DType d, const void* x, const void* e_in, void* e, int64_t n, const Params& p,
                void* payload) {
  const int64_t k = p.k;
  Layout L = layout(payload, k);
  L.head[0] = payload_tag(kTopK, d);
  L.head[1] = static_cast<uint32_t>(k);
  if (k % 2) L.idx[k] = 0;  // padding to 8 bytes: payloads are deterministic bytes
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    const T* ein = static_cast<const T*>(e_in);
    T* es = static_cast<T*>(e);
    if (k == 0 || k == n) {
      if (es)
        for (int64_t i = 0; i < n; ++i) es[i] = ef_sum(xs[i], ein[i]);
      for (int64_t i = 0; i < k; ++i) L.idx[i] = static_cast<int32_t>(i);
    } else {
      select(xs, ein, es, n, k, L.idx);
    }
    const T* from = es ? es : xs;
    T* vals = reinterpret_cast<T*>(L.values);
    for (int64_t j = 0; j < k; ++j) vals[j] = from[L.idx[j]];
  });
}
}  // namespace

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  encode_top(d, x, nullptr, nullptr, n, p, payload);
}

void ef_accumulate_encode(DType d, const void* x, const void* e_in, void* e, int64_t n,
                          const Params& p, void* payload) {
  encode_top(d, x, e_in, e, n, p, payload);
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
               const Params& p, void* out, double alpha, bool* finite) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  std::vector<sparse::Entries> runs;
  for (int64_t r = 0; r < ranks; ++r) {
    const uint8_t* payload = base + r * stride;
    check_tag(payload, kTopK, d, r);
    check_k(payload, p.k, r);
    runs.push_back({indices_of(payload), payload + kHeader + index_bytes(p.k), p.k});
  }
  sparse::sum_entries(d, runs, n, out, alpha, finite, "topk");
}

}  // namespace topk
}  // namespace hvdc
