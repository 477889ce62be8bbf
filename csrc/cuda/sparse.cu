// topk, threshold and DGC (layouts in csrc/cpu/topk.cc and sparse.cc).
//
// Selection is a radix select: the k-th largest magnitude key is found 8 bits at a time by
// histograms over the keys still matching the prefix found so far (4 passes for 32-bit keys,
// 8 for 64-bit), never by sorting. The chosen elements are then written by an ordered
// compaction (per-tile counts, a scan over tiles, per-tile block scans), so indices come out
// ascending, ties at the k-th key go to the lowest indices, and the payload is byte for byte
// the CPU's. Every count and threshold stays on the device.
#include <algorithm>
#include <climits>
#include <vector>

#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

int64_t index_bytes(int64_t k) { return (k * 4 + 7) / 8 * 8; }
constexpr int64_t kTopkHeader = 8;
constexpr int64_t kThrHeader = 8;
constexpr int64_t kDgcHeader = 16;

// Magnitude keys with the order of |x| (NaN above inf), in the accumulator type's width.
template <class A> struct KeyType { using type = uint32_t; };
template <> struct KeyType<double> { using type = uint64_t; };

// ---- radix select ---------------------------------------------------------------------------
// Up to kTargets ranks are selected in the same passes (DGC's sample thresholds).
constexpr int kTargets = 5;

template <class K> struct Target {
  K prefix, mask;
  int64_t remaining;  // rank still to find among keys matching prefix; at the end, how many
                      // keys equal to prefix are taken
};

template <class K> struct Targets {
  Target<K> t[kTargets];
};

template <class K>
__global__ void select_init(Target<K>* st, Targets<K> init, int ntargets) {
  if (static_cast<int>(threadIdx.x) < ntargets) st[threadIdx.x] = init.t[threadIdx.x];
}

template <class K, class Keys>
__global__ void select_hist(Keys keys, int64_t m, const Target<K>* st, int ntargets, int shift,
                            unsigned long long* hist) {
  __shared__ unsigned h[kTargets * 256];
  for (int b = threadIdx.x; b < ntargets * 256; b += blockDim.x) h[b] = 0;
  K prefix[kTargets], mask[kTargets];
  for (int t = 0; t < ntargets; ++t) {
    prefix[t] = st[t].prefix;
    mask[t] = st[t].mask;
  }
  __syncthreads();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m;
       i += int64_t(gridDim.x) * blockDim.x) {
    const K key = keys(i);
    const unsigned digit = static_cast<unsigned>((key >> shift) & 0xff);
    for (int t = 0; t < ntargets; ++t)
      if ((key & mask[t]) == prefix[t]) atomicAdd(&h[t * 256 + digit], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < ntargets * 256; b += blockDim.x)
    if (h[b]) atomicAdd(&hist[b], static_cast<unsigned long long>(h[b]));
}

template <class K>
__global__ void select_pick(Target<K>* st, int ntargets, int shift, unsigned long long* hist) {
  const int t = threadIdx.x;
  if (t < ntargets) {
    int64_t cum = 0;
    const int64_t want = st[t].remaining;
    for (int d = 255; d >= 0; --d) {
      const int64_t c = static_cast<int64_t>(hist[t * 256 + d]);
      if (cum + c >= want) {
        st[t].prefix |= static_cast<K>(d) << shift;
        st[t].mask |= static_cast<K>(0xff) << shift;
        st[t].remaining = want - cum;
        break;
      }
      cum += c;
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < ntargets * 256; b += blockDim.x) hist[b] = 0;
}

// st[t] ends as (the ranks[t]-th largest key, how many keys equal to it are among the top
// ranks[t]). 1 <= ranks[t] <= m. scratch: 256 * kTargets counters.
template <class K, class Keys>
void radix_select(Keys keys, int64_t m, const int64_t* ranks, int ntargets, Target<K>* st,
                  unsigned long long* hist, cudaStream_t s) {
  Targets<K> init{};
  for (int t = 0; t < ntargets; ++t) init.t[t] = {K(0), K(0), ranks[t]};
  select_init<K><<<1, 32, 0, s>>>(st, init, ntargets);
  check(cudaMemsetAsync(hist, 0, 256 * kTargets * sizeof(unsigned long long), s), "memset");
  for (int shift = 8 * static_cast<int>(sizeof(K)) - 8; shift >= 0; shift -= 8) {
    select_hist<K><<<blocks_for(m), kThreads, 0, s>>>(keys, m, st, ntargets, shift, hist);
    select_pick<K><<<1, kThreads, 0, s>>>(st, ntargets, shift, hist);
  }
}

// ---- ordered compaction ---------------------------------------------------------------------
// Element i is taken when flags(i) has bit 0 (strict) or has bit 1 (a tie) and fewer than
// *take ties come before it. write(position, i) stores it; positions follow i.
constexpr int kItems = 16;
constexpr int64_t kTile = kThreads * kItems;

template <class Flags>
__global__ void compact_count(Flags flags, int64_t n, int64_t* strict, int64_t* ties) {
  __shared__ int64_t smem[kThreads / 32];
  const int64_t tiles = (n + kTile - 1) / kTile;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t cs = 0, ce = 0;
    for (int it = 0; it < kItems; ++it) {
      const int64_t i = tile * kTile + it * kThreads + threadIdx.x;
      if (i < n) {
        const unsigned f = flags(i);
        cs += f & 1u;
        ce += (f >> 1) & 1u;
      }
    }
    const int64_t bs = block_sum(cs, smem);
    const int64_t be = block_sum(ce, smem);
    if (threadIdx.x == 0) {
      strict[tile] = bs;
      ties[tile] = be;
    }
  }
}

