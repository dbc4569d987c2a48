// Forward and backward passes of the decoder layers' elementwise parts, float32 on CPU: RMSNorm, SwiGLU
// and rotary embeddings. megatron-core runs these unfused on CPU (no apex, no Transformer Engine): a
// handful of memory-bound ops and temporaries each, which took more of a small model's training step than
// its matmuls. Here each is one pass over its rows. Plain-PyTorch references and the autograd functions
// that call these are in hybridflow/kernels/layers.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

#include "layers.h"

namespace {

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

using hybridflow_cpu::grain;

}  // namespace

// x [..., dim], weight [dim] -> y = weight * (x * rstd) [..., dim], rstd = 1 / sqrt(mean(x^2) + eps) [rows].
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_input(x, "x");
  check_input(weight, "weight");
  const int64_t dim = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == dim, "x's last dimension must be the weight's size ", dim);
  const int64_t rows = x.numel() / dim;
  at::Tensor y = at::empty_like(x), rstd = at::empty({rows}, x.options());
  const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rp[i] = hybridflow_cpu::rms_scale(xp + i * dim, dim, eps);
      hybridflow_cpu::rms_norm_row(xp + i * dim, w, yp + i * dim, dim, rp[i]);
    }
  });
  return {y, rstd};
}

// With xhat = x * rstd: dx = rstd * (g * w - xhat * mean(g * w * xhat)), dweight = sum over rows of g * xhat.
// dweight sums in one float partial per task (as many tasks as threads), then over the partials in order.
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd) {
  for (const auto& [t, name] : {std::pair{&g, "grad"}, {&x, "x"}, {&weight, "weight"}, {&rstd, "rstd"}}) {
    check_input(*t, name);
  }
  const int64_t dim = weight.numel(), rows = x.numel() / dim;
  TORCH_CHECK(g.sizes() == x.sizes() && rstd.numel() == rows, "grad must match x, and rstd have one per row");
  const int64_t tasks = std::clamp<int64_t>((rows + grain(dim) - 1) / grain(dim), 1, at::get_num_threads());
  at::Tensor dx = at::empty_like(x), partial = at::zeros({tasks, dim}, x.options());
  at::Tensor dweight = at::zeros({dim}, x.options());
  const float *gp = g.data_ptr<float>(), *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float *dxp = dx.data_ptr<float>(), *pp = partial.data_ptr<float>();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      float* acc = pp + task * dim;
      for (int64_t i = rows * task / tasks; i < rows * (task + 1) / tasks; ++i) {
        const float *gi = gp + i * dim, *xi = xp + i * dim, r = rp[i];
        float dot = 0.f;
        for (int64_t j = 0; j < dim; ++j) dot += gi[j] * w[j] * (xi[j] * r);
        const float mean = dot / static_cast<float>(dim);
        float* out = dxp + i * dim;
        for (int64_t j = 0; j < dim; ++j) {
          const float xhat = xi[j] * r;
          out[j] = r * (gi[j] * w[j] - xhat * mean);
          acc[j] += gi[j] * xhat;
        }
      }
    }
  });
  float* dw = dweight.data_ptr<float>();
  for (int64_t task = 0; task < tasks; ++task) {
    for (int64_t j = 0; j < dim; ++j) dw[j] += pp[task * dim + j];
  }
  return {dx, dweight};
}

// x [..., 2f] = [gate | up] -> silu(gate) * up [..., f].
at::Tensor swiglu_forward(const at::Tensor& x) {
  check_input(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "x's last dimension must be even (gate and up halves)");
  const int64_t f = x.size(-1) / 2, rows = x.numel() / (2 * f);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = f;
  at::Tensor y = at::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain(2 * f), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hybridflow_cpu::swiglu_row(xp + i * 2 * f, yp + i * f, f);
  });
  return y;
}

// g [..., f], x [..., 2f] -> dx [..., 2f]: d gate = g * up * s * (1 + gate * (1 - s)), d up = g * silu(gate).
at::Tensor swiglu_backward(const at::Tensor& g, const at::Tensor& x) {
  check_input(g, "grad");
  check_input(x, "x");
  const int64_t f = x.size(-1) / 2, rows = x.numel() / (2 * f);
  TORCH_CHECK(g.numel() == rows * f && g.size(-1) == f, "grad must be x's shape with half its last dimension");
  at::Tensor dx = at::empty_like(x);
  const float *gp = g.data_ptr<float>(), *xp = x.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  at::parallel_for(0, rows, grain(2 * f), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *a = xp + i * 2 * f, *b = a + f, *gi = gp + i * f;
      float *da = dxp + i * 2 * f, *db = da + f;
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        const float s = hybridflow_cpu::sigmoid(a[j]);
        da[j] = gi[j] * b[j] * s * (1.0f + a[j] * (1.0f - s));
        db[j] = gi[j] * a[j] * s;
      }
    }
  });
  return dx;
}

// t [s, b, h, d] (the last dimension contiguous, the others any stride), cos and sin [s, 1 or b, d]
// contiguous -> t rotated, contiguous [s, b, h, d]; `backward` applies the transpose (t is then the
// output's gradient).
at::Tensor rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  check_input(cos, "cos");
  check_input(sin, "sin");
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 && t.stride(3) == 1,
              "t must be a float32 CPU tensor [s, b, h, d] with a contiguous last dimension");
  const int64_t s = t.size(0), b = t.size(1), h = t.size(2), d = t.size(3), bc = cos.size(1);
  TORCH_CHECK(d % 2 == 0 && cos.dim() == 3 && cos.size(0) == s && (bc == 1 || bc == b) && cos.size(2) == d &&
                  sin.sizes() == cos.sizes(),
              "cos and sin must be [s, 1 or b, d] for t [s, b, h, d] with d even");
  at::Tensor out = at::empty({s, b, h, d}, t.options());
  const float *tp = t.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = t.stride(0), s1 = t.stride(1), s2 = t.stride(2);
  at::parallel_for(0, s * b, grain(h * d), [&](int64_t begin, int64_t end) {
    for (int64_t sb = begin; sb < end; ++sb) {
      const int64_t i = sb / b, j = sb % b, c = (i * bc + (bc == 1 ? 0 : j)) * d;
      for (int64_t k = 0; k < h; ++k) {
        const float* in = tp + i * s0 + j * s1 + k * s2;
        float* o = op + (sb * h + k) * d;
        if (backward) {
          hybridflow_cpu::rope_row_backward(in, o, cp + c, sp + c, d / 2);
        } else {
          hybridflow_cpu::rope_row(in, o, cp + c, sp + c, d / 2);
        }
      }
    }
  });
  return out;
}
