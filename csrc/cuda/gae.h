// Host API of the CUDA GAE scan (csrc/cuda/gae.cu): plain C++ with raw
// pointers, no torch and no CUDA headers, like logprob_entropy.h.
#pragma once

#include <cstdint>

namespace hybridflow_cuda {

// GAE over each row's valid steps (mask != 0) of rewards, values, mask
// [rows, steps] (contiguous float32); masked steps get 0 and the recursion
// carries the next value and advantage across them. Writes advantages and
// returns (= advantages + values on valid steps) [rows, steps]. `stream` is a
// cudaStream_t. Returns nullptr on success, else the CUDA error message.
const char* gae_forward(const float* rewards, const float* values, const float* mask, int64_t rows,
                        int64_t steps, float gamma, float lam, float* advantages, float* returns, void* stream);

}  // namespace hybridflow_cuda
