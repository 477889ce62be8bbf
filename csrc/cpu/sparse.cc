// Threshold sparsification and Deep Gradient Compression (Lin et al. 2018).
//
// threshold payload (variable size): [u32 tag][u32 count][i32 indices, ascending, padded to 8]
//   [count values in the gradient dtype]; every element with |x| > threshold. payload_bytes is
//   the capacity (all n kept); encoded_bytes is what was filled. Never empty: a rank with
//   nothing above the threshold still sends its 8-byte header, so collectives see a payload.
// dgc payload (fixed size, so allgather sizes match on all ranks): [u32 tag][u32 k][u32 count]
//   [u32 0][i32 indices[k], ascending, padded to 8][values[k]]; slots past count are zero.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace hvdc {
namespace sparse {
namespace {

int64_t index_bytes(int64_t k) { return (k * 4 + 7) / 8 * 8; }
constexpr int64_t kThrHeader = 8;
constexpr int64_t kDgcHeader = 16;

// A value as the state tensor stores it: the state is in the gradient's dtype.
template <class T> typename Acc<T>::type round_to(typename Acc<T>::type v) {
  return to_acc(from_acc<T>(v));
}

uint32_t read_u32(const void* p, int64_t off) {
  uint32_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(p) + off, 4);
  return v;
}

// out[idx[j]] += alpha * vals[j] for count entries, in the accumulator type.
template <class T, class A>
void scatter(const int32_t* idx, const T* vals, int64_t count, int64_t n, A alpha, A* acc,
             const char* what) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t i = idx[j];
    if (i < 0 || i >= n)
      throw KernelError(std::string(what) + " payload index " + std::to_string(i) +
                        " outside a tensor of " + std::to_string(n) + " elements");
    acc[i] += alpha * to_acc(vals[j]);
  }
}

// Sum over payloads of alpha * D(payload), each given as (indices, values, count); with
// accumulate, added to out.
template <class F>
void reduce_sparse(DType d, int64_t n, void* out, double alpha, bool accumulate, int64_t ranks,
                   F&& entry, const char* what, bool* finite) {
  std::vector<Entries> runs(static_cast<size_t>(ranks));
  for (int64_t r = 0; r < ranks; ++r) entry(r, &runs[r].idx, &runs[r].vals, &runs[r].count);
  if (!accumulate) return sum_entries(d, runs, n, out, alpha, finite, what);
  // Adding into a tensor (error feedback's residual): only the entries' elements are touched.
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    if constexpr (std::is_same_v<T, A>) {
      for (const Entries& e : runs)
        scatter(e.idx, static_cast<const T*>(e.vals), e.count, n, static_cast<A>(alpha), o, what);
    } else {  // narrower dtypes add in a float copy
      std::vector<A> wide(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) wide[i] = to_acc(o[i]);
      for (const Entries& e : runs)
        scatter(e.idx, static_cast<const T*>(e.vals), e.count, n, static_cast<A>(alpha),
                wide.data(), what);
      for (int64_t i = 0; i < n; ++i) o[i] = from_acc<T>(wide[i]);
    }
  });
  if (finite) *finite = all_finite(d, out, n);
}

// sum_entries works through the output a block of this many elements at a time, in a buffer
// that stays in L1: the block is zeroed there, every rank's entries that fall in it are added,
// it is checked for inf and NaN, and written out once. Zeroing the whole output first and
// scattering into it after touched each of its cache lines twice, and the step's finiteness
// check read them all a third time.
constexpr int64_t kSumBlock = 2048;

