// Public entry points: argument checks, then the codec's own file.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "common.h"
#include "hvdc/cuda.h"

namespace hvdc {
namespace {

const char* codec_name(CodecId c) {
  switch (c) {
    case kNone: return "none";
    case kFP16: return "fp16";
    case kBF16Codec: return "bf16";
    case kOnebit: return "onebit";
    case kSignSGD: return "signsgd";
    case kEFSignSGD: return "efsignsgd";
    case kTopK: return "topk";
    case kRandomK: return "randomk";
    case kMinMax8: return "minmax8";
    case kDither: return "dither";
    case kNatural: return "natural";
    case kThreshold: return "threshold";
    case kDGC: return "dgc";
  }
  throw KernelError("unknown codec id " + std::to_string(static_cast<int>(c)) +
                    " (valid: 0..12: none, fp16, bf16, onebit, signsgd, efsignsgd, topk, randomk, "
                    "minmax8, dither, natural, threshold, dgc)");
}

bool is_sign(CodecId c) { return c == kOnebit || c == kSignSGD || c == kEFSignSGD; }
bool is_cast(CodecId c) { return c == kNone || c == kFP16 || c == kBF16Codec; }

void check_common(CodecId c, DType d, int64_t n, const Params& p) {
  codec_name(c);
  dtype_size(d);
  if (d != kF32 && d != kF16 && d != kBF16 && d != kF64)
    throw KernelError("unsupported gradient dtype code " + std::to_string(static_cast<int>(d)) +
                      " (valid: float32, float16, bfloat16, float64)");
  if (n < 0) throw KernelError("element count must be >= 0, got " + std::to_string(n));
  if (c == kMinMax8 && (p.chunk < 1 || p.chunk > 0x7fffffffLL))
    throw KernelError("minmax8: chunk must be in [1, 2^31-1], got " + std::to_string(p.chunk));
  if (c == kDither) {
    if (p.s < 1 || p.s > 127)
      throw KernelError("dithering: s (levels) must be in [1, 127], got " + std::to_string(p.s));
    if (p.partition != kLinear && p.partition != kNaturalLevels)
      throw KernelError("dithering: partition code must be 0 (linear) or 1 (natural), got " +
                        std::to_string(p.partition));
    if (p.normalize != kMax && p.normalize != kL2 && p.normalize != kClipSigma)
      throw KernelError("dithering: normalize code must be 0 (max), 1 (l2) or 2 (clipped max), got " +
                        std::to_string(p.normalize));
    if (p.normalize == kClipSigma && !(p.clip > 0.0))
      throw KernelError("dithering: clip must be > 0, got " + std::to_string(p.clip));
  }
  if (c == kThreshold && !(p.threshold >= 0.0 && std::isfinite(p.threshold)))
    throw KernelError("threshold: threshold must be a finite number >= 0, got " +
                      std::to_string(p.threshold));
  if (c == kDGC) {
    if (!(p.momentum_factor >= 0.0 && p.momentum_factor < 1.0))
      throw KernelError("dgc: momentum_factor must be in [0, 1), got " + std::to_string(p.momentum_factor));
    if (!(p.clip_norm >= 0.0))
      throw KernelError("dgc: clip_norm must be >= 0 (0: off), got " + std::to_string(p.clip_norm));
  }
  if ((c == kThreshold || c == kDGC) && n > 0x7fffffffLL)
    throw KernelError(std::string(codec_name(c)) + ": tensors above 2^31-1 elements are not "
                      "supported (int32 indices), got " + std::to_string(n));
  if (c == kTopK || c == kRandomK || c == kDGC) {
    if (p.k < 0 || p.k > n)
      throw KernelError(std::string(codec_name(c)) + ": k must be in [0, n] = [0, " +
                        std::to_string(n) + "], got " + std::to_string(p.k));
    if (n > 0x7fffffffLL)
      throw KernelError(std::string(codec_name(c)) + ": tensors above 2^31-1 elements are not "
                        "supported (int32 indices), got " + std::to_string(n));
  }
}

// Homomorphic quantisation: the checks every entry point makes (summands < 0: not a decode).
void check_homo(int64_t n, int64_t block, int64_t levels, int64_t lane_ranks, int64_t summands) {
  if (n < 0) throw KernelError("homomorphic: element count must be >= 0, got " + std::to_string(n));
  if (block < 1) throw KernelError("homomorphic: block must be >= 1, got " + std::to_string(block));
  if (levels < 1 || levels > 65535)
    throw KernelError("homomorphic: levels must be in [1, 65535], got " + std::to_string(levels));
  if (lane_ranks < 1)
    throw KernelError("homomorphic: lane_ranks must be >= 1, got " + std::to_string(lane_ranks));
  // levels < 2^16 and lane_ranks < 2^63: the product fits 128 bits.
  const unsigned __int128 top = static_cast<unsigned __int128>(levels) * lane_ranks;
  int w = 0;
  while ((top >> w) != 0) ++w;
  if (w > 32)
    throw KernelError("homomorphic: levels=" + std::to_string(levels) + " with lane_ranks=" +
                      std::to_string(lane_ranks) + " needs lanes of w=" + std::to_string(w) +
                      " bits (2^w > levels * lane_ranks), more than an int32 word holds (32): "
                      "lower levels or lane_ranks");
  if (summands >= 0 && (summands < 1 || summands > lane_ranks))
    throw KernelError("homomorphic: summands must be in [1, lane_ranks] = [1, " +
                      std::to_string(lane_ranks) + "], got " + std::to_string(summands));
}

void check_pair(CodecId c, DType d, int64_t rank, int64_t n, const Params& p) {
  check_common(c, d, n, p);
  if (!pair_aggregates(c))
    throw KernelError(std::string("aggregate_pair takes fp16, bf16, minmax8, dithering or natural payloads, not ") +
                      codec_name(c));
  if (rank != 0 && rank != 1)
    throw KernelError("aggregate_pair is for two ranks: rank must be 0 or 1, got " +
                      std::to_string(rank));
}

}  // namespace

void check_tag(const void* payload, CodecId c, DType d, int64_t rank) {
  uint32_t got;
  std::memcpy(&got, payload, 4);
  const uint32_t want = payload_tag(c, d);
  if (got == want) return;
  std::string from = rank >= 0 ? " from rank " + std::to_string(rank) : "";
  if ((got & 0xffff0000u) != kTagMagic)
    throw KernelError("payload" + from + " is not an hvd_compress payload (expected " +
                      codec_name(c) + ")");
  throw KernelError("payload" + from + " was made by codec id " + std::to_string((got >> 8) & 0xff) +
                    " / dtype code " + std::to_string(got & 0xff) + ", this rank expects " +
                    codec_name(c) + " / dtype code " + std::to_string(static_cast<int>(d)) +
                    ": ranks must use the same compression spec");
}

namespace gpu {

void check_args(CodecId c, DType d, int64_t n, const Params& p) { check_common(c, d, n, p); }

void check_pair_args(CodecId c, DType d, int64_t rank, int64_t n, const Params& p) {
  check_pair(c, d, rank, n, p);
}

void homo_check_args(int64_t n, int64_t block, int64_t levels, int64_t lane_ranks,
                     int64_t summands) {
  check_homo(n, block, levels, lane_ranks, summands);
}

void check_header(CodecId c, DType d, const uint8_t* h, const Params& p, int64_t rank) {
  check_tag(h, c, d, rank);
  uint32_t w1, w2;
  std::memcpy(&w1, h + 4, 4);
  std::memcpy(&w2, h + 8, 4);
  const std::string from = rank >= 0 ? " from rank " + std::to_string(rank) : "";
  if (c == kTopK && w1 != static_cast<uint64_t>(p.k))
    throw KernelError("topk payload" + from + " carries k=" + std::to_string(w1) +
                      " but this rank expects k=" + std::to_string(p.k) +
                      " (ranks configured with different k or ratio?)");
  if (c == kMinMax8 && w1 != static_cast<uint64_t>(p.chunk))
    throw KernelError("minmax8 payload" + from + " uses chunk=" + std::to_string(w1) +
                      ", this rank chunk=" + std::to_string(p.chunk));
  if (c == kDither && (h[4] != p.s || h[5] != p.partition || h[6] != p.normalize))
    throw KernelError("dithering payload" + from + " has s=" + std::to_string(h[4]) +
                      " partition=" + std::to_string(h[5]) + " normalize=" + std::to_string(h[6]) +
                      ", this rank s=" + std::to_string(p.s) + " partition=" +
                      std::to_string(p.partition) + " normalize=" + std::to_string(p.normalize));
  if (c == kDGC && (w1 != static_cast<uint64_t>(p.k) || w2 > static_cast<uint64_t>(p.k)))
    throw KernelError("dgc payload" + from + " has capacity " + std::to_string(w1) +
                      ", this rank k=" + std::to_string(p.k));
}

}  // namespace gpu

int64_t payload_bytes(CodecId c, DType d, int64_t n, const Params& p) {
  check_common(c, d, n, p);
  if (is_cast(c)) return cast::payload_bytes(c, d, n);
  if (is_sign(c)) return sign::payload_bytes(n);
  if (c == kTopK) return topk::payload_bytes(d, p.k);
  if (c == kMinMax8) return minmax8::payload_bytes(n, p.chunk);
  if (c == kDither) return quant::dither_payload_bytes(n, p.s);
  if (c == kNatural) return quant::natural_payload_bytes(n);
  if (c == kThreshold) return sparse::threshold_capacity(d, n);
  if (c == kDGC) return sparse::dgc_payload_bytes(d, p.k);
  return p.k * dtype_size(d);  // randomk
}

int32_t wire_dtype(CodecId c, DType d) {
  codec_name(c);
  if (c == kFP16) return kF16;
  if (c == kBF16Codec) return kBF16;
  if (c == kNone || c == kRandomK) return d;
  return -1;
}

void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload) {
  check_common(c, d, n, p);
  if (is_cast(c)) return cast::encode(c, d, x, n, p, payload);
  if (is_sign(c)) return sign::encode(c, d, x, n, p, payload);
  if (c == kTopK) return topk::encode(d, x, n, p, payload);
  if (c == kMinMax8) return minmax8::encode(d, x, n, p, payload);
  if (c == kDither) return quant::dither_encode(d, x, n, p, payload);
  if (c == kNatural) return quant::natural_encode(d, x, n, p, payload);
  if (c == kThreshold) return sparse::threshold_encode(d, x, n, p, payload);
  if (c == kDGC)
    throw KernelError("dgc keeps momentum and accumulation state: call encode_with_state");
  return randomk::encode(d, x, n, p, payload);
}

