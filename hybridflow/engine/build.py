"""The engine's model: megatron-core's GPTModel built for one pipeline stage, and the pieces around it.

`transformer_config` maps a `DecoderConfig` and a `ParallelConfig` to
megatron-core's `TransformerConfig`; `build_model` builds this stage's
GPTModel with the local layer spec (no Transformer Engine), the plain
decoder's RoPE frequencies and megatron-core's TP attributes. Where the
engine needs GPTModel to do something else, it swaps in a module of its own
or registers a hook, never patching a megatron object (rule 13):

- `ValueHead` replaces the vocabulary output layer for the critic;
- `HiddenOutput` replaces it where the loss applies the output layer itself
  (`fused_output`), holding the same weight Parameter;
- `RopePositions` is a forward hook on the rotary module that gives it
  per-row positions (shared-prompt rows), and at cp > 1 the angles of this
  CP rank's chunks (`parallel.cp_split`);
- at cp > 1 the local spec's core attention is `cp_attention`'s (megatron-core's
  local one asserts cp == 1); at cp = 1 the spec is as megatron-core gives it.

Each keeps parameter names, checkpoints and the bridge as they are.
`use_fused_adam` switches the optimizer's torch Adam steps to the fused CPU
kernel.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from hybridflow.config.schema import ParallelConfig
from hybridflow.engine import cpu_layers
from hybridflow.engine.cp_attention import core_attention_for
from hybridflow.models.config import DecoderConfig
from hybridflow.models.decoder import rope_inv_freq
from hybridflow.models.sharding import spec_for
from hybridflow.parallel.cp_split import cp_positions


class ValueHead(nn.Module):
    """The critic's output layer: hidden -> one value, replicated across TP.

    Under sequence parallelism its input is this rank's slice of the sequence (the vocabulary layer it
    replaces gathers it itself); it gathers the whole sequence, and as every TP rank then computes the
    same values and loss, the backward takes the rank's slice of the gradient (no reduce-scatter sum).
    """

    def __init__(self, hidden: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return hidden_states @ self.weight.t(), None


class HiddenOutput(nn.Module):
    """GPTModel's output layer when the loss applies it: hands its input (the final hidden states) back,
    and records in `used_weight` the weight it would have applied: its own, or the tied embedding that
    GPTModel passes in. It holds the replaced layer's weight Parameter, so names and checkpoints stay."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.weight = layer.weight  # None on a first stage whose output layer is tied to the embedding
        # Set past nn.Module.__setattr__, which would register a Parameter as this module's own.
        object.__setattr__(self, "used_weight", None)

    def forward(self, input_: Tensor, weight: Optional[Tensor] = None, runtime_gather_output=None, **_unused):
        object.__setattr__(self, "used_weight", self.weight if weight is None else weight)
        return input_, None


class RopePositions:
    """Per-row RoPE positions for GPTModel, which rotates a row's token j as position j.

    `attach` registers a forward hook on GPTModel's rotary module. Inside
    `at(positions)` (positions [b, s]) the hook replaces the module's angles
    by those of the given positions, per row (`[s, b, 1, dim]`, which the
    rotation broadcasts over heads): what shared-prompt rows need. Outside
    it the module's own angles stand; at cp > 1 the rank's local token i is
    global position `cp_positions(S)[i]`, and `at` takes global positions.
    """

    def __init__(self):
        self.positions: Optional[Tensor] = None
        self.cp_size, self.cp_rank = 1, 0

    def attach(self, rope: nn.Module, cp_size: int = 1, cp_rank: int = 0) -> None:
        if cp_size > 1:
            # megatron-core slices the angles for a CP rank with a pinned CUDA index, which a CPU-only
            # torch cannot make; without a CP group the module gives the whole sequence's angles (it is
            # called with the global length) and `_angles` takes this rank's chunks (the same chunks).
            rope.cp_group = None
        self.cp_size, self.cp_rank = cp_size, cp_rank
        rope.register_forward_hook(self._angles)

    @contextmanager
    def at(self, positions: Tensor) -> Iterator[None]:
        self.positions = positions
        try:
            yield
        finally:
            self.positions = None

    def _angles(self, rope: nn.Module, args, output: Tensor) -> Optional[Tensor]:
        if self.positions is None:
            if self.cp_size == 1:
                return None  # keep the module's output
            return output.index_select(0, cp_positions(output.shape[0], self.cp_size, self.cp_rank,
                                                       output.device))
        inv_freq = rope.inv_freq.to(self.positions.device)
        freqs = self.positions.t()[..., None].to(inv_freq.dtype) * inv_freq  # [s, b, dim / 2]
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]