// Exclusive scans over tiles (one block), in place; *total = what the compaction will write.
__global__ void compact_scan(int64_t* strict, int64_t* ties, int64_t tiles, const int64_t* take,
                             int64_t* total) {
  __shared__ int64_t smem[32];
  int64_t run_s = 0, run_e = 0;
  for (int64_t base = 0; base < tiles; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    const int64_t vs = j < tiles ? strict[j] : 0, ve = j < tiles ? ties[j] : 0;
    int64_t ts, te;
    const int64_t xs = block_exclusive_scan(vs, smem, &ts);
    const int64_t xe = block_exclusive_scan(ve, smem, &te);
    if (j < tiles) {
      strict[j] = run_s + xs;
      ties[j] = run_e + xe;
    }
    run_s += ts;
    run_e += te;
  }
  if (threadIdx.x == 0) {
    const int64_t lim = take ? *take : LLONG_MAX;
    *total = run_s + (run_e < lim ? run_e : lim);
  }
}

template <class Flags, class Write>
__global__ void compact_write(Flags flags, Write write, int64_t n, const int64_t* strict,
                              const int64_t* ties, const int64_t* take) {
  __shared__ int64_t smem[32];
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t lim = take ? *take : LLONG_MAX;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t tie_base = ties[tile];
    int64_t out = strict[tile] + (tie_base < lim ? tie_base : lim);
    for (int it = 0; it < kItems; ++it) {
      const int64_t i = tile * kTile + it * kThreads + threadIdx.x;
      const unsigned f = i < n ? flags(i) : 0u;
      int64_t tie_total, sel_total;
      const int64_t tie_rank = tie_base + block_exclusive_scan((f >> 1) & 1u, smem, &tie_total);
      const bool sel = (f & 1u) || (((f >> 1) & 1u) && tie_rank < lim);
      const int64_t pos = out + block_exclusive_scan(sel ? 1 : 0, smem, &sel_total);
      if (sel) write(pos, i);
      tie_base += tie_total;
      out += sel_total;
    }
  }
}

// Scratch: 2 * tiles counters. total: device int64.
template <class Flags, class Write>
void compact(Flags flags, Write write, int64_t n, const int64_t* take, int64_t* counters,
             int64_t* total, cudaStream_t s) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  if (tiles == 0) {
    check(cudaMemsetAsync(total, 0, sizeof(int64_t), s), "memset");
    return;
  }
  compact_count<<<blocks_for(tiles, 1), kThreads, 0, s>>>(flags, n, counters, counters + tiles);
  compact_scan<<<1, kThreads, 0, s>>>(counters, counters + tiles, tiles, take, total);
  compact_write<<<blocks_for(tiles, 1), kThreads, 0, s>>>(flags, write, n, counters,
                                                          counters + tiles, take);
}

int64_t compact_scratch(int64_t n) { return 2 * ((n + kTile - 1) / kTile) * sizeof(int64_t); }