void decode(CodecId c, DType d, const void* payload, int64_t n, const Params& p, void* out,
            double alpha, bool accumulate) {
  check_common(c, d, n, p);
  if (is_cast(c)) return cast::decode(c, d, payload, n, out, alpha, accumulate);
  if (is_sign(c)) return sign::decode(c, d, payload, n, out, alpha, accumulate);
  if (c == kTopK) return topk::decode(d, payload, n, p, out, alpha, accumulate);
  if (c == kMinMax8) return minmax8::decode(d, payload, n, p, out, alpha, accumulate);
  if (c == kDither)
    return quant::dither_aggregate(d, payload, 1, payload_bytes(c, d, n, p), n, p, out, alpha,
                                   accumulate);
  if (c == kNatural)
    return quant::natural_aggregate(d, payload, 1, payload_bytes(c, d, n, p), n, out, alpha,
                                    accumulate);
  if (c == kThreshold)
    return sparse::threshold_aggregate(d, payload, 1, sparse::threshold_used(d, payload), n, out,
                                       alpha, accumulate);
  if (c == kDGC)
    return sparse::dgc_aggregate(d, payload, 1, payload_bytes(c, d, n, p), n, p, out, alpha,
                                 accumulate);
  return randomk::decode(d, payload, n, p, out, alpha, accumulate);
}

