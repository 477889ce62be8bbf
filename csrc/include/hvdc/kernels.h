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
// With `finite`, *finite = whether every element of out is finite (in its dtype): found while
// each block of out is in L1 by topk, threshold and dgc, by a pass over out after the others.
void aggregate(CodecId codec, DType dtype, const void* payloads, int64_t ranks, int64_t stride,
               int64_t n, const Params& p, void* out, double alpha, bool* finite = nullptr);

// Two ranks' fp16, bf16, minmax8, dithering or natural payloads reduced from the int32 sum (wrapping) of their words, as
// two-rank Gloo jobs gather them (hvd_compress.collectives.gather_rows): `own` is this rank's
// payload, `summed` the sum of both payloads' bytes as little-endian int32 words (the last one
// zero-padded), `rank` 0 or 1. The other payload is summed - own, word by word, decoded in the
// same pass: out equals aggregate() of the two payloads in rank order, bit for bit. `finite`
// as aggregate's; for float32 out it is found as out is written, not by a pass that reads it
// back.
bool pair_aggregates(CodecId codec);
void aggregate_pair(CodecId codec, DType dtype, const void* own, const int32_t* summed,
                    int64_t rank, int64_t n, const Params& p, void* out, double alpha,
                    bool* finite = nullptr);

// Error feedback around any codec, one call: p = x + e; payload = C(p); e = p - D(payload).
//
// Codecs with ef_carry_size() > 0 (the sign family) keep the residual lazily so that one pass
// suffices: after the call e holds p and carry[0] the scale whose +-scale has yet to be taken
// off; the next call (or ef_settle) does that first. The arithmetic, and so every bit of the
// payloads and of the settled residual, equals the eager definition above. carry must point to
// ef_carry_size() floats, zero-initialised with e; it may be null when that size is 0.
//
// e_in is the residual before the call and e where the new one is written: the same buffer
// for an update in place, or two, so that a step's transaction keeps the old residual as its
// backup without copying it (e is then written in full and e_in only read).
void ef_encode(CodecId codec, DType dtype, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload);
int64_t ef_carry_size(CodecId codec);
// Makes e the plain residual (and carry zero): before reading or checkpointing e.
void ef_settle(CodecId codec, DType dtype, void* e, float* carry, int64_t n);

// Codecs that keep their own per-parameter state (DGC: velocity u and accumulator v, each
// shaped like x): updates the state and writes the payload in one call.
// dgc: g clipped to clip_norm; u = momentum_factor * u + g; v = v + u; the (at most) k largest
// |v| (threshold from a 1% strided sample, exact top-k when it overshoots) are sent and
// their u and v entries zeroed (momentum factor masking).
// state_in holds the state before the call and state is where the new state is written, as
// ef_encode's e_in and e: the same buffers for an update in place, or others (written in full,
// state_in only read) so that a step's transaction keeps the old state as its backup.
int64_t state_count(CodecId codec);
void encode_with_state(CodecId codec, DType dtype, const void* x, const void* const* state_in,
                       void* const* state, int64_t nstate, int64_t n, const Params& p,
                       void* payload);

// PowerSGD passes (csrc/cpu/powersgd.cc). M is rows x cols in the gradient dtype; P (rows x r)
// and Qt (r x cols, Q transposed) are float32, float64 for float64 gradients.
// project: M = g + e_in (stored into e when ef), P = M Q. e may be e_in; when it is not, e_in
// is left as it was (the step's backup of the residual, with no copy).
void powersgd_project(DType dtype, const void* g, const void* e_in, void* e, bool ef, int64_t rows,
                      int64_t cols, const void* qt, int64_t r, void* p);
// The first Qt (r x cols) of a matrix: standard normals drawn from `seed` (derive_seed of the
// spec's seed, the parameter's name and the step) with no generator state, so every rank and
// both frontends draw the same. Element i is one of a Box-Muller pair (cos for even i, sin for
// odd) from two 53-bit uniforms, splitmix64 of seed + (2*(i/2) + 1 or 2) * golden, computed in
// double and rounded once for float32 factors. dtype is the factor type: kF32 or kF64.
void powersgd_initial_q(DType dtype, uint64_t seed, int64_t r, int64_t cols, void* qt);
// Gram-Schmidt on P's columns: each divided by (its norm + eps), later ones made orthogonal.
void powersgd_orthogonalize(DType dtype, void* p, int64_t rows, int64_t r, double eps);
// Qt = (M^T P)^T.
void powersgd_back_project(DType dtype, const void* m, int64_t rows, int64_t cols, const void* p,
                           int64_t r, void* qt);
