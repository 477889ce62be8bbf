// PowerSGD (Vogels et al. 2019) kernels: the memory-bound passes over a gradient matrix M
// (rows x cols, row-major) with a rank-r factor pair. P is rows x r (row-major); Q is kept
// transposed, r x cols, so every pass streams M's rows against contiguous Q rows. P and Q are
// float32 (float64 for float64 gradients). Dot products use eight fixed partial sums, so the
// results do not depend on the instructions the compiler picks.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace hvdc {
namespace {

template <class A, class Row>
A dot8(Row&& row_at, const A* b, int64_t n) {
  A s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) s[l] += row_at(j + l) * b[j + l];
  for (int l = 0; j < n; ++j, ++l) s[l] += row_at(j) * b[j];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// One row of step 3 for float32: m = g (+ e_in, stored to e), and pr[k] = m . q_k for the K
// columns q_k = q + k * cols, in one sweep. The scalar path's order: eight partial sums per
// column, lane l adding the products of j = l mod 8 in order. The K sums are independent, so
// the products hide in the time the row takes to arrive from memory: done after the row, one
// column at a time, each sum a chain of dependent adds, they made the pass 1.4x slower.
template <int K>
__attribute__((target("avx2"))) void project_row_f32_avx2(const float* g, const float* e_in,
                                                          float* e, const float* q,
                                                          int64_t cols, float* pr, bool stream) {
  __m256 acc[K];
  for (int k = 0; k < K; ++k) acc[k] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    __m256 m = _mm256_loadu_ps(g + j);
    if (e_in) {
      m = _mm256_add_ps(m, _mm256_loadu_ps(e_in + j));
      if (stream) _mm256_stream_ps(e + j, m);
      else _mm256_storeu_ps(e + j, m);
    }
    for (int k = 0; k < K; ++k)
      acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(m, _mm256_loadu_ps(q + k * cols + j)));
  }
  float s[K][8];
  for (int k = 0; k < K; ++k) _mm256_storeu_ps(s[k], acc[k]);
  for (int l = 0; j < cols; ++j, ++l) {
    float m = g[j];
    if (e_in) e[j] = m = m + e_in[j];
    for (int k = 0; k < K; ++k) s[k][l] += m * q[k * cols + j];
  }
  for (int k = 0; k < K; ++k)
    pr[k] = ((s[k][0] + s[k][1]) + (s[k][2] + s[k][3])) +
            ((s[k][4] + s[k][5]) + (s[k][6] + s[k][7]));
}

// Columns four at a time; the first group also forms M (into e with error feedback), the
// others read it back from e while the row is still in cache. With four columns or fewer
// nothing reads M again before the back-projection, after P's allreduce: it goes around the
// cache (when every row starts 32-byte aligned), saving the read-for-ownership of a buffer
// that was last touched a step ago.
__attribute__((target("avx2"))) void project_f32_avx2(const float* g, const float* e_in, float* e,
                                                      bool ef, int64_t rows, int64_t cols,
                                                      const float* q, int64_t r, float* p) {
  const bool stream =
      ef && r <= 4 && cols % 8 == 0 && (reinterpret_cast<uintptr_t>(e) & 31) == 0;
  for (int64_t i = 0; i < rows; ++i) {
    const float* gr = g + i * cols;
    const float* eir = ef ? e_in + i * cols : nullptr;
    float* er = ef ? e + i * cols : nullptr;
    for (int64_t c = 0; c < r; c += 4) {
      const float* a = c == 0 || !ef ? gr : er;
      const float* b = c == 0 ? eir : nullptr;
      const float* qc = q + c * cols;
      float* pr = p + i * r + c;
      switch (std::min<int64_t>(4, r - c)) {
        case 4: project_row_f32_avx2<4>(a, b, er, qc, cols, pr, stream); break;
        case 3: project_row_f32_avx2<3>(a, b, er, qc, cols, pr, stream); break;
        case 2: project_row_f32_avx2<2>(a, b, er, qc, cols, pr, stream); break;
        default: project_row_f32_avx2<1>(a, b, er, qc, cols, pr, stream); break;
      }
    }
  }
  if (stream) _mm_sfence();
}

