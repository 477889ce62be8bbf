// TensorFlow custom ops over the framework-neutral kernels: csrc/cpu, and csrc/cuda for the GPU
// kernels of a build against a CUDA TensorFlow (GOOGLE_CUDA, launch.h). The ops are functional
// (state in, new state out), so they behave the same eagerly and inside tf.function, and the
// frontend keeps state in tf.Variables.
#if GOOGLE_CUDA && !defined(EIGEN_USE_GPU)
// Eigen declares its GpuDevice, whose stream the GPU kernels run on, only with this set.
#define EIGEN_USE_GPU
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "hvdc/kernels.h"
#include "launch.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using tensorflow::DataType;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;
using hvdc_tf::CpuLaunch;

#define HVDC_TF_TRY(ctx, expr)                                                  \
  try {                                                                         \
    expr;                                                                       \
  } catch (const std::exception& e) {                                           \
    (ctx)->CtxFailure(__FILE__, __LINE__,                                       \
                      tensorflow::errors::InvalidArgument(e.what()));           \
    return;                                                                     \
  }

// Nanoseconds spent inside the codec ops of this process, for CompressionStatsCallback. A
// Python timer cannot see inside a traced tf.function; the kernels can time themselves. For the
// GPU kernels it is host time (launches, and the waits for a payload header), as for torch.
std::atomic<int64_t> g_codec_ns{0};

class CodecTimer {
 public:
  CodecTimer() : start_(std::chrono::steady_clock::now()) {}
  ~CodecTimer() {
    g_codec_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

bool to_hvdc(DataType t, hvdc::DType* out) {
  switch (t) {
    case tensorflow::DT_FLOAT: *out = hvdc::kF32; return true;
    case tensorflow::DT_HALF: *out = hvdc::kF16; return true;
    case tensorflow::DT_BFLOAT16: *out = hvdc::kBF16; return true;
    case tensorflow::DT_DOUBLE: *out = hvdc::kF64; return true;
    default: return false;
  }
}

// The codec attributes (HVDC_CODEC_ATTRS) as kernel parameters; Ctx is an op's construction
// context or a shape-inference context.
template <class Ctx>
tensorflow::Status read_params(Ctx* c, int* codec, hvdc::Params* p) {
  tensorflow::int64 k = 0, chunk = 0, s = 0, partition = 0, normalize = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("codec", codec));
  TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
  TF_RETURN_IF_ERROR(c->GetAttr("scaling", &p->scaling));
  TF_RETURN_IF_ERROR(c->GetAttr("rescale", &p->rescale));
  TF_RETURN_IF_ERROR(c->GetAttr("chunk", &chunk));
  TF_RETURN_IF_ERROR(c->GetAttr("s", &s));
  TF_RETURN_IF_ERROR(c->GetAttr("partition", &partition));
  TF_RETURN_IF_ERROR(c->GetAttr("normalize", &normalize));
  float clip = 2.5f;
  TF_RETURN_IF_ERROR(c->GetAttr("clip", &clip));
  p->clip = clip;
  // TF's float attributes are 32-bit; these parameters reach the kernels as the doubles torch
  // passes, so they travel as their IEEE-754 bits.
  for (auto [name, field] : {std::pair<const char*, double*>{"threshold", &p->threshold},
                             {"momentum_factor", &p->momentum_factor},
                             {"clip_norm", &p->clip_norm}}) {
    tensorflow::int64 bits = 0;
    TF_RETURN_IF_ERROR(c->GetAttr(name, &bits));
    std::memcpy(field, &bits, sizeof(double));
  }
  p->k = k;
  p->chunk = chunk;
  p->s = s;
  p->partition = partition;
  p->normalize = normalize;
  return tensorflow::OkStatus();
}

// Attributes shared by the codec ops: which codec and its kernel parameters.
class CodecOp : public OpKernel {
 public:
  explicit CodecOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, read_params(ctx, &codec_, &params_));
    tensorflow::int64 base = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed_base", &base));
    seed_base_ = static_cast<uint64_t>(base);
    tensorflow::int64 fraction_bits = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("warmup_steps", &warmup_steps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k_fraction", &fraction_bits));
    std::memcpy(&k_fraction_, &fraction_bits, sizeof(double));
  }

 protected:
  hvdc::CodecId codec() const { return static_cast<hvdc::CodecId>(codec_); }

  // Kernel parameters for this call of an n-element tensor: the seed comes from the step
  // counter tensor, and so does k under a warm-up.
  hvdc::Params params_for(OpKernelContext* ctx, int step_input, int prescale_input,
                          int64_t n) const {
    hvdc::Params p = params_;
    if (step_input >= 0) {
      const tensorflow::int64 step = ctx->input(step_input).scalar<tensorflow::int64>()();
      p.seed = hvdc::step_seed(seed_base_, step);
      if (warmup_steps_ > 0) p.k = warmup_kept(n, step);
    }
    if (prescale_input >= 0) p.prescale = ctx->input(prescale_input).scalar<double>()();
    return p;
  }

  // DGC's warm-up inside one traced graph, where k cannot be an attribute: the kept count at
  // this step, by the arithmetic of the registry's CodecInfo.kept (a fraction falling
  // geometrically from 25% to k over warmup_steps), so that it matches the eager count.
  int64_t warmup_kept(int64_t n, int64_t step) const {
    constexpr double kStart = 0.25;
    double k = k_fraction_;
    if (k < 1 && step < warmup_steps_ && k < kStart)
      k = kStart * std::pow(k / kStart, static_cast<double>(step) / warmup_steps_);
    if (k < 1)
      return n > 0 ? std::min<int64_t>(n, std::max<int64_t>(1, std::ceil(k * n))) : 0;
    return std::min<int64_t>(n, static_cast<int64_t>(k));
  }

