// CUDA versions of the codec kernels (csrc/cuda). Same arguments and same results as the CPU
// entry points in hvdc/kernels.h, on device pointers, queued on `stream` (a cudaStream_t, kept
// as void* so frontends include this header without the CUDA headers). Argument checks and
// payload sizes come from the CPU library, so both sides refuse the same inputs.
//
// Nothing here waits for the GPU except where the host must learn a number that lives on it:
//   - aggregate() copies the first 16 bytes of every gathered payload to the host (one copy)
//     to refuse payloads made by ranks configured differently, as the CPU kernels do;
//   - threshold's payload size depends on the data: encoded_bytes() reads the count, and
//     aggregate() walks the back-to-back payloads' headers.
// Scratch memory comes from the stream-ordered allocator (cudaMallocAsync), so it is reused
// without a synchronisation either.
//
// Results equal the CPU kernels bit for bit, with two kinds of exception, both reductions in a
// different order: the scale of the sign codecs, the L2 / sigma norms of the dithering family
// and DGC's clipping norm are sums over the tensor (a sum in double, rounded to float once),
// and PowerSGD's orthogonalisation.
#pragma once

#include <cstdint>

#include "hvdc/kernels.h"

namespace hvdc {
namespace gpu {

void encode(CodecId codec, DType dtype, const void* x, int64_t n, const Params& p, void* payload,
            void* stream);
void decode(CodecId codec, DType dtype, const void* payload, int64_t n, const Params& p,
            void* out, double alpha, bool accumulate, void* stream);
void aggregate(CodecId codec, DType dtype, const void* payloads, int64_t ranks, int64_t stride,
               int64_t n, const Params& p, void* out, double alpha, void* stream);
int64_t encoded_bytes(CodecId codec, DType dtype, const void* payload, int64_t n,
                      const Params& p, void* stream);
// own: this rank's payload; summed: the words' sum (int32, 4-byte aligned); see hvdc/kernels.h.
void aggregate_pair(CodecId codec, DType dtype, const void* own, const int32_t* summed,
                    int64_t rank, int64_t n, const Params& p, void* out, double alpha,
                    void* stream);
// carry: ef_carry_size(codec) floats in device memory.
void ef_encode(CodecId codec, DType dtype, const void* x, const void* e_in, void* e, float* carry,
               int64_t n, const Params& p, void* payload, void* stream);
void ef_settle(CodecId codec, DType dtype, void* e, float* carry, int64_t n, void* stream);
void encode_with_state(CodecId codec, DType dtype, const void* x, const void* const* state_in,
                       void* const* state, int64_t nstate, int64_t n, const Params& p,
                       void* payload, void* stream);
void nesterov(DType dtype, void* x, void* m, int64_t n, double mu, void* stream);
void heavy_ball(DType dtype, const void* x, const void* m, void* out, int64_t n, double factor,
                void* stream);

// Sets *flag (device memory, unsigned) to nonzero when one of the n elements on the device is
// inf or NaN (hvdc/kernels.h's all_finite); leaves it alone otherwise. Does not wait.
void flag_nonfinite(DType dtype, const void* x, int64_t n, unsigned* flag, void* stream);
// *finite (device memory) = whether *flag is still zero, so that a verdict stays on the device
// for the ops that read it. Does not wait.
void flag_to_finite(const unsigned* flag, bool* finite, void* stream);

// Homomorphic quantisation (hvdc/kernels.h), on device pointers: x, scales, words and out
// all live on the GPU; homo_lane_bits / homo_words / homo_blocks are the CPU library's.
void homo_block_absmax(DType dtype, const void* x, int64_t n, int64_t block, float* out,
                       void* stream);
void homo_encode(DType dtype, const void* x, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, uint64_t seed, int32_t* words, void* stream);
void homo_decode(DType dtype, const int32_t* words, int64_t n, int64_t block, const float* scales,
                 int64_t levels, int64_t lane_ranks, int64_t summands, void* out, double alpha,
                 bool accumulate, void* stream);

// PowerSGD on a batch of `batch` same-shape matrices in one launch per pass: g, e_in, e and
// out are host arrays of `batch` device pointers; P ([batch, rows, r]) and Qt ([batch, r, cols])
// are stacked in device memory.
void powersgd_project(DType dtype, const void* const* g, const void* const* e_in, void* const* e,
                      bool ef, int64_t batch, int64_t rows, int64_t cols, const void* qt, int64_t r,
                      void* p, void* stream);
void powersgd_orthogonalize(DType dtype, void* p, int64_t batch, int64_t rows, int64_t r,
                            double eps, void* stream);
void powersgd_back_project(DType dtype, const void* const* m, int64_t batch, int64_t rows,
                           int64_t cols, const void* p, int64_t r, void* qt, void* stream);
void powersgd_reconstruct(DType dtype, const void* p, const void* qt, int64_t batch,
                          int64_t rows, int64_t cols, int64_t r, void* const* out, double alpha,
                          bool subtract_from_out, void* stream);

// The argument checks of the CPU entry points (hvdc/kernels.h), for the CUDA ones
// (csrc/cpu/dispatch.cc).
void check_args(CodecId codec, DType dtype, int64_t n, const Params& p);
// The checks of the CPU aggregate_pair (codec fp16, bf16, minmax8, dithering or natural, rank 0 or 1).
void check_pair_args(CodecId codec, DType dtype, int64_t rank, int64_t n, const Params& p);
// The checks the CPU kernels make on a received payload's first 16 bytes (tag, and k, chunk or
// levels where the codec records them), with the same messages.
void check_header(CodecId codec, DType dtype, const uint8_t* header, const Params& p, int64_t rank);
// The argument checks of the homomorphic entry points (summands < 0 for the calls without one).
void homo_check_args(int64_t n, int64_t block, int64_t levels, int64_t lane_ranks,
                     int64_t summands);

}  // namespace gpu
}  // namespace hvdc
