// torch extension: tensors in, the framework-neutral kernels called on their data: csrc/cpu for
// CPU tensors, csrc/cuda for CUDA tensors (when built with CUDA), on the current stream.
// ATen and torch's pybind11 casters, not <torch/extension.h>: that one brings the whole C++
// frontend (nn, optim, data), none of it used, and took twice as long to compile (68 s to 35 s).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "hvdc/kernels.h"
#ifdef HVDC_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "hvdc/cuda.h"
#endif

namespace {

// Where a call runs: on the CPU, or on a CUDA device and its current stream.
struct Where {
  bool cuda = false;
  void* stream = nullptr;
  c10::Device device = c10::Device(c10::kCPU);
};

Where where_of(const at::Tensor& t, const char* what) {
  Where w;
  w.device = t.device();
  if (t.device().is_cpu()) return w;
#ifdef HVDC_WITH_CUDA
  if (t.device().is_cuda()) {
    w.cuda = true;
    w.stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
    return w;
  }
#endif
  throw hvdc::KernelError(std::string(what) + " is on " + t.device().str() +
#ifdef HVDC_WITH_CUDA
                          "; hvd_compress runs on CPU and CUDA tensors");
#else
                          "; this build has CPU kernels only (build with a CUDA torch and nvcc "
                          "for CUDA tensors)");
#endif
}

void check_on(const at::Tensor& t, const Where& w, const char* what) {
  if (t.device() != w.device)
    throw hvdc::KernelError(std::string(what) + " is on " + t.device().str() + ", the gradient on " +
                            w.device.str() + ": all tensors of a call must be on one device");
}

#ifdef HVDC_WITH_CUDA
#define HVDC_GUARD(w) c10::OptionalDeviceGuard guard_(w.cuda ? std::optional<c10::Device>(w.device) : std::nullopt)
#else
#define HVDC_GUARD(w) (void)w
#endif

hvdc::DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return hvdc::kF32;
    case at::kHalf: return hvdc::kF16;
    case at::kBFloat16: return hvdc::kBF16;
    case at::kDouble: return hvdc::kF64;
    default:
      throw hvdc::KernelError(std::string(what) + " has dtype " +
                              std::string(c10::toString(t.scalar_type())) +
                              "; valid: float32, float16, bfloat16, float64");
  }
}

at::ScalarType scalar_of(int32_t d) {
  switch (d) {
    case hvdc::kF32: return at::kFloat;
    case hvdc::kF16: return at::kHalf;
    case hvdc::kBF16: return at::kBFloat16;
    case hvdc::kF64: return at::kDouble;
    default: return at::kByte;
  }
}

void check_out(const at::Tensor& out, const at::Tensor& like, const Where& w, const char* what) {
  check_on(out, w, what);
  if (!out.is_contiguous()) throw hvdc::KernelError(std::string(what) + " must be contiguous");
  if (out.scalar_type() != like.scalar_type() || out.numel() != like.numel())
    throw hvdc::KernelError(std::string(what) + " must match the gradient: " +
                            std::string(c10::toString(like.scalar_type())) + "[" +
                            std::to_string(like.numel()) + "], got " +
                            std::string(c10::toString(out.scalar_type())) + "[" +
                            std::to_string(out.numel()) + "]");
}

// A kernel that reads e_in and writes e element by element needs them to be one buffer or
// apart: a partial overlap would read elements it has already written.
void check_same_or_apart(const at::Tensor& e_in, const at::Tensor& e,
                         const char* what = "error-feedback residuals e_in and e") {
  const auto* a = static_cast<const char*>(e_in.data_ptr());
  const auto* b = static_cast<const char*>(e.data_ptr());
  const int64_t bytes = e.numel() * e.element_size();
  if (a != b && a < b + bytes && b < a + bytes)
    throw hvdc::KernelError(std::string(what) + " overlap without being the same buffer");
}

void check_payload(const at::Tensor& payload, const Where& w, int64_t codec, hvdc::DType d,
                   int64_t n, const hvdc::Params& p) {
  check_on(payload, w, "payload");
  if (!payload.is_contiguous()) throw hvdc::KernelError("payload must be contiguous");
  const int64_t want = hvdc::payload_bytes(static_cast<hvdc::CodecId>(codec), d, n, p);
  const int64_t got = payload.numel() * payload.element_size();
  if (got != want)
    throw hvdc::KernelError("payload has " + std::to_string(got) + " bytes, the codec needs " +
                            std::to_string(want) + " for " + std::to_string(n) + " elements");
}

