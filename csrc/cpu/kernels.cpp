// CPU kernels for hybridflow: token log-prob + entropy from logits (forward and
// backward) and the GAE reverse scan. Each has a plain-PyTorch reference in
// hybridflow/kernels/; tests compare the two. The rollout's decode loop lives in
// decode.cpp and is bound here too: one extension, compiled once.
//
// Log-prob/entropy reads each logits row twice (max, then sum of exp) and
// writes three floats per token: no [tokens, vocab] temporary, unlike eager
// log_softmax + gather + exp. exp() is a small polynomial written so that GCC
// vectorises it without -ffast-math (which would break inf/nan semantics).
// The headers of the ATen operators used and torch's pybind11 casters only: torch/extension.h (the whole
// C++ frontend) or even ATen/ATen.h (every operator) took longer to parse than everything else here.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "layers.h"

namespace {

using hybridflow_cpu::exp_nonpos;
using hybridflow_cpu::grain;

template <typename T>
inline const float* as_float_row(const T* src, int64_t v, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    buf.resize(v);
    for (int64_t j = 0; j < v; ++j) buf[j] = static_cast<float>(src[j]);
    return buf.data();
  }
}

struct RowStats {
  double lse, sum_exp;
  float max;
  double weighted;  // sum of exp(x - max) * (x - max), for the entropy
};

// Sums run in float within blocks of kBlock columns (vectorised) and in double
// across blocks. One float accumulator over a whole row loses the tail: at
// vocab 49152 with a peaked row (s ~ 1), every term under half an ulp of the
// running sum vanishes, which cost 2e-4 on real SmolLM2 log-probs (torch's
// cascade sum: 2e-5).
constexpr int64_t kBlock = 256;

inline RowStats row_stats(const float* x, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < v; ++j) m = x[j] > m ? x[j] : m;
  double s = 0.0, sx = 0.0;
  for (int64_t b = 0; b < v; b += kBlock) {
    const int64_t e_end = b + kBlock < v ? b + kBlock : v;
    float bs = 0.0f, bsx = 0.0f;
#pragma omp simd reduction(+ : bs, bsx)
    for (int64_t j = b; j < e_end; ++j) {
      const float e = exp_nonpos(x[j] - m);
      bs += e;
      bsx += e * (x[j] - m);  // shifted by m: keeps the sum well conditioned
    }
    s += bs;
    sx += bsx;
  }
  return {static_cast<double>(m) + std::log(s), s, m, sx};
}

template <typename T>
void logprob_entropy_fwd_impl(const at::Tensor& logits, const at::Tensor& labels,
                              at::Tensor& logp, at::Tensor& ent, at::Tensor& lse) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const T* src = logits.data_ptr<T>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  float *lp = logp.data_ptr<float>(), *en = ent.data_ptr<float>(), *ls = lse.data_ptr<float>();
  at::parallel_for(0, n, grain(v), [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i) {
      const float* x = as_float_row(src + i * v, v, buf);
      const RowStats st = row_stats(x, v);
      ls[i] = static_cast<float>(st.lse);
      lp[i] = static_cast<float>(static_cast<double>(x[lab[i]]) - st.lse);
      // H = lse - E_p[x] = log(s) - E_p[x - m]
      en[i] = static_cast<float>(std::log(st.sum_exp) - st.weighted / st.sum_exp);
    }
  });
}