namespace {
void aggregate_unchecked(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride,
                         int64_t n, const Params& p, void* out, double alpha) {
  if (is_sign(c)) return sign::aggregate(c, d, payloads, ranks, stride, n, out, alpha);
  if (c == kFP16 || c == kBF16Codec) return cast::aggregate(c, d, payloads, ranks, stride, n, out, alpha);
  throw KernelError(std::string(codec_name(c)) +
                    " payloads are reduced by allreduce, not aggregated locally");
}
}  // namespace

void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, bool* finite) {
  check_common(c, d, n, p);
  if (ranks < 1) throw KernelError("aggregate needs at least one payload, got " + std::to_string(ranks));
  if (c == kThreshold)
    return sparse::threshold_aggregate(d, payloads, ranks, stride, n, out, alpha, false, finite);
  if (stride < payload_bytes(c, d, n, p))
    throw KernelError(std::string(codec_name(c)) + ": gathered payloads are " + std::to_string(stride) +
                      " bytes apart but one payload is " + std::to_string(payload_bytes(c, d, n, p)) +
                      " bytes");
  if (c == kTopK) return topk::aggregate(d, payloads, ranks, stride, n, p, out, alpha, finite);
  if (c == kDGC)
    return sparse::dgc_aggregate(d, payloads, ranks, stride, n, p, out, alpha, false, finite);
  // These find finite as they write out.
  if (c == kMinMax8)
    return minmax8::aggregate(d, payloads, ranks, stride, n, p, out, alpha, false, finite);
  if (c == kDither)
    return quant::dither_aggregate(d, payloads, ranks, stride, n, p, out, alpha, false, finite);
  if (c == kNatural)
    return quant::natural_aggregate(d, payloads, ranks, stride, n, out, alpha, false, finite);
  aggregate_unchecked(c, d, payloads, ranks, stride, n, p, out, alpha);
  if (finite) *finite = all_finite(d, out, n);
}

