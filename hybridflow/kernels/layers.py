"""The decoder layers' elementwise parts, forward and backward, one pass each on CPU.

    rms_norm(x[..., d], weight[d], eps)  -> x * rsqrt(mean(x^2) + eps) * weight
    swiglu(x[..., 2f])                   -> silu(x[..., :f]) * x[..., f:]
    rotary(t[s, b, h, d], cos, sin)      -> t * cos + rotate_half(t) * sin   (cos, sin [s, 1 or b, d])

Backends (see `backend.py`): `reference` is plain PyTorch, the math megatron-core runs unfused without
apex or Transformer Engine; `cpu` is C++ (csrc/cpu/layers.cpp) for float32 CPU tensors, an autograd
function whose backward is one pass too. `auto` takes `cpu` where it applies and the reference elsewhere
(GPU tensors, other dtypes, a missing compiler). Tests compare the two, values and gradients.
"""
from __future__ import annotations

import torch

from hybridflow.kernels.backend import BackendUnavailable, cpu_extension, resolve


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron-core's unfused rotation (half-split convention); cos and sin broadcast over the heads."""
    cos, sin = cos.unsqueeze(2).to(t.dtype), sin.unsqueeze(2).to(t.dtype)
    first, second = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin


def _cpu_applies(*tensors: torch.Tensor, backend: str) -> bool:
    """Whether the C++ kernel runs: `cpu` or `auto` on float32 CPU tensors (`cpu` by name raises elsewhere)."""
    if resolve(backend, tensors[0].device, ("cpu",)) != "cpu":
        return False
    if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return True
    if backend == "cpu":
        raise BackendUnavailable(f"the C++ layer kernels take float32 CPU tensors, got "
                                 f"{sorted({f'{t.dtype} on {t.device}' for t in tensors})}")
    return False


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = cpu_extension().rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = cpu_extension().rms_norm_backward(g.contiguous(), x, weight, rstd)
        return dx, dweight, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return cpu_extension().swiglu_forward(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return cpu_extension().swiglu_backward(g.contiguous(), x)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return cpu_extension().rotary(t, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        g = g if g.stride(-1) == 1 else g.contiguous()  # the kernel walks each head's vector in order
        return cpu_extension().rotary(g, cos, sin, backward=True), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if not _cpu_applies(x, weight, backend=backend):
        return rms_norm_reference(x, weight, eps)
    return _RMSNorm.apply(x.contiguous(), weight.contiguous(), eps)


def swiglu(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if not _cpu_applies(x, backend=backend):
        return swiglu_reference(x)
    return _SwiGLU.apply(x.contiguous())


def rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """No gradient reaches cos and sin (they come from fixed frequencies): the reference runs when they need one."""
    if cos.requires_grad or sin.requires_grad or t.dim() != 4 or t.stride(-1) != 1 \
            or not _cpu_applies(t, cos, sin, backend=backend):
        return rotary_reference(t, cos, sin)
    return _Rotary.apply(t, cos.contiguous(), sin.contiguous())