template <typename T>
void logprob_entropy_bwd_impl(const at::Tensor& logits, const at::Tensor& labels,
                              const at::Tensor& lse, const at::Tensor& ent,
                              const at::Tensor& g_logp, const at::Tensor& g_ent,
                              at::Tensor& grad) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const T* src = logits.data_ptr<T>();
  T* dst = grad.data_ptr<T>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  const float *ls = lse.data_ptr<float>(), *en = ent.data_ptr<float>();
  const float *gl = g_logp.data_ptr<float>(), *ge = g_ent.data_ptr<float>();
  at::parallel_for(0, n, grain(v), [&](int64_t begin, int64_t end) {
    std::vector<float> buf, out(std::is_same_v<T, float> ? 0 : v);
    for (int64_t i = begin; i < end; ++i) {
      const float* x = as_float_row(src + i * v, v, buf);
      float* o = std::is_same_v<T, float> ? reinterpret_cast<float*>(dst + i * v) : out.data();
      const float l = ls[i], h = en[i], a = gl[i], b = ge[i];
      // d logp / dx_j = [j == label] - p_j ;  d H / dx_j = -p_j (log p_j + H)
#pragma omp simd
      for (int64_t j = 0; j < v; ++j) {
        const float logpj = x[j] - l;
        const float p = exp_nonpos(logpj);
        o[j] = -a * p - b * p * (logpj + h);
      }
      o[lab[i]] += a;
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < v; ++j) dst[i * v + j] = static_cast<T>(o[j]);
      }
    }
  });
}

void check_logits(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                  labels.size(0) == logits.size(0) && labels.is_contiguous(),
              "labels must be a contiguous int64 vector, one per logits row");
}

}  // namespace

std::vector<at::Tensor> logprob_entropy_forward(at::Tensor logits, at::Tensor labels) {
  check_logits(logits, labels);
  auto opts = logits.options().dtype(at::kFloat);
  auto logp = at::empty({logits.size(0)}, opts);
  auto ent = at::empty_like(logp), lse = at::empty_like(logp);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "lp_fwd", [&] {
    logprob_entropy_fwd_impl<scalar_t>(logits, labels, logp, ent, lse);
  });
  return {logp, ent, lse};
}

// inplace: the gradient overwrites `logits` (each element is read before it is written, row by row),
// for callers whose logits are needed by nothing after this backward.
at::Tensor logprob_entropy_backward(at::Tensor logits, at::Tensor labels, at::Tensor lse,
                                       at::Tensor ent, at::Tensor g_logp, at::Tensor g_ent,
                                       bool inplace) {
  check_logits(logits, labels);
  auto grad = inplace ? logits : at::empty_like(logits);
  auto f = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  auto lse_f = f(lse), ent_f = f(ent), gl = f(g_logp), ge = f(g_ent);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "lp_bwd", [&] {
    logprob_entropy_bwd_impl<scalar_t>(logits, labels, lse_f, ent_f, gl, ge, grad);
  });
  return grad;
}

// GAE over each row's valid (mask != 0) steps; masked steps get 0 and are
// skipped, carrying the next value and advantage across them. With `whiten`
// the advantages are then whitened over all valid steps of the batch, as
// masked_whiten does ((a - mean) / sqrt(unbiased var + eps)), in two more
// passes over the rows with double accumulators: the scan also sums each
// row's advantages, a second pass sums squared deviations from the batch
// mean, a third normalises. Returns are a + v before whitening.
std::vector<at::Tensor> gae_forward(at::Tensor rewards, at::Tensor values, at::Tensor mask,
                                       double gamma, double lam, bool whiten, double eps) {
  TORCH_CHECK(rewards.sizes() == values.sizes() && rewards.sizes() == mask.sizes() && rewards.dim() == 2,
              "rewards, values and mask must share one [B, T] shape");
  auto r = rewards.to(at::kFloat).contiguous(), val = values.to(at::kFloat).contiguous();
  auto m = mask.to(at::kFloat).contiguous();
  auto adv = at::zeros_like(r), ret = at::zeros_like(r);
  const int64_t b = r.size(0), t = r.size(1);
  const float *pr = r.data_ptr<float>(), *pv = val.data_ptr<float>(), *pm = m.data_ptr<float>();
  float *pa = adv.data_ptr<float>(), *pt = ret.data_ptr<float>();
  const float g = static_cast<float>(gamma), gl = static_cast<float>(gamma * lam);
  std::vector<double> row_sum(b, 0.0), row_count(b, 0.0);
  at::parallel_for(0, b, grain(t), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float next_v = 0.0f, next_a = 0.0f;
      double sum = 0.0, count = 0.0;
      for (int64_t j = t - 1; j >= 0; --j) {
        const int64_t k = i * t + j;
        if (pm[k] == 0.0f) continue;
        const float a = pr[k] + g * next_v - pv[k] + gl * next_a;
        pa[k] = a;
        pt[k] = a + pv[k];
        next_v = pv[k];
        next_a = a;
        sum += a;
        count += 1.0;
      }
      row_sum[i] = sum;
      row_count[i] = count;
    }
  });
  if (!whiten) return {adv, ret};
  double total = 0.0, n = 0.0;
  for (int64_t i = 0; i < b; ++i) {
    total += row_sum[i];
    n += row_count[i];
  }
  const double mean = total / std::max(n, 1.0);
  at::parallel_for(0, b, grain(t), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      double sq = 0.0;
      for (int64_t k = i * t; k < (i + 1) * t; ++k) {
        if (pm[k] != 0.0f) sq += (pa[k] - mean) * (pa[k] - mean);
      }
      row_sum[i] = sq;
    }
  });
  double sq = 0.0;
  for (int64_t i = 0; i < b; ++i) sq += row_sum[i];
  const double var = sq / std::max(n - 1.0, 1.0);  // unbiased; a single valid step has no spread
  const float scale = static_cast<float>(1.0 / std::sqrt(var + eps)), shift = static_cast<float>(mean);
  at::parallel_for(0, b, grain(t), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin * t; k < end * t; ++k) {
      if (pm[k] != 0.0f) pa[k] = (pa[k] - shift) * scale;
    }
  });
  return {adv, ret};
}