// Step 6's Qt += (rows i0..i0+K of M)^T P for float32: eight columns of the K rows are loaded
// once and added into every column of Q, rows in order as the scalar path adds them (a sum
// kept in a register or stored and loaded again between rows rounds alike). The scalar
// path's order, column of Q by column, reads the block of M r times.
template <int K>
__attribute__((target("avx2"))) void back_project_rows_f32_avx2(const float* m, int64_t cols,
                                                                const float* p, int64_t r,
                                                                float* q) {
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    __m256 mv[K];
    for (int k = 0; k < K; ++k) mv[k] = _mm256_loadu_ps(m + k * cols + j);
    for (int64_t c = 0; c < r; ++c) {
      float* qc = q + c * cols + j;
      __m256 v = _mm256_loadu_ps(qc);
      for (int k = 0; k < K; ++k)
        v = _mm256_add_ps(v, _mm256_mul_ps(mv[k], _mm256_set1_ps(p[k * r + c])));
      _mm256_storeu_ps(qc, v);
    }
  }
  for (; j < cols; ++j)
    for (int64_t c = 0; c < r; ++c) {
      float v = q[c * cols + j];
      for (int k = 0; k < K; ++k) v += m[k * cols + j] * p[k * r + c];
      q[c * cols + j] = v;
    }
}

__attribute__((target("avx2"))) void back_project_f32_avx2(const float* m, int64_t rows,
                                                           int64_t cols, const float* p,
                                                           int64_t r, float* q) {
  std::fill(q, q + r * cols, 0.0f);
  int64_t i = 0;
  for (; i + 8 <= rows; i += 8) back_project_rows_f32_avx2<8>(m + i * cols, cols, p + i * r, r, q);
  for (; i < rows; ++i) back_project_rows_f32_avx2<1>(m + i * cols, cols, p + i * r, r, q);
}

// o[0, 8) = alpha * acc or o - acc, noting in `bad` the lanes that are inf or NaN.
__attribute__((target("avx2"), always_inline)) inline void put_f32_avx2(
    float* o, __m256 acc, __m256 alpha, bool subtract, bool stream, __m256i& bad) {
  const __m256 v = subtract ? _mm256_sub_ps(_mm256_loadu_ps(o), acc) : _mm256_mul_ps(alpha, acc);
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  const __m256i e = _mm256_and_si256(_mm256_castps_si256(v), exponent);
  bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, exponent));
  if (stream) _mm256_stream_ps(o, v);
  else _mm256_storeu_ps(o, v);
}

// Step 9 (and the residual of step 6) for float32: out = alpha * P Q^T, or out - P Q^T, 64
// columns of a row at a time in registers, each sum adding the r products in order from 0 as
// the scalar path does. Outputs that are only written go around the cache when every row
// starts 32-byte aligned: nothing reads them before the optimizer's update, long after, and
// the read-for-ownership would double their traffic. With `finite`, whether every value
// written is finite, checked in registers on its way out.
__attribute__((target("avx2"))) void reconstruct_f32_avx2(const float* p, const float* q,
                                                          int64_t rows, int64_t cols, int64_t r,
                                                          float* out, float alpha, bool subtract,
                                                          bool* finite) {
  const bool stream =
      !subtract && cols % 8 == 0 && (reinterpret_cast<uintptr_t>(out) & 31) == 0;
  const __m256 a = _mm256_set1_ps(alpha);
  __m256i bad = _mm256_setzero_si256();
  bool tail_finite = true;
  for (int64_t i = 0; i < rows; ++i) {
    const float* pr = p + i * r;
    float* orow = out + i * cols;
    int64_t j = 0;
    for (; j + 64 <= cols; j += 64) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      for (int64_t c = 0; c < r; ++c) {
        const __m256 pc = _mm256_set1_ps(pr[c]);
        const float* qc = q + c * cols + j;
        for (int u = 0; u < 8; ++u)
          acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(pc, _mm256_loadu_ps(qc + 8 * u)));
      }
      for (int u = 0; u < 8; ++u) put_f32_avx2(orow + j + 8 * u, acc[u], a, subtract, stream, bad);
    }
    for (; j + 8 <= cols; j += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < r; ++c)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(pr[c]),
                                               _mm256_loadu_ps(q + c * cols + j)));
      put_f32_avx2(orow + j, acc, a, subtract, stream, bad);
    }
    for (; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t c = 0; c < r; ++c) acc += pr[c] * q[c * cols + j];
      orow[j] = subtract ? orow[j] - acc : alpha * acc;
      tail_finite = tail_finite && std::isfinite(orow[j]);
    }
  }
  if (stream) _mm_sfence();
  if (finite) *finite = tail_finite && _mm256_testz_si256(bad, bad);
}

