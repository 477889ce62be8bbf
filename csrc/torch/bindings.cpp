// torch extension: tensors in, the framework-neutral kernels of csrc/cpu called on their data.
#include <torch/extension.h>

#include "hvdc/kernels.h"

namespace {

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

void check_cpu(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu())
    throw hvdc::KernelError(std::string(what) + " is on " + t.device().str() +
                            "; this build has CPU kernels only");
}

void check_out(const at::Tensor& out, const at::Tensor& like, const char* what) {
  check_cpu(out, what);
  if (!out.is_contiguous()) throw hvdc::KernelError(std::string(what) + " must be contiguous");
  if (out.scalar_type() != like.scalar_type() || out.numel() != like.numel())
    throw hvdc::KernelError(std::string(what) + " must match the gradient: " +
                            std::string(c10::toString(like.scalar_type())) + "[" +
                            std::to_string(like.numel()) + "], got " +
                            std::string(c10::toString(out.scalar_type())) + "[" +
                            std::to_string(out.numel()) + "]");
}

void check_payload(const at::Tensor& payload, int64_t codec, hvdc::DType d, int64_t n,
                   const hvdc::Params& p) {
  check_cpu(payload, "payload");
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
  check_cpu(x, "gradient");
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  check_payload(payload, codec, d, xc.numel(), p);
  hvdc::encode(static_cast<hvdc::CodecId>(codec), d, xc.data_ptr(), xc.numel(), p,
               payload.data_ptr());
}

void decode(int64_t codec, const at::Tensor& payload, at::Tensor& out, const hvdc::Params& p,
            double alpha, bool accumulate) {
  check_out(out, out, "output");
  const auto d = dtype_of(out, "output");
  check_payload(payload, codec, d, out.numel(), p);
  hvdc::decode(static_cast<hvdc::CodecId>(codec), d, payload.data_ptr(), out.numel(), p,
               out.data_ptr(), alpha, accumulate);
}

void aggregate(int64_t codec, const at::Tensor& gathered, at::Tensor& out, const hvdc::Params& p,
               double alpha) {
  check_out(out, out, "output");
  check_cpu(gathered, "gathered payloads");
  if (gathered.dim() != 2 || gathered.scalar_type() != at::kByte || !gathered.is_contiguous())
    throw hvdc::KernelError("gathered payloads must be a contiguous uint8 [ranks, bytes] tensor");
  const auto d = dtype_of(out, "output");
  const int64_t want = hvdc::payload_bytes(static_cast<hvdc::CodecId>(codec), d, out.numel(), p);
  if (gathered.size(1) != want)
    throw hvdc::KernelError("gathered payloads are " + std::to_string(gathered.size(1)) +
                            " bytes per rank, the codec needs " + std::to_string(want) +
                            ": ranks disagree on the tensor size or the codec parameters");
  hvdc::aggregate(static_cast<hvdc::CodecId>(codec), d, gathered.data_ptr(), gathered.size(0),
                  gathered.size(1), out.numel(), p, out.data_ptr(), alpha);
}

// Payloads of variable-size codecs, back to back in one uint8 vector (Horovod's allgather of
// 1-D tensors of different lengths).
void aggregate_concat(int64_t codec, const at::Tensor& gathered, int64_t ranks, at::Tensor& out,
                      const hvdc::Params& p, double alpha) {
  check_out(out, out, "output");
  check_cpu(gathered, "gathered payloads");
  if (gathered.dim() != 1 || gathered.scalar_type() != at::kByte || !gathered.is_contiguous())
    throw hvdc::KernelError("gathered payloads must be a contiguous uint8 vector");
  hvdc::aggregate(static_cast<hvdc::CodecId>(codec), dtype_of(out, "output"), gathered.data_ptr(),
                  ranks, gathered.numel(), out.numel(), p, out.data_ptr(), alpha);
}

int64_t encoded_bytes(int64_t codec, const at::Tensor& payload, const at::Tensor& like,
                      const hvdc::Params& p) {
  const auto d = dtype_of(like, "gradient");
  check_payload(payload, codec, d, like.numel(), p);
  return hvdc::encoded_bytes(static_cast<hvdc::CodecId>(codec), d, payload.data_ptr(), like.numel(), p);
}