template <class T>
void sum_entries_as(DType d, const std::vector<Entries>& runs, int64_t n, T* o, double alpha,
                    bool* finite, const char* what) {
  using A = typename Acc<T>::type;
  const A a = static_cast<A>(alpha);
  std::vector<int64_t> next(runs.size(), 0);
  std::vector<A> acc(kSumBlock);
  std::vector<T> narrow(std::is_same_v<T, A> ? 0 : kSumBlock);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  // 100 4-MiB buckets at 6% density from two ranks: 59 ms with plain stores, 42-47 streamed.
  const bool stream = cpu_has_avx2_f16c() && bytes >= kLaterBytes;
  bool ok = true;
  for (int64_t lo = 0; lo < n; lo += kSumBlock) {
    const int64_t len = std::min(kSumBlock, n - lo);
    std::fill(acc.begin(), acc.begin() + len, A(0));
    for (size_t r = 0; r < runs.size(); ++r) {
      const int32_t* idx = runs[r].idx;
      const T* vals = static_cast<const T*>(runs[r].vals);
      int64_t j = next[r];
      for (; j < runs[r].count && idx[j] < lo + len; ++j) {
        if (idx[j] < lo) {
          if (idx[j] < 0)
            throw KernelError(std::string(what) + " payload index " + std::to_string(idx[j]) +
                              " outside a tensor of " + std::to_string(n) + " elements");
          throw KernelError(std::string(what) + " payload indices are not ascending (" +
                            std::to_string(idx[j - 1]) + " before " + std::to_string(idx[j]) +
                            "): a corrupt payload");
        }
        acc[idx[j] - lo] += a * to_acc(vals[j]);
      }
      next[r] = j;
    }
    const T* block;
    if constexpr (std::is_same_v<T, A>) {
      block = acc.data();
    } else {
      for (int64_t i = 0; i < len; ++i) narrow[i] = from_acc<T>(acc[i]);
      block = narrow.data();
    }
    if (finite && ok) ok = all_finite(d, block, len);
    const int64_t b = len * static_cast<int64_t>(sizeof(T));
    if (stream) stream_copy_avx2(o + lo, block, b);
    else std::memcpy(o + lo, block, static_cast<size_t>(b));
  }
  if (stream) _mm_sfence();
  for (size_t r = 0; r < runs.size(); ++r)
    if (next[r] < runs[r].count)
      throw KernelError(std::string(what) + " payload index " +
                        std::to_string(runs[r].idx[next[r]]) + " outside a tensor of " +
                        std::to_string(n) + " elements");
  if (finite) *finite = ok;
}

// DGC's selection samples every dgc_stride(n)-th key of the accumulated velocity (1%).
int64_t dgc_stride(int64_t n) { return std::max<int64_t>(1, n / std::max<int64_t>(1, n / 100)); }

// Indices (ascending) of the at most k largest |v|, DGC style: a threshold from the 1% strided
// sample (its keys in `sample`) at the target density, lowered (up to 4 times) while fewer than
// 0.8k pass it, then an exact top-k among the candidates (ties to the lower index) when more
// than k pass. Magnitudes compare as key_of keys, as in the CUDA kernel: a NaN in the velocity
// is sent. The first candidates come from first(t, cand), the pass that also writes v, so
// that v is swept again only when the threshold must come down.
template <class A, class K, class First>
std::vector<int32_t> dgc_select(const A* v, int64_t n, int64_t k, std::vector<K> sample,
                                First&& first) {
  std::vector<int32_t> cand;
  const int64_t m = static_cast<int64_t>(sample.size());
  int64_t r = std::max<int64_t>(1, (k * m + n / 2) / n);
  int64_t placed = 0;  // sample[0, placed) holds the largest values, each >= what follows
  bool at_zero = false;  // the threshold fell to 0: only nonzero keys were collected
  for (int attempt = 0; attempt < 5; ++attempt) {
    // The r-th largest sample value. Lowering r later only looks past the ones placed before,
    // so the sample is partitioned once overall (selection, not a sort).
    const int64_t at = std::min(r, m) - 1;
    std::nth_element(sample.begin() + placed, sample.begin() + at, sample.end(), std::greater<K>());
    placed = at + 1;
    // At a threshold of 0 only the nonzero keys are collected; take_zeros adds zeros below.
    at_zero = sample[at] == 0;
    const K thr = at_zero ? K(1) : sample[at];
    cand.clear();
    if (attempt == 0) {
      first(thr, cand);
    } else if constexpr (std::is_same_v<A, float>) {
      topk::collect_at_least(v, nullptr, nullptr, n, thr, cand);
    } else {
      for (int64_t i = 0; i < n; ++i)
        if (key_of(v[i]) >= thr) cand.push_back(static_cast<int32_t>(i));
    }
    if (static_cast<int64_t>(cand.size()) * 5 >= k * 4 || r >= m || at_zero) break;
    r *= 2;
  }
  if (at_zero && static_cast<int64_t>(cand.size()) < k) {
    std::vector<int32_t> top(static_cast<size_t>(k));
    topk::take_zeros(cand, k, top.data());
    return top;
  }
  if (static_cast<int64_t>(cand.size()) > k) {
    std::vector<int32_t> order(cand);
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), [&](int32_t a, int32_t b) {
      const K fa = key_of(v[a]), fb = key_of(v[b]);
      return fa != fb ? fa > fb : a < b;
    });
    order.resize(static_cast<size_t>(k));
    std::sort(order.begin(), order.end());
    cand.swap(order);
  }
  return cand;
}

