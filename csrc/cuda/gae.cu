// CUDA GAE: the reverse recursion of each row as a parallel scan, one warp per row.
// Reference: hybridflow/kernels/gae.py (gae_reference); CPU: csrc/cpu/kernels.cpp.
//
// Walking a row backwards, the state s = (next value, next advantage) goes
// through one affine map per step:
//     valid step j:  s' = (v_j, r_j - v_j + gamma * s.v + gamma * lam * s.a)
//     masked step:   s' = s
// and the advantage written at a valid step is the new s.a. Affine maps
// compose associatively, so each of the 32 lanes composes the maps of its
// own contiguous chunk of steps (phase 1), the warp scans the chunk maps from
// the last lane down with shuffles (phase 2: lane L's incoming state is the
// composition of lanes L+1..31 applied to the zero state) and each lane
// replays its chunk from that state, writing outputs (phase 3). Each lane
// reads its chunk twice; all arithmetic is float32, as in the CPU kernel.
// The per-lane work is __host__ __device__ so a CPU test can run it
// (tests/kernels/cuda_gae_harness.cu).
#include "gae.h"

#include <cuda_runtime.h>

#include <cstdint>

#define HD __host__ __device__ __forceinline__

namespace hybridflow_cuda {
namespace {

constexpr int kLanes = 32;
constexpr int kRowsPerBlock = 4;  // warps per block

// s -> m * s + c, with m = [[m00, m01], [m10, m11]] acting on (v, a).
struct Affine {
  float m00, m01, m10, m11, c0, c1;
};

HD Affine identity() { return {1.f, 0.f, 0.f, 1.f, 0.f, 0.f}; }

// outer(inner(s)): inner is applied first.
HD Affine compose(const Affine& outer, const Affine& inner) {
  return {outer.m00 * inner.m00 + outer.m01 * inner.m10, outer.m00 * inner.m01 + outer.m01 * inner.m11,
          outer.m10 * inner.m00 + outer.m11 * inner.m10, outer.m10 * inner.m01 + outer.m11 * inner.m11,
          outer.m00 * inner.c0 + outer.m01 * inner.c1 + outer.c0,
          outer.m10 * inner.c0 + outer.m11 * inner.c1 + outer.c1};
}

HD int64_t chunk_of(int64_t steps) { return (steps + kLanes - 1) / kLanes; }

// Phase 1: the map of steps [lo, hi) of one row, walked backwards.
HD Affine chunk_map(const float* r, const float* v, const float* m, int64_t lo, int64_t hi, float gamma,
                    float gamma_lam) {
  Affine f = identity();
  for (int64_t j = hi - 1; j >= lo; --j) {
    if (m[j] == 0.f) continue;
    // step(f(s)) with step: (v, a) -> (v_j, r_j - v_j + gamma v + gamma_lam a)
    f = {0.f, 0.f, gamma * f.m00 + gamma_lam * f.m10, gamma * f.m01 + gamma_lam * f.m11, v[j],
         r[j] - v[j] + gamma * f.c0 + gamma_lam * f.c1};
  }
  return f;
}

// Phase 3: replay steps [lo, hi) from the state (next_v, next_a), writing outputs.
HD void chunk_apply(const float* r, const float* v, const float* m, int64_t lo, int64_t hi, float gamma,
                    float gamma_lam, float next_v, float next_a, float* adv, float* ret) {
  for (int64_t j = hi - 1; j >= lo; --j) {
    if (m[j] == 0.f) {
      adv[j] = 0.f;
      ret[j] = 0.f;
      continue;
    }
    const float a = r[j] + gamma * next_v - v[j] + gamma_lam * next_a;
    adv[j] = a;
    ret[j] = a + v[j];
    next_v = v[j];
    next_a = a;
  }
}

__device__ __forceinline__ Affine shfl_down(const Affine& f, int delta) {
  constexpr unsigned kAll = 0xffffffffu;
  return {__shfl_down_sync(kAll, f.m00, delta), __shfl_down_sync(kAll, f.m01, delta),
          __shfl_down_sync(kAll, f.m10, delta), __shfl_down_sync(kAll, f.m11, delta),
          __shfl_down_sync(kAll, f.c0, delta), __shfl_down_sync(kAll, f.c1, delta)};
}

__global__ void __launch_bounds__(kLanes * kRowsPerBlock)
    gae_kernel(const float* __restrict__ rewards, const float* __restrict__ values, const float* __restrict__ mask,
               int64_t rows, int64_t steps, float gamma, float gamma_lam, float* __restrict__ adv,
               float* __restrict__ ret) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (row >= rows) return;  // whole warps exit together: rows are per warp
  const int lane = threadIdx.x % kLanes;
  const int64_t base = row * steps, chunk = chunk_of(steps);
  const int64_t lo = lane * chunk < steps ? lane * chunk : steps;
  const int64_t hi = lo + chunk < steps ? lo + chunk : steps;
  const float *r = rewards + base, *v = values + base, *m = mask + base;

  // Inclusive scan from the last lane down: scan = map(lane) o ... o map(31).
  Affine scan = chunk_map(r, v, m, lo, hi, gamma, gamma_lam);
  for (int delta = 1; delta < kLanes; delta <<= 1) {
    const Affine later = shfl_down(scan, delta);
    if (lane + delta < kLanes) scan = compose(scan, later);
  }
  // This lane starts from the state the later lanes leave: their scan applied to zero.
  const Affine after = shfl_down(scan, 1);
  const bool last = lane == kLanes - 1;
  chunk_apply(r, v, m, lo, hi, gamma, gamma_lam, last ? 0.f : after.c0, last ? 0.f : after.c1, adv + base,
              ret + base);
}

}  // namespace

const char* gae_forward(const float* rewards, const float* values, const float* mask, int64_t rows,
                        int64_t steps, float gamma, float lam, float* advantages, float* returns, void* stream) {
  if (rows == 0 || steps == 0) return nullptr;
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  gae_kernel<<<blocks, kLanes * kRowsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      rewards, values, mask, rows, steps, gamma, gamma * lam, advantages, returns);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace hybridflow_cuda