bool pair_aggregates(CodecId c) {
  return c == kFP16 || c == kBF16Codec || c == kMinMax8 || c == kDither || c == kNatural;
}

void aggregate_pair(CodecId c, DType d, const void* own, const int32_t* summed, int64_t rank,
                    int64_t n, const Params& p, void* out, double alpha, bool* finite) {
  check_pair(c, d, rank, n, p);
  if (c == kDither) quant::dither_aggregate_pair(d, own, summed, rank, n, p, out, alpha, finite);
  else if (c == kNatural) quant::natural_aggregate_pair(d, own, summed, rank, n, out, alpha, finite);
  else if (c == kMinMax8) minmax8::aggregate_pair(d, own, summed, rank, n, p, out, alpha, finite);
  else cast::aggregate_pair(c, d, own, summed, rank, n, out, alpha, finite);
}

int64_t encoded_bytes(CodecId c, DType d, const void* payload, int64_t n, const Params& p) {
  if (c == kThreshold) {
    check_common(c, d, n, p);
    check_tag(payload, c, d, -1);
    return sparse::threshold_used(d, payload);
  }
  return payload_bytes(c, d, n, p);
}

int64_t state_count(CodecId c) {
  codec_name(c);
  return c == kDGC ? 2 : 0;
}

void encode_with_state(CodecId c, DType d, const void* x, const void* const* state_in,
                       void* const* state, int64_t nstate, int64_t n, const Params& p,
                       void* payload) {
  check_common(c, d, n, p);
  if (nstate != state_count(c))
    throw KernelError(std::string(codec_name(c)) + " keeps " + std::to_string(state_count(c)) +
                      " state tensor(s), got " + std::to_string(nstate));
  if (c == kDGC)
    return sparse::dgc_encode(d, x, state_in[0], state_in[1], state[0], state[1], n, p, payload);
  throw KernelError(std::string(codec_name(c)) + " keeps no state: call encode");
}

int64_t ef_carry_size(CodecId c) {
  codec_name(c);
  return is_sign(c) ? 1 : 0;
}

void ef_settle(CodecId c, DType d, void* e, float* carry, int64_t n) {
  check_common(c, d, n, Params{});
  if (ef_carry_size(c) && carry == nullptr)
    throw KernelError(std::string(codec_name(c)) + ": error feedback needs its carry slot");
  if (is_sign(c)) sign::ef_settle(d, e, carry, n);
}