at::Tensor new_payload(int64_t codec, const at::Tensor& x, const hvdc::Params& p) {
  const auto c = static_cast<hvdc::CodecId>(codec);
  const auto d = dtype_of(x, "gradient");
  const int64_t bytes = hvdc::payload_bytes(c, d, x.numel(), p);
  const int32_t wd = hvdc::wire_dtype(c, d);
  if (wd < 0) return at::empty({bytes}, x.options().dtype(at::kByte));
  const auto st = scalar_of(wd);
  return at::empty({bytes / static_cast<int64_t>(c10::elementSize(st))}, x.options().dtype(st));
}

void encode(int64_t codec, const at::Tensor& x, const hvdc::Params& p, at::Tensor& payload) {
  const Where w = where_of(x, "gradient");
  HVDC_GUARD(w);
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  check_payload(payload, w, codec, d, xc.numel(), p);
  const auto c = static_cast<hvdc::CodecId>(codec);
#ifdef HVDC_WITH_CUDA
  if (w.cuda) return hvdc::gpu::encode(c, d, xc.data_ptr(), xc.numel(), p, payload.data_ptr(), w.stream);
#endif
  hvdc::encode(c, d, xc.data_ptr(), xc.numel(), p, payload.data_ptr());
}

void decode(int64_t codec, const at::Tensor& payload, at::Tensor& out, const hvdc::Params& p,
            double alpha, bool accumulate) {
  const Where w = where_of(out, "output");
  HVDC_GUARD(w);
  check_out(out, out, w, "output");
  const auto d = dtype_of(out, "output");
  check_payload(payload, w, codec, d, out.numel(), p);
  const auto c = static_cast<hvdc::CodecId>(codec);
#ifdef HVDC_WITH_CUDA
  if (w.cuda)
    return hvdc::gpu::decode(c, d, payload.data_ptr(), out.numel(), p, out.data_ptr(), alpha,
                             accumulate, w.stream);
#endif
  hvdc::decode(c, d, payload.data_ptr(), out.numel(), p, out.data_ptr(), alpha, accumulate);
}

// With check_finite (CPU), the aggregations return whether every element of out is finite,
// found while out is in cache (hvdc/kernels.h aggregate) rather than in the optimizer's pass
// over every reduced gradient; true when not asked.
void refuse_check_on_cuda(const Where& w, bool check_finite) {
  if (w.cuda && check_finite)
    throw hvdc::KernelError("check_finite is for CPU tensors: on CUDA, all_finite checks the "
                            "outputs with one wait per step");
}

bool run_aggregate(const Where& w, hvdc::CodecId c, hvdc::DType d, const at::Tensor& gathered,
                   int64_t ranks, int64_t stride, at::Tensor& out, const hvdc::Params& p,
                   double alpha, bool check_finite) {
  refuse_check_on_cuda(w, check_finite);
#ifdef HVDC_WITH_CUDA
  if (w.cuda) {
    hvdc::gpu::aggregate(c, d, gathered.data_ptr(), ranks, stride, out.numel(), p,
                         out.data_ptr(), alpha, w.stream);
    return true;
  }
#endif
  bool finite = true;
  hvdc::aggregate(c, d, gathered.data_ptr(), ranks, stride, out.numel(), p, out.data_ptr(), alpha,
                  check_finite ? &finite : nullptr);
  return finite;
}

bool aggregate(int64_t codec, const at::Tensor& gathered, at::Tensor& out, const hvdc::Params& p,
               double alpha, bool check_finite) {
  const Where w = where_of(out, "output");
  HVDC_GUARD(w);
  check_out(out, out, w, "output");
  check_on(gathered, w, "gathered payloads");
  if (gathered.dim() != 2 || gathered.scalar_type() != at::kByte || !gathered.is_contiguous())
    throw hvdc::KernelError("gathered payloads must be a contiguous uint8 [ranks, bytes] tensor");
  const auto d = dtype_of(out, "output");
  const auto c = static_cast<hvdc::CodecId>(codec);
  const int64_t want = hvdc::payload_bytes(c, d, out.numel(), p);
  if (gathered.size(1) != want)
    throw hvdc::KernelError("gathered payloads are " + std::to_string(gathered.size(1)) +
                            " bytes per rank, the codec needs " + std::to_string(want) +
                            ": ranks disagree on the tensor size or the codec parameters");
  return run_aggregate(w, c, d, gathered, gathered.size(0), gathered.size(1), out, p, alpha,
                       check_finite);
}

