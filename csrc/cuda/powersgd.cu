// PowerSGD passes (csrc/cpu/powersgd.cc) over a batch of same-shape matrices, one launch per
// pass for the whole batch. project, back_project and reconstruct add in the CPU's order, so
// they match it bit for bit: project's dot products use eight partial sums (element j goes to
// partial j % 8, combined as ((0+1)+(2+3))+((4+5)+(6+7))), which is eight threads per row here,
// combined by shuffles in that tree. Orthogonalisation reduces over rows in a block, in a
// different order from the CPU's running sum.
#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

constexpr int kMaxBatch = 32;  // matrices per launch (pointers travel as a kernel argument)
constexpr int kCols = 8;       // factor columns kept in registers per sweep

struct Ptrs {
  const void* in[kMaxBatch];
  const void* in2[kMaxBatch];  // project's old residuals, which may be `out`
  void* out[kMaxBatch];
};

// Eight threads per (matrix, row). With ef, the first sweep forms M = g + e_in and stores it in
// e; later sweeps (rank > kCols) read M back from e, each thread touching only its own elements.
template <class T, class A>
__global__ void project_k(Ptrs ptrs, bool ef, int64_t batch, int64_t rows, int64_t cols,
                          const A* qt, int64_t r, A* p) {
  const int lane8 = threadIdx.x & 7;
  // Grid-stride by whole blocks, so every lane of a warp runs the same iterations (shuffles).
  for (int64_t base = blockIdx.x * int64_t(blockDim.x); base < batch * rows * 8;
       base += int64_t(gridDim.x) * blockDim.x) {
    const int64_t item = (base + threadIdx.x) / 8;
    const bool live = item < batch * rows;
    const int64_t b = live ? item / rows : 0, i = live ? item % rows : 0;
    const T* g = static_cast<const T*>(ptrs.in[b]) + i * cols;
    const T* e_in = ef ? static_cast<const T*>(ptrs.in2[b]) + i * cols : nullptr;
    T* e = ef ? static_cast<T*>(ptrs.out[b]) + i * cols : nullptr;
    const A* q = qt + b * r * cols;
    for (int64_t c0 = 0; c0 < r; c0 += kCols) {
      A s[kCols];
      for (int c = 0; c < kCols; ++c) s[c] = A(0);
      if (live) {
        for (int64_t j = lane8; j < cols; j += 8) {
          A m;
          if (ef && c0 == 0) {
            const T mt = from_acc<T>(to_acc(g[j]) + to_acc(e_in[j]));
            e[j] = mt;
            m = to_acc(mt);
          } else {
            m = ef ? to_acc(e[j]) : to_acc(g[j]);
          }
          for (int c = 0; c < kCols; ++c)
            if (c0 + c < r) s[c] += m * q[(c0 + c) * cols + j];
        }
      }
      for (int c = 0; c < kCols; ++c) {
        A v = s[c];
        v = v + __shfl_xor_sync(0xffffffffu, v, 1, 8);
        v = v + __shfl_xor_sync(0xffffffffu, v, 2, 8);
        v = v + __shfl_xor_sync(0xffffffffu, v, 4, 8);
        if (live && lane8 == 0 && c0 + c < r) p[(b * rows + i) * r + c0 + c] = v;
      }
    }
  }
}

// One block per matrix: Gram-Schmidt over P's columns.
template <class A>
__global__ void orthogonalize_k(A* p, int64_t rows, int64_t r, double eps) {
  __shared__ A smem[kThreads / 32];
  __shared__ A bcast;
  A* pb = p + blockIdx.x * rows * r;
  for (int64_t c = 0; c < r; ++c) {
    A sq = 0;
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) sq += pb[i * r + c] * pb[i * r + c];
    sq = block_sum(sq, smem);
    if (threadIdx.x == 0) bcast = sqrt(sq) + static_cast<A>(eps);
    __syncthreads();
    const A norm = bcast;
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) pb[i * r + c] /= norm;
    __syncthreads();
    for (int64_t c2 = c + 1; c2 < r; ++c2) {
      A proj = 0;
      for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) proj += pb[i * r + c] * pb[i * r + c2];
      proj = block_sum(proj, smem);
      if (threadIdx.x == 0) bcast = proj;
      __syncthreads();
      const A pr = bcast;
      for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) pb[i * r + c2] -= pr * pb[i * r + c];
      __syncthreads();
    }
  }
}

