// randomk: stratified random sampling. The n elements are cut into k strata
// [floor(j*n/k), floor((j+1)*n/k)); one element is drawn from each by a counter-based hash of
// (seed, j). Every rank derives the same seed, so the indices agree without being sent: the
// payload is just the k values, and it travels by allreduce. Indices come out sorted and
// distinct, so the gather is a forward walk through memory.
#include "common.h"

namespace hvdc {
namespace randomk {
namespace {

inline uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Stratum {
  int64_t index;
  int64_t size;
};

inline Stratum stratum(int64_t j, int64_t n, int64_t k, uint64_t seed) {
  const int64_t lo = static_cast<int64_t>((static_cast<__int128>(j) * n) / k);
  const int64_t hi = static_cast<int64_t>((static_cast<__int128>(j + 1) * n) / k);
  const uint64_t h = mix64(seed + static_cast<uint64_t>(j + 1) * 0x9e3779b97f4a7c15ull);
  return {lo + static_cast<int64_t>(h % static_cast<uint64_t>(hi - lo)), hi - lo};
}

}  // namespace

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    T* vals = static_cast<T*>(payload);
    for (int64_t j = 0; j < p.k; ++j) vals[j] = xs[stratum(j, n, p.k, p.seed).index];
  });
}

void decode(DType d, const void* payload, int64_t n, const Params& p, void* out, double alpha,
            bool acc) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    const T* vals = static_cast<const T*>(payload);
    T* o = static_cast<T*>(out);
    if (!acc) std::fill(o, o + n, from_acc<T>(0));
    const A a = static_cast<A>(alpha);
    for (int64_t j = 0; j < p.k; ++j) {
      const Stratum s = stratum(j, n, p.k, p.seed);
      A v = to_acc(vals[j]);
      if (p.rescale) v = v * static_cast<A>(s.size);
      o[s.index] = from_acc<T>(to_acc(o[s.index]) + a * v);
    }
  });
}

}  // namespace randomk
}  // namespace hvdc