// Two ranks' payloads from the int32 sum of their words (hvdc/kernels.h aggregate_pair).
bool aggregate_pair(int64_t codec, const at::Tensor& own, const at::Tensor& summed, int64_t rank,
                    at::Tensor& out, const hvdc::Params& p, double alpha, bool check_finite) {
  const Where w = where_of(out, "output");
  HVDC_GUARD(w);
  check_out(out, out, w, "output");
  const auto d = dtype_of(out, "output");
  check_payload(own, w, codec, d, out.numel(), p);
  check_on(summed, w, "summed words");
  const int64_t words = (own.numel() * own.element_size() + 3) / 4;
  if (summed.scalar_type() != at::kInt || !summed.is_contiguous() || summed.numel() != words)
    throw hvdc::KernelError("summed words must be a contiguous int32 vector of " +
                            std::to_string(words) + " elements, got " +
                            std::string(c10::toString(summed.scalar_type())) + "[" +
                            std::to_string(summed.numel()) + "]");
  const auto c = static_cast<hvdc::CodecId>(codec);
  const auto* sw = static_cast<const int32_t*>(summed.data_ptr());
  refuse_check_on_cuda(w, check_finite);
#ifdef HVDC_WITH_CUDA
  if (w.cuda) {
    hvdc::gpu::aggregate_pair(c, d, own.data_ptr(), sw, rank, out.numel(), p, out.data_ptr(),
                              alpha, w.stream);
    return true;
  }
#endif
  bool finite = true;
  hvdc::aggregate_pair(c, d, own.data_ptr(), sw, rank, out.numel(), p, out.data_ptr(), alpha,
                       check_finite ? &finite : nullptr);
  return finite;
}

// Payloads of variable-size codecs, back to back in one uint8 vector (Horovod's allgather of
// 1-D tensors of different lengths).
bool aggregate_concat(int64_t codec, const at::Tensor& gathered, int64_t ranks, at::Tensor& out,
                      const hvdc::Params& p, double alpha, bool check_finite) {
  const Where w = where_of(out, "output");
  HVDC_GUARD(w);
  check_out(out, out, w, "output");
  check_on(gathered, w, "gathered payloads");
  if (gathered.dim() != 1 || gathered.scalar_type() != at::kByte || !gathered.is_contiguous())
    throw hvdc::KernelError("gathered payloads must be a contiguous uint8 vector");
  return run_aggregate(w, static_cast<hvdc::CodecId>(codec), dtype_of(out, "output"), gathered,
                       ranks, gathered.numel(), out, p, alpha, check_finite);
}

int64_t encoded_bytes(int64_t codec, const at::Tensor& payload, const at::Tensor& like,
                      const hvdc::Params& p) {
  const Where w = where_of(payload, "payload");
  HVDC_GUARD(w);
  const auto d = dtype_of(like, "gradient");
  check_payload(payload, w, codec, d, like.numel(), p);
  const auto c = static_cast<hvdc::CodecId>(codec);
#ifdef HVDC_WITH_CUDA
  if (w.cuda) return hvdc::gpu::encoded_bytes(c, d, payload.data_ptr(), like.numel(), p, w.stream);
#endif
  return hvdc::encoded_bytes(c, d, payload.data_ptr(), like.numel(), p);
}

// state_in (optional): the state before the call, one tensor per state tensor, each either
// that tensor or memory apart from it; state is then written in full and state_in only read.
void encode_with_state(int64_t codec, const at::Tensor& x, std::vector<at::Tensor> state,
                       const hvdc::Params& p, at::Tensor& payload,
                       std::optional<std::vector<at::Tensor>> state_in) {
  const Where w = where_of(x, "gradient");
  HVDC_GUARD(w);
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  check_payload(payload, w, codec, d, xc.numel(), p);
  if (state_in && state_in->size() != state.size())
    throw hvdc::KernelError("state_in has " + std::to_string(state_in->size()) +
                            " tensor(s) for " + std::to_string(state.size()) + " state tensor(s)");
  std::vector<void*> ptrs;
  std::vector<const void*> in_ptrs;
  for (size_t i = 0; i < state.size(); ++i) {
    check_out(state[i], xc, w, "codec state");
    ptrs.push_back(state[i].data_ptr());
    if (state_in) {
      const at::Tensor& s = (*state_in)[i];
      check_out(s, xc, w, "codec state_in");
      check_same_or_apart(s, state[i], "codec state tensors state_in and state");
      in_ptrs.push_back(s.data_ptr());
    } else {
      in_ptrs.push_back(state[i].data_ptr());
    }
  }
  const auto c = static_cast<hvdc::CodecId>(codec);
  const auto ns = static_cast<int64_t>(ptrs.size());
#ifdef HVDC_WITH_CUDA
  if (w.cuda)
    return hvdc::gpu::encode_with_state(c, d, xc.data_ptr(), in_ptrs.data(), ptrs.data(), ns,
                                        xc.numel(), p, payload.data_ptr(), w.stream);
#endif
  hvdc::encode_with_state(c, d, xc.data_ptr(), in_ptrs.data(), ptrs.data(), ns, xc.numel(), p,
                          payload.data_ptr());
}