// One thread per (matrix, column j, sweep of kCols factor columns): Qt[c, j] = sum over rows,
// in row order, of M[i, j] * P[i, c]. Neighbouring threads read neighbouring columns of a row.
template <class T, class A>
__global__ void back_project_k(Ptrs ptrs, int64_t batch, int64_t rows, int64_t cols, const A* p,
                               int64_t r, A* qt) {
  const int64_t sweeps = (r + kCols - 1) / kCols;
  const int64_t total = batch * sweeps * cols;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = t % cols, sweep = (t / cols) % sweeps, b = t / (cols * sweeps);
    const int64_t c0 = sweep * kCols;
    const T* m = static_cast<const T*>(ptrs.in[b]);
    const A* pb = p + b * rows * r;
    A s[kCols];
    for (int c = 0; c < kCols; ++c) s[c] = A(0);
    for (int64_t i = 0; i < rows; ++i) {
      const A mv = to_acc(m[i * cols + j]);
      for (int c = 0; c < kCols; ++c)
        if (c0 + c < r) s[c] += mv * pb[i * r + c0 + c];
    }
    for (int c = 0; c < kCols; ++c)
      if (c0 + c < r) qt[(b * r + c0 + c) * cols + j] = s[c];
  }
}

template <class T, class A>
__global__ void reconstruct_k(Ptrs ptrs, int64_t batch, int64_t rows, int64_t cols, const A* p,
                              const A* qt, int64_t r, double alpha, bool subtract) {
  const A a = static_cast<A>(alpha);
  const int64_t total = batch * rows * cols;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = t % cols, i = (t / cols) % rows, b = t / (rows * cols);
    const A* pr = p + (b * rows + i) * r;
    const A* q = qt + b * r * cols;
    A row = A(0);
    for (int64_t c = 0; c < r; ++c) row += pr[c] * q[c * cols + j];
    T* o = static_cast<T*>(ptrs.out[b]) + i * cols + j;
    *o = subtract ? from_acc<T>(to_acc(*o) - row) : from_acc<T>(a * row);
  }
}

template <class F> void dispatch_factors(DType d, F&& fn) {
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fn(tag, static_cast<typename Acc<T>::type*>(nullptr));
  });
}

// Runs fn(first, count, ptrs) over the batch in launches of at most kMaxBatch matrices.
template <class F>
void in_launches(int64_t batch, const void* const* in, const void* const* in2, void* const* out,
                 F&& fn) {
  for (int64_t first = 0; first < batch; first += kMaxBatch) {
    const int64_t count = std::min<int64_t>(kMaxBatch, batch - first);
    Ptrs ptrs{};
    for (int64_t b = 0; b < count; ++b) {
      ptrs.in[b] = in ? in[first + b] : nullptr;
      ptrs.in2[b] = in2 ? in2[first + b] : nullptr;
      ptrs.out[b] = out ? out[first + b] : nullptr;
    }
    fn(first, count, ptrs);
  }
}

}  // namespace