template <class F> void dispatch_factors(DType d, F&& fn) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fn(tag, static_cast<typename Acc<T>::type*>(nullptr));
  });
}

void check_shape(int64_t rows, int64_t cols, int64_t r) {
  if (rows < 0 || cols < 0 || r < 1)
    throw KernelError("powersgd: need rows, cols >= 0 and rank >= 1, got " + std::to_string(rows) +
                      " x " + std::to_string(cols) + ", rank " + std::to_string(r));
}

}  // namespace

void powersgd_project(DType d, const void* g, const void* e_in, void* e, bool ef, int64_t rows,
                      int64_t cols, const void* qt, int64_t r, void* p) {
  check_shape(rows, cols, r);
  with_avx2([&] {
    dispatch_factors(d, [&](auto* ttag, auto* atag) {
      using T = std::remove_pointer_t<decltype(ttag)>;
      using A = std::remove_pointer_t<decltype(atag)>;
      const T* gs = static_cast<const T*>(g);
      const T* eis = static_cast<const T*>(e_in);
      T* es = static_cast<T*>(e);
      const A* q = static_cast<const A*>(qt);
      A* ps = static_cast<A*>(p);
      if constexpr (std::is_same_v<T, float>) {
        if (cpu_has_avx2_f16c())
          return project_f32_avx2(gs, eis, es, ef, rows, cols, q, r, ps);
      }
      std::vector<A> m(static_cast<size_t>(cols));
      for (int64_t i = 0; i < rows; ++i) {
        const T* gr = gs + i * cols;
        if (ef) {  // e holds M = g + e_in until the residual is taken
          const T* eir = eis + i * cols;
          T* er = es + i * cols;
          for (int64_t j = 0; j < cols; ++j) {
            er[j] = ef_sum(gr[j], eir[j]);
            m[j] = to_acc(er[j]);
          }
        } else {
          for (int64_t j = 0; j < cols; ++j) m[j] = to_acc(gr[j]);
        }
        for (int64_t c = 0; c < r; ++c)
          ps[i * r + c] = dot8<A>([&](int64_t j) { return m[j]; }, q + c * cols, cols);
      }
    });
  });
}

void powersgd_initial_q(DType d, uint64_t seed, int64_t r, int64_t cols, void* qt) {
  check_shape(0, cols, r);
  if (d != kF32 && d != kF64)
    throw KernelError("powersgd: factors are float32 or float64, got dtype " + std::to_string(d));
  constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t i = 0; i < r * cols; ++i) {
    const uint64_t pair = static_cast<uint64_t>(i / 2);
    const double u1 = (static_cast<double>(mix64(seed + (2 * pair + 1) * kGolden) >> 11) + 1.0) *
                      0x1p-53;  // (0, 1]: the logarithm stays finite
    const double u2 = static_cast<double>(mix64(seed + (2 * pair + 2) * kGolden) >> 11) * 0x1p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double v = radius * (i % 2 ? std::sin(kTwoPi * u2) : std::cos(kTwoPi * u2));
    if (d == kF64)
      static_cast<double*>(qt)[i] = v;
    else
      static_cast<float*>(qt)[i] = static_cast<float>(v);
  }
}

void powersgd_orthogonalize(DType d, void* p, int64_t rows, int64_t r, double eps) {
  check_shape(rows, 1, r);
  dispatch_factors(d, [&](auto*, auto* atag) {
    using A = std::remove_pointer_t<decltype(atag)>;
    A* ps = static_cast<A*>(p);
    for (int64_t c = 0; c < r; ++c) {
      A sq = 0;
      for (int64_t i = 0; i < rows; ++i) sq += ps[i * r + c] * ps[i * r + c];
      const A norm = std::sqrt(sq) + static_cast<A>(eps);
      for (int64_t i = 0; i < rows; ++i) ps[i * r + c] /= norm;
      for (int64_t c2 = c + 1; c2 < r; ++c2) {
        A proj = 0;
        for (int64_t i = 0; i < rows; ++i) proj += ps[i * r + c] * ps[i * r + c2];
        for (int64_t i = 0; i < rows; ++i) ps[i * r + c2] -= proj * ps[i * r + c];
      }
    }
  });
}