// PowerSGD: M is the 2-D gradient view, P [rows, r] and Qt [r, cols] in its accumulator type.
at::ScalarType factor_type(const at::Tensor& m) {
  return m.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_factor(const at::Tensor& f, const at::Tensor& m, const Where& w, int64_t d0, int64_t d1,
                  const char* what) {
  check_on(f, w, what);
  if (f.scalar_type() != factor_type(m) || f.dim() != 2 || f.size(0) != d0 || f.size(1) != d1 ||
      !f.is_contiguous())
    throw hvdc::KernelError(std::string(what) + " must be a contiguous " +
                            std::string(c10::toString(factor_type(m))) + " [" + std::to_string(d0) +
                            ", " + std::to_string(d1) + "] tensor");
}

void check_matrix(const at::Tensor& m, const Where& w, const char* what) {
  check_on(m, w, what);
  if (m.dim() != 2 || !m.is_contiguous())
    throw hvdc::KernelError(std::string(what) + " must be a contiguous 2-D tensor");
}

// The PowerSGD bindings take a batch: B same-shape matrices as a list (gradients and residuals
// stay in their own storage) and their factors stacked, P as [B, rows, r] and Qt as [B, r, cols],
// so one allreduce carries every P (or Q) of the batch, and on CUDA one launch runs each pass.
void check_factor_batch(size_t b, const at::Tensor& factor, const char* what) {
  if (factor.dim() != 3 || factor.size(0) != static_cast<int64_t>(b))
    throw hvdc::KernelError(std::string(what) + " must be a [" + std::to_string(b) +
                            ", ., .] tensor, one factor per matrix of the batch");
}

Where check_batch(const std::vector<at::Tensor>& ms, const at::Tensor& p, const at::Tensor& qt) {
  if (ms.empty()) throw hvdc::KernelError("a PowerSGD batch needs at least one matrix");
  const Where w = where_of(ms[0], "matrix");
  check_factor_batch(ms.size(), p, "P");
  check_factor_batch(ms.size(), qt, "Qt");
  for (const auto& m : ms) {
    check_matrix(m, w, "matrix");
    if (m.sizes() != ms[0].sizes() || m.scalar_type() != ms[0].scalar_type())
      throw hvdc::KernelError("the matrices of a PowerSGD batch must share shape and dtype");
  }
  // Every matrix of a batch shares its shape, so the first one's factor shapes stand for all.
  const auto& m = ms[0];
  check_factor(qt.select(0, 0), m, w, qt.size(1), m.size(1), "Qt");
  check_factor(p.select(0, 0), m, w, m.size(0), qt.size(1), "P");
  if (!p.is_contiguous() || !qt.is_contiguous())
    throw hvdc::KernelError("P and Qt must be contiguous stacks");
  return w;
}

template <class V> std::vector<V> data_ptrs(const std::vector<at::Tensor>& ts) {
  std::vector<V> out;
  for (const auto& t : ts) out.push_back(t.data_ptr());
  return out;
}

// es_in: the residuals to read when they are not es themselves.
void powersgd_project(const std::vector<at::Tensor>& gs, std::vector<at::Tensor>& es, bool ef,
                      const at::Tensor& qt, at::Tensor& p,
                      std::optional<std::vector<at::Tensor>> es_in) {
  const Where w = check_batch(gs, p, qt);
  HVDC_GUARD(w);
  const std::vector<at::Tensor>& eins = es_in ? *es_in : es;
  if (ef && (es.size() != gs.size() || eins.size() != gs.size()))
    throw hvdc::KernelError("error feedback needs one residual per matrix of the batch (" +
                            std::to_string(gs.size()) + "), got " + std::to_string(es.size()) +
                            " and " + std::to_string(eins.size()) + " old ones");
  if (ef)
    for (size_t b = 0; b < gs.size(); ++b) {
      check_out(es[b], gs[b], w, "error-feedback residual");
      if (es_in) {
        check_out(eins[b], gs[b], w, "error-feedback residual e_in");
        check_same_or_apart(eins[b], es[b]);
      }
    }
  const auto d = dtype_of(gs[0], "gradient");
  const int64_t rows = gs[0].size(0), cols = gs[0].size(1), r = qt.size(1);
#ifdef HVDC_WITH_CUDA
  if (w.cuda) {
    const auto g = data_ptrs<const void*>(gs);
    const auto ein = ef ? data_ptrs<const void*>(eins) : std::vector<const void*>(gs.size());
    const auto e = ef ? data_ptrs<void*>(es) : std::vector<void*>(gs.size(), nullptr);
    return hvdc::gpu::powersgd_project(d, g.data(), ein.data(), e.data(), ef,
                                       static_cast<int64_t>(gs.size()), rows, cols, qt.data_ptr(),
                                       r, p.data_ptr(), w.stream);
  }
#endif
  for (size_t b = 0; b < gs.size(); ++b)
    hvdc::powersgd_project(d, gs[b].data_ptr(), ef ? eins[b].data_ptr() : nullptr,
                           ef ? es[b].data_ptr() : nullptr, ef, rows, cols,
                           qt.select(0, b).data_ptr(), r, p.select(0, b).data_ptr());
}

// A CPU tensor: drawn once per matrix, copied to the gradient's device by the caller.
at::Tensor powersgd_initial_q(uint64_t seed, int64_t r, int64_t cols, bool f64) {
  auto qt = at::empty({r, cols}, at::dtype(f64 ? at::kDouble : at::kFloat));
  hvdc::powersgd_initial_q(f64 ? hvdc::kF64 : hvdc::kF32, seed, r, cols, qt.data_ptr());
  return qt;
}

void powersgd_orthogonalize(at::Tensor& p, double eps) {
  const Where w = where_of(p, "P");
  HVDC_GUARD(w);
  if (p.dim() != 3 || !p.is_contiguous() ||
      (p.scalar_type() != at::kFloat && p.scalar_type() != at::kDouble))
    throw hvdc::KernelError("P must be a contiguous float32 or float64 [batch, rows, rank] tensor");
  const auto d = p.scalar_type() == at::kDouble ? hvdc::kF64 : hvdc::kF32;
#ifdef HVDC_WITH_CUDA
  if (w.cuda)
    return hvdc::gpu::powersgd_orthogonalize(d, p.data_ptr(), p.size(0), p.size(1), p.size(2), eps,
                                             w.stream);
#endif
  for (int64_t b = 0; b < p.size(0); ++b)
    hvdc::powersgd_orthogonalize(d, p.select(0, b).data_ptr(), p.size(1), p.size(2), eps);
}

void powersgd_back_project(const std::vector<at::Tensor>& ms, const at::Tensor& p, at::Tensor& qt) {
  const Where w = check_batch(ms, p, qt);
  HVDC_GUARD(w);
  const auto d = dtype_of(ms[0], "matrix");
  const int64_t rows = ms[0].size(0), cols = ms[0].size(1), r = p.size(2);
#ifdef HVDC_WITH_CUDA
  if (w.cuda) {
    const auto m = data_ptrs<const void*>(ms);
    return hvdc::gpu::powersgd_back_project(d, m.data(), static_cast<int64_t>(ms.size()), rows, cols,
                                            p.data_ptr(), r, qt.data_ptr(), w.stream);
  }
#endif
  for (size_t b = 0; b < ms.size(); ++b)
    hvdc::powersgd_back_project(d, ms[b].data_ptr(), rows, cols, p.select(0, b).data_ptr(), r,
                                qt.select(0, b).data_ptr());
}

// With check_finite (CPU), whether every output element is finite, found as it is written
// rather than in another pass over the gradient after the step's reduction.
bool powersgd_reconstruct(const at::Tensor& p, const at::Tensor& qt, std::vector<at::Tensor>& outs,
                          double alpha, bool subtract, bool check_finite) {
  const Where w = check_batch(outs, p, qt);
  HVDC_GUARD(w);
  const auto d = dtype_of(outs[0], "output");
  const int64_t rows = outs[0].size(0), cols = outs[0].size(1), r = p.size(2);
  refuse_check_on_cuda(w, check_finite);
#ifdef HVDC_WITH_CUDA
  if (w.cuda) {
    const auto o = data_ptrs<void*>(outs);
    hvdc::gpu::powersgd_reconstruct(d, p.data_ptr(), qt.data_ptr(),
                                    static_cast<int64_t>(outs.size()), rows, cols, r, o.data(),
                                    alpha, subtract, w.stream);
    return true;
  }
#endif
  bool all = true;
  for (size_t b = 0; b < outs.size(); ++b) {
    bool finite = true;
    hvdc::powersgd_reconstruct(d, p.select(0, b).data_ptr(), qt.select(0, b).data_ptr(), rows, cols,
                               r, outs[b].data_ptr(), alpha, subtract,
                               check_finite ? &finite : nullptr);
    all = all && finite;
  }
  return all;
}

float* carry_of(int64_t codec, at::Tensor& carry, const Where& w) {
  const int64_t want = hvdc::ef_carry_size(static_cast<hvdc::CodecId>(codec));
  if (!want) return nullptr;
  check_on(carry, w, "error-feedback carry");
  if (carry.scalar_type() != at::kFloat || carry.numel() != want || !carry.is_contiguous())
    throw hvdc::KernelError("error-feedback carry must be a contiguous float32 tensor of " +
                            std::to_string(want) + " element(s) for this codec");
  return carry.data_ptr<float>();
}

// e_in: the residual to read when it is not e itself (see hvdc/kernels.h).
void ef_encode(int64_t codec, const at::Tensor& x, at::Tensor& e, at::Tensor& carry,
               const hvdc::Params& p, at::Tensor& payload, std::optional<at::Tensor> e_in) {
  const Where w = where_of(x, "gradient");
  HVDC_GUARD(w);
  check_out(e, x, w, "error-feedback residual");
  const at::Tensor& ein = e_in ? *e_in : e;
  if (e_in) {
    check_out(ein, x, w, "error-feedback residual e_in");
    check_same_or_apart(ein, e);
  }
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  check_payload(payload, w, codec, d, xc.numel(), p);
  const auto c = static_cast<hvdc::CodecId>(codec);
#ifdef HVDC_WITH_CUDA
  if (w.cuda)
    return hvdc::gpu::ef_encode(c, d, xc.data_ptr(), ein.data_ptr(), e.data_ptr(),
                                carry_of(codec, carry, w), xc.numel(), p, payload.data_ptr(),
                                w.stream);
#endif
  hvdc::ef_encode(c, d, xc.data_ptr(), ein.data_ptr(), e.data_ptr(), carry_of(codec, carry, w),
                  xc.numel(), p, payload.data_ptr());
}

void ef_settle(int64_t codec, at::Tensor& e, at::Tensor& carry) {
  const Where w = where_of(e, "error-feedback residual");
  HVDC_GUARD(w);
  check_out(e, e, w, "error-feedback residual");
  const auto c = static_cast<hvdc::CodecId>(codec);
  const auto d = dtype_of(e, "residual");
#ifdef HVDC_WITH_CUDA
  if (w.cuda)
    return hvdc::gpu::ef_settle(c, d, e.data_ptr(), carry_of(codec, carry, w), e.numel(), w.stream);
#endif
  hvdc::ef_settle(c, d, e.data_ptr(), carry_of(codec, carry, w), e.numel());
}

int64_t ef_carry_size(int64_t codec) {
  return hvdc::ef_carry_size(static_cast<hvdc::CodecId>(codec));
}

void nesterov(at::Tensor& x, at::Tensor& m, double mu) {
  const Where w = where_of(x, "gradient");
  HVDC_GUARD(w);
  check_out(x, x, w, "gradient");
  check_out(m, x, w, "momentum buffer");
  const auto d = dtype_of(x, "gradient");
#ifdef HVDC_WITH_CUDA
  if (w.cuda) return hvdc::gpu::nesterov(d, x.data_ptr(), m.data_ptr(), x.numel(), mu, w.stream);
#endif
  hvdc::nesterov(d, x.data_ptr(), m.data_ptr(), x.numel(), mu);
}

// out = factor * m + x (hvdc/kernels.h); out may be x or m.
void heavy_ball(const at::Tensor& x, const at::Tensor& m, at::Tensor& out, double factor) {
  const Where w = where_of(x, "gradient");
  HVDC_GUARD(w);
  check_out(x, x, w, "gradient");
  check_out(m, x, w, "momentum buffer");
  check_out(out, x, w, "output");
  const auto d = dtype_of(x, "gradient");
#ifdef HVDC_WITH_CUDA
  if (w.cuda)
    return hvdc::gpu::heavy_ball(d, x.data_ptr(), m.data_ptr(), out.data_ptr(), x.numel(), factor,
                                 w.stream);
#endif
  hvdc::heavy_ball(d, x.data_ptr(), m.data_ptr(), out.data_ptr(), x.numel(), factor);
}

// Homomorphic quantisation: scales float32 [homo_blocks], words int32 [homo_words], on the
// gradient's device.
void check_scales(const at::Tensor& scales, const Where& w, int64_t n, int64_t block) {
  check_on(scales, w, "scales");
  const int64_t want = hvdc::homo_blocks(n, block);
  if (scales.scalar_type() != at::kFloat || !scales.is_contiguous() || scales.numel() != want)
    throw hvdc::KernelError("scales must be a contiguous float32 tensor of " +
                            std::to_string(want) + " element(s) (one per block of " + std::to_string(block) + " of " +
                            std::to_string(n) + "), got " +
                            std::string(c10::toString(scales.scalar_type())) + "[" +
                            std::to_string(scales.numel()) + "]");
}

at::Tensor homo_block_absmax(const at::Tensor& x, int64_t block) {
  const Where w = where_of(x, "gradient");
  HVDC_GUARD(w);
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  auto out = at::empty({hvdc::homo_blocks(xc.numel(), block)}, xc.options().dtype(at::kFloat));
#ifdef HVDC_WITH_CUDA
  if (w.cuda) {
    hvdc::gpu::homo_block_absmax(d, xc.data_ptr(), xc.numel(), block, out.data_ptr<float>(),
                                 w.stream);
    return out;
  }
#endif
  hvdc::homo_block_absmax(d, xc.data_ptr(), xc.numel(), block, out.data_ptr<float>());
  return out;
}

// Whether every element of every tensor is finite: one call for a step's reduced gradients.
// CUDA tensors share one flag per device, read once at the end.
bool all_finite(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flags;
  for (const auto& t : tensors) {
    const Where w = where_of(t, "gradient");
    const auto d = dtype_of(t, "gradient");
    auto tc = t.contiguous();
#ifdef HVDC_WITH_CUDA
    if (w.cuda) {
      HVDC_GUARD(w);
      auto it = std::find_if(flags.begin(), flags.end(),
                             [&](const at::Tensor& f) { return f.device() == w.device; });
      if (it == flags.end())
        it = flags.insert(flags.end(), at::zeros({1}, tc.options().dtype(at::kInt)));
      hvdc::gpu::flag_nonfinite(d, tc.data_ptr(), tc.numel(),
                                reinterpret_cast<unsigned*>(it->data_ptr<int32_t>()), w.stream);
      continue;
    }
#endif
    (void)w;
    if (!hvdc::all_finite(d, tc.data_ptr(), tc.numel())) return false;
  }
  for (const auto& f : flags)
    if (f.item<int32_t>() != 0) return false;
  return true;
}

// Words in a new tensor, or in `into` (reused across steps, a large payload skips the page
// faults of fresh memory).
void check_words(const at::Tensor& words, const Where& w, int64_t n, int64_t levels,
                 int64_t lane_ranks) {
  check_on(words, w, "words");
  const int64_t want = hvdc::homo_words(n, levels, lane_ranks);
  if (words.scalar_type() != at::kInt || !words.is_contiguous() || words.numel() != want)
    throw hvdc::KernelError("words must be a contiguous int32 tensor of " + std::to_string(want) +
                            " element(s) for " + std::to_string(n) + " elements at levels=" +
                            std::to_string(levels) + ", lane_ranks=" + std::to_string(lane_ranks) +
                            ", got " + std::string(c10::toString(words.scalar_type())) + "[" +
                            std::to_string(words.numel()) + "]");
}

at::Tensor homo_encode(const at::Tensor& x, const at::Tensor& scales, int64_t block, int64_t levels,
                       int64_t lane_ranks, uint64_t seed, std::optional<at::Tensor> into) {
  const Where w = where_of(x, "gradient");
  HVDC_GUARD(w);
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  const int64_t n = xc.numel();
  check_scales(scales, w, n, block);
  at::Tensor words;
  if (into) {
    words = *into;
    check_words(words, w, n, levels, lane_ranks);
  } else {
    words = at::empty({hvdc::homo_words(n, levels, lane_ranks)}, xc.options().dtype(at::kInt));
  }
#ifdef HVDC_WITH_CUDA
  if (w.cuda) {
    hvdc::gpu::homo_encode(d, xc.data_ptr(), n, block, scales.data_ptr<float>(), levels, lane_ranks,
                           seed, words.data_ptr<int32_t>(), w.stream);
    return words;
  }
#endif
  hvdc::homo_encode(d, xc.data_ptr(), n, block, scales.data_ptr<float>(), levels, lane_ranks, seed,
                    words.data_ptr<int32_t>());
  return words;
}

void homo_decode(const at::Tensor& words, const at::Tensor& scales, at::Tensor& out, int64_t block,
                 int64_t levels, int64_t lane_ranks, int64_t summands, double alpha,
                 bool accumulate) {
  const Where w = where_of(out, "output");
  HVDC_GUARD(w);
  check_out(out, out, w, "output");
  const auto d = dtype_of(out, "output");
  const int64_t n = out.numel();
  check_scales(scales, w, n, block);
  check_words(words, w, n, levels, lane_ranks);
#ifdef HVDC_WITH_CUDA
  if (w.cuda)
    return hvdc::gpu::homo_decode(d, words.data_ptr<int32_t>(), n, block, scales.data_ptr<float>(),
                                  levels, lane_ranks, summands, out.data_ptr(), alpha, accumulate,
                                  w.stream);
#endif
  hvdc::homo_decode(d, words.data_ptr<int32_t>(), n, block, scales.data_ptr<float>(), levels,
                    lane_ranks, summands, out.data_ptr(), alpha, accumulate);
}

// Nanoseconds this process spent inside kernel calls, for the launcher's summary and the
// TensorBoard scalars (the TF op library keeps its own count the same way). Host time: for CUDA
// tensors it is the launch cost, not the kernels' run time on the stream.
std::atomic<int64_t> g_codec_ns{0};

struct CodecTimer {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~CodecTimer() {
    g_codec_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start).count();
  }
};