  // The kept count whose payload is `stride` bytes, for an op without the step (aggregation
  // of gathered payloads under a warm-up): payloads grow with k.
  int64_t kept_for_stride(hvdc::DType d, int64_t n, int64_t stride) const {
    hvdc::Params p = params_;
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      p.k = lo + (hi - lo) / 2;
      if (hvdc::payload_bytes(codec(), d, n, p) < stride) lo = p.k + 1; else hi = p.k;
    }
    p.k = lo;
    if (hvdc::payload_bytes(codec(), d, n, p) != stride)
      throw hvdc::KernelError("gathered payloads of " + std::to_string(stride) +
                              " bytes per rank match no kept count of this codec");
    return lo;
  }

  bool dtype(OpKernelContext* ctx, const Tensor& t, hvdc::DType* d) {
    if (to_hvdc(t.dtype(), d)) return true;
    ctx->CtxFailure(__FILE__, __LINE__,
                    tensorflow::errors::InvalidArgument(
                        "gradient dtype ", tensorflow::DataTypeString(t.dtype()),
                        " is not supported; valid: float32, float16, bfloat16, float64"));
    return false;
  }

  // Allocates the payload output: payload_bytes of the codec, as elements of its dtype.
  bool payload_output(OpKernelContext* ctx, int index, hvdc::DType d, int64_t n,
                      const hvdc::Params& p, Tensor** out) {
    int64_t bytes = 0;
    try {
      bytes = hvdc::payload_bytes(codec(), d, n, p);
    } catch (const std::exception& e) {
      ctx->CtxFailure(__FILE__, __LINE__, tensorflow::errors::InvalidArgument(e.what()));
      return false;
    }
    const int64_t item = tensorflow::DataTypeSize(ctx->expected_output_dtype(index));
    if (bytes % item != 0) {
      ctx->CtxFailure(__FILE__, __LINE__,
                      tensorflow::errors::InvalidArgument("payload of ", bytes,
                                                          " bytes is not a whole number of ",
                                                          item, "-byte elements"));
      return false;
    }
    auto status = ctx->allocate_output(index, TensorShape({bytes / item}), out);
    if (!status.ok()) {
      ctx->CtxFailure(__FILE__, __LINE__, status);
      return false;
    }
    return true;
  }

  int codec_ = 0;
  hvdc::Params params_;
  uint64_t seed_base_ = 0;
  tensorflow::int64 warmup_steps_ = 0;
  double k_fraction_ = 0;
};

template <class Launch>
class EncodeOp : public CodecOp {
 public:
  using CodecOp::CodecOp;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& x = ctx->input(0);
    hvdc::DType d;
    if (!dtype(ctx, x, &d)) return;
    const hvdc::Params p = params_for(ctx, 1, 2, x.NumElements());
    Tensor* payload = nullptr;
    if (!payload_output(ctx, 0, d, x.NumElements(), p, &payload)) return;
    HVDC_TF_TRY(ctx, Launch(ctx).encode(codec(), d, x.data(), x.NumElements(), p, payload->data()));
  }
};

template <class Launch>
class DecodeOp : public CodecOp {
 public:
  explicit DecodeOp(OpKernelConstruction* ctx) : CodecOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n_));
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &out));
    hvdc::DType d;
    if (!dtype(ctx, *out, &d)) return;
    const hvdc::Params p = params_for(ctx, 1, -1, n_);
    const Tensor& payload = ctx->input(0);
    const double alpha = ctx->input(2).scalar<double>()();
    HVDC_TF_TRY(ctx, {
      const int64_t want = hvdc::payload_bytes(codec(), d, n_, p);
      if (static_cast<int64_t>(payload.TotalBytes()) != want)
        throw hvdc::KernelError("payload has " + std::to_string(payload.TotalBytes()) +
                                " bytes, the codec needs " + std::to_string(want));
      Launch(ctx).decode(codec(), d, payload.data(), n_, p, out->data(), alpha, false);
    });
  }

 private:
  tensorflow::int64 n_ = 0;
};

template <class Launch>
class AggregateOp : public CodecOp {
 public:
  explicit AggregateOp(OpKernelConstruction* ctx) : CodecOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n_));
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& gathered = ctx->input(0);
    OP_REQUIRES(ctx, gathered.dims() == 2,
                tensorflow::errors::InvalidArgument("gathered payloads must be [ranks, bytes]"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &out));
    hvdc::DType d;
    if (!dtype(ctx, *out, &d)) return;
    const double alpha = ctx->input(1).scalar<double>()();
    HVDC_TF_TRY(ctx, {
      hvdc::Params p = params_;
      if (warmup_steps_ > 0) p.k = kept_for_stride(d, n_, gathered.dim_size(1));
      const int64_t want = hvdc::payload_bytes(codec(), d, n_, p);
      if (gathered.dim_size(1) != want)
        throw hvdc::KernelError("gathered payloads are " + std::to_string(gathered.dim_size(1)) +
                                " bytes per rank, the codec needs " + std::to_string(want) +
                                ": ranks disagree on the tensor size or the codec parameters");
      Launch(ctx).aggregate(codec(), d, gathered.data(), gathered.dim_size(0),
                            gathered.dim_size(1), n_, p, out->data(), alpha);
    });
  }

 private:
  tensorflow::int64 n_ = 0;
};

// Two ranks' payloads from the int32 sum of their words (hvdc/kernels.h aggregate_pair).
template <class Launch>
class AggregatePairOp : public CodecOp {
 public:
  explicit AggregatePairOp(OpKernelConstruction* ctx) : CodecOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rank", &rank_));
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& own = ctx->input(0);
    const Tensor& summed = ctx->input(1);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &out));
    hvdc::DType d;
    if (!dtype(ctx, *out, &d)) return;
    const double alpha = ctx->input(2).scalar<double>()();
    HVDC_TF_TRY(ctx, {
      const int64_t want = hvdc::payload_bytes(codec(), d, n_, params_);
      if (static_cast<int64_t>(own.TotalBytes()) != want)
        throw hvdc::KernelError("payload has " + std::to_string(own.TotalBytes()) +
                                " bytes, the codec needs " + std::to_string(want));
      if (summed.NumElements() != (want + 3) / 4)
        throw hvdc::KernelError("summed words are " + std::to_string(summed.NumElements()) +
                                ", the payload fills " + std::to_string((want + 3) / 4));
      Launch(ctx).aggregate_pair(codec(), d, own.data(),
                                 static_cast<const int32_t*>(summed.data()), rank_, n_, params_,
                                 out->data(), alpha);
    });
  }

 private:
  tensorflow::int64 n_ = 0, rank_ = 0;
};

