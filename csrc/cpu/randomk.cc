// randomk: stratified random sampling. The n elements are cut into k strata
// [floor(j*n/k), floor((j+1)*n/k)); one element is drawn from each by a counter-based hash of
// (seed, j). Every rank derives the same seed, so the indices agree without being sent: the
// payload is just the k values, and it travels by allreduce. Indices come out sorted and
// distinct, so the gather is a forward walk through memory.
#include "common.h"

namespace hvdc {
namespace randomk {
namespace {

// Walks the strata in order without a division per stratum:
// lo_j = j*q + floor(j*r/k) with q = n/k, r = n%k; the floor part steps by one when the running
// remainder wraps. The element inside a stratum is stratum_pick() (hvdc/element.h).
class Strata {
 public:
  Strata(int64_t n, int64_t k, uint64_t seed) : k_(k), q_(n / k), r_(n % k), seed_(seed) {}
  // Index drawn in stratum j (called for j = 0, 1, 2, ... in order) and that stratum's size.
  int64_t next(int64_t j, int64_t* size) {
    const bool carry = rem_ + r_ >= k_;
    *size = q_ + (carry ? 1 : 0);
    rem_ = rem_ + r_ - (carry ? k_ : 0);
    const int64_t idx = stratum_pick(lo_, *size, seed_, j);
    lo_ += *size;
    return idx;
  }

 private:
  int64_t k_, q_, r_;
  uint64_t seed_;
  int64_t lo_ = 0, rem_ = 0;
};

}  // namespace

void encode(DType d, const void* x, int64_t n, const Params& p, void* payload) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    T* vals = static_cast<T*>(payload);
    if (p.k == 0) return;
    Strata strata(n, p.k, p.seed);
    int64_t size;
    for (int64_t j = 0; j < p.k; ++j) vals[j] = xs[strata.next(j, &size)];
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
    if (p.k == 0) return;
    Strata strata(n, p.k, p.seed);
    for (int64_t j = 0; j < p.k; ++j) {
      int64_t size;
      const int64_t i = strata.next(j, &size);
      A v = to_acc(vals[j]);
      if (p.rescale) v = v * static_cast<A>(size);
      o[i] = from_acc<T>(to_acc(o[i]) + a * v);
    }
  });
}

}  // namespace randomk
}  // namespace hvdc