void powersgd_back_project(DType d, const void* mat, int64_t rows, int64_t cols, const void* p,
                           int64_t r, void* qt) {
  check_shape(rows, cols, r);
  with_avx2([&] {
    dispatch_factors(d, [&](auto* ttag, auto* atag) {
      using T = std::remove_pointer_t<decltype(ttag)>;
      using A = std::remove_pointer_t<decltype(atag)>;
      const T* ms = static_cast<const T*>(mat);
      const A* ps = static_cast<const A*>(p);
      A* q = static_cast<A*>(qt);
      if constexpr (std::is_same_v<T, float>) {
        if (cpu_has_avx2_f16c()) return back_project_f32_avx2(ms, rows, cols, ps, r, q);
      }
      std::fill(q, q + r * cols, A(0));
      // kRows rows at a time: each element of Q is loaded and stored once per block rather
      // than once per row, and still adds the rows in order.
      constexpr int64_t kRows = 4;
      auto rows_from = [&](int64_t i0, auto count) {
        constexpr int64_t K = decltype(count)::value;
        for (int64_t c = 0; c < r; ++c) {
          A pc[K];
          for (int64_t k = 0; k < K; ++k) pc[k] = ps[(i0 + k) * r + c];
          A* qc = q + c * cols;
          const T* mr = ms + i0 * cols;
          for (int64_t j = 0; j < cols; ++j) {
            A v = qc[j];
            for (int64_t k = 0; k < K; ++k) v += to_acc(mr[k * cols + j]) * pc[k];
            qc[j] = v;
          }
        }
      };
      int64_t i = 0;
      for (; i + kRows <= rows; i += kRows) rows_from(i, std::integral_constant<int64_t, kRows>{});
      for (; i < rows; ++i) rows_from(i, std::integral_constant<int64_t, 1>{});
    });
  });
}

void powersgd_reconstruct(DType d, const void* p, const void* qt, int64_t rows, int64_t cols,
                          int64_t r, void* out, double alpha, bool subtract_from_out,
                          bool* finite) {
  check_shape(rows, cols, r);
  with_avx2([&] {
    dispatch_factors(d, [&](auto* ttag, auto* atag) {
      using T = std::remove_pointer_t<decltype(ttag)>;
      using A = std::remove_pointer_t<decltype(atag)>;
      const A* ps = static_cast<const A*>(p);
      const A* q = static_cast<const A*>(qt);
      T* o = static_cast<T*>(out);
      if constexpr (std::is_same_v<T, float>) {
        if (cpu_has_avx2_f16c())
          return reconstruct_f32_avx2(ps, q, rows, cols, r, o, static_cast<float>(alpha),
                                      subtract_from_out, finite);
      }
      const A a = static_cast<A>(alpha);
      // A block of a row's sums stays in registers across the r factor columns, so each
      // output element is read and written once; each sum adds the columns in order from 0.
      constexpr int64_t kBlock = 64 / sizeof(A) * 4;
      auto block = [&](int64_t i, int64_t j0, auto width) {
        constexpr int64_t W = decltype(width)::value;
        const int64_t w = W ? W : cols - j0;
        A acc[W ? W : kBlock];
        for (int64_t jj = 0; jj < w; ++jj) acc[jj] = A(0);
        for (int64_t c = 0; c < r; ++c) {
          const A pc = ps[i * r + c];
          const A* qc = q + c * cols + j0;
          for (int64_t jj = 0; jj < w; ++jj) acc[jj] += pc * qc[jj];
        }
        T* orow = o + i * cols + j0;
        if (subtract_from_out)
          for (int64_t jj = 0; jj < w; ++jj) orow[jj] = from_acc<T>(to_acc(orow[jj]) - acc[jj]);
        else
          for (int64_t jj = 0; jj < w; ++jj) orow[jj] = from_acc<T>(a * acc[jj]);
      };
      bool all = true;
      for (int64_t i = 0; i < rows; ++i) {
        int64_t j0 = 0;
        for (; j0 + kBlock <= cols; j0 += kBlock)
          block(i, j0, std::integral_constant<int64_t, kBlock>{});
        if (j0 < cols) block(i, j0, std::integral_constant<int64_t, 0>{});
        // The row is still in L1: checking it now costs no pass over memory.
        if (finite && all) all = all_finite(d, o + i * cols, cols);
      }
      if (finite) *finite = all;
    });
  });
}

}  // namespace hvdc