// DGC's momentum correction and accumulation, u = mf u_in + scale x and v = v_in + u, with
// the indices whose new key_of(v) is at least t (t > 0) appended to out in ascending order:
// the update and the first candidate pass in one sweep of memory. The same float operations in
// the same order as the scalar loop, so the same bits. A state written apart from state_in is
// read again only at the next step: from kLaterBytes it goes around the cache, from the first
// element where u (and v with it) lies on a 32-byte boundary.
__attribute__((target("avx2"))) void dgc_step_f32_avx2(const float* x, const float* u_in,
                                                       const float* v_in, float* u, float* v,
                                                       int64_t n, float mf, float scale,
                                                       uint32_t t, std::vector<int32_t>& out) {
  // keys are below 2^31, so a signed compare against t - 1 is the unsigned test key >= t.
  const __m256i thr = _mm256_set1_epi32(static_cast<int32_t>(t) - 1);
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  const __m256 vm = _mm256_set1_ps(mf), vs = _mm256_set1_ps(scale);
  auto one = [&](int64_t j) {
    u[j] = mf * u_in[j] + x[j] * scale;
    v[j] = v_in[j] + u[j];
    if (key_of(v[j]) >= t) out.push_back(static_cast<int32_t>(j));
  };
  const auto at = [](const float* q) { return reinterpret_cast<uintptr_t>(q); };
  const bool stream = u != u_in && 4 * n >= kLaterBytes && ((at(u) ^ at(v)) & 31) == 0 &&
                      (at(u) & 3) == 0;
  int64_t i = 0;
  if (stream)
    for (; i < n && (at(u + i) & 31); ++i) one(i);
  for (; i + 32 <= n; i += 32) {
    for (int64_t ahead = 0; ahead < 32; ahead += 16) {
      prefetch_ahead(x + i + ahead);
      prefetch_ahead(u_in + i + ahead);
      prefetch_ahead(v_in + i + ahead);
    }
    uint32_t mask = 0;
    for (int w = 0; w < 4; ++w) {
      const int64_t j = i + 8 * w;
      const __m256 uj = _mm256_add_ps(_mm256_mul_ps(vm, _mm256_loadu_ps(u_in + j)),
                                      _mm256_mul_ps(_mm256_loadu_ps(x + j), vs));
      const __m256 vj = _mm256_add_ps(_mm256_loadu_ps(v_in + j), uj);
      if (stream) {
        _mm256_stream_ps(u + j, uj);
        _mm256_stream_ps(v + j, vj);
      } else {
        _mm256_storeu_ps(u + j, uj);
        _mm256_storeu_ps(v + j, vj);
      }
      const __m256i key = _mm256_and_si256(_mm256_castps_si256(vj), absmask);
      mask |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(
                  _mm256_cmpgt_epi32(key, thr)))) << (8 * w);
    }
    while (mask) {
      out.push_back(static_cast<int32_t>(i + __builtin_ctz(mask)));
      mask &= mask - 1;
    }
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) one(i);
}

}  // namespace

void sum_entries(DType d, const std::vector<Entries>& ranks, int64_t n, void* out, double alpha,
                 bool* finite, const char* what) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    sum_entries_as(d, ranks, n, static_cast<T*>(out), alpha, finite, what);
  });
}

int64_t threshold_capacity(DType d, int64_t n) { return kThrHeader + index_bytes(n) + n * dtype_size(d); }

int64_t threshold_used(DType d, const void* payload) {
  const int64_t c = read_u32(payload, 4);
  return kThrHeader + index_bytes(c) + c * dtype_size(d);
}