void ef_encode(CodecId c, DType d, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload) {
  check_common(c, d, n, p);
  if (!(p.prescale > 0.0))
    throw KernelError("prescale must be > 0, got " + std::to_string(p.prescale));
  if (ef_carry_size(c) && carry == nullptr)
    throw KernelError(std::string(codec_name(c)) + ": error feedback needs its carry slot");
  if (is_sign(c)) return sign::ef_encode(c, d, x, e_in, e, carry, n, p, payload);
  if (c == kTopK) {
    topk::ef_accumulate_encode(d, x, e_in, e, n, p, payload);
  } else if (c == kThreshold) {  // the residual taken in the same sweep
    return sparse::threshold_ef_encode(d, x, e_in, e, n, p, payload, -1.0 / p.prescale);
  } else if (c == kDither) {  // the sum is not stored; the residual is taken as it codes
    return quant::dither_ef_encode(d, x, e_in, e, n, p, payload, -1.0 / p.prescale);
  } else if (c == kMinMax8) {  // chunk by chunk, each in cache from its sum to its residual
    return minmax8::ef_encode(d, x, e_in, e, n, p, payload, -1.0 / p.prescale);
  } else {
    dispatch_dtype(d, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      const T* xs = static_cast<const T*>(x);
      const T* ein = static_cast<const T*>(e_in);
      T* es = static_cast<T*>(e);
      for (int64_t i = 0; i < n; ++i) es[i] = ef_sum(xs[i], ein[i]);
    });
    encode(c, d, e, n, p, payload);
  }
  // D undoes the prescale, so the residual is measured in gradient units.
  decode(c, d, payload, n, p, e, -1.0 / p.prescale, true);
}

int32_t homo_lane_bits(int64_t levels, int64_t lane_ranks) {
  check_homo(0, 1, levels, lane_ranks, -1);
  return homo_bits(levels, lane_ranks);
}

int64_t homo_words(int64_t n, int64_t levels, int64_t lane_ranks) {
  check_homo(n, 1, levels, lane_ranks, -1);
  const int64_t lanes = 32 / homo_bits(levels, lane_ranks);
  return n / lanes + (n % lanes != 0);
}

int64_t homo_blocks(int64_t n, int64_t block) {
  check_homo(n, block, 1, 1, -1);
  return n / block + (n % block != 0);
}

void homo_block_absmax(DType d, const void* x, int64_t n, int64_t block, float* out) {
  check_homo(n, block, 1, 1, -1);
  homo::block_absmax(d, x, n, block, out);
}

void homo_encode(DType d, const void* x, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, uint64_t seed, int32_t* words) {
  check_homo(n, block, levels, lane_ranks, -1);
  homo::encode(d, x, n, block, scales, levels, lane_ranks, seed, words);
}

void homo_decode(DType d, const int32_t* words, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
                 bool accumulate) {
  check_homo(n, block, levels, lane_ranks, summands);
  homo::decode(d, words, n, block, scales, levels, lane_ranks, summands, out, alpha, accumulate);
}

void nesterov(DType d, void* x, void* m, int64_t n, double mu) {
  if (n < 0) throw KernelError("element count must be >= 0, got " + std::to_string(n));
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    T* xs = static_cast<T*>(x);
    T* ms = static_cast<T*>(m);
    const A u = static_cast<A>(mu);
    for (int64_t i = 0; i < n; ++i) {
      ms[i] = from_acc<T>(u * to_acc(ms[i]) + to_acc(xs[i]));
      xs[i] = from_acc<T>(u * to_acc(ms[i]) + to_acc(xs[i]));
    }
  });
}

void heavy_ball(DType d, const void* x, const void* m, void* out, int64_t n, double factor) {
  if (n < 0) throw KernelError("element count must be >= 0, got " + std::to_string(n));
  dispatch_dtype(d, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = typename Acc<T>::type;
    const T* xs = static_cast<const T*>(x);
    const T* ms = static_cast<const T*>(m);
    T* os = static_cast<T*>(out);
    const A f = static_cast<A>(factor);
    for (int64_t i = 0; i < n; ++i)
      os[i] = from_acc<T>(to_acc(from_acc<T>(f * to_acc(ms[i]))) + to_acc(xs[i]));
  });
}

bool cpu_has_avx2_f16c() {
  static const bool has = [] {
    if (const char* env = std::getenv("HVDC_FORCE_SCALAR"); env && env[0] == '1') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return has;
}

uint64_t step_seed(uint64_t base, int64_t step) {
  uint64_t z = base + static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

const char* cpu_isa() { return cpu_has_avx2_f16c() ? "avx2+f16c" : "scalar"; }

}  // namespace hvdc