// Payloads of variable-size codecs (threshold) back to back: a 1-D allgather result.
template <class Launch>
class AggregateConcatOp : public CodecOp {
 public:
  explicit AggregateConcatOp(OpKernelConstruction* ctx) : CodecOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ranks", &ranks_));
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& gathered = ctx->input(0);
    OP_REQUIRES(ctx, gathered.dims() == 1,
                tensorflow::errors::InvalidArgument("gathered payloads must be a uint8 vector"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &out));
    hvdc::DType d;
    if (!dtype(ctx, *out, &d)) return;
    const double alpha = ctx->input(1).scalar<double>()();
    HVDC_TF_TRY(ctx, Launch(ctx).aggregate(codec(), d, gathered.data(), ranks_,
                                           gathered.NumElements(), n_, params_, out->data(),
                                           alpha));
  }

 private:
  tensorflow::int64 n_ = 0, ranks_ = 1;
};

// Copies `in` into a new output tensor, for the functional state updates below.
template <class Launch>
bool copy_to_output(OpKernelContext* ctx, const Launch& launch, int index, const Tensor& in,
                    Tensor** out) {
  auto status = ctx->allocate_output(index, in.shape(), out);
  if (!status.ok()) {
    ctx->CtxFailure(__FILE__, __LINE__, status);
    return false;
  }
  try {
    launch.copy((*out)->data(), in.data(), in.TotalBytes());
  } catch (const std::exception& e) {
    ctx->CtxFailure(__FILE__, __LINE__, tensorflow::errors::Internal(e.what()));
    return false;
  }
  return true;
}

template <class Launch>
class EfEncodeOp : public CodecOp {
 public:
  using CodecOp::CodecOp;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& x = ctx->input(0);
    const Tensor& e = ctx->input(1);
    const Tensor& carry = ctx->input(2);
    hvdc::DType d;
    if (!dtype(ctx, x, &d)) return;
    OP_REQUIRES(ctx, e.dtype() == x.dtype() && e.NumElements() == x.NumElements(),
                tensorflow::errors::InvalidArgument(
                    "error-feedback residual must match the gradient"));
    const hvdc::Params p = params_for(ctx, 3, 4, x.NumElements());
    const Launch launch(ctx);
    Tensor *payload = nullptr, *e_out = nullptr, *carry_out = nullptr;
    if (!payload_output(ctx, 0, d, x.NumElements(), p, &payload)) return;
    // The kernel reads e and writes every element of e_out: no copy of e first.
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, e.shape(), &e_out));
    if (!copy_to_output(ctx, launch, 2, carry, &carry_out)) return;
    HVDC_TF_TRY(ctx, {
      if (carry.NumElements() != hvdc::ef_carry_size(codec()))
        throw hvdc::KernelError("error-feedback carry must hold " +
                                std::to_string(hvdc::ef_carry_size(codec())) + " element(s)");
      launch.ef_encode(codec(), d, x.data(), e.data(), e_out->data(),
                       carry.NumElements() ? carry_out->flat<float>().data() : nullptr,
                       x.NumElements(), p, payload->data());
    });
  }
};

// Codecs that keep their own state (DGC's velocity and accumulator): state in, new state out.
template <class Launch>
class EncodeWithStateOp : public CodecOp {
 public:
  using CodecOp::CodecOp;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& x = ctx->input(0);
    hvdc::DType d;
    if (!dtype(ctx, x, &d)) return;
    tensorflow::OpInputList state;
    OP_REQUIRES_OK(ctx, ctx->input_list("state", &state));
    tensorflow::OpOutputList state_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("state_out", &state_out));
    const hvdc::Params p = params_for(ctx, 1 + state.size(), -1, x.NumElements());
    const Launch launch(ctx);
    Tensor* payload = nullptr;
    if (!payload_output(ctx, 0, d, x.NumElements(), p, &payload)) return;
    // The kernel reads the state and writes every element of the new state: no copy first.
    std::vector<const void*> in_ptrs;
    std::vector<void*> ptrs;
    for (int i = 0; i < state.size(); ++i) {
      OP_REQUIRES(ctx, state[i].dtype() == x.dtype() && state[i].NumElements() == x.NumElements(),
                  tensorflow::errors::InvalidArgument("codec state must match the gradient"));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1 + i, state[i].shape(), &out));
      in_ptrs.push_back(state[i].data());
      ptrs.push_back(out->data());
    }
    HVDC_TF_TRY(ctx, launch.encode_with_state(codec(), d, x.data(), in_ptrs.data(), ptrs.data(),
                                              static_cast<int64_t>(ptrs.size()), x.NumElements(),
                                              p, payload->data()));
  }
};

template <class Launch>
class EfSettleOp : public OpKernel {
 public:
  explicit EfSettleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("codec", &codec_));
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Launch launch(ctx);
    Tensor *e_out = nullptr, *carry_out = nullptr;
    if (!copy_to_output(ctx, launch, 0, ctx->input(0), &e_out) ||
        !copy_to_output(ctx, launch, 1, ctx->input(1), &carry_out))
      return;
    hvdc::DType d;
    OP_REQUIRES(ctx, to_hvdc(e_out->dtype(), &d),
                tensorflow::errors::InvalidArgument("unsupported residual dtype"));
    const auto c = static_cast<hvdc::CodecId>(codec_);
    HVDC_TF_TRY(ctx, launch.ef_settle(c, d, e_out->data(),
                                      carry_out->NumElements() ? carry_out->flat<float>().data()
                                                               : nullptr,
                                      e_out->NumElements()));
  }

 private:
  int codec_ = 0;
};

template <class Launch>
class NesterovOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Launch launch(ctx);
    Tensor *x_out = nullptr, *m_out = nullptr;
    OP_REQUIRES(ctx, ctx->input(0).shape() == ctx->input(1).shape(),
                tensorflow::errors::InvalidArgument("momentum buffer must match the gradient"));
    if (!copy_to_output(ctx, launch, 0, ctx->input(0), &x_out) ||
        !copy_to_output(ctx, launch, 1, ctx->input(1), &m_out))
      return;
    hvdc::DType d;
    OP_REQUIRES(ctx, to_hvdc(x_out->dtype(), &d),
                tensorflow::errors::InvalidArgument("unsupported gradient dtype"));
    const double mu = ctx->input(2).scalar<double>()();
    HVDC_TF_TRY(ctx, launch.nesterov(d, x_out->data(), m_out->data(), x_out->NumElements(), mu));
  }
};