// ---- functors -------------------------------------------------------------------------------
template <class T> struct MagKeys {  // key of |x[i * stride]|
  const T* x;
  int64_t stride;
  __device__ auto operator()(int64_t i) const { return key_of(to_acc(x[i * stride])); }
};

template <class T, class K> struct RuleFlags {  // key > rule, or a tie at it
  const T* x;
  const Target<K>* rule;
  __device__ unsigned operator()(int64_t i) const {
    const K key = key_of(to_acc(x[i]));
    return key > rule->prefix ? 1u : key == rule->prefix ? 2u : 0u;
  }
};

template <class T> struct AboveFlags {  // threshold: !(|x| <= t), so NaN is sent
  const T* x;
  typename Acc<T>::type t;
  __device__ unsigned operator()(int64_t i) const { return !(fabs(to_acc(x[i])) <= t) ? 1u : 0u; }
};

template <class T> struct WriteIdxVal {  // idx[pos] = i, vals[pos] = x[i]; vals may depend on count
  const T* x;
  int32_t* idx;
  uint8_t* payload;
  int64_t vals_fixed;      // >= 0: byte offset of the values
  const int64_t* count;    // else: values at header + index_bytes(*count)
  int64_t header;
  __device__ void operator()(int64_t pos, int64_t i) const {
    idx[pos] = static_cast<int32_t>(i);
    const int64_t off = vals_fixed >= 0 ? vals_fixed : header + (*count * 4 + 7) / 8 * 8;
    reinterpret_cast<T*>(payload + off)[pos] = x[i];
  }
};

template <class T> struct WriteDgc {  // payload entry, then momentum factor masking
  T* u;
  T* v;
  int32_t* idx;
  T* vals;
  __device__ void operator()(int64_t pos, int64_t i) const {
    idx[pos] = static_cast<int32_t>(i);
    vals[pos] = v[i];
    u[i] = from_acc<T>(0);
    v[i] = from_acc<T>(0);
  }
};

// Header words and the index padding slot (k odd), once the count is known on the device.
__global__ void sparse_header(uint8_t* payload, uint32_t tag, int64_t fixed_count, const int64_t* count,
                              int count_word, uint32_t k_word_value, int64_t header) {
  const int64_t c = count ? *count : fixed_count;
  put_u32(payload, 0, tag);
  if (count_word == 1) {
    put_u32(payload, 1, static_cast<uint32_t>(c));
  } else {  // dgc: [tag][k][count][0]
    put_u32(payload, 1, k_word_value);
    put_u32(payload, 2, static_cast<uint32_t>(c));
    put_u32(payload, 3, 0);
  }
  if (count_word == 1 && c % 2) reinterpret_cast<int32_t*>(payload + header)[c] = 0;
}

// out (+)= alpha * scattered values, one launch per rank so sums follow rank order as on the
// CPU. Entries outside [0, n) are skipped (they can only come from a corrupted payload).
template <class T, class A>
__global__ void scatter_k(const int32_t* idx, const T* vals, int64_t count, const uint32_t* count_dev,
                          int64_t n, A alpha, A* acc) {
  if (count_dev && *count_dev < count) count = *count_dev;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < count;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx[j];
    if (i >= 0 && i < n) acc[i] += alpha * to_acc(vals[j]);
  }
}

template <class T, class A> __global__ void widen_k(const T* o, A* acc, int64_t n, bool keep) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    acc[i] = keep ? to_acc(o[i]) : A(0);
}
template <class T, class A> __global__ void narrow_k(const A* acc, T* o, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    o[i] = from_acc<T>(acc[i]);
}

// Sum over ranks of alpha * (idx, vals, count) entries, as csrc/cpu/sparse.cc's reduce_sparse.
// entry(r) gives a rank's device pointers and the launch bound `count`; when the real count
// is only on the device (DGC), count_dev points to it.
struct Entry {
  const int32_t* idx;
  const void* vals;
  int64_t count;
  const uint32_t* count_dev;
};
template <class F>
void reduce_sparse(DType d, int64_t n, void* out, double alpha, bool accumulate, int64_t ranks,
                   F&& entry, cudaStream_t s) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* o = static_cast<T*>(out);
    const bool wide = !std::is_same_v<T, A>;
    Scratch scratch(wide ? n * sizeof(A) : 0, s);
    A* acc = wide ? scratch.as<A>() : reinterpret_cast<A*>(o);
    if (n) {
      if (wide) widen_k<T, A><<<blocks_for(n), kThreads, 0, s>>>(o, acc, n, accumulate);
      else if (!accumulate) check(cudaMemsetAsync(acc, 0, n * sizeof(A), s), "memset");
    }
    for (int64_t r = 0; r < ranks; ++r) {
      const Entry e = entry(r);
      if (e.count)
        scatter_k<T, A><<<blocks_for(e.count), kThreads, 0, s>>>(
            e.idx, static_cast<const T*>(e.vals), e.count, e.count_dev, n, static_cast<A>(alpha), acc);
    }
    if (wide && n) narrow_k<T, A><<<blocks_for(n), kThreads, 0, s>>>(acc, o, n);
  });
  check_launch("sparse reduce");
}

