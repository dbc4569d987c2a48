// Runs the CUDA log-prob/entropy kernels' per-thread code on the CPU, one
// emulated block per row (threads in sequence, partial statistics merged
// as block_merge does), so a machine without a GPU can compare the kernels'
// arithmetic, row splitting and vectorised indexing with the PyTorch
// reference. Only the shuffles, shared memory and launches are not covered.
//
// stdin:  int64 {dtype, rows, vocab, threads (0: as launched), in_offset, out_offset},
//         logits[rows * vocab] (raw, dtype), labels int64[rows], g_logp f32[rows], g_ent f32[rows]
// stdout: logp, entropy, lse f32[rows], then grad[rows * vocab] (raw, dtype)
// The offsets (in elements) shift the logits and gradient buffers off
// 16-byte alignment, to reach the scalar head and fallback paths.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "harness_io.h"

#include "../../csrc/cuda/logprob_entropy.cu"

namespace {

using namespace hybridflow_cuda;

using harness::read_exact;

template <typename T>
T* aligned_buffer(size_t elems, int64_t offset) {
  const size_t bytes = ((elems + offset) * sizeof(T) + 63) / 64 * 64 + 64;
  return reinterpret_cast<T*>(std::aligned_alloc(64, bytes)) + offset;
}

template <typename T>
void run(int64_t rows, int64_t v, int threads, int64_t in_offset, int64_t out_offset) {
  if (threads == 0) threads = threads_for(v, Pack<T>::kSize);
  T* x = aligned_buffer<T>(rows * v, in_offset);
  T* grad = aligned_buffer<T>(rows * v, out_offset);
  std::vector<int64_t> labels(rows);
  std::vector<float> g_logp(rows), g_ent(rows), logp(rows), ent(rows), lse(rows);
  read_exact(x, rows * v * sizeof(T));
  read_exact(labels.data(), rows * sizeof(int64_t));
  read_exact(g_logp.data(), rows * sizeof(float));
  read_exact(g_ent.data(), rows * sizeof(float));
  for (int64_t row = 0; row < rows; ++row) {
    const T* xr = x + row * v;
    Online st = empty_stats();
    for (int tid = 0; tid < threads; ++tid) st = merge(st, thread_stats(xr, v, tid, threads));
    const int64_t y = labels[row];
    const bool valid = y >= 0 && y < v;
    finish_row(st, valid ? to_float(xr[y]) : 0.0f, valid, &logp[row], &ent[row], &lse[row]);
    const GradRow r = grad_row(lse[row], ent[row], g_logp[row], g_ent[row], y);
    for (int tid = 0; tid < threads; ++tid) thread_grad(xr, grad + row * v, v, r, tid, threads);
  }
  std::fwrite(logp.data(), sizeof(float), rows, stdout);
  std::fwrite(ent.data(), sizeof(float), rows, stdout);
  std::fwrite(lse.data(), sizeof(float), rows, stdout);
  std::fwrite(grad, sizeof(T), rows * v, stdout);
}

}  // namespace

int main() {
  int64_t h[6];
  read_exact(h, sizeof(h));
  const int threads = static_cast<int>(h[3]);
  switch (static_cast<Dtype>(h[0])) {
    case Dtype::kFloat32: run<float>(h[1], h[2], threads, h[4], h[5]); break;
    case Dtype::kBFloat16: run<__nv_bfloat16>(h[1], h[2], threads, h[4], h[5]); break;
    case Dtype::kFloat16: run<__half>(h[1], h[2], threads, h[4], h[5]); break;
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}