void encode_with_state(int64_t codec, const at::Tensor& x, std::vector<at::Tensor> state,
                       const hvdc::Params& p, at::Tensor& payload) {
  check_cpu(x, "gradient");
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  check_payload(payload, codec, d, xc.numel(), p);
  std::vector<void*> ptrs;
  for (auto& s : state) {
    check_out(s, xc, "codec state");
    ptrs.push_back(s.data_ptr());
  }
  hvdc::encode_with_state(static_cast<hvdc::CodecId>(codec), d, xc.data_ptr(), ptrs.data(),
                          static_cast<int64_t>(ptrs.size()), xc.numel(), p, payload.data_ptr());
}

// PowerSGD: M is the 2-D gradient view, P [rows, r] and Qt [r, cols] in its accumulator type.
at::ScalarType factor_type(const at::Tensor& m) {
  return m.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_factor(const at::Tensor& f, const at::Tensor& m, int64_t d0, int64_t d1, const char* what) {
  check_cpu(f, what);
  if (f.scalar_type() != factor_type(m) || f.dim() != 2 || f.size(0) != d0 || f.size(1) != d1 ||
      !f.is_contiguous())
    throw hvdc::KernelError(std::string(what) + " must be a contiguous " +
                            std::string(c10::toString(factor_type(m))) + " [" + std::to_string(d0) +
                            ", " + std::to_string(d1) + "] tensor");
}

void check_matrix(const at::Tensor& m, const char* what) {
  check_cpu(m, what);
  if (m.dim() != 2 || !m.is_contiguous())
    throw hvdc::KernelError(std::string(what) + " must be a contiguous 2-D tensor");
}

// The PowerSGD bindings take a batch: B same-shape matrices as a list (gradients and residuals
// stay in their own storage) and their factors stacked, P as [B, rows, r] and Qt as [B, r, cols],
// so one allreduce carries every P (or Q) of the batch.
void check_factor_batch(size_t b, const at::Tensor& factor, const char* what) {
  if (factor.dim() != 3 || factor.size(0) != static_cast<int64_t>(b))
    throw hvdc::KernelError(std::string(what) + " must be a [" + std::to_string(b) +
                            ", ., .] tensor, one factor per matrix of the batch");
}

void check_batch(const std::vector<at::Tensor>& ms, const at::Tensor& p, const at::Tensor& qt) {
  if (ms.empty()) throw hvdc::KernelError("a PowerSGD batch needs at least one matrix");
  check_factor_batch(ms.size(), p, "P");
  check_factor_batch(ms.size(), qt, "Qt");
  for (const auto& m : ms) {
    check_matrix(m, "matrix");
    if (m.sizes() != ms[0].sizes() || m.scalar_type() != ms[0].scalar_type())
      throw hvdc::KernelError("the matrices of a PowerSGD batch must share shape and dtype");
  }
}

void powersgd_project(const std::vector<at::Tensor>& gs, std::vector<at::Tensor>& es, bool ef,
                      const at::Tensor& qt, at::Tensor& p) {
  check_batch(gs, p, qt);
  if (ef && es.size() != gs.size())
    throw hvdc::KernelError("error feedback needs one residual per matrix of the batch");
  for (size_t b = 0; b < gs.size(); ++b) {
    const at::Tensor& g = gs[b];
    at::Tensor qb = qt.select(0, b), pb = p.select(0, b);
    if (ef) check_out(es[b], g, "error-feedback residual");
    check_factor(qb, g, qb.size(0), g.size(1), "Qt");
    check_factor(pb, g, g.size(0), qb.size(0), "P");
    hvdc::powersgd_project(dtype_of(g, "gradient"), g.data_ptr(), ef ? es[b].data_ptr() : nullptr,
                           ef, g.size(0), g.size(1), qb.data_ptr(), qb.size(0), pb.data_ptr());
  }
}

void powersgd_orthogonalize(at::Tensor& p, double eps) {
  check_cpu(p, "P");
  if (p.dim() != 3 || !p.is_contiguous())
    throw hvdc::KernelError("P must be a contiguous [batch, rows, rank] tensor");
  for (int64_t b = 0; b < p.size(0); ++b)
    hvdc::powersgd_orthogonalize(p.scalar_type() == at::kDouble ? hvdc::kF64 : hvdc::kF32,
                                 p.select(0, b).data_ptr(), p.size(1), p.size(2), eps);
}

void powersgd_back_project(const std::vector<at::Tensor>& ms, const at::Tensor& p, at::Tensor& qt) {
  check_batch(ms, p, qt);
  for (size_t b = 0; b < ms.size(); ++b) {
    const at::Tensor& m = ms[b];
    at::Tensor pb = p.select(0, b), qb = qt.select(0, b);
    check_factor(pb, m, m.size(0), pb.size(1), "P");
    check_factor(qb, m, pb.size(1), m.size(1), "Qt");
    hvdc::powersgd_back_project(dtype_of(m, "matrix"), m.data_ptr(), m.size(0), m.size(1),
                                pb.data_ptr(), pb.size(1), qb.data_ptr());
  }
}

void powersgd_reconstruct(const at::Tensor& p, const at::Tensor& qt, std::vector<at::Tensor>& outs,
                          double alpha, bool subtract) {
  check_batch(outs, p, qt);
  for (size_t b = 0; b < outs.size(); ++b) {
    at::Tensor& out = outs[b];
    at::Tensor pb = p.select(0, b), qb = qt.select(0, b);
    check_factor(pb, out, out.size(0), pb.size(1), "P");
    check_factor(qb, out, pb.size(1), out.size(1), "Qt");
    hvdc::powersgd_reconstruct(dtype_of(out, "output"), pb.data_ptr(), qb.data_ptr(),
                               out.size(0), out.size(1), pb.size(1), out.data_ptr(), alpha,
                               subtract);
  }
}

float* carry_of(int64_t codec, at::Tensor& carry) {
  const int64_t want = hvdc::ef_carry_size(static_cast<hvdc::CodecId>(codec));
  check_cpu(carry, "error-feedback carry");
  if (carry.scalar_type() != at::kFloat || carry.numel() != want || !carry.is_contiguous())
    throw hvdc::KernelError("error-feedback carry must be a contiguous float32 tensor of " +
                            std::to_string(want) + " element(s) for this codec");
  return want ? carry.data_ptr<float>() : nullptr;
}

void ef_encode(int64_t codec, const at::Tensor& x, at::Tensor& e, at::Tensor& carry,
               const hvdc::Params& p, at::Tensor& payload) {
  check_cpu(x, "gradient");
  check_out(e, x, "error-feedback residual");
  const auto d = dtype_of(x, "gradient");
  auto xc = x.contiguous();
  check_payload(payload, codec, d, xc.numel(), p);
  hvdc::ef_encode(static_cast<hvdc::CodecId>(codec), d, xc.data_ptr(), e.data_ptr(),
                  carry_of(codec, carry), xc.numel(), p, payload.data_ptr());
}

void ef_settle(int64_t codec, at::Tensor& e, at::Tensor& carry) {
  check_out(e, e, "error-feedback residual");
  hvdc::ef_settle(static_cast<hvdc::CodecId>(codec), dtype_of(e, "residual"), e.data_ptr(),
                  carry_of(codec, carry), e.numel());
}

int64_t ef_carry_size(int64_t codec) {
  return hvdc::ef_carry_size(static_cast<hvdc::CodecId>(codec));
}

void nesterov(at::Tensor& x, at::Tensor& m, double mu) {
  check_out(x, x, "gradient");
  check_out(m, x, "momentum buffer");
  hvdc::nesterov(dtype_of(x, "gradient"), x.data_ptr(), m.data_ptr(), x.numel(), mu);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hvd_compress codec kernels (CPU)";
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
  using G = py::call_guard<py::gil_scoped_release>;
  m.def("new_payload", &new_payload, G());
  m.def("encode", &encode, G());
  m.def("decode", &decode, G());
  m.def("aggregate", &aggregate, G());
  m.def("ef_encode", &ef_encode, G());
  m.def("ef_settle", &ef_settle, G());
  m.def("ef_carry_size", &ef_carry_size);
  m.def("aggregate_concat", &aggregate_concat, G());
  m.def("powersgd_project", &powersgd_project, G());
  m.def("powersgd_orthogonalize", &powersgd_orthogonalize, G());
  m.def("powersgd_back_project", &powersgd_back_project, G());
  m.def("powersgd_reconstruct", &powersgd_reconstruct, G());
  m.def("encoded_bytes", &encoded_bytes, G());
  m.def("encode_with_state", &encode_with_state, G());
  m.def("state_count", [](int64_t c) { return hvdc::state_count(static_cast<hvdc::CodecId>(c)); });
  m.def("nesterov", &nesterov, G());
  m.def("cpu_isa", &hvdc::cpu_isa);
}