bool built_with_cuda() {
#ifdef HVDC_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hvd_compress codec kernels (CPU, and CUDA when built with it)";
  py::class_<hvdc::Params>(m, "Params")
      .def(py::init<>())
      .def_readwrite("k", &hvdc::Params::k)
      .def_readwrite("seed", &hvdc::Params::seed)
      .def_readwrite("prescale", &hvdc::Params::prescale)
      .def_readwrite("scaling", &hvdc::Params::scaling)
      .def_readwrite("rescale", &hvdc::Params::rescale)
      .def_readwrite("chunk", &hvdc::Params::chunk)
      .def_readwrite("s", &hvdc::Params::s)
      .def_readwrite("partition", &hvdc::Params::partition)
      .def_readwrite("normalize", &hvdc::Params::normalize)
      .def_readwrite("clip", &hvdc::Params::clip)
      .def_readwrite("threshold", &hvdc::Params::threshold)
      .def_readwrite("momentum_factor", &hvdc::Params::momentum_factor)
      .def_readwrite("clip_norm", &hvdc::Params::clip_norm);
  py::register_exception<hvdc::KernelError>(m, "KernelError", PyExc_ValueError);
  using G = py::call_guard<CodecTimer, py::gil_scoped_release>;
  m.def("new_payload", &new_payload, G());
  m.def("encode", &encode, G());
  m.def("decode", &decode, G());
  m.def("aggregate", &aggregate, G(), py::arg("codec"), py::arg("gathered"), py::arg("out"),
        py::arg("params"), py::arg("alpha"), py::arg("check_finite") = false);
  m.def("ef_encode", &ef_encode, G(), py::arg("codec"), py::arg("x"), py::arg("e"),
        py::arg("carry"), py::arg("params"), py::arg("payload"), py::arg("e_in") = py::none());
  m.def("ef_settle", &ef_settle, G());
  m.def("ef_carry_size", &ef_carry_size);
  m.def("aggregate_concat", &aggregate_concat, G(), py::arg("codec"), py::arg("gathered"),
        py::arg("ranks"), py::arg("out"), py::arg("params"), py::arg("alpha"),
        py::arg("check_finite") = false);
  m.def("aggregate_pair", &aggregate_pair, G(), py::arg("codec"), py::arg("own"),
        py::arg("summed"), py::arg("rank"), py::arg("out"), py::arg("params"), py::arg("alpha"),
        py::arg("check_finite") = false);
  m.def("pair_aggregates", [](int64_t codec) {
    return hvdc::pair_aggregates(static_cast<hvdc::CodecId>(codec));
  });
  m.def("powersgd_project", &powersgd_project, G(), py::arg("gs"), py::arg("es"), py::arg("ef"),
        py::arg("qt"), py::arg("p"), py::arg("es_in") = py::none());
  m.def("powersgd_initial_q", &powersgd_initial_q, G());
  m.def("powersgd_orthogonalize", &powersgd_orthogonalize, G());
  m.def("powersgd_back_project", &powersgd_back_project, G());
  m.def("powersgd_reconstruct", &powersgd_reconstruct, G(), py::arg("p"), py::arg("qt"),
        py::arg("outs"), py::arg("alpha"), py::arg("subtract"), py::arg("check_finite") = false);
  m.def("encoded_bytes", &encoded_bytes, G());
  m.def("encode_with_state", &encode_with_state, G(), py::arg("codec"), py::arg("x"),
        py::arg("state"), py::arg("params"), py::arg("payload"), py::arg("state_in") = py::none());
  m.def("state_count", [](int64_t c) { return hvdc::state_count(static_cast<hvdc::CodecId>(c)); });
  m.def("nesterov", &nesterov, G());
  m.def("heavy_ball", &heavy_ball, G());
  m.def("cpu_isa", &hvdc::cpu_isa);
  m.def("homo_lane_bits", &hvdc::homo_lane_bits, py::arg("levels"), py::arg("lane_ranks"));
  m.def("homo_words", &hvdc::homo_words, py::arg("n"), py::arg("levels"), py::arg("lane_ranks"));
  m.def("homo_blocks", &hvdc::homo_blocks, py::arg("n"), py::arg("block"));
  // not counted as codec time: it is the step's check of its result, not compression
  m.def("all_finite", &all_finite, py::call_guard<py::gil_scoped_release>(), py::arg("tensors"));
  m.def("homo_block_absmax", &homo_block_absmax, G(), py::arg("x"), py::arg("block"));
  m.def("homo_encode", &homo_encode, G(), py::arg("x"), py::arg("scales"), py::arg("block"),
        py::arg("levels"), py::arg("lane_ranks"), py::arg("seed"), py::arg("words") = py::none());
  m.def("homo_decode", &homo_decode, G(), py::arg("words"), py::arg("scales"), py::arg("out"),
        py::arg("block"), py::arg("levels"), py::arg("lane_ranks"), py::arg("summands"),
        py::arg("alpha"), py::arg("accumulate"));
  m.def("built_with_cuda", &built_with_cuda);
  m.def("codec_time_ns", [] { return g_codec_ns.load(); });
}
