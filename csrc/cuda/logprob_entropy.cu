// CUDA log-prob + entropy from logits: forward and backward, one block per row.
// Reference: hybridflow/kernels/logprob.py (logprob_entropy_reference, _chunk_grad).
//
// Forward: a single pass over each row (online softmax). Every thread keeps
// (m, s, w) = (running max, sum 2^(u-m), sum 2^(u-m) * (u-m)) over its
// elements, with u = z * log2(e) so each element costs one FMA and one ex2;
// the block merges the triples with shuffles. Then
//     lse = (m + log2 s) ln2,   H = lse - E_p[z] = (log2 s - w / s) ln2,
// which stays well conditioned for large logits (both terms are relative to m).
// Backward: d/dz_j of (a logp + b H) = a ([j == label] - p_j) - b p_j (log p_j + H).
//
// Loads and stores are 16 bytes where the row is aligned (scalar head and
// tail otherwise), two packs in flight per thread. Inputs are float32,
// bfloat16 or float16; all arithmetic is float32. No torch headers here: the
// per-thread work is __host__ __device__ so tests can also run it on a CPU
// (tests/kernels/cuda_host_harness.cu); binding.cpp is the torch side.
#include "logprob_entropy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#define HD __host__ __device__ __forceinline__

namespace hybridflow_cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxThreads = 512;

HD float to_float(float x) { return x; }
HD float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
HD float to_float(__half x) { return __half2float(x); }

template <typename T> HD T from_float(float x);
template <> HD float from_float<float>(float x) { return x; }
template <> HD __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> HD __half from_float<__half>(float x) { return __float2half(x); }

// 2^x; the hardware approximation (rel. error ~2^-22) on the GPU.
HD float exp2_fast(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// A row as [head scalars | `packs` aligned 16-byte packs | tail scalars].
// `out` (may equal `in`) must share the alignment, else the whole row is scalar.
struct RowSplit {
  int64_t head, packs;
};

template <typename T>
HD RowSplit split_row(const T* in, const T* out, int64_t v) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(in) % 16;
  if (mis % sizeof(T) != 0 || mis != reinterpret_cast<uintptr_t>(out) % 16) return {v, 0};
  const int64_t head = mis == 0 ? 0 : static_cast<int64_t>((16 - mis) / sizeof(T));
  if (head >= v) return {v, 0};
  return {head, (v - head) / Pack<T>::kSize};
}

// Softmax statistics of a set of elements, in base-2 units (u = z log2 e).
struct Online {
  float m;  // max u; -FLT_MAX (not -inf) when empty, so -inf logits never meet -inf - -inf
  float s;  // sum 2^(u - m)
  float w;  // sum 2^(u - m) (u - m)
};

HD Online empty_stats() { return {-FLT_MAX, 0.0f, 0.0f}; }

// Re-express `a` relative to a new max m >= a.m.
HD void rescale(Online& a, float m) {
  const float d = a.m - m;
  const float f = exp2_fast(d);
  a.w = a.s > 0.0f ? f * (a.w + d * a.s) : 0.0f;
  a.s *= f;
  a.m = m;
}

HD Online merge(Online a, Online b) {
  const float m = fmaxf(a.m, b.m);
  rescale(a, m);
  rescale(b, m);
  return {m, a.s + b.s, a.w + b.w};
}

template <int K>
HD void add(Online& a, const float (&z)[K]) {
  float zmax = z[0];
#pragma unroll
  for (int k = 1; k < K; ++k) zmax = fmaxf(zmax, z[k]);
  const float m = zmax * kLog2e;  // = max of z[k] * log2 e: rounding is monotone
  if (m > a.m) rescale(a, m);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    // Clamped so that a -inf logit adds 0 * -FLT_MAX = 0, not 0 * -inf = NaN.
    const float t = fmaxf(fmaf(z[k], kLog2e, -a.m), -FLT_MAX);
    const float e = exp2_fast(t);
    a.s += e;
    a.w = fmaf(e, t, a.w);
  }
}

template <typename T, int N>
HD void unpack(const Pack<T>& p, float* z) {
#pragma unroll
  for (int k = 0; k < N; ++k) z[k] = to_float(p.v[k]);
}