// The gradient goes into the output's buffer where TF can hand it over: the gradient is read
// once, and no copy of it is made.
template <class Launch>
class HeavyBallOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Launch launch(ctx);
    const Tensor &x = ctx->input(0), &m = ctx->input(1);
    OP_REQUIRES(ctx, x.shape() == m.shape(),
                tensorflow::errors::InvalidArgument("momentum buffer must match the gradient"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &out));
    hvdc::DType d;
    OP_REQUIRES(ctx, to_hvdc(x.dtype(), &d),
                tensorflow::errors::InvalidArgument("unsupported gradient dtype"));
    const double factor = ctx->input(2).scalar<double>()();
    HVDC_TF_TRY(ctx, launch.heavy_ball(d, x.data(), m.data(), out->data(), x.NumElements(),
                                       factor));
  }
};

// Whether every element of every input is finite (hvdc/kernels.h's all_finite): one read of
// each tensor, where IsFinite and All wrote and read a bool per element.
class AllFiniteOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    bool finite = true;
    for (int i = 0; i < ctx->num_inputs() && finite; ++i) {
      const Tensor& x = ctx->input(i);
      hvdc::DType d;
      OP_REQUIRES(ctx, to_hvdc(x.dtype(), &d),
                  tensorflow::errors::InvalidArgument("unsupported gradient dtype"));
      HVDC_TF_TRY(ctx, finite = hvdc::all_finite(d, x.data(), x.NumElements()));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &out));
    out->scalar<bool>()() = finite;
  }
};

#if GOOGLE_CUDA
// On the device: the inputs' findings ORed into one flag (hvdc/cuda.h), and the verdict left in
// device memory, so the op does not wait for the GPU.
class GpuAllFiniteOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    void* stream = ctx->eigen_gpu_device().stream();
    Tensor flag;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_UINT32, tensorflow::TensorShape({}),
                                           &flag));
    auto* bits = static_cast<unsigned*>(flag.data());
    const cudaError_t err = cudaMemsetAsync(bits, 0, sizeof(unsigned),
                                            static_cast<cudaStream_t>(stream));
    OP_REQUIRES(ctx, err == cudaSuccess,
                tensorflow::errors::Internal("finite flag: ", cudaGetErrorString(err)));
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const Tensor& x = ctx->input(i);
      hvdc::DType d;
      OP_REQUIRES(ctx, to_hvdc(x.dtype(), &d),
                  tensorflow::errors::InvalidArgument("unsupported gradient dtype"));
      HVDC_TF_TRY(ctx, hvdc::gpu::flag_nonfinite(d, x.data(), x.NumElements(), bits, stream));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &out));
    HVDC_TF_TRY(ctx, hvdc::gpu::flag_to_finite(bits, out->flat<bool>().data(), stream));
  }
};
#endif

// Homomorphic quantisation (hvdc/kernels.h): per-block max |x|, codes on the agreed scales, and
// the decode of words that hold `summands` ranks' codes (after Horovod's int32 allreduce).
class HomoOp : public OpKernel {
 public:
  explicit HomoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("block", &block_));
  }

 protected:
  bool dtype(OpKernelContext* ctx, DataType t, hvdc::DType* d) {
    if (to_hvdc(t, d)) return true;
    ctx->CtxFailure(__FILE__, __LINE__,
                    tensorflow::errors::InvalidArgument(
                        "gradient dtype ", tensorflow::DataTypeString(t),
                        " is not supported; valid: float32, float16, bfloat16, float64"));
    return false;
  }

  // scales must hold one float per block of n elements.
  static void check_scales(const Tensor& scales, int64_t n, int64_t block) {
    const int64_t want = hvdc::homo_blocks(n, block);
    if (scales.NumElements() != want)
      throw hvdc::KernelError("scales must hold " + std::to_string(want) + " element(s) (one per " +
                              "block of " + std::to_string(block) + " of " + std::to_string(n) +
                              "), got " + std::to_string(scales.NumElements()));
  }

  tensorflow::int64 block_ = 1;
};

template <class Launch>
class HomoBlockAbsmaxOp : public HomoOp {
 public:
  using HomoOp::HomoOp;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& x = ctx->input(0);
    hvdc::DType d;
    if (!dtype(ctx, x.dtype(), &d)) return;
    int64_t blocks = 0;
    HVDC_TF_TRY(ctx, blocks = hvdc::homo_blocks(x.NumElements(), block_));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({blocks}), &out));
    HVDC_TF_TRY(ctx, Launch(ctx).homo_block_absmax(d, x.data(), x.NumElements(), block_,
                                                   out->flat<float>().data()));
  }
};

template <class Launch>
class HomoEncodeOp : public HomoOp {
 public:
  explicit HomoEncodeOp(OpKernelConstruction* ctx) : HomoOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("levels", &levels_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lane_ranks", &lane_ranks_));
    tensorflow::int64 base = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed_base", &base));
    seed_base_ = static_cast<uint64_t>(base);
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& x = ctx->input(0);
    const Tensor& scales = ctx->input(1);
    hvdc::DType d;
    if (!dtype(ctx, x.dtype(), &d)) return;
    const int64_t n = x.NumElements();
    const uint64_t seed =
        hvdc::step_seed(seed_base_, ctx->input(2).scalar<tensorflow::int64>()());
    int64_t nw = 0;
    HVDC_TF_TRY(ctx, {
      nw = hvdc::homo_words(n, levels_, lane_ranks_);
      check_scales(scales, n, block_);
    });
    Tensor* words = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nw}), &words));
    HVDC_TF_TRY(ctx, Launch(ctx).homo_encode(d, x.data(), n, block_, scales.flat<float>().data(),
                                             levels_, lane_ranks_, seed,
                                             words->flat<tensorflow::int32>().data()));
  }

 private:
  tensorflow::int64 levels_ = 0, lane_ranks_ = 0;
  uint64_t seed_base_ = 0;
};