// out = alpha * P Q^T, or out = out - P Q^T (the local residual) when subtract_from_out. With
// `finite`, *finite = whether every element written is finite (in the output's dtype), found
// as it is written rather than in another pass.
void powersgd_reconstruct(DType dtype, const void* p, const void* qt, int64_t rows, int64_t cols,
                          int64_t r, void* out, double alpha, bool subtract_from_out,
                          bool* finite = nullptr);

// Homomorphic quantisation (THC, Li et al., NSDI 2024; csrc/cpu/homomorphic.cc). Every rank
// quantises with the same per-block scales, so the codes of all ranks can be summed by Horovod's
// plain int32 allreduce and decoded once:
//   1. homo_block_absmax on each rank, then the caller allreduces the per-block results with
//      op=Max: M_b, the agreed scale of block b (elements b * block .. b * block + block - 1).
//   2. homo_encode: unsigned codes c in [0, L] (L = levels), packed into int32 words.
//   3. allreduce (sum) of the words: a lane sum of `ranks` codes never carries into the next
//      lane, so the wrapped int32 sum of the words is the words of the lane sums.
//   4. homo_decode with summands = ranks (or a rank's own words with summands = 1).
//
// Encode, element i of block b = i / block, all in float32 with each operation rounded:
//   v = (float)x[i] (f16 / bf16 exactly, f64 rounded to nearest), M = scales[b]
//   if !(0 < M < inf):  c = 0                          (zero, negative, NaN or inf scale)
//   else:  t = (v / M + 1) * (L / 2);   t = t > 0 ? t : 0 (NaN too);   t = t < L ? t : L
//          c = floor(t) + (u < t - floor(t) ? 1 : 0),  u = uniform(seed, i) (hvdc/element.h)
// so E[c] = t and the decoded value below is unbiased for |x| <= M (to the 2^-16 grid of u).
// Lanes: w = bit width of L * lane_ranks (smallest w with 2^w > L * lane_ranks, at most 32),
// 32 / w lanes per word; element i sits in word i / lanes at bits (i % lanes) * w; unused lanes
// and bits are zero.
//
// Decode, lane sum S of `summands` codes (1 <= summands <= lane_ranks), sL = summands * L:
//   vd = NaN                                           if M is NaN, inf or < 0, or S > sL
//   vd = +0                                            else if M == 0
//   vd = (double)M * ((double)(2 * S - sL) / (double)L)   otherwise (2S - sL as an integer)
//   out = alpha * (A)vd, or out = out + alpha * (A)vd with accumulate, A the accumulator type
//   (float for 32-bit and narrower gradients, double for float64), alpha as an A.
// A non-finite gradient is never hidden: homo_block_absmax reports its block as NaN (inf for
// inf), the Max allreduce carries that to every rank (inf always; a NaN only when the reduction
// propagates NaN, so callers should turn NaN into inf before reducing), and a non-finite M
// decodes to NaN in the whole block. Unused bits above the last lane are ignored on decode.
int32_t homo_lane_bits(int64_t levels, int64_t lane_ranks);
// int32 words of one rank's payload for n elements.
int64_t homo_words(int64_t n, int64_t levels, int64_t lane_ranks);
// Blocks (entries of `scales`) for n elements: ceil(n / block).
int64_t homo_blocks(int64_t n, int64_t block);
// out[b] = max |(float)x| over block b; a canonical quiet NaN if the block holds a NaN.
void homo_block_absmax(DType d, const void* x, int64_t n, int64_t block, float* out);
void homo_encode(DType d, const void* x, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, uint64_t seed, int32_t* words);
void homo_decode(DType d, const int32_t* words, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
                 bool accumulate);

// Worker-side Nesterov momentum, in place on x: m = mu * m + x; x = mu * m + x.
void nesterov(DType dtype, void* x, void* m, int64_t n, double mu);

// Worker-side heavy-ball momentum (DGC's momentum correction), in one pass:
// out = factor * m + x, the product and the sum each rounded to the element type, as
// torch.optim.SGD's buffer in its dtype. out may be x or m.
void heavy_ball(DType dtype, const void* x, const void* m, void* out, int64_t n, double factor);

// Whether none of the n elements is inf or NaN (by their exponent bits; reads x once).
bool all_finite(DType dtype, const void* x, int64_t n);

// Per-step seed from a per-parameter base (hvd_compress.seeds.derive_seed, last step), so graph
// frontends can advance a step counter tensor without leaving the graph.
uint64_t step_seed(uint64_t base, int64_t step);

// Which SIMD path the CPU kernels take on this machine ("avx2+f16c" or "scalar").
const char* cpu_isa();

}  // namespace hvdc
