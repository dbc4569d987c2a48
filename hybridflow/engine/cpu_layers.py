"""megatron-core's decoder layer on CPU with one-pass RMSNorm, SwiGLU and rotary kernels.

Without apex or Transformer Engine, megatron-core runs these three unfused: torch's composite RMSNorm,
chunk + silu + mul, and a rotation that computes cos and sin again in every layer. On a small model's
CPU step they took more time than the matmuls. This module plugs `hybridflow.kernels.layers` into the
places megatron-core leaves for fused kernels, so its files stay untouched and parameter names,
checkpoints and the bridge are the same:

- the layer spec's norms (`input_layernorm`, `pre_mlp_layernorm`, the block's final norm) are `RMSNorm`,
  a `torch.nn.RMSNorm` (what megatron-core's WrappedTorchNorm builds) whose forward is the kernel;
- the MLP's activation is `SwiGLU`: megatron-core calls a spec'd activation module on [gate | up] when
  `use_te_activation_func` is set;
- `apply_rope_fusion` routes the rotation to `rope_utils.fused_apply_rotary_pos_emb`, the slot
  Transformer Engine fills on GPU; `install_rope` fills it with `fused_rope`.

`transformer_config` and `MegatronEngine` use this only for `device="cpu"`; the kernels fall back to the
reference math for tensors they do not take (another dtype), so the model is the same either way.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridflow.kernels.layers import rms_norm, rotary, swiglu


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        # Under sequence parallelism each TP rank's gradient covers its slice of the sequence only;
        # megatron-core sums the gradients of weights so tagged over TP (finalize_model_grads), as it
        # does for apex's FusedLayerNorm, which tags its weights the same way.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """QK-norm over each head's features: its weight is not split by sequence parallelism (megatron-core
    sums its gradient over TP by name, as `qk_layernorm` asks)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x)


class _AnglesCache:
    """cos and sin of the last `freqs` seen: every layer rotates q and k by the same angles in a forward
    pass, so they are computed once instead of 2 x layers times. Keyed by the tensor itself (held, so its
    id cannot be reused) and its version counter (an in-place change invalidates it)."""

    def __init__(self):
        self.key: tuple[Tensor, int] | None = None
        self.cos = self.sin = None
        self.computed = 0  # how many times they were computed (a test counts them per forward pass)

    def __call__(self, freqs: Tensor) -> tuple[Tensor, Tensor]:
        if self.key is None or self.key[0] is not freqs or self.key[1] != freqs._version:
            angles = freqs[:, :, 0]  # [s, 1 or b, 1, d] -> [s, 1 or b, d]
            self.cos, self.sin = angles.cos(), angles.sin()
            self.key = (freqs, freqs._version)
            self.computed += 1
        return self.cos, self.sin


_angles = _AnglesCache()


def fused_rope(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """megatron-core's fused-RoPE call: t [s, b, heads, d], freqs [s, 1 or b, 1, rot_dim]."""
    if interleaved or freqs.shape[-1] != t.shape[-1] or freqs.dim() != 4 or freqs.requires_grad:
        from megatron.core.models.common.embeddings import rope_utils  # only here: 2 x layers calls a forward

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    cos, sin = _angles(freqs)
    return rotary(t, cos, sin)


def install_rope() -> bool:
    """Fill megatron-core's fused-RoPE slot (empty without Transformer Engine) with `fused_rope`; whether
    the slot holds it (Transformer Engine's own is left in place)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope


def layer_spec(config):
    """The local (no Transformer Engine) GPT layer spec for this pipeline stage, with the kernels above."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec(normalization="RMSNorm", num_experts=config.num_moe_experts,
                                     qk_layernorm=config.qk_layernorm)
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    mlp = layer.submodules.mlp.submodules
    if config.num_moe_experts:  # the experts' and the shared expert's MLPs
        for sub in (mlp.experts.submodules, mlp.shared_experts.submodules):
            sub.activation_func = SwiGLU
    else:
        mlp.activation_func = SwiGLU
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)