namespace {
// The threshold payload of x, or with e given, of e = x + e, which it writes.
void threshold_select(DType d, const void* x, const void* e_in, void* e, int64_t n,
                      const Params& p, void* payload) {
  auto* out = static_cast<uint8_t*>(payload);
  auto* idx = reinterpret_cast<int32_t*>(out + kThrHeader);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    const T* xs = static_cast<const T*>(x);
    const T* ein = static_cast<const T*>(e_in);
    T* es = static_cast<T*>(e);
    const A t = static_cast<A>(p.threshold);
    int64_t c = 0;
    if constexpr (std::is_same_v<T, float>) {
      // !(|v| <= t) is key_of(v) > key_of(t) for t >= 0, NaN included: top-k's candidate pass,
      // which also adds the residual as it goes (one pass over x and e, vectorised).
      std::vector<int32_t> taken;
      topk::collect_at_least(xs, ein, es, n, key_of(t) + 1, taken);
      c = static_cast<int64_t>(taken.size());
      std::copy(taken.begin(), taken.end(), idx);
    } else {
      if (es)
        for (int64_t i = 0; i < n; ++i) es[i] = ef_sum(xs[i], ein[i]);
      const T* from = es ? es : xs;
      for (int64_t i = 0; i < n; ++i)
        if (!(std::fabs(to_acc(from[i])) <= t)) idx[c++] = static_cast<int32_t>(i);  // NaN is sent
    }
    if (c % 2) idx[c] = 0;
    const T* from = es ? es : xs;
    T* vals = reinterpret_cast<T*>(out + kThrHeader + index_bytes(c));
    for (int64_t j = 0; j < c; ++j) vals[j] = from[idx[j]];
    const uint32_t head[2] = {payload_tag(kThreshold, d), static_cast<uint32_t>(c)};
    std::memcpy(out, head, 8);
  });
}

// For each 8-bit lane mask, the lanes it sets, in order, then zeros: the permutation that
// packs a vector's selected lanes to its front.
struct PackTable {
  alignas(32) int32_t lanes[256][8];
  PackTable() {
    for (int m = 0; m < 256; ++m) {
      int w = 0;
      for (int b = 0; b < 8; ++b)
        if (m >> b & 1) lanes[m][w++] = b;
      for (; w < 8; ++w) lanes[m][w] = 0;
    }
  }
};
const PackTable kPack;

// threshold_ef_encode for float32: each vector of p = x + e_in is compared with t, the lanes
// above it are packed to the front of their vector and stored at idx and vals (8 lanes a store,
// the next store overwriting the unused ones), and e gets p, or p + alpha * p where it was sent
// (what the decode into e computes, bit for bit: 0 at prescale 1, NaN for inf), in one store,
// around the cache when large. Returns the count. idx and vals have room for n.
// Error feedback drives threshold's density up (bench/network.py's MLP row sends 1% of the
// elements at its first step and 16% by its tenth); there, appending lane by lane to growing
// vectors took 3-8x as long (24 buckets of 4 MiB at 16-32%: 41-104 ms, against 12 now).
__attribute__((target("avx2"))) int64_t threshold_ef_f32_avx2(const float* x, const float* e_in,
                                                               float* e, int64_t n,
                                                               uint32_t key_t, float alpha,
                                                               int32_t* idx, float* vals) {
  // keys are below 2^31, so the signed compare is the unsigned key > key_t
  const __m256i thr = _mm256_set1_epi32(static_cast<int32_t>(key_t));
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t c = 0;
  auto one = [&](int64_t i) {
    const float v = x[i] + e_in[i];
    if (key_of(v) > key_t) {
      idx[c] = static_cast<int32_t>(i);
      vals[c++] = v;
      e[i] = v + alpha * v;
    } else {
      e[i] = v;
    }
  };
  // Elements up to e's first 32-byte boundary go one by one, so that a residual that starts
  // inside a parameter's slot (a bucket's piece) streams too.
  const int64_t head = std::min<int64_t>(n, ((32 - (reinterpret_cast<uintptr_t>(e) & 31)) & 31) / 4);
  const bool stream = n * 4 >= kLaterBytes && (reinterpret_cast<uintptr_t>(e) & 3) == 0;
  int64_t i = 0;
  for (; i < head; ++i) one(i);
  // A store of 8 lanes at c writes at most 7 past the count, and c <= i: inside the room for n.
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(x + i);
    prefetch_ahead(e_in + i);
    for (int u = 0; u < 2; ++u) {
      const int64_t at = i + 8 * u;
      const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + at), _mm256_loadu_ps(e_in + at));
      const __m256 sent = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), absmask), thr));
      const int m = _mm256_movemask_ps(sent);
      // No branch on m: at the densities error feedback reaches, whether a vector has a lane to
      // send is a coin toss, and the mispredictions cost more than the stores.
      const __m256 kept = _mm256_blendv_ps(v, _mm256_add_ps(v, _mm256_mul_ps(a, v)), sent);
      const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPack.lanes[m]));
      const __m256i at_v = _mm256_add_epi32(iota, _mm256_set1_epi32(static_cast<int32_t>(at)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + c),
                          _mm256_permutevar8x32_epi32(at_v, order));
      _mm256_storeu_ps(vals + c, _mm256_permutevar8x32_ps(v, order));
      c += __builtin_popcount(static_cast<unsigned>(m));
      if (stream) _mm256_stream_ps(e + at, kept);
      else _mm256_storeu_ps(e + at, kept);
    }
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) one(i);
  return c;
}
}  // namespace

void threshold_encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  threshold_select(d, x, nullptr, nullptr, n, p, payload);
}

void threshold_ef_encode(DType d, const void* x, const void* e_in, void* e, int64_t n,
                         const Params& p, void* payload, double alpha) {
  if (d != kF32 || !cpu_has_avx2_f16c()) {
    threshold_select(d, x, e_in, e, n, p, payload);
    return threshold_aggregate(d, payload, 1, threshold_used(d, payload), n, e, alpha, true);
  }
  // Indices go straight to their place; the values, whose place depends on the count, to the
  // end of the payload's room, then down to it.
  auto* out = static_cast<uint8_t*>(payload);
  auto* idx = reinterpret_cast<int32_t*>(out + kThrHeader);
  auto* room = reinterpret_cast<float*>(out + kThrHeader + index_bytes(n));
  const int64_t c = threshold_ef_f32_avx2(
      static_cast<const float*>(x), static_cast<const float*>(e_in), static_cast<float*>(e), n,
      key_of(static_cast<float>(p.threshold)), static_cast<float>(alpha), idx, room);
  const uint32_t head[2] = {payload_tag(kThreshold, d), static_cast<uint32_t>(c)};
  std::memcpy(out, head, 8);
  if (c % 2) idx[c] = 0;
  std::memmove(out + kThrHeader + index_bytes(c), room, 4 * static_cast<size_t>(c));
}

void threshold_aggregate(DType d, const void* payloads, int64_t ranks, int64_t total, int64_t n,
                         void* out, double alpha, bool acc, bool* finite) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  std::vector<int64_t> offsets;
  int64_t off = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    if (off + kThrHeader > total)
      throw KernelError("threshold: gathered payloads end after " + std::to_string(r) + " of " +
                        std::to_string(ranks) + " ranks");
    check_tag(base + off, kThreshold, d, r);
    const int64_t c = read_u32(base + off, 4);
    if (c > n)
      throw KernelError("threshold payload from rank " + std::to_string(r) + " holds " +
                        std::to_string(c) + " elements of a tensor of " + std::to_string(n));
    offsets.push_back(off);
    off += threshold_used(d, base + off);
  }
  if (off != total)
    throw KernelError("threshold: gathered payloads are " + std::to_string(total) +
                      " bytes, their headers add up to " + std::to_string(off));
  reduce_sparse(d, n, out, alpha, acc, ranks, [&](int64_t r, const int32_t** idx, const void** vals,
                                                  int64_t* count) {
    const uint8_t* h = base + offsets[r];
    *count = read_u32(h, 4);
    *idx = reinterpret_cast<const int32_t*>(h + kThrHeader);
    *vals = h + kThrHeader + index_bytes(*count);
  }, "threshold", finite);
}

int64_t dgc_payload_bytes(DType d, int64_t k) { return kDgcHeader + index_bytes(k) + k * dtype_size(d); }

