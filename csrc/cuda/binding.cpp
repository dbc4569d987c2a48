// Torch binding of the CUDA kernels: log-prob/entropy (logprob_entropy.cu) and GAE (gae.cu).
//
// Only device-generic torch headers: the current stream comes from c10's
// device-guard interface rather than c10/cuda, so this file also compiles
// against torch's CPU wheel (the CPU test checks that it does). Per-operator headers, as in
// csrc/cpu/kernels.cpp, keep the parse short.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "gae.h"
#include "logprob_entropy.h"

namespace {

hybridflow_cuda::Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return hybridflow_cuda::Dtype::kFloat32;
    case at::kBFloat16: return hybridflow_cuda::Dtype::kBFloat16;
    case at::kHalf: return hybridflow_cuda::Dtype::kFloat16;
    default: break;
  }
  TORCH_CHECK(false, "logits must be float32, bfloat16 or float16, got ", t.scalar_type());
}

void check_logits(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous 2-D CUDA tensor with a non-empty last dimension");
  TORCH_CHECK(labels.device() == logits.device() && labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                  labels.size(0) == logits.size(0) && labels.is_contiguous(),
              "labels must be a contiguous int64 vector on the logits' device, one per logits row");
}

// The current stream of `device`, as a cudaStream_t.
void* current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

void check_launch(const char* error) { TORCH_CHECK(error == nullptr, "CUDA kernel launch: ", error); }

}  // namespace

std::vector<at::Tensor> logprob_entropy_forward(at::Tensor logits, at::Tensor labels) {
  check_logits(logits, labels);
  const c10::DeviceGuard guard(logits.device());
  auto logp = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  auto ent = at::empty_like(logp), lse = at::empty_like(logp);
  check_launch(hybridflow_cuda::logprob_entropy_forward(
      logits.data_ptr(), dtype_of(logits), labels.data_ptr<int64_t>(), logits.size(0), logits.size(1),
      logp.data_ptr<float>(), ent.data_ptr<float>(), lse.data_ptr<float>(), current_stream(logits.device())));
  return {logp, ent, lse};
}

at::Tensor logprob_entropy_backward(at::Tensor logits, at::Tensor labels, at::Tensor lse,
                                       at::Tensor ent, at::Tensor g_logp, at::Tensor g_ent) {
  check_logits(logits, labels);
  const c10::DeviceGuard guard(logits.device());
  // Upstream gradients of a sum() arrive expanded (stride 0): make them plain vectors.
  auto f = [&](const at::Tensor& t) { return t.to(logits.device(), at::kFloat).contiguous(); };
  auto lse_f = f(lse), ent_f = f(ent), gl = f(g_logp), ge = f(g_ent);
  auto grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  check_launch(hybridflow_cuda::logprob_entropy_backward(
      logits.data_ptr(), dtype_of(logits), labels.data_ptr<int64_t>(), lse_f.data_ptr<float>(),
      ent_f.data_ptr<float>(), gl.data_ptr<float>(), ge.data_ptr<float>(), logits.size(0), logits.size(1),
      grad.data_ptr(), current_stream(logits.device())));
  return grad;
}

// GAE over each row's valid (mask != 0) steps; masked steps get 0 and are skipped.
std::vector<at::Tensor> gae_forward(at::Tensor rewards, at::Tensor values, at::Tensor mask,
                                       double gamma, double lam) {
  TORCH_CHECK(rewards.sizes() == values.sizes() && rewards.sizes() == mask.sizes() && rewards.dim() == 2,
              "rewards, values and mask must share one [B, T] shape");
  TORCH_CHECK(rewards.is_cuda() && values.device() == rewards.device() && mask.device() == rewards.device(),
              "rewards, values and mask must be on one CUDA device");
  const c10::DeviceGuard guard(rewards.device());
  auto f = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  auto r = f(rewards), v = f(values), m = f(mask);
  auto adv = at::empty_like(r), ret = at::empty_like(r);
  check_launch(hybridflow_cuda::gae_forward(r.data_ptr<float>(), v.data_ptr<float>(), m.data_ptr<float>(),
                                            r.size(0), r.size(1), static_cast<float>(gamma),
                                            static_cast<float>(lam), adv.data_ptr<float>(),
                                            ret.data_ptr<float>(), current_stream(r.device())));
  return {adv, ret};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("logprob_entropy_forward", &logprob_entropy_forward, "token log-prob, entropy, logsumexp (CUDA)");
  m.def("logprob_entropy_backward", &logprob_entropy_backward, "gradient w.r.t. logits (CUDA)");
  m.def("gae_forward", &gae_forward, "GAE advantages and returns over valid steps (CUDA)");
}