template <class Launch>
class HomoDecodeOp : public HomoOp {
 public:
  explicit HomoDecodeOp(OpKernelConstruction* ctx) : HomoOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("levels", &levels_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lane_ranks", &lane_ranks_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("summands", &summands_));
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Tensor& words = ctx->input(0);
    const Tensor& scales = ctx->input(1);
    const double alpha = ctx->input(2).scalar<double>()();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &out));
    hvdc::DType d;
    if (!dtype(ctx, out->dtype(), &d)) return;
    HVDC_TF_TRY(ctx, {
      const int64_t want = hvdc::homo_words(n_, levels_, lane_ranks_);
      if (words.NumElements() != want)
        throw hvdc::KernelError("words has " + std::to_string(words.NumElements()) +
                                " element(s), " + std::to_string(n_) + " elements at levels=" +
                                std::to_string(levels_) + ", lane_ranks=" +
                                std::to_string(lane_ranks_) + " need " + std::to_string(want));
      check_scales(scales, n_, block_);
      Launch(ctx).homo_decode(d, words.flat<tensorflow::int32>().data(), n_, block_,
                              scales.flat<float>().data(), levels_, lane_ranks_, summands_,
                              out->data(), alpha, false);
    });
  }

 private:
  tensorflow::int64 n_ = 0, levels_ = 0, lane_ranks_ = 0, summands_ = 0;
};

// PowerSGD (hvdc/kernels.h): B same-shape matrices [rows, cols] as a list, their factors stacked,
// P [B, rows, r] and Qt [B, r, cols] in the accumulator type F (float64 for float64 matrices,
// else float32). Functional: residuals and factors in, new ones out.
class PowerSGDOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

 protected:
  // The batch's shared shape; fails the op unless every matrix has it and the factors match.
  bool batch_shape(OpKernelContext* ctx, const tensorflow::OpInputList& ms, int64_t* rows,
                   int64_t* cols, hvdc::DType* d) {
    const Tensor& m0 = ms[0];
    if (m0.dims() != 2 || !to_hvdc(m0.dtype(), d)) {
      ctx->CtxFailure(__FILE__, __LINE__, tensorflow::errors::InvalidArgument(
                                              "PowerSGD matrices must be 2-D float tensors"));
      return false;
    }
    for (int i = 1; i < ms.size(); ++i)
      if (ms[i].shape() != m0.shape()) {
        ctx->CtxFailure(__FILE__, __LINE__, tensorflow::errors::InvalidArgument(
                                                "the matrices of a PowerSGD batch must share "
                                                "their shape"));
        return false;
      }
    *rows = m0.dim_size(0);
    *cols = m0.dim_size(1);
    return true;
  }

  // The kernels size the factors' slices from the matrices' dtype, so a factor of the other
  // width would be read past its end.
  static bool factor_matches(OpKernelContext* ctx, const Tensor& f, hvdc::DType d) {
    if (f.dtype() == (d == hvdc::kF64 ? tensorflow::DT_DOUBLE : tensorflow::DT_FLOAT)) return true;
    ctx->CtxFailure(__FILE__, __LINE__, tensorflow::errors::InvalidArgument(
                                            "PowerSGD factors must be float64 for float64 "
                                            "matrices, float32 otherwise"));
    return false;
  }

  static std::vector<const void*> data_ptrs(const tensorflow::OpInputList& ts) {
    std::vector<const void*> out;
    for (int i = 0; i < ts.size(); ++i) out.push_back(ts[i].data());
    return out;
  }
};

class PowerSGDInitialQOp : public OpKernel {
 public:
  explicit PowerSGDInitialQOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    tensorflow::int64 base = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed_base", &base));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("r", &r_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
    seed_base_ = static_cast<uint64_t>(base);
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    Tensor* qt = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({r_, cols_}), &qt));
    const uint64_t seed = hvdc::step_seed(seed_base_, ctx->input(0).scalar<tensorflow::int64>()());
    HVDC_TF_TRY(ctx, hvdc::powersgd_initial_q(qt->dtype() == tensorflow::DT_DOUBLE ? hvdc::kF64
                                                                                    : hvdc::kF32,
                                              seed, r_, cols_, qt->data()));
  }

 private:
  tensorflow::int64 r_ = 1, cols_ = 0;
  uint64_t seed_base_ = 0;
};

template <class Launch>
class PowerSGDProjectOp : public PowerSGDOp {
 public:
  using PowerSGDOp::PowerSGDOp;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Launch launch(ctx);
    tensorflow::OpInputList ms, es;
    OP_REQUIRES_OK(ctx, ctx->input_list("m", &ms));
    OP_REQUIRES_OK(ctx, ctx->input_list("e", &es));
    const Tensor& qt = ctx->input(ms.size() + es.size());
    int64_t rows, cols;
    hvdc::DType d;
    if (!batch_shape(ctx, ms, &rows, &cols, &d) || !factor_matches(ctx, qt, d)) return;
    const int64_t b = ms.size(), r = qt.dims() == 3 ? qt.dim_size(1) : 0;
    OP_REQUIRES(ctx, qt.dims() == 3 && qt.dim_size(0) == b && qt.dim_size(2) == cols,
                tensorflow::errors::InvalidArgument("Qt must be [batch, r, cols]"));
    OP_REQUIRES(ctx, es.size() == 0 || es.size() == b,
                tensorflow::errors::InvalidArgument("one residual per matrix, or none"));
    Tensor* p = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({b, rows, r}), &p));
    const bool ef = es.size() > 0;
    // The kernel reads each residual and writes every element of its output: no copy first.
    std::vector<const void*> e_in(b, nullptr);
    std::vector<void*> e(b, nullptr);
    for (int64_t i = 0; ef && i < b; ++i) {
      OP_REQUIRES(ctx, es[i].shape() == ms[i].shape(),
                  tensorflow::errors::InvalidArgument("residual must match its matrix"));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1 + i, es[i].shape(), &out));
      e_in[i] = es[i].data();
      e[i] = out->data();
    }
    const auto m = data_ptrs(ms);
    HVDC_TF_TRY(ctx, launch.powersgd_project(d, m.data(), e_in.data(), e.data(), ef, b, rows, cols,
                                             qt.data(), r, p->data()));
  }
};