def moe_fields(cfg: DecoderConfig, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0) -> dict:
    """megatron-core's MoE settings for an MoE model (empty for a dense one): the softmax top-k router
    (`moe_router_pre_softmax` keeps the full softmax's weights where the family does not renormalise the
    top k), SequentialMLP experts, the allgather token dispatcher (the one that runs over gloo), the
    shared expert and its sigmoid gate, and the load-balancing and z losses with the run's coefficients."""
    if not cfg.is_moe:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_top_k, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_score_function="softmax", moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
        moe_router_dtype="fp32", moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff, moe_z_loss_coeff=z_loss_coeff or None,
        moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=cfg.shared_expert_gate, moe_permute_fusion=False)


def transformer_config(cfg: DecoderConfig, parallel: ParallelConfig, dtype: torch.dtype, device: str,
                       layer_kernels: bool = True, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0):
    """megatron-core's TransformerConfig for `cfg` at `parallel`; the two coefficients weigh an MoE
    model's load-balancing and router z losses (megatron-core adds their gradients in the backward)."""
    from megatron.core.transformer import TransformerConfig

    if len(set(cfg.layer_windows)) > 1:
        raise NotImplementedError("the Megatron engine supports one attention window for all layers; "
                                  f"this model has {sorted(set(map(str, cfg.layer_windows)))}")
    window = cfg.layer_windows[0] if cfg.layer_windows else None
    virtual_pp = parallel.virtual_pp or 1
    # On CPU the norms, the SwiGLU and the rotation run hybridflow's one-pass kernels (engine/cpu_layers.py).
    cpu_kernels = device == "cpu" and layer_kernels and cpu_layers.install_rope()
    if parallel.sequence_parallel and device == "cpu" and not cpu_kernels:  # else an assert while building
        raise NotImplementedError("sequence parallelism on CPU needs the engine's layer kernels "
                                  "(model.cpu_layer_kernels: true): without apex, megatron-core's own norm "
                                  "(WrappedTorchNorm) does not support it")
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads, num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm, **moe_fields(cfg, aux_loss_coeff, z_loss_coeff),
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=cpu_kernels,
        use_te_activation_func=cpu_kernels,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        window_size=None if window is None else (window - 1, 0),
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        pipeline_dtype=dtype,
        context_parallel_size=parallel.cp, sequence_parallel=parallel.sequence_parallel,
        expert_model_parallel_size=parallel.ep,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        virtual_pipeline_model_parallel_size=virtual_pp if virtual_pp > 1 else None,
        # The interleaved schedule at pp = 2 sends a stage's activation and its gradient to the same peer in
        # one step; batched, both land in one ordered queue and each rank posts them in another order (a
        # swapped pair: the forward passes agree, the gradients do not). Unbatched, megatron-core sends the
        # two directions on two groups, as megatron-LM's interleaved default does.
        batch_p2p_comm=virtual_pp == 1,
        use_cpu_initialization=device == "cpu", perform_initialization=False)


