// Scalar and row-wise math shared by the CPU kernels, written once: a vectorisable exp (log-probs in
// kernels.cpp, the sigmoid), and the decoder layers' RMSNorm and rotary rows, used by the rollout's
// decode loop (decode.cpp) and by the training layers' forward and backward passes (layers.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace hybridflow_cpu {

// Rows per parallel task, so that a task touches about 16k floats: at::parallel_for runs a range no
// larger than its grain inline, so a small tensor never wakes the thread pool (whose join waits a whole
// scheduler slice for a thread that another process has descheduled).
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

// exp(x) for x <= 0 (the log-prob kernel's x - rowmax, the sigmoid's -|x|). Range reduction to
// r in [-ln2/2, ln2/2], degree-6 polynomial, scale by 2^n via the exponent
// bits. Max relative error ~2e-7 over the range; below -87 it flushes to 0.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.0f ? 0.0f : p * scale;
}

// 1 / sqrt(mean(x^2) + eps) over one row of `dim` floats.
inline float rms_scale(const float* row, int64_t dim, double eps) {
  float sum = 0.f;
  for (int64_t j = 0; j < dim; ++j) sum += row[j] * row[j];
  return 1.0f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
}

// out = weight * (row * scale), the order torch's RMSNorm multiplies in.
inline void rms_norm_row(const float* row, const float* weight, float* out, int64_t dim, float scale) {
  for (int64_t j = 0; j < dim; ++j) out[j] = weight[j] * (row[j] * scale);
}

// Rotate one head vector of 2 * half floats (the half-split convention of HF and megatron-core):
// out = v * cos + rotate_half(v) * sin, rotate_half(v) = [-v2, v1]. `out` may be `v`.
inline void rope_row(const float* v, float* out, const float* cos_, const float* sin_, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = v[j], b = v[j + half];
    out[j] = a * cos_[j] - b * sin_[j];
    out[j + half] = b * cos_[j + half] + a * sin_[j + half];
  }
}

// The transpose of rope_row: the gradient of its input from the gradient `g` of its output.
inline void rope_row_backward(const float* g, float* out, const float* cos_, const float* sin_, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = g[j], b = g[j + half];
    out[j] = a * cos_[j] + b * sin_[j + half];
    out[j + half] = b * cos_[j + half] - a * sin_[j];
  }
}

// sigmoid(x) through exp(-|x|) <= 1, which never overflows and vectorises (exp_nonpos, no libm call).
inline float sigmoid(float x) {
  const float e = exp_nonpos(x < 0.f ? x : -x);
  const float r = 1.0f / (1.0f + e);
  return x < 0.f ? e * r : r;
}

// One row of SwiGLU: out[j] = silu(gate[j]) * up[j] for the row's [gate | up] of 2 * f floats.
inline void swiglu_row(const float* gate_up, float* out, int64_t f) {
  const float* up = gate_up + f;
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) out[j] = gate_up[j] * sigmoid(gate_up[j]) * up[j];
}

}  // namespace hybridflow_cpu