// ---- DGC ------------------------------------------------------------------------------------
template <class T>
__global__ void sumsq_k(const T* x, int64_t n, double* partial) {
  __shared__ double smem[kThreads / 32];
  double s = 0.0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double g = to_acc(x[i]);
    s += g * g;
  }
  s = block_sum(s, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

template <class A>
__global__ void clip_scale_k(const double* partial, int64_t parts, double clip_norm, A* scale) {
  __shared__ double smem[kThreads / 32];
  double s = 0.0;
  for (int64_t j = threadIdx.x; j < parts; j += blockDim.x) s += partial[j];
  s = block_sum(s, smem);
  if (threadIdx.x == 0) {
    // Rounded to float for float64 as on the CPU (csrc/cpu/sparse.cc): the order of the sum
    // differs, the rounded norm does not.
    const double norm = std::is_same_v<A, double> ? static_cast<float>(sqrt(s)) : sqrt(s);
    *scale = norm > clip_norm ? static_cast<A>(clip_norm / norm) : A(1);
  }
}

// u = mf * u_in + g * scale; v = v_in + u, each rounded to the state's dtype (u, v may be
// u_in, v_in).
template <class T>
__global__ void dgc_update(const T* x, const T* u_in, const T* v_in, T* u, T* v, int64_t n,
                           double mf, const typename Acc<T>::type* scale) {
  using A = typename Acc<T>::type;
  const A m = static_cast<A>(mf);
  const A sc = scale ? *scale : A(1);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const A ui = round_to<T>(m * to_acc(u_in[i]) + to_acc(x[i]) * sc);
    const A vi = round_to<T>(to_acc(v_in[i]) + ui);
    u[i] = from_acc<T>(ui);
    v[i] = from_acc<T>(vi);
  }
}

// How many keys reach each attempt's threshold.
template <class T, class K>
__global__ void dgc_count(const T* v, int64_t n, const Target<K>* thr, int attempts,
                          unsigned long long* counts) {
  __shared__ unsigned long long smem[kThreads / 32];
  K t[kTargets];
  for (int a = 0; a < attempts; ++a) t[a] = thr[a].prefix;
  unsigned long long c[kTargets] = {0, 0, 0, 0, 0};
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const K key = key_of(to_acc(v[i]));
    for (int a = 0; a < attempts; ++a) c[a] += key >= t[a] ? 1u : 0u;
  }
  for (int a = 0; a < attempts; ++a) {
    const unsigned long long b = block_sum(c[a], smem);
    if (threadIdx.x == 0 && b) atomicAdd(&counts[a], b);
  }
}

// The attempt csrc/cpu/sparse.cc's dgc_select stops at, and the rule the compaction applies:
// all keys >= its threshold when at most k reach it, else the exact top k.
template <class K>
__global__ void dgc_choose(const Target<K>* thr, const unsigned long long* counts, int attempts,
                           const int64_t* ranks, int64_t m, int64_t k, const Target<K>* topk,
                           Target<K>* rule) {
  int a = 0;
  for (; a < attempts - 1; ++a)
    if (static_cast<int64_t>(counts[a]) * 5 >= k * 4 || ranks[a] >= m) break;
  if (static_cast<int64_t>(counts[a]) > k) *rule = *topk;
  else *rule = {thr[a].prefix, K(0), LLONG_MAX};
}

struct DgcRanks {
  int64_t r[kTargets];
};
__global__ void put_ranks(int64_t* dst, DgcRanks src) {
  if (threadIdx.x < kTargets) dst[threadIdx.x] = src.r[threadIdx.x];
}

}  // namespace