void dgc_encode(DType d, const void* x, const void* u_in, const void* v_in, void* u, void* v,
                int64_t n, const Params& p, void* payload) {
  const int64_t k = p.k;
  auto* out = static_cast<uint8_t*>(payload);
  std::memset(out, 0, static_cast<size_t>(dgc_payload_bytes(d, k)));
  auto* idx = reinterpret_cast<int32_t*>(out + kDgcHeader);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    const T* xs = static_cast<const T*>(x);
    const T* u0 = static_cast<const T*>(u_in);
    const T* v0 = static_cast<const T*>(v_in);
    T* us = static_cast<T*>(u);
    T* vs = static_cast<T*>(v);
    A scale = 1;
    if (p.clip_norm > 0.0) {
      double sq = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const double g = to_acc(xs[i]);
        sq += g * g;
      }
      // A float64 gradient's norm is rounded to float as well: the GPU adds the squares in
      // another order, and only the rounding makes both give the same scale.
      const double norm = std::is_same_v<A, double> ? static_cast<float>(std::sqrt(sq)) : std::sqrt(sq);
      if (norm > p.clip_norm) scale = static_cast<A>(p.clip_norm / norm);
    }
    const A mf = static_cast<A>(p.momentum_factor);
    auto next_v = [&](int64_t i, A* ui) {
      *ui = round_to<T>(mf * to_acc(u0[i]) + to_acc(xs[i]) * scale);
      return round_to<T>(to_acc(v0[i]) + *ui);
    };
    // Selection reads v in the accumulator type: in place for float32/float64, a copy else.
    std::vector<A> widened(std::is_same_v<T, A> ? 0 : static_cast<size_t>(n));
    // The update, collecting the keys at least t on the way when t > 0.
    auto step = [&](auto t, std::vector<int32_t>& cand) {
      if constexpr (std::is_same_v<T, float>) {
        if (t > 0 && cpu_has_avx2_f16c()) {
          dgc_step_f32_avx2(xs, u0, v0, us, vs, n, mf, scale, t, cand);
          return;
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        A ui;
        const A vi = next_v(i, &ui);
        us[i] = from_acc<T>(ui);
        vs[i] = from_acc<T>(vi);
        if constexpr (!std::is_same_v<T, A>) widened[i] = vi;
        if (t > 0 && key_of(vi) >= t) cand.push_back(static_cast<int32_t>(i));
      }
    };
    using K = decltype(key_of(A()));
    std::vector<int32_t> sel;
    if (k == 0 || n == 0) {
      step(K(0), sel);
    } else {
      // The sample is of the velocity after this step's update, computed ahead of it.
      std::vector<K> sample;
      const int64_t stride = dgc_stride(n);
      for (int64_t i = 0; i < n; i += stride) {
        A ui;
        sample.push_back(key_of(next_v(i, &ui)));
      }
      const A* acc = nullptr;
      if constexpr (std::is_same_v<T, A>) acc = vs;
      else acc = widened.data();
      sel = dgc_select(acc, n, k, std::move(sample), step);
    }
    T* vals = reinterpret_cast<T*>(out + kDgcHeader + index_bytes(k));
    for (size_t j = 0; j < sel.size(); ++j) {
      idx[j] = sel[j];
      vals[j] = vs[sel[j]];
      us[sel[j]] = from_acc<T>(A(0));  // momentum factor masking
      vs[sel[j]] = from_acc<T>(A(0));
    }
    const uint32_t head[3] = {payload_tag(kDGC, d), static_cast<uint32_t>(k),
                              static_cast<uint32_t>(sel.size())};
    std::memcpy(out, head, 12);
  });
}

void dgc_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                   const Params& p, void* out, double alpha, bool acc, bool* finite) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  for (int64_t r = 0; r < ranks; ++r) {
    const uint8_t* h = base + r * stride;
    check_tag(h, kDGC, d, r);
    if (read_u32(h, 4) != static_cast<uint64_t>(p.k) || read_u32(h, 8) > static_cast<uint64_t>(p.k))
      throw KernelError("dgc payload from rank " + std::to_string(r) + " has capacity " +
                        std::to_string(read_u32(h, 4)) + ", this rank k=" + std::to_string(p.k));
  }
  reduce_sparse(d, n, out, alpha, acc, ranks, [&](int64_t r, const int32_t** idx, const void** vals,
                                                  int64_t* count) {
    const uint8_t* h = base + r * stride;
    *count = read_u32(h, 8);
    *idx = reinterpret_cast<const int32_t*>(h + kDgcHeader);
    *vals = h + kDgcHeader + index_bytes(p.k);
  }, "dgc", finite);
}

}  // namespace sparse
}  // namespace hvdc