template <class Launch>
class PowerSGDOrthogonalizeOp : public PowerSGDOp {
 public:
  using PowerSGDOp::PowerSGDOp;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Launch launch(ctx);
    const Tensor& p = ctx->input(0);
    OP_REQUIRES(ctx, p.dims() == 3, tensorflow::errors::InvalidArgument("P must be [batch, rows, r]"));
    Tensor* out = nullptr;
    if (!copy_to_output(ctx, launch, 0, p, &out)) return;
    const double eps = ctx->input(1).scalar<double>()();
    const hvdc::DType d = p.dtype() == tensorflow::DT_DOUBLE ? hvdc::kF64 : hvdc::kF32;
    HVDC_TF_TRY(ctx, launch.powersgd_orthogonalize(d, out->data(), p.dim_size(0), p.dim_size(1),
                                                   p.dim_size(2), eps));
  }
};

template <class Launch>
class PowerSGDBackProjectOp : public PowerSGDOp {
 public:
  using PowerSGDOp::PowerSGDOp;
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    tensorflow::OpInputList ms;
    OP_REQUIRES_OK(ctx, ctx->input_list("m", &ms));
    const Tensor& p = ctx->input(ms.size());
    int64_t rows, cols;
    hvdc::DType d;
    if (!batch_shape(ctx, ms, &rows, &cols, &d) || !factor_matches(ctx, p, d)) return;
    const int64_t b = ms.size();
    OP_REQUIRES(ctx, p.dims() == 3 && p.dim_size(0) == b && p.dim_size(1) == rows,
                tensorflow::errors::InvalidArgument("P must be [batch, rows, r]"));
    const int64_t r = p.dim_size(2);
    Tensor* qt = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({b, r, cols}), &qt));
    const auto m = data_ptrs(ms);
    HVDC_TF_TRY(ctx, Launch(ctx).powersgd_back_project(d, m.data(), b, rows, cols, p.data(), r,
                                                       qt->data()));
  }
};

// subtract: out_i = base_i - P_i Q_i^T (the residual); else out_i = alpha * P_i Q_i^T.
template <class Launch>
class PowerSGDReconstructOp : public PowerSGDOp {
 public:
  explicit PowerSGDReconstructOp(OpKernelConstruction* ctx) : PowerSGDOp(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("subtract", &subtract_));
  }
  void Compute(OpKernelContext* ctx) override {
    CodecTimer timer;
    const Launch launch(ctx);
    tensorflow::OpInputList base;
    OP_REQUIRES_OK(ctx, ctx->input_list("base", &base));
    const Tensor& p = ctx->input(base.size());
    const Tensor& qt = ctx->input(base.size() + 1);
    const double alpha = ctx->input(base.size() + 2).scalar<double>()();
    int64_t rows, cols;
    hvdc::DType d;
    if (!batch_shape(ctx, base, &rows, &cols, &d) || !factor_matches(ctx, p, d) ||
        !factor_matches(ctx, qt, d))
      return;
    const int64_t b = base.size();
    OP_REQUIRES(ctx, p.dims() == 3 && qt.dims() == 3 && p.dim_size(0) == b &&
                         qt.dim_size(0) == b && p.dim_size(1) == rows && qt.dim_size(2) == cols &&
                         p.dim_size(2) == qt.dim_size(1),
                tensorflow::errors::InvalidArgument("P [batch, rows, r] and Qt [batch, r, cols] "
                                                    "must match the matrices"));
    std::vector<void*> outs;
    for (int64_t i = 0; i < b; ++i) {
      Tensor* out = nullptr;
      if (subtract_) {
        if (!copy_to_output(ctx, launch, i, base[i], &out)) return;
      } else {
        OP_REQUIRES_OK(ctx, ctx->allocate_output(i, base[i].shape(), &out));
      }
      outs.push_back(out->data());
    }
    HVDC_TF_TRY(ctx, launch.powersgd_reconstruct(d, p.data(), qt.data(), b, rows, cols,
                                                 p.dim_size(2), outs.data(), alpha, subtract_));
  }

 private:
  bool subtract_ = false;
};

// Number of elements of input 0 when its shape is known, else -1.
int64_t known_elements(InferenceContext* c) {
  auto x = c->input(0);
  if (!c->FullyDefined(x)) return -1;
  int64_t n = 1;
  for (int i = 0; i < c->Rank(x); ++i) n *= c->Value(c->Dim(x, i));
  return n;
}

tensorflow::Status homo_absmax_shape(InferenceContext* c) {
  tensorflow::int64 block;
  TF_RETURN_IF_ERROR(c->GetAttr("block", &block));
  const int64_t n = known_elements(c);
  try {
    c->set_output(0, c->Vector(n < 0 ? InferenceContext::kUnknownDim
                                     : hvdc::homo_blocks(n, block)));
  } catch (const std::exception& e) {
    return tensorflow::errors::InvalidArgument(e.what());
  }
  return tensorflow::OkStatus();
}

tensorflow::Status homo_words_shape(InferenceContext* c) {
  tensorflow::int64 block, levels, lane_ranks;
  TF_RETURN_IF_ERROR(c->GetAttr("block", &block));
  TF_RETURN_IF_ERROR(c->GetAttr("levels", &levels));
  TF_RETURN_IF_ERROR(c->GetAttr("lane_ranks", &lane_ranks));
  const int64_t n = known_elements(c);
  try {
    hvdc::homo_blocks(0, block);
    c->set_output(0, c->Vector(n < 0 ? InferenceContext::kUnknownDim
                                     : hvdc::homo_words(n, levels, lane_ranks)));
  } catch (const std::exception& e) {
    return tensorflow::errors::InvalidArgument(e.what());
  }
  return tensorflow::OkStatus();
}

// Payload length from the kernels' own payload_bytes, so graphs see static payload shapes
// (Horovod's allgather and the stats need them).
tensorflow::Status payload_shape(InferenceContext* c) {
  int codec = 0;
  hvdc::Params p;
  DataType t, w;
  TF_RETURN_IF_ERROR(read_params(c, &codec, &p));
  TF_RETURN_IF_ERROR(c->GetAttr("T", &t));
  TF_RETURN_IF_ERROR(c->GetAttr("W", &w));
  tensorflow::int64 warmup = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("warmup_steps", &warmup));
  auto x = c->input(0);
  hvdc::DType d;
  if (!c->FullyDefined(x) || !to_hvdc(t, &d) || warmup > 0) {  // warm-up: k set by the step
    c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
    return tensorflow::OkStatus();
  }
  int64_t n = 1;
  for (int i = 0; i < c->Rank(x); ++i) n *= c->Value(c->Dim(x, i));
  try {
    const int64_t bytes = hvdc::payload_bytes(static_cast<hvdc::CodecId>(codec), d, n, p);
    c->set_output(0, c->Vector(bytes / tensorflow::DataTypeSize(w)));
  } catch (const std::exception& e) {
    return tensorflow::errors::InvalidArgument(e.what());
  }
  return tensorflow::OkStatus();
}