// The statistics of the elements thread `tid` of `nthreads` owns in row x[v].
template <typename T>
HD Online thread_stats(const T* __restrict__ x, int64_t v, int tid, int nthreads) {
  constexpr int K = Pack<T>::kSize;
  Online st = empty_stats();
  const RowSplit sp = split_row(x, x, v);
  const int64_t tail = sp.head + sp.packs * K;
  for (int64_t j = tid; j < sp.head; j += nthreads) add<1>(st, {to_float(x[j])});
  for (int64_t j = tail + tid; j < v; j += nthreads) add<1>(st, {to_float(x[j])});
  const Pack<T>* packs = reinterpret_cast<const Pack<T>*>(x + sp.head);
  int64_t i = tid;
  for (; i + nthreads < sp.packs; i += 2 * nthreads) {
    const Pack<T> p0 = packs[i], p1 = packs[i + nthreads];  // both loads issued before any math
    float z[2 * K];
    unpack<T, K>(p0, z);
    unpack<T, K>(p1, z + K);
    add<2 * K>(st, z);
  }
  if (i < sp.packs) {
    float z[K];
    unpack<T, K>(packs[i], z);
    add<K>(st, z);
  }
  return st;
}

// Writes one row's outputs from its merged statistics.
HD void finish_row(const Online& st, float target, bool valid, float* logp, float* entropy, float* lse) {
  const float log2_s = log2f(st.s);
  *lse = (st.m + log2_s) * kLn2;
  *entropy = (log2_s - st.w / st.s) * kLn2;
  *logp = valid ? (fmaf(target, kLog2e, -st.m) - log2_s) * kLn2 : NAN;
}

// Per-row constants of the backward.
struct GradRow {
  float lse2;    // lse in base-2 units
  float shift;   // H - lse, so that log p_j + H = z_j + shift
  float g_logp, g_ent;
  int64_t label;
};

HD GradRow grad_row(float lse, float entropy, float g_logp, float g_ent, int64_t label) {
  return {lse * kLog2e, entropy - lse, g_logp, g_ent, label};
}

// d/dz_j of (g_logp logp + g_ent H) = -p_j (g_logp + g_ent (log p_j + H)) + [j == label] g_logp,
// the formula of _chunk_grad in logprob.py.
HD float grad_at(float z, int64_t j, const GradRow& r) {
  const float p = exp2_fast(fmaf(z, kLog2e, -r.lse2));
  const float g = p > 0.0f ? -p * fmaf(r.g_ent, z + r.shift, r.g_logp) : 0.0f;  // p = 0: no -inf * 0
  return j == r.label ? g + r.g_logp : g;
}

template <typename T, int N>
HD void grad_pack(const Pack<T>& in, Pack<T>& out, int64_t j0, const GradRow& r) {
#pragma unroll
  for (int k = 0; k < N; ++k) out.v[k] = from_float<T>(grad_at(to_float(in.v[k]), j0 + k, r));
}

// Writes the gradient of the elements thread `tid` of `nthreads` owns in row x[v].
template <typename T>
HD void thread_grad(const T* __restrict__ x, T* __restrict__ out, int64_t v, const GradRow& r, int tid,
                    int nthreads) {
  constexpr int K = Pack<T>::kSize;
  const RowSplit sp = split_row(x, out, v);
  const int64_t tail = sp.head + sp.packs * K;
  for (int64_t j = tid; j < sp.head; j += nthreads) out[j] = from_float<T>(grad_at(to_float(x[j]), j, r));
  for (int64_t j = tail + tid; j < v; j += nthreads) out[j] = from_float<T>(grad_at(to_float(x[j]), j, r));
  const Pack<T>* in = reinterpret_cast<const Pack<T>*>(x + sp.head);
  Pack<T>* dst = reinterpret_cast<Pack<T>*>(out + sp.head);
  int64_t i = tid;
  for (; i + nthreads < sp.packs; i += 2 * nthreads) {
    const Pack<T> p0 = in[i], p1 = in[i + nthreads];
    Pack<T> q0, q1;
    grad_pack<T, K>(p0, q0, sp.head + i * K, r);
    grad_pack<T, K>(p1, q1, sp.head + (i + nthreads) * K, r);
    dst[i] = q0;
    dst[i + nthreads] = q1;
  }
  if (i < sp.packs) {
    Pack<T> q;
    grad_pack<T, K>(in[i], q, sp.head + i * K, r);
    dst[i] = q;
  }
}

__device__ __forceinline__ Online warp_merge(Online a) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Online b{__shfl_xor_sync(0xffffffffu, a.m, offset), __shfl_xor_sync(0xffffffffu, a.s, offset),
                   __shfl_xor_sync(0xffffffffu, a.w, offset)};
    a = merge(a, b);
  }
  return a;
}

