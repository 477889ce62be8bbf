// Public CUDA entry points (hvdc/cuda.h): argument checks shared with the CPU library, the
// host-side checks of received payload headers, then the codec's own file.
#include <vector>

#include "common.cuh"

namespace hvdc {
namespace gpu {
namespace {

bool is_sign(CodecId c) { return c == kOnebit || c == kSignSGD || c == kEFSignSGD; }
bool is_cast(CodecId c) { return c == kNone || c == kFP16 || c == kBF16Codec; }
bool has_header(CodecId c) { return !is_cast(c) && c != kRandomK; }

// The first 16 bytes of each of `ranks` payloads `stride` apart, on the host: one copy, and the
// one wait for the GPU that refusing a mismatched rank costs.
void check_headers(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride,
                   const Params& p, cudaStream_t s) {
  const int64_t width = stride < 16 ? stride : 16;
  std::vector<uint8_t> h(static_cast<size_t>(ranks * 16), 0);
  check(cudaMemcpy2DAsync(h.data(), 16, payloads, stride, width, ranks, cudaMemcpyDeviceToHost, s),
        "payload headers");
  check(cudaStreamSynchronize(s), "payload headers");
  for (int64_t r = 0; r < ranks; ++r) check_header(c, d, h.data() + r * 16, p, r);
}

// Offsets of back-to-back threshold payloads, walked through their headers as the CPU does.
std::vector<int64_t> threshold_offsets(DType d, const void* payloads, int64_t ranks, int64_t total,
                                       int64_t n, cudaStream_t s) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  std::vector<int64_t> offsets;
  int64_t off = 0;
  const int64_t elem = d == kF32 ? 4 : d == kF64 ? 8 : 2;
  for (int64_t r = 0; r < ranks; ++r) {
    if (off + 8 > total)
      throw KernelError("threshold: gathered payloads end after " + std::to_string(r) + " of " +
                        std::to_string(ranks) + " ranks");
    uint8_t h[16] = {0};
    check(cudaMemcpyAsync(h, base + off, 8, cudaMemcpyDeviceToHost, s), "payload header");
    check(cudaStreamSynchronize(s), "payload header");
    check_header(kThreshold, d, h, Params{}, r);
    uint32_t count;
    std::memcpy(&count, h + 4, 4);
    if (count > static_cast<uint64_t>(n))
      throw KernelError("threshold payload from rank " + std::to_string(r) + " holds " +
                        std::to_string(count) + " elements of a tensor of " + std::to_string(n));
    offsets.push_back(off);
    off += 8 + (static_cast<int64_t>(count) * 4 + 7) / 8 * 8 + count * elem;
  }
  if (off != total)
    throw KernelError("threshold: gathered payloads are " + std::to_string(total) +
                      " bytes, their headers add up to " + std::to_string(off));
  return offsets;
}

// A payload's fields lie on multiples of their own size from its start, so the kernels read it
// in place only from an 8-byte boundary. Received payloads need not start on one: gathered rows
// of an odd length (16-bit values with an odd k; natural's or QSGD's byte per element of an
// odd-sized tensor) or a payload split out of a concatenation. The GPU faults on misaligned
// loads where the CPU does not, so such payloads are read from a copy whose rows start on the
// boundary.
constexpr int64_t kAlign = 8;
int64_t round_up(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
bool misaligned(const void* p, int64_t ranks, int64_t stride) {
  return reinterpret_cast<uintptr_t>(p) % kAlign != 0 || (ranks > 1 && stride % kAlign != 0);
}

// `ranks` rows `stride` apart, copied to rows `round_up(stride)` apart in `copy`.
const void* realign(const void* payloads, int64_t ranks, int64_t stride, Scratch& copy,
                    cudaStream_t s) {
  check(cudaMemcpy2DAsync(copy.as<void>(), round_up(stride), payloads, stride, stride, ranks,
                          cudaMemcpyDeviceToDevice, s), "payload realignment");
  return copy.as<void>();
}

// Threshold's back-to-back payloads of any length, each copied to an aligned offset.
const void* realign(const void* payloads, std::vector<int64_t>& offsets, int64_t total,
                    Scratch& copy, cudaStream_t s) {
  const auto* base = static_cast<const uint8_t*>(payloads);
  int64_t to = 0;
  for (size_t r = 0; r < offsets.size(); ++r) {
    const int64_t bytes = (r + 1 < offsets.size() ? offsets[r + 1] : total) - offsets[r];
    check(cudaMemcpyAsync(copy.as<uint8_t>(to), base + offsets[r], bytes, cudaMemcpyDeviceToDevice, s),
          "payload realignment");
    offsets[r] = to;
    to += round_up(bytes);
  }
  return copy.as<void>();
}

// alpha * D(payload) into out (accumulating or not), for a payload this rank made or one that
// has passed the header checks.
void decode_checked(CodecId c, DType d, const void* payload, int64_t n, const Params& p, void* out,
                    double alpha, bool acc, cudaStream_t s) {
  if (is_cast(c)) return cast::decode(c, d, payload, n, out, alpha, acc, s);
  if (is_sign(c)) return sign::decode(d, payload, n, out, alpha, acc, s);
  const int64_t bytes = payload_bytes(c, d, n, p);
  switch (c) {
    case kTopK: return sparse::topk_aggregate(d, payload, 1, bytes, n, p, out, alpha, acc, s);
    case kMinMax8: return minmax8::aggregate(d, payload, 1, bytes, n, p, out, alpha, acc, s);
    case kDither: return quant::dither_aggregate(d, payload, 1, bytes, n, p, out, alpha, acc, s);
    case kNatural: return quant::natural_aggregate(d, payload, 1, bytes, n, out, alpha, acc, s);
    case kDGC: return sparse::dgc_aggregate(d, payload, 1, bytes, n, p, out, alpha, acc, s);
    case kThreshold: {
      const int64_t offset = 0;
      return sparse::threshold_aggregate(d, payload, &offset, 1, n, out, alpha, acc, s);
    }
    default: return randomk::decode(d, payload, n, p, out, alpha, acc, s);
  }
}

}  // namespace

void encode(CodecId c, DType d, const void* x, int64_t n, const Params& p, void* payload,
            void* stream) {
  check_args(c, d, n, p);
  cudaStream_t s = as_stream(stream);
  if (is_cast(c)) return cast::encode(c, d, x, n, p, payload, s);
  if (is_sign(c)) return sign::encode(c, d, x, n, p, payload, s);
  switch (c) {
    case kTopK: return sparse::topk_encode(d, x, n, p, payload, s);
    case kMinMax8: return minmax8::encode(d, x, n, p, payload, s);
    case kDither: return quant::dither_encode(d, x, n, p, payload, s);
    case kNatural: return quant::natural_encode(d, x, n, p, payload, s);
    case kThreshold: return sparse::threshold_encode(d, x, n, p, payload, s);
    case kDGC: throw KernelError("dgc keeps momentum and accumulation state: call encode_with_state");
    default: return randomk::encode(d, x, n, p, payload, s);
  }
}

void decode(CodecId c, DType d, const void* payload, int64_t n, const Params& p, void* out,
            double alpha, bool accumulate, void* stream) {
  check_args(c, d, n, p);
  cudaStream_t s = as_stream(stream);
  const int64_t bytes = encoded_bytes(c, d, payload, n, p, stream);
  if (has_header(c) && c != kThreshold) check_headers(c, d, payload, 1, bytes, p, s);
  if (c == kThreshold) threshold_offsets(d, payload, 1, bytes, n, s);
  const bool move = misaligned(payload, 1, bytes);
  Scratch copy(move ? round_up(bytes) : 0, s);
  if (move) payload = realign(payload, 1, bytes, copy, s);
  decode_checked(c, d, payload, n, p, out, alpha, accumulate, s);
}

void aggregate(CodecId c, DType d, const void* payloads, int64_t ranks, int64_t stride, int64_t n,
               const Params& p, void* out, double alpha, void* stream) {
  check_args(c, d, n, p);
  cudaStream_t s = as_stream(stream);
  if (ranks < 1) throw KernelError("aggregate needs at least one payload, got " + std::to_string(ranks));
  if (c == kThreshold) {
    std::vector<int64_t> offsets = threshold_offsets(d, payloads, ranks, stride, n, s);
    bool move = misaligned(payloads, 1, 0);
    for (int64_t o : offsets) move = move || o % kAlign != 0;
    Scratch copy(move ? stride + ranks * kAlign : 0, s);
    if (move) payloads = realign(payloads, offsets, stride, copy, s);
    return sparse::threshold_aggregate(d, payloads, offsets.data(), ranks, n, out, alpha, false, s);
  }
  const int64_t one = payload_bytes(c, d, n, p);
  if (stride < one)
    throw KernelError("gathered payloads are " + std::to_string(stride) +
                      " bytes apart but one payload is " + std::to_string(one) + " bytes");
  if (has_header(c)) check_headers(c, d, payloads, ranks, stride, p, s);
  const bool move = misaligned(payloads, ranks, stride);
  Scratch copy(move ? ranks * round_up(stride) : 0, s);
  if (move) {
    payloads = realign(payloads, ranks, stride, copy, s);
    stride = round_up(stride);
  }
  if (is_sign(c)) return sign::aggregate(c, d, payloads, ranks, stride, n, out, alpha, s);
  switch (c) {
    case kFP16:
    case kBF16Codec: return cast::aggregate(c, d, payloads, ranks, stride, n, out, alpha, s);
    case kTopK: return sparse::topk_aggregate(d, payloads, ranks, stride, n, p, out, alpha, false, s);
    case kMinMax8: return minmax8::aggregate(d, payloads, ranks, stride, n, p, out, alpha, false, s);
    case kDither: return quant::dither_aggregate(d, payloads, ranks, stride, n, p, out, alpha, false, s);
    case kNatural: return quant::natural_aggregate(d, payloads, ranks, stride, n, out, alpha, false, s);
    case kDGC: return sparse::dgc_aggregate(d, payloads, ranks, stride, n, p, out, alpha, false, s);
    default:
      throw KernelError("payloads of this codec are reduced by allreduce, not aggregated locally");
  }
}

void aggregate_pair(CodecId c, DType d, const void* own, const int32_t* summed, int64_t rank,
                    int64_t n, const Params& p, void* out, double alpha, void* stream) {
  check_pair_args(c, d, rank, n, p);
  if (reinterpret_cast<uintptr_t>(own) % 2 != 0 || reinterpret_cast<uintptr_t>(summed) % 4 != 0)
    throw KernelError("aggregate_pair needs the payload at an even address and the summed words "
                      "at a multiple of 4");
  if (c == kMinMax8 || c == kDither || c == kNatural) {  // both payloads written out in rank order, then aggregated
    const int64_t bytes = payload_bytes(c, d, n, p);
    Scratch rows(2 * bytes, as_stream(stream));
    quant::pair_rows(own, summed, rank, bytes, rows.as<uint8_t>(), as_stream(stream));
    return aggregate(c, d, rows.as<uint8_t>(), 2, bytes, n, p, out, alpha, stream);
  }
  cast::aggregate_pair(c, d, own, summed, rank, n, out, alpha, as_stream(stream));
}

int64_t encoded_bytes(CodecId c, DType d, const void* payload, int64_t n, const Params& p,
                      void* stream) {
  check_args(c, d, n, p);
  if (c != kThreshold) return payload_bytes(c, d, n, p);
  cudaStream_t s = as_stream(stream);
  uint8_t h[16] = {0};
  check(cudaMemcpyAsync(h, payload, 8, cudaMemcpyDeviceToHost, s), "payload header");
  check(cudaStreamSynchronize(s), "payload header");
  check_header(c, d, h, p, -1);
  uint32_t count;
  std::memcpy(&count, h + 4, 4);
  const int64_t elem = d == kF32 ? 4 : d == kF64 ? 8 : 2;
  return 8 + (static_cast<int64_t>(count) * 4 + 7) / 8 * 8 + count * elem;
}

void ef_encode(CodecId c, DType d, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload, void* stream) {
  check_args(c, d, n, p);
  if (!(p.prescale > 0.0)) throw KernelError("prescale must be > 0, got " + std::to_string(p.prescale));
  if (ef_carry_size(c) && carry == nullptr)
    throw KernelError("error feedback needs its carry slot for this codec");
  cudaStream_t s = as_stream(stream);
  if (is_sign(c)) return sign::ef_encode(c, d, x, e_in, e, carry, n, p, payload, s);
  cast::add_into(d, x, e_in, e, n, s);
  encode(c, d, e, n, p, payload, stream);
  // D undoes the prescale, so the residual is measured in gradient units.
  decode_checked(c, d, payload, n, p, e, -1.0 / p.prescale, true, s);
}

void ef_settle(CodecId c, DType d, void* e, float* carry, int64_t n, void* stream) {
  check_args(c, d, n, Params{});
  if (ef_carry_size(c) && carry == nullptr)
    throw KernelError("error feedback needs its carry slot for this codec");
  if (is_sign(c)) sign::ef_settle(d, e, carry, n, as_stream(stream));
}

void encode_with_state(CodecId c, DType d, const void* x, const void* const* state_in,
                       void* const* state, int64_t nstate, int64_t n, const Params& p,
                       void* payload, void* stream) {
  check_args(c, d, n, p);
  if (nstate != state_count(c))
    throw KernelError("this codec keeps " + std::to_string(state_count(c)) + " state tensor(s), got " +
                      std::to_string(nstate));
  if (c != kDGC) throw KernelError("this codec keeps no state: call encode");
  sparse::dgc_encode(d, x, state_in[0], state_in[1], state[0], state[1], n, p, payload,
                     as_stream(stream));
}

void homo_block_absmax(DType d, const void* x, int64_t n, int64_t block, float* out,
                       void* stream) {
  homo_check_args(n, block, 1, 1, -1);
  homo::block_absmax(d, x, n, block, out, as_stream(stream));
}

void homo_encode(DType d, const void* x, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, uint64_t seed, int32_t* words, void* stream) {
  homo_check_args(n, block, levels, lane_ranks, -1);
  homo::encode(d, x, n, block, scales, levels, lane_ranks, seed, words, as_stream(stream));
}

void homo_decode(DType d, const int32_t* words, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
                 bool accumulate, void* stream) {
  homo_check_args(n, block, levels, lane_ranks, summands);
  homo::decode(d, words, n, block, scales, levels, lane_ranks, summands, out, alpha, accumulate,
               as_stream(stream));
}

void nesterov(DType d, void* x, void* m, int64_t n, double mu, void* stream) {
  if (n < 0) throw KernelError("element count must be >= 0, got " + std::to_string(n));
  cast::nesterov(d, x, m, n, mu, as_stream(stream));
}

void heavy_ball(DType d, const void* x, const void* m, void* out, int64_t n, double factor,
                void* stream) {
  if (n < 0) throw KernelError("element count must be >= 0, got " + std::to_string(n));
  cast::heavy_ball(d, x, m, out, n, factor, as_stream(stream));
}

}  // namespace gpu
}  // namespace hvdc
