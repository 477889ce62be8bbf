// Framework-neutral codec kernels. Both frontends (the torch extension and, later, the
// TensorFlow custom ops) call exactly these entry points on raw buffers, so a codec's numerics
// are defined once. CUDA versions will sit beside the CPU ones with the same signatures.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace hvdc {

// Gradient element types. Values match hvd_compress.registry.DTYPES.
enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };

// Codec ids. Values match the `kernel_id` of each entry in hvd_compress.registry.
enum CodecId : int32_t {
  kNone = 0,
  kFP16 = 1,
  kBF16Codec = 2,
  kOnebit = 3,
  kSignSGD = 4,
  kEFSignSGD = 5,
  kTopK = 6,
  kRandomK = 7,
  kMinMax8 = 8,
  kDither = 9,    // dithering, qsgd and terngrad are parametrisations of this kernel
  kNatural = 10,
  kThreshold = 11,
  kDGC = 12,
};

enum Partition : int32_t { kLinear = 0, kNaturalLevels = 1 };
enum Normalize : int32_t { kMax = 0, kL2 = 1, kClipSigma = 2 };

struct Params {
  int64_t k = 0;          // topk / randomk: number of elements kept (0 <= k <= n)
  uint64_t seed = 0;      // randomk: per (seed, step, parameter) value, identical on all ranks
  double prescale = 1.0;  // fp16 / bf16 / none: multiply before the cast (overflow guard)
  bool scaling = true;    // sign codecs: scale = mean|x| (else 1)
  bool rescale = false;   // randomk: multiply kept values by the stratum size (unbiased)
  int64_t chunk = 4096;   // minmax8: elements sharing one min/max pair
  int64_t s = 8;          // dither: quantisation levels per sign (1..127)
  int64_t partition = kLinear;  // dither: level spacing
  int64_t normalize = kMax;     // dither: what |x| is divided by
  double clip = 2.5;      // dither with kClipSigma (TernGrad): clip |x| at clip * std(x)
  double threshold = 0.0;  // threshold: elements with |x| > threshold are sent
  double momentum_factor = 0.9;  // dgc: momentum correction
  double clip_norm = 0.0;  // dgc: local L2 clipping of the gradient (0: off)
};

// Raised for any bad argument; the message names what was wrong.
struct KernelError : std::invalid_argument {
  explicit KernelError(const std::string& m) : std::invalid_argument(m) {}
};

// Bytes of one rank's payload for n elements of dtype.
int64_t payload_bytes(CodecId codec, DType dtype, int64_t n, const Params& p);

// Element type of the payload as the collective sees it. Linear codecs travel by allreduce,
// so their payload is a typed array; non-linear ones are bytes (returned as -1).
int32_t wire_dtype(CodecId codec, DType dtype);

void encode(CodecId codec, DType dtype, const void* x, int64_t n, const Params& p,
            void* payload);

// out = alpha * D(payload)            (accumulate == false)
// out = out + alpha * D(payload)      (accumulate == true)
void decode(CodecId codec, DType dtype, const void* payload, int64_t n, const Params& p,
            void* out, double alpha, bool accumulate);

// Bytes of the payload actually used: payload_bytes for fixed-size codecs; for variable-size
// ones (threshold) payload_bytes is the capacity and the header says how much was filled.
int64_t encoded_bytes(CodecId codec, DType dtype, const void* payload, int64_t n,
                      const Params& p);

// Reduction of `ranks` payloads laid out `stride` bytes apart (the result of an allgather).
// Variable-size codecs: the payloads are back to back and `stride` is their total size.
// Mean-style codecs: out = sum_r alpha * D(payload_r), accumulated in float (double for f64).
// signsgd: out = sign(sum_r sign_r) * mean_r(scale_r) * alpha * ranks (majority vote).
void aggregate(CodecId codec, DType dtype, const void* payloads, int64_t ranks, int64_t stride,
               int64_t n, const Params& p, void* out, double alpha);

// Error feedback around any codec, one call: p = x + e; payload = C(p); e = p - D(payload).
//
// Codecs with ef_carry_size() > 0 (the sign family) keep the residual lazily so that one pass
// suffices: after the call e holds p and carry[0] the scale whose +-scale has yet to be taken
// off; the next call (or ef_settle) does that first. The arithmetic, and so every bit of the
// payloads and of the settled residual, equals the eager definition above. carry must point to
// ef_carry_size() floats, zero-initialised with e; it may be null when that size is 0.
void ef_encode(CodecId codec, DType dtype, const void* x, void* e, float* carry, int64_t n,
               const Params& p, void* payload);
int64_t ef_carry_size(CodecId codec);
// Makes e the plain residual (and carry zero): before reading or checkpointing e.
void ef_settle(CodecId codec, DType dtype, void* e, float* carry, int64_t n);

// Codecs that keep their own per-parameter state (DGC: velocity u and accumulator v, each
// shaped like x): updates the state and writes the payload in one call.
// dgc: g clipped to clip_norm; u = momentum_factor * u + g; v = v + u; the (at most) k largest
// |v| (threshold from a 1% strided sample, exact top-k when it overshoots) are sent and
// their u and v entries zeroed (momentum factor masking).
int64_t state_count(CodecId codec);
void encode_with_state(CodecId codec, DType dtype, const void* x, void* const* state,
                       int64_t nstate, int64_t n, const Params& p, void* payload);

// PowerSGD passes (csrc/cpu/powersgd.cc). M is rows x cols in the gradient dtype; P (rows x r)
// and Qt (r x cols, Q transposed) are float32, float64 for float64 gradients.
// project: M = g + e (stored into e when ef), P = M Q.
void powersgd_project(DType dtype, const void* g, void* e, bool ef, int64_t rows, int64_t cols,
                      const void* qt, int64_t r, void* p);
// Gram-Schmidt on P's columns: each divided by (its norm + eps), later ones made orthogonal.
void powersgd_orthogonalize(DType dtype, void* p, int64_t rows, int64_t r, double eps);
// Qt = (M^T P)^T.
void powersgd_back_project(DType dtype, const void* m, int64_t rows, int64_t cols, const void* p,
                           int64_t r, void* qt);
// out = alpha * P Q^T, or out = out - P Q^T (the local residual) when subtract_from_out.
void powersgd_reconstruct(DType dtype, const void* p, const void* qt, int64_t rows, int64_t cols,
                          int64_t r, void* out, double alpha, bool subtract_from_out);

// Worker-side Nesterov momentum, in place on x: m = mu * m + x; x = mu * m + x.
void nesterov(DType dtype, void* x, void* m, int64_t n, double mu);

// Per-step seed from a per-parameter base (hvd_compress.seeds.derive_seed, last step), so graph
// frontends can advance a step counter tensor without leaving the graph.
uint64_t step_seed(uint64_t base, int64_t step);

// Which SIMD path the CPU kernels take on this machine ("avx2+f16c" or "scalar").
const char* cpu_isa();

}  // namespace hvdc