namespace sparse {

void topk_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s) {
  const int64_t k = p.k;
  auto* out = static_cast<uint8_t*>(payload);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using K = typename KeyType<typename Acc<T>::type>::type;
    const T* xs = static_cast<const T*>(x);
    if (k > 0) {
      // [target (<= 32 bytes)][histograms][total][compaction counters]
      constexpr size_t kHistAt = 32;
      const size_t total_at = kHistAt + 256 * kTargets * sizeof(unsigned long long);
      Scratch scratch(total_at + sizeof(int64_t) + compact_scratch(n), s);
      auto* st = scratch.as<Target<K>>();
      auto* hist = scratch.as<unsigned long long>(kHistAt);
      int64_t* total = scratch.as<int64_t>(total_at);
      radix_select<K>(MagKeys<T>{xs, 1}, n, &k, 1, st, hist, s);
      // ties at the k-th key: as many as the select left in `remaining`
      compact(RuleFlags<T, K>{xs, st},
              WriteIdxVal<T>{xs, reinterpret_cast<int32_t*>(out + kTopkHeader), out,
                             kTopkHeader + index_bytes(k), nullptr, kTopkHeader},
              n, &st->remaining, total + 1, total, s);
    }
    sparse_header<<<1, 1, 0, s>>>(out, payload_tag(kTopK, d), k, nullptr, 1, 0, kTopkHeader);
  });
  check_launch("topk encode");
}

void topk_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                    const Params& p, void* out, double alpha, bool acc, cudaStream_t s) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  const int64_t k = p.k;
  reduce_sparse(d, n, out, alpha, acc, ranks, [&](int64_t r) {
    const uint8_t* h = base + r * stride;
    return Entry{reinterpret_cast<const int32_t*>(h + kTopkHeader), h + kTopkHeader + index_bytes(k), k,
                 nullptr};
  }, s);
}

void threshold_encode(DType d, const void* x, int64_t n, const Params& p, void* payload, cudaStream_t s) {
  auto* out = static_cast<uint8_t*>(payload);
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    const T* xs = static_cast<const T*>(x);
    Scratch scratch(sizeof(int64_t) + compact_scratch(n), s);
    int64_t* total = scratch.as<int64_t>();
    compact(AboveFlags<T>{xs, static_cast<A>(p.threshold)},
            WriteIdxVal<T>{xs, reinterpret_cast<int32_t*>(out + kThrHeader), out, -1, total, kThrHeader},
            n, nullptr, total + 1, total, s);
    sparse_header<<<1, 1, 0, s>>>(out, payload_tag(kThreshold, d), 0, total, 1, 0, kThrHeader);
  });
  check_launch("threshold encode");
}

void threshold_aggregate(DType d, const void* payloads, const int64_t* offsets, int64_t ranks,
                         int64_t n, void* out, double alpha, bool acc, cudaStream_t s) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  std::vector<uint32_t> counts(static_cast<size_t>(ranks));
  for (int64_t r = 0; r < ranks; ++r)
    check(cudaMemcpyAsync(&counts[r], base + offsets[r] + 4, 4, cudaMemcpyDeviceToHost, s), "copy");
  check(cudaStreamSynchronize(s), "threshold counts");
  reduce_sparse(d, n, out, alpha, acc, ranks, [&](int64_t r) {
    const uint8_t* h = base + offsets[r];
    return Entry{reinterpret_cast<const int32_t*>(h + kThrHeader),
                 h + kThrHeader + index_bytes(counts[r]), counts[r], nullptr};
  }, s);
}