void powersgd_project(DType d, const void* const* g, const void* const* e_in, void* const* e,
                      bool ef, int64_t batch, int64_t rows, int64_t cols, const void* qt, int64_t r,
                      void* p, void* stream) {
  check_args(kNone, d, 0, Params{});
  if (rows < 0 || cols < 0 || r < 1 || batch < 0)
    throw KernelError("powersgd: need rows, cols >= 0 and rank >= 1");
  cudaStream_t s = as_stream(stream);
  dispatch_factors(d, [&](auto* ttag, auto* atag) {
    using T = std::remove_pointer_t<decltype(ttag)>;
    using A = std::remove_pointer_t<decltype(atag)>;
    const void* const* ein = ef ? e_in : nullptr;
    void* const* eout = ef ? e : nullptr;
    in_launches(batch, g, ein, eout, [&](int64_t first, int64_t count, const Ptrs& ptrs) {
      if (count * rows == 0) return;
      project_k<T, A><<<blocks_for(count * rows * 8), kThreads, 0, s>>>(
          ptrs, ef, count, rows, cols, static_cast<const A*>(qt) + first * r * cols, r,
          static_cast<A*>(p) + first * rows * r);
    });
  });
  check_launch("powersgd project");
}

void powersgd_orthogonalize(DType d, void* p, int64_t batch, int64_t rows, int64_t r, double eps,
                            void* stream) {
  if (rows < 0 || r < 1 || batch < 0) throw KernelError("powersgd: need rows >= 0 and rank >= 1");
  if (batch == 0) return;
  cudaStream_t s = as_stream(stream);
  dispatch_factors(d, [&](auto*, auto* atag) {
    using A = std::remove_pointer_t<decltype(atag)>;
    orthogonalize_k<A><<<static_cast<unsigned>(batch), kThreads, 0, s>>>(static_cast<A*>(p), rows, r, eps);
  });
  check_launch("powersgd orthogonalize");
}

void powersgd_back_project(DType d, const void* const* m, int64_t batch, int64_t rows, int64_t cols,
                           const void* p, int64_t r, void* qt, void* stream) {
  if (rows < 0 || cols < 0 || r < 1 || batch < 0)
    throw KernelError("powersgd: need rows, cols >= 0 and rank >= 1");
  cudaStream_t s = as_stream(stream);
  dispatch_factors(d, [&](auto* ttag, auto* atag) {
    using T = std::remove_pointer_t<decltype(ttag)>;
    using A = std::remove_pointer_t<decltype(atag)>;
    in_launches(batch, m, nullptr, nullptr, [&](int64_t first, int64_t count, const Ptrs& ptrs) {
      const int64_t threads = count * ((r + kCols - 1) / kCols) * cols;
      if (threads == 0) return;
      back_project_k<T, A><<<blocks_for(threads), kThreads, 0, s>>>(
          ptrs, count, rows, cols, static_cast<const A*>(p) + first * rows * r, r,
          static_cast<A*>(qt) + first * r * cols);
    });
  });
  check_launch("powersgd back_project");
}

void powersgd_reconstruct(DType d, const void* p, const void* qt, int64_t batch, int64_t rows,
                          int64_t cols, int64_t r, void* const* out, double alpha,
                          bool subtract_from_out, void* stream) {
  if (rows < 0 || cols < 0 || r < 1 || batch < 0)
    throw KernelError("powersgd: need rows, cols >= 0 and rank >= 1");
  cudaStream_t s = as_stream(stream);
  dispatch_factors(d, [&](auto* ttag, auto* atag) {
    using T = std::remove_pointer_t<decltype(ttag)>;
    using A = std::remove_pointer_t<decltype(atag)>;
    in_launches(batch, nullptr, nullptr, out, [&](int64_t first, int64_t count, const Ptrs& ptrs) {
      const int64_t threads = count * rows * cols;
      if (threads == 0) return;
      reconstruct_k<T, A><<<blocks_for(threads), kThreads, 0, s>>>(
          ptrs, count, rows, cols, static_cast<const A*>(p) + first * rows * r,
          static_cast<const A*>(qt) + first * r * cols, r, alpha, subtract_from_out);
    });
  });
  check_launch("powersgd reconstruct");
}

}  // namespace gpu
}  // namespace hvdc
