"""megatron-core's mixture-of-experts layers in the engine: which columns their routers count, and what
they did in the training passes since the last read.

`forward_with_padding` tells the routers which columns of a micro-batch are padding, so that the
load-balancing and z losses count real tokens only (padding is still routed and computed, its output
dropped). `RouterStats`, per layer: the share of the real tokens' (token, expert) pairs that its most and
least loaded expert took (a balanced layer gives each 1 / experts), counted by a forward hook on
megatron-core's routers; and megatron-core's own load-balancing and z losses (unscaled by their
coefficients) from its loss tracker, averaged over the micro-batches. Only passes in training mode count:
log-prob passes run in eval mode.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.engine.distributed import all_reduced
from hybridflow.models.config import DecoderConfig

def forward_with_padding(model: nn.Module, inputs: tuple[Tensor, Tensor, Tensor], real: Tensor, tconfig) -> Tensor:
    """`model(*inputs)` (ids [b, S], positions, mask); an MoE model's routers also get which columns are padding
    (all but the first `real[b]` of row b). tconfig: the model's TransformerConfig."""
    ids = inputs[0]
    padding = torch.arange(ids.shape[1], device=ids.device)[None] >= real.to(ids.device)[:, None]
    return model(*inputs, **padding_kwargs(model, padding, tconfig))


def padding_kwargs(model: nn.Module, padding: Tensor, tconfig) -> dict[str, Tensor]:
    """GPTModel's `padding_mask` argument for an MoE model ({} for a dense one): `padding` [b, S] (True at
    padding, S the columns this rank runs). GPTModel splits that mask over TP under sequence parallelism on the
    first pipeline stage only; a later stage is given its TP rank's columns here."""
    if not tconfig.num_moe_experts:
        return {}
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    if tconfig.sequence_parallel and not get_attr_wrapped_model(model, "pre_process"):
        tp = ps.get_tensor_model_parallel_world_size()
        padding = padding.chunk(tp, dim=1)[ps.get_tensor_model_parallel_rank()].contiguous()
    return {"padding_mask": padding}


LOSSES = {"load_balancing_loss": "aux_loss", "z_loss": "z_loss"}  # megatron-core's tracker names -> ours


class RouterStats:
    """Hooks on every router of `chunks`; `read()` (a collective on every rank of the engine) gives the figures
    over all ranks and starts a new count. A dense model has no router: `read()` gives {}."""

    def __init__(self, chunks: list[nn.Module], cfg: DecoderConfig):
        from megatron.core.transformer.moe.router import Router

        self.loads = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.float64)
        self.passes = torch.zeros(cfg.num_layers, dtype=torch.float64)
        for chunk in chunks if cfg.is_moe else ():
            for module in chunk.modules():
                if isinstance(module, Router):
                    module.register_forward_hook(self._record)

    def _record(self, router: nn.Module, args, output) -> None:
        if router.training:
            _, routing_map = output  # [tokens, experts], True where a token goes
            padding = args[1] if len(args) > 1 else None  # [s, b], True at padding: the tokens' order
            if padding is not None:
                routing_map = routing_map & ~padding.reshape(-1, 1)
            self.loads[router.layer_number - 1] += routing_map.sum(0).to(device="cpu", dtype=torch.float64)
            self.passes[router.layer_number - 1] += 1

    def read(self) -> dict[str, float]:
        """{"aux_loss", "z_loss" (where a coefficient turned them on), "layer{i}/max_load",
        "layer{i}/min_load"}; empty when no training pass ran since the last read."""
        if not self.loads.numel():  # a dense model
            return {}
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        names = [name for name in LOSSES if name in tracker]
        tp_cp = ps.get_tensor_and_context_parallel_group()
        # Per layer, each rank's mean per pass. megatron-core names the group whose ranks hold parts of a loss
        # (the load-balancing loss: TP under SP, and CP): summed over it; a loss without one (z) is each rank's
        # own mean: averaged over TP and CP. Loads: tokens are split over TP (under SP) and CP; ranks routing
        # the same tokens (TP without SP) scale every count alike, which leaves the shares.
        losses = []
        for name in names:
            values = tracker[name]["values"][:len(self.passes)].detach().to("cpu", torch.float64)
            values = values / self.passes.clamp(min=1)
            group = tracker[name].get("reduce_group")
            losses.append(all_reduced(values, group) if group is not None
                          else all_reduced(values, tp_cp) / dist.get_world_size(tp_cp))
        layers, experts = self.loads.shape
        totals = torch.cat([all_reduced(self.loads, tp_cp).flatten(), *losses, self.passes])
        totals = all_reduced(totals, ps.get_pipeline_model_parallel_group())  # each stage holds its own layers
        dp = ps.get_data_parallel_group()
        totals = all_reduced(totals, dp)
        self.loads.zero_(), self.passes.zero_()
        for name in names:  # the tracker is one per process: another MoE model there (the critic's) starts anew
            tracker.pop(name)
        if not totals[-layers:].any():
            return {}
        out = {LOSSES[name]: float(totals[layers * (experts + i):layers * (experts + i + 1)].mean() / dist.get_world_size(dp))
               for i, name in enumerate(names)}
        share = totals[:layers * experts].view(layers, experts)
        share = share / share.sum(-1, keepdim=True).clamp(min=1)
        for layer in range(layers):
            out[f"layer{layer}/max_load"] = float(share[layer].max())
            out[f"layer{layer}/min_load"] = float(share[layer].min())
        return out