// decode.cpp: the built-in rollout's prefill and decode loop.
std::vector<at::Tensor> decode_loop(at::Tensor logits, std::vector<at::Tensor> weights, at::Tensor k_cache,
                                    at::Tensor v_cache, at::Tensor key_mask, at::Tensor seen, int64_t filled,
                                    at::Tensor inv_freq, int64_t heads_per_group, double eps, int64_t steps,
                                    bool greedy, double temperature, at::Tensor keys, at::Tensor stop_ids,
                                    int64_t pad_id);

at::Tensor prefill(at::Tensor ids, at::Tensor mask, int64_t rep, std::vector<at::Tensor> weights, at::Tensor k_cache,
                   at::Tensor v_cache, at::Tensor key_mask, at::Tensor seen, at::Tensor inv_freq,
                   int64_t heads_per_group, double eps);

// layers.cpp: the decoder layers' RMSNorm, SwiGLU and rotary embeddings, forward and backward.
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd);
at::Tensor swiglu_forward(const at::Tensor& x);
at::Tensor swiglu_backward(const at::Tensor& g, const at::Tensor& x);
at::Tensor rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool backward);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_loop", &decode_loop, "the rollout's decode steps after a prefill, keyed or greedy sampling");
  m.def("prefill", &prefill, "the rollout's prefill: left-padded prompts into an empty KV cache, last logits");
  m.def("logprob_entropy_forward", &logprob_entropy_forward, "token log-prob, entropy, logsumexp");
  m.def("logprob_entropy_backward", &logprob_entropy_backward, "gradient w.r.t. logits", py::arg("logits"),
        py::arg("labels"), py::arg("lse"), py::arg("ent"), py::arg("g_logp"), py::arg("g_ent"),
        py::arg("inplace") = false);
  m.def("gae_forward", &gae_forward, "GAE advantages (optionally whitened over the batch) and returns",
        py::arg("rewards"), py::arg("values"), py::arg("mask"), py::arg("gamma"), py::arg("lam"),
        py::arg("whiten") = false, py::arg("eps") = 1e-8);
  m.def("rms_norm_forward", &rms_norm_forward, "RMSNorm: output and 1 / rms per row");
  m.def("rms_norm_backward", &rms_norm_backward, "RMSNorm: gradients of the input and the weight");
  m.def("swiglu_forward", &swiglu_forward, "silu(gate) * up from [gate | up]");
  m.def("swiglu_backward", &swiglu_backward, "SwiGLU: gradient of [gate | up]");
  m.def("rotary", &rotary, "rotary embedding (or its transpose) with per-position cos and sin",
        py::arg("t"), py::arg("cos"), py::arg("sin"), py::arg("backward") = false);
}