// The whole block's statistics, valid in thread 0. blockDim.x is a multiple of 32.
__device__ __forceinline__ Online block_merge(Online a) {
  __shared__ Online partial[kMaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  a = warp_merge(a);
  if (lane == 0) partial[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : empty_stats();
    a = warp_merge(a);
  }
  return a;
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels, int64_t v,
                   float* __restrict__ logp, float* __restrict__ entropy, float* __restrict__ lse) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * v;
  const Online st = block_merge(thread_stats(x, v, threadIdx.x, blockDim.x));
  if (threadIdx.x == 0) {
    const int64_t y = labels[row];
    const bool valid = y >= 0 && y < v;
    finish_row(st, valid ? to_float(x[y]) : 0.0f, valid, logp + row, entropy + row, lse + row);
  }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                    const float* __restrict__ lse, const float* __restrict__ entropy,
                    const float* __restrict__ g_logp, const float* __restrict__ g_ent, int64_t v,
                    T* __restrict__ grad) {
  const int64_t row = blockIdx.x;
  const GradRow r = grad_row(lse[row], entropy[row], g_logp[row], g_ent[row], labels[row]);
  thread_grad(logits + row * v, grad + row * v, v, r, threadIdx.x, blockDim.x);
}

// Threads per row: grow while each thread would still get >= 4 packs.
int threads_for(int64_t v, int pack) {
  int threads = 32;
  while (threads < kMaxThreads && static_cast<int64_t>(threads) * 4 * pack < v) threads *= 2;
  return threads;
}

template <typename T>
void launch_forward(const void* logits, const int64_t* labels, int64_t rows, int64_t v, float* logp,
                    float* entropy, float* lse, cudaStream_t stream) {
  forward_kernel<T><<<static_cast<unsigned>(rows), threads_for(v, Pack<T>::kSize), 0, stream>>>(
      static_cast<const T*>(logits), labels, v, logp, entropy, lse);
}

template <typename T>
void launch_backward(const void* logits, const int64_t* labels, const float* lse, const float* entropy,
                     const float* g_logp, const float* g_ent, int64_t rows, int64_t v, void* grad,
                     cudaStream_t stream) {
  backward_kernel<T><<<static_cast<unsigned>(rows), threads_for(v, Pack<T>::kSize), 0, stream>>>(
      static_cast<const T*>(logits), labels, lse, entropy, g_logp, g_ent, v, static_cast<T*>(grad));
}

const char* check_shape(int64_t rows, int64_t v) {
  if (v <= 0) return "logprob_entropy: the vocabulary dimension is empty";
  if (rows > 2147483647) return "logprob_entropy: more than 2^31 - 1 rows";
  return nullptr;
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* logprob_entropy_forward(const void* logits, Dtype dtype, const int64_t* labels, int64_t rows,
                                    int64_t vocab, float* logp, float* entropy, float* lse, void* stream) {
  if (const char* bad = check_shape(rows, vocab)) return bad;
  if (rows == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat32: launch_forward<float>(logits, labels, rows, vocab, logp, entropy, lse, s); break;
    case Dtype::kBFloat16: launch_forward<__nv_bfloat16>(logits, labels, rows, vocab, logp, entropy, lse, s); break;
    case Dtype::kFloat16: launch_forward<__half>(logits, labels, rows, vocab, logp, entropy, lse, s); break;
  }
  return last_error();
}

const char* logprob_entropy_backward(const void* logits, Dtype dtype, const int64_t* labels, const float* lse,
                                     const float* entropy, const float* g_logp, const float* g_ent, int64_t rows,
                                     int64_t vocab, void* grad, void* stream) {
  if (const char* bad = check_shape(rows, vocab)) return bad;
  if (rows == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat32:
      launch_backward<float>(logits, labels, lse, entropy, g_logp, g_ent, rows, vocab, grad, s);
      break;
    case Dtype::kBFloat16:
      launch_backward<__nv_bfloat16>(logits, labels, lse, entropy, g_logp, g_ent, rows, vocab, grad, s);
      break;
    case Dtype::kFloat16:
      launch_backward<__half>(logits, labels, lse, entropy, g_logp, g_ent, rows, vocab, grad, s);
      break;
  }
  return last_error();
}

}  // namespace hybridflow_cuda