tensorflow::Status vector_n(InferenceContext* c) {
  tensorflow::int64 n;
  TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
  c->set_output(0, c->Vector(n));
  return tensorflow::OkStatus();
}

class CodecTimeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tensorflow::int64>()() = g_codec_ns.load();
  }
};

}  // namespace

#define HVDC_CODEC_ATTRS                                      \
  Attr("codec: int")                                          \
      .Attr("k: int = 0")                                     \
      .Attr("seed_base: int = 0")                             \
      .Attr("scaling: bool = true")                           \
      .Attr("rescale: bool = false")                          \
      .Attr("chunk: int = 4096")                              \
      .Attr("s: int = 8")                                     \
      .Attr("partition: int = 0")                             \
      .Attr("normalize: int = 0")                             \
      .Attr("clip: float = 2.5")                              \
      .Attr("threshold: int = 0")                             \
      .Attr("momentum_factor: int = 0")                       \
      .Attr("clip_norm: int = 0")                             \
      .Attr("warmup_steps: int = 0")                          \
      .Attr("k_fraction: int = 0")

REGISTER_OP("HvdcEncode")
    .Input("x: T")
    .Input("step: int64")
    .Input("prescale: float64")
    .Output("payload: W")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("W: {float, half, bfloat16, double, uint8}")
    .HVDC_CODEC_ATTRS
    .SetShapeFn(payload_shape);