void dgc_encode(DType d, const void* x, const void* u_in, const void* v_in, void* u, void* v,
                int64_t n, const Params& p, void* payload, cudaStream_t s) {
  const int64_t k = p.k;
  auto* out = static_cast<uint8_t*>(payload);
  check(cudaMemsetAsync(out, 0, kDgcHeader + index_bytes(k) + k * (d == kF32 ? 4 : d == kF64 ? 8 : 2), s),
        "memset");
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    using K = typename KeyType<A>::type;
    T* us = static_cast<T*>(u);
    T* vs = static_cast<T*>(v);
    // layout: [scale A][pad][targets: kTargets sample + 1 top-k + 1 rule][hist][ranks][counts]
    //         [count, counters...]
    const size_t tgt = 8 + sizeof(Target<K>) * (kTargets + 2);
    const size_t hist_at = (tgt + 7) / 8 * 8;
    const size_t ranks_at = hist_at + 256 * kTargets * sizeof(unsigned long long);
    const size_t counts_at = ranks_at + kTargets * sizeof(int64_t);
    const size_t total_at = counts_at + kTargets * sizeof(unsigned long long);
    const unsigned parts = blocks_for(n);
    Scratch scratch(total_at + sizeof(int64_t) + compact_scratch(n) + parts * sizeof(double), s);
    A* scale = scratch.as<A>();
    auto* sample_t = scratch.as<Target<K>>(8);
    Target<K>* topk_t = sample_t + kTargets;
    Target<K>* rule = topk_t + 1;
    auto* hist = scratch.as<unsigned long long>(hist_at);
    auto* ranks_dev = scratch.as<int64_t>(ranks_at);
    auto* counts = scratch.as<unsigned long long>(counts_at);
    auto* total = scratch.as<int64_t>(total_at);
    int64_t* counters = total + 1;
    auto* partial = reinterpret_cast<double*>(counters + compact_scratch(n) / sizeof(int64_t));

    if (p.clip_norm > 0.0 && n) {
      sumsq_k<T><<<parts, kThreads, 0, s>>>(static_cast<const T*>(x), n, partial);
      clip_scale_k<A><<<1, kThreads, 0, s>>>(partial, parts, p.clip_norm, scale);
    }
    if (n)
      dgc_update<T><<<blocks_for(n), kThreads, 0, s>>>(
          static_cast<const T*>(x), static_cast<const T*>(u_in), static_cast<const T*>(v_in), us,
          vs, n, p.momentum_factor, p.clip_norm > 0.0 ? scale : nullptr);
    if (k > 0 && n > 0) {
      // The 1% strided sample and the ranks dgc_select tries in it (r, 2r, 4r, ...).
      const int64_t stride = std::max<int64_t>(1, n / std::max<int64_t>(1, n / 100));
      const int64_t m = (n + stride - 1) / stride;
      int64_t ranks[kTargets];
      DgcRanks dr{};
      int64_t r = std::max<int64_t>(1, (k * m + n / 2) / n);
      for (int a = 0; a < kTargets; ++a, r *= 2) {
        dr.r[a] = r;
        ranks[a] = std::min(r, m);
      }
      put_ranks<<<1, 32, 0, s>>>(ranks_dev, dr);
      radix_select<K>(MagKeys<T>{vs, stride}, m, ranks, kTargets, sample_t, hist, s);
      check(cudaMemsetAsync(counts, 0, kTargets * sizeof(unsigned long long), s), "memset");
      dgc_count<T, K><<<blocks_for(n), kThreads, 0, s>>>(vs, n, sample_t, kTargets, counts);
      radix_select<K>(MagKeys<T>{vs, 1}, n, &k, 1, topk_t, hist, s);
      dgc_choose<K><<<1, 1, 0, s>>>(sample_t, counts, kTargets, ranks_dev, m, k, topk_t, rule);
      compact(RuleFlags<T, K>{vs, rule},
              WriteDgc<T>{us, vs, reinterpret_cast<int32_t*>(out + kDgcHeader),
                          reinterpret_cast<T*>(out + kDgcHeader + index_bytes(k))},
              n, &rule->remaining, counters, total, s);
    } else {
      check(cudaMemsetAsync(total, 0, sizeof(int64_t), s), "memset");
    }
    sparse_header<<<1, 1, 0, s>>>(out, payload_tag(kDGC, d), 0, total, 2, static_cast<uint32_t>(k),
                                  kDgcHeader);
  });
  check_launch("dgc encode");
}

void dgc_aggregate(DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
                   const Params& p, void* out, double alpha, bool acc, cudaStream_t s) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  const int64_t k = p.k;
  // The capacity k bounds the launch; the kernel reads the payload's own count (header word 2)
  // on the device, so it never has to reach the host.
  reduce_sparse(d, n, out, alpha, acc, ranks, [&](int64_t r) {
    const uint8_t* h = base + r * stride;
    return Entry{reinterpret_cast<const int32_t*>(h + kDgcHeader), h + kDgcHeader + index_bytes(k),
                 n ? k : 0, reinterpret_cast<const uint32_t*>(h) + 2};
  }, s);
}

}  // namespace sparse
}  // namespace gpu
}  // namespace hvdc