def build_model(cfg: DecoderConfig, tconfig, padded_vocab: int, dtype: torch.dtype, device: torch.device,
                rope: RopePositions, *, value_head: bool = False, fused_output: bool = False,
                vp_stage: Optional[int] = None) -> nn.Module:
    """This pipeline stage's GPTModel on `device`, its parameters tagged for TP; in a Float16Module below
    float32. value_head: the critic's `ValueHead` as output layer; fused_output: `HiddenOutput`.
    vp_stage: under the interleaved schedule (tconfig's virtual pipeline size set), which of the stage's
    model chunks to build: megatron-core places its layers (`parallel.stages` gives the same) and gives
    the embedding to chunk 0 of the first stage, the output layer to the last chunk of the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = (cpu_layers.layer_spec(tconfig) if tconfig.use_te_activation_func
            else get_gpt_layer_local_spec(normalization="RMSNorm", num_experts=tconfig.num_moe_experts,
                                          qk_layernorm=tconfig.qk_layernorm))
    core_attention = core_attention_for(tconfig, torch.device(device).type)
    if core_attention is not None:  # cp > 1
        for layer in getattr(spec, "layer_specs", [spec]):
            layer.submodules.self_attention.submodules.core_attention = core_attention
    model = GPTModel(
        config=tconfig, transformer_layer_spec=spec,
        vocab_size=padded_vocab, max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings and not value_head, vp_stage=vp_stage)
    # RoPE frequencies (incl. linear / llama3 scaling) come from the one
    # definition the plain decoder uses, so both layouts agree exactly.
    model.rotary_pos_emb.inv_freq = rope_inv_freq(cfg).to(device)
    rope.attach(model.rotary_pos_emb, ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
    if value_head and model.post_process:
        model.output_layer = ValueHead(cfg.hidden_size, dtype, tconfig.sequence_parallel)
    if fused_output and model.post_process:
        model.output_layer = HiddenOutput(model.output_layer)
    model.to(device)
    mark_tensor_parallel(model, value_head)
    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(tconfig, model)
    return model


def mark_tensor_parallel(model: nn.Module, value_head: bool = False) -> None:
    """Tag each parameter with megatron-core's TP attributes, from the sharding plan.

    megatron-core 0.16 sets `tensor_model_parallel` on a layer's weight only
    while initializing it; built with `perform_initialization=False` (weights
    come from a checkpoint) the weights of its TP layers are left untagged.
    The optimizer then counts every untagged parameter on TP rank 0 only as a
    "duplicate", so the gradient norm (and clipping) misses the other ranks'
    shards: at tp=2 it measured 1.51 where the single-rank norm is 1.91.
    """
    from megatron.core.tensor_parallel.layers import (set_defaults_if_not_set_tensor_model_parallel_attributes,
                                                      set_tensor_model_parallel_attributes)

    for name, param in model.named_parameters():
        if hasattr(param, "tensor_model_parallel"):  # megatron-core tagged it (biases are)
            continue
        spec = None if value_head and name == "output_layer.weight" else spec_for(name)  # the value head is replicated
        if spec is not None and spec.dim is not None:
            set_tensor_model_parallel_attributes(param, True, spec.dim, 1)
        else:
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)


def lr_scheduler(optimizer, optim, total_steps: int):
    """megatron-core's LR (and weight-decay) schedule over `total_steps` optimizer steps, as `optim` (an
    `OptimConfig`) sets it: both engines' optimizers follow it, so their steps take the same learning rates."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    steps = max(1, total_steps)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr,
        min_lr=optim.min_lr, lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(steps, optim.warmup_steps + 1), lr_decay_style=optim.lr_schedule,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=steps,
        wd_incr_style="constant")


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam(W) steps inside a megatron-core optimizer to torch's fused CPU kernel.

    Without Transformer Engine or apex, megatron-core builds `torch.optim.AdamW` with torch's defaults, which
    on CPU tensors is the per-parameter loop: ~10 ops per tensor per step (measured on the demo model's 27
    tensors: 5.1 ms a step, fused 0.9 ms). The fused kernel computes the same update in one pass per tensor.
    Returns how many param groups were switched.
    """
    switched = 0
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_opt.param_groups:
            if all(p.device.type == "cpu" for p in group["params"]) and not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched
