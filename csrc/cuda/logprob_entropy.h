// Host API of the CUDA log-prob/entropy kernels (csrc/cuda/logprob_entropy.cu).
//
// Plain C++ with raw pointers, no torch and no CUDA headers: the kernels
// compile alone with nvcc in seconds (a CPU-only CI checks them that way:
// torch's CPU wheel lacks c10/cuda's generated headers, and nvcc spends over
// a minute on torch/extension.h), and binding.cpp turns tensors into these
// arguments.
#pragma once

#include <cstdint>

namespace hybridflow_cuda {

enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Per row of logits[rows, vocab] (contiguous, `dtype`): logp = log softmax at
// labels[row], entropy, and the log-sum-exp the backward needs; all float32.
// A label outside [0, vocab) gives logp = NaN (a kernel cannot raise) and
// receives no gradient. `stream` is a cudaStream_t. Returns nullptr on
// success, else the CUDA error message.
const char* logprob_entropy_forward(const void* logits, Dtype dtype, const int64_t* labels, int64_t rows,
                                    int64_t vocab, float* logp, float* entropy, float* lse, void* stream);

// grad[rows, vocab] (`dtype`, contiguous) of sum(g_logp * logp + g_ent * entropy)
// with respect to the logits, from the forward's lse and entropy.
const char* logprob_entropy_backward(const void* logits, Dtype dtype, const int64_t* labels, const float* lse,
                                     const float* entropy, const float* g_logp, const float* g_ent, int64_t rows,
                                     int64_t vocab, void* grad, void* stream);

}  // namespace hybridflow_cuda