REGISTER_OP("HvdcDecode")
    .Input("payload: W")
    .Input("step: int64")
    .Input("alpha: float64")
    .Output("out: T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("W: {float, half, bfloat16, double, uint8}")
    .Attr("n: int")
    .HVDC_CODEC_ATTRS
    .SetShapeFn(vector_n);

REGISTER_OP("HvdcAggregate")
    .Input("gathered: uint8")
    .Input("alpha: float64")
    .Output("out: T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("n: int")
    .HVDC_CODEC_ATTRS
    .SetShapeFn(vector_n);

REGISTER_OP("HvdcAggregatePair")
    .Input("own: W")
    .Input("summed: int32")
    .Input("alpha: float64")
    .Output("out: T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("W: {half, uint8}")
    .Attr("n: int")
    .Attr("rank: int")
    .HVDC_CODEC_ATTRS
    .SetShapeFn(vector_n);

REGISTER_OP("HvdcAggregateConcat")
    .Input("gathered: uint8")
    .Input("alpha: float64")
    .Output("out: T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("n: int")
    .Attr("ranks: int >= 1")
    .HVDC_CODEC_ATTRS
    .SetShapeFn(vector_n);

REGISTER_OP("HvdcEncodeWithState")
    .Input("x: T")
    .Input("state: N * T")
    .Input("step: int64")
    .Output("payload: W")
    .Output("state_out: N * T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("W: {uint8}")
    .Attr("N: int >= 1")
    .HVDC_CODEC_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(payload_shape(c));
      for (int i = 1; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcEfEncode")
    .Input("x: T")
    .Input("e: T")
    .Input("carry: float")
    .Input("step: int64")
    .Input("prescale: float64")
    .Output("payload: W")
    .Output("e_out: T")
    .Output("carry_out: float")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("W: {float, half, bfloat16, double, uint8}")
    .HVDC_CODEC_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(payload_shape(c));
      c->set_output(1, c->input(1));
      c->set_output(2, c->input(2));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcEfSettle")
    .Input("e: T")
    .Input("carry: float")
    .Output("e_out: T")
    .Output("carry_out: float")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("codec: int")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(1));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcNesterov")
    .Input("x: T")
    .Input("m: T")
    .Input("mu: float64")
    .Output("x_out: T")
    .Output("m_out: T")
    .Attr("T: {float, half, bfloat16, double}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(1));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcHeavyBall")
    .Input("x: T")
    .Input("m: T")
    .Input("factor: float64")
    .Output("out: T")
    .Attr("T: {float, half, bfloat16, double}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcAllFinite")
    .Input("xs: T")
    .Output("finite: bool")
    .Attr("T: list({float, half, bfloat16, double}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcHomoBlockAbsmax")
    .Input("x: T")
    .Output("absmax: float")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("block: int")
    .SetShapeFn(homo_absmax_shape);

REGISTER_OP("HvdcHomoEncode")
    .Input("x: T")
    .Input("scales: float")
    .Input("step: int64")
    .Output("words: int32")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("block: int")
    .Attr("levels: int")
    .Attr("lane_ranks: int")
    .Attr("seed_base: int = 0")
    .SetShapeFn(homo_words_shape);

REGISTER_OP("HvdcHomoDecode")
    .Input("words: int32")
    .Input("scales: float")
    .Input("alpha: float64")
    .Output("out: T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("n: int")
    .Attr("block: int")
    .Attr("levels: int")
    .Attr("lane_ranks: int")
    .Attr("summands: int")
    .SetShapeFn([](InferenceContext* c) {
      tensorflow::int64 n, block, levels, lane_ranks, summands;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("block", &block));
      TF_RETURN_IF_ERROR(c->GetAttr("levels", &levels));
      TF_RETURN_IF_ERROR(c->GetAttr("lane_ranks", &lane_ranks));
      TF_RETURN_IF_ERROR(c->GetAttr("summands", &summands));
      try {
        hvdc::homo_blocks(n, block);
        // no elements: only the argument checks run
        hvdc::homo_decode(hvdc::kF32, nullptr, 0, block, nullptr, levels, lane_ranks, summands,
                          nullptr, 1.0, false);
      } catch (const std::exception& e) {
        return tensorflow::errors::InvalidArgument(e.what());
      }
      return vector_n(c);
    });

REGISTER_OP("HvdcPowersgdInitialQ")
    .Input("step: int64")
    .Output("qt: F")
    .Attr("F: {float, double}")
    .Attr("seed_base: int")
    .Attr("r: int >= 1")
    .Attr("cols: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      tensorflow::int64 r, cols;
      TF_RETURN_IF_ERROR(c->GetAttr("r", &r));
      TF_RETURN_IF_ERROR(c->GetAttr("cols", &cols));
      c->set_output(0, c->Matrix(r, cols));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcPowersgdProject")
    .Input("m: N * T")
    .Input("e: E * T")
    .Input("qt: F")
    .Output("p: F")
    .Output("e_out: E * T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("F: {float, double}")
    .Attr("N: int >= 1")
    .Attr("E: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      int n = 0, e = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("E", &e));
      auto qt = c->input(n + e);
      c->set_output(0, c->MakeShape({c->MakeDim(n), c->Dim(c->input(0), 0),
                                     c->Dim(qt, 1)}));
      for (int i = 0; i < e; ++i) c->set_output(1 + i, c->input(n + i));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcPowersgdOrthogonalize")
    .Input("p: F")
    .Input("eps: float64")
    .Output("p_out: F")
    .Attr("F: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcPowersgdBackProject")
    .Input("m: N * T")
    .Input("p: F")
    .Output("qt: F")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("F: {float, double}")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int n = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      c->set_output(0, c->MakeShape({c->MakeDim(n), c->Dim(c->input(n), 2),
                                     c->Dim(c->input(0), 1)}));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcPowersgdReconstruct")
    .Input("base: N * T")
    .Input("p: F")
    .Input("qt: F")
    .Input("alpha: float64")
    .Output("out: N * T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("F: {float, double}")
    .Attr("N: int >= 1")
    .Attr("subtract: bool")
    .SetShapeFn([](InferenceContext* c) {
      int n = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(i));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcCodecTime")
    .Output("nanoseconds: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return tensorflow::OkStatus();
    });

#define HVDC_TF_CPU(name, op) \
  REGISTER_KERNEL_BUILDER(Name(name).Device(tensorflow::DEVICE_CPU), op)

HVDC_TF_CPU("HvdcCodecTime", CodecTimeOp);
HVDC_TF_CPU("HvdcPowersgdInitialQ", PowerSGDInitialQOp);
HVDC_TF_CPU("HvdcEncode", EncodeOp<CpuLaunch>);
HVDC_TF_CPU("HvdcDecode", DecodeOp<CpuLaunch>);
HVDC_TF_CPU("HvdcAggregate", AggregateOp<CpuLaunch>);
HVDC_TF_CPU("HvdcAggregateConcat", AggregateConcatOp<CpuLaunch>);
HVDC_TF_CPU("HvdcAggregatePair", AggregatePairOp<CpuLaunch>);
HVDC_TF_CPU("HvdcEfEncode", EfEncodeOp<CpuLaunch>);
HVDC_TF_CPU("HvdcEncodeWithState", EncodeWithStateOp<CpuLaunch>);
HVDC_TF_CPU("HvdcEfSettle", EfSettleOp<CpuLaunch>);
HVDC_TF_CPU("HvdcNesterov", NesterovOp<CpuLaunch>);
HVDC_TF_CPU("HvdcHeavyBall", HeavyBallOp<CpuLaunch>);
HVDC_TF_CPU("HvdcAllFinite", AllFiniteOp);
HVDC_TF_CPU("HvdcPowersgdProject", PowerSGDProjectOp<CpuLaunch>);
HVDC_TF_CPU("HvdcPowersgdOrthogonalize", PowerSGDOrthogonalizeOp<CpuLaunch>);
HVDC_TF_CPU("HvdcPowersgdBackProject", PowerSGDBackProjectOp<CpuLaunch>);
HVDC_TF_CPU("HvdcPowersgdReconstruct", PowerSGDReconstructOp<CpuLaunch>);
HVDC_TF_CPU("HvdcHomoBlockAbsmax", HomoBlockAbsmaxOp<CpuLaunch>);
HVDC_TF_CPU("HvdcHomoEncode", HomoEncodeOp<CpuLaunch>);
HVDC_TF_CPU("HvdcHomoDecode", HomoDecodeOp<CpuLaunch>);

#if GOOGLE_CUDA
// Tensors stay in GPU memory; only the scalars the op body reads on the host (steps, prescale,
// alpha, mu, eps) are HostMemory. The initial Q and the codec clock are computed on the host
// whatever the device, so their kernels keep host outputs and TF copies Q where it is used.
using hvdc_tf::GpuLaunch;
#define HVDC_TF_GPU(name) Name(name).Device(tensorflow::DEVICE_GPU)

REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcCodecTime").HostMemory("nanoseconds"), CodecTimeOp);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcPowersgdInitialQ").HostMemory("step").HostMemory("qt"),
                        PowerSGDInitialQOp);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcEncode").HostMemory("step").HostMemory("prescale"),
                        EncodeOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcDecode").HostMemory("step").HostMemory("alpha"),
                        DecodeOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcAggregate").HostMemory("alpha"), AggregateOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcAggregateConcat").HostMemory("alpha"),
                        AggregateConcatOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcAggregatePair").HostMemory("alpha"),
                        AggregatePairOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcEfEncode").HostMemory("step").HostMemory("prescale"),
                        EfEncodeOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcEncodeWithState").HostMemory("step"),
                        EncodeWithStateOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcEfSettle"), EfSettleOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcNesterov").HostMemory("mu"), NesterovOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcHeavyBall").HostMemory("factor"),
                        HeavyBallOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcAllFinite"), GpuAllFiniteOp);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcPowersgdProject"), PowerSGDProjectOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcPowersgdOrthogonalize").HostMemory("eps"),
                        PowerSGDOrthogonalizeOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcPowersgdBackProject"), PowerSGDBackProjectOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcPowersgdReconstruct").HostMemory("alpha"),
                        PowerSGDReconstructOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcHomoBlockAbsmax"), HomoBlockAbsmaxOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcHomoEncode").HostMemory("step"), HomoEncodeOp<GpuLaunch>);
REGISTER_KERNEL_BUILDER(HVDC_TF_GPU("HvdcHomoDecode").HostMemory("alpha"), HomoDecodeOp<GpuLaunch>);
#endif
