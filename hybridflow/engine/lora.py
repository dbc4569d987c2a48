"""LoRA on the megatron-core engine: low-rank adapters on the column- and row-parallel linears.

An adapted layer computes `W x + s * B A dropout(x)` (s = alpha / rank, A [r, in], B [out, r]) with W
frozen. The adapters are sharded with TP the way W is, so no rank ever holds a whole adapted matrix
and the merged tensor `W + s * B A` of a rank's shard is computed from that rank's pieces alone:

- column-parallel (`linear_qkv`, `linear_fc1`: W split on output rows): B split like W's rows (the same
  `[gate_r; up_r]` blocks for `linear_fc1`), A replicated. The replicated `h = A x` meets the split B
  through megatron-core's copy-to-TP mapping (its backward sums h's gradient over TP, so A's gradient is
  whole on every rank); under sequence parallelism h (r features, not `in`) is gathered instead and A's
  gradient, then a sum over each rank's tokens, is summed by megatron-core's sequence-parallel reduce.
- row-parallel (`linear_proj`, `linear_fc2`: W split on input columns): A split like W's columns, B
  replicated; the partial `h = A_r x_r` is summed over TP (reduce-scattered over the sequence under
  sequence parallelism, where B's gradient is then summed like a norm's).

The adapters are parameters of the linear module itself (`linear_qkv.lora_A`, `.lora_B`) and a forward
hook adds their term, so megatron-core's DDP, distributed optimizer, gradient-norm and checkpoints see
them as ordinary parameters while the base weights' names, bridge and loaders stay as they are. A is
drawn from the adapter's global name (kaiming-uniform, as peft draws it) and B is zero, so every layout
starts from the same adapters and step 0 is the base model. On an MoE model `linear_fc1`/`linear_fc2` adapt each
expert's (megatron-core's SequentialMLP `local_experts.J`): at ep > 1 a rank holds its own experts' adapters, named
globally (`experts.ExpertShard`) and reduced over the expert-data-parallel ranks as their weights are
(`allreduce`); experts' adapters at tp > 1 are not built (their linears leave the TP reductions to the token
dispatcher).
"""
from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from hybridflow.config.schema import LORA_TARGETS, LoRAConfig
from hybridflow.models.sharding import REPLICATE, ROW, ShardSpec, shard_tensor, spec_for
from hybridflow.parallel.stages import chunk_name

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")  # the others in LORA_TARGETS are row-parallel


@dataclass
class Adapted:
    """One adapted linear on this rank: `key` its global module name (`decoder.layers.3.mlp.linear_fc1`),
    `local` its weight's name in `MegatronEngine.named_params`, `column` whether W splits on output rows."""

    key: str
    local: str
    module: nn.Module
    column: bool

    @property
    def weight_spec(self) -> ShardSpec:
        return spec_for(self.key + ".weight")

    @property
    def a_spec(self) -> ShardSpec:
        """How A splits over TP: replicated on a column-parallel layer, like W's columns on a row one."""
        return REPLICATE if self.column else ROW

    @property
    def b_spec(self) -> ShardSpec:
        """How B splits over TP: like W's rows on a column-parallel layer, replicated on a row one."""
        return self.weight_spec if self.column else REPLICATE


class LoRA:
    """The adapters of one engine's model chunks; `enabled` False computes the base model (`disabled()`)."""

    def __init__(self, cfg: LoRAConfig, adapted: list[Adapted], tp: int):
        self.cfg, self.adapted, self.tp = cfg, adapted, tp
        self.scale = cfg.alpha / cfg.rank
        self.enabled = True
        self.by_local = {a.local: a for a in adapted}

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model's forward inside: every adapter's term left out."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def adapter_names(self) -> list[str]:
        """The adapters' parameter names in `MegatronEngine.named_params` (A then B per adapted layer)."""
        base = [a.local[:-len("weight")] for a in self.adapted]
        return [f"{b}{p}" for b in base for p in ("lora_A", "lora_B")]

    @torch.no_grad()
    def delta(self, a: Adapted) -> Tensor:
        """s * B A of this rank's shard of `a`'s weight, in its layout and dtype (computed in float32)."""
        return lora_delta(a.module.lora_A, a.module.lora_B, self.scale, a.module.weight.dtype)

    @torch.no_grad()
    def merged(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """`params` (local names -> tensors, as `named_params` gives them) with every adapted weight
        replaced by a new tensor W + s * B A of the same shard; the rest are the same tensors."""
        return {name: (t.detach() + self.delta(self.by_local[name]) if name in self.by_local else t)
                for name, t in params.items()}

    def forward_term(self, a: Adapted, x: Tensor) -> Tensor:
        """s * B A dropout(x) in the layer's output layout (x: the layer's input [s, b, in(/tp)])."""
        from megatron.core.tensor_parallel import mappings

        module, sp = a.module, bool(a.module.sequence_parallel)
        if self.cfg.dropout and module.training:
            x = nn.functional.dropout(x, self.cfg.dropout)
        h = x @ module.lora_A.t()
        if a.column:
            h = (mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True) if sp
                 else mappings.copy_to_tensor_model_parallel_region(h))
        else:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if sp
                 else mappings.reduce_from_tensor_model_parallel_region(h))
        return (h @ module.lora_B.t()) * self.scale

    def hook(self, a: Adapted):
        def add_term(module, args, output):
            if not self.enabled:
                return output
            out, bias = output
            return out + self.forward_term(a, args[0]), bias
        return add_term


@torch.no_grad()
def lora_delta(lora_a: Tensor, lora_b: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """scale * B A (A [r, in], B [out, r]) computed in float32, then cast to `dtype`: the one computation of a
    merged delta, so a rollout that merges from the same pieces gets the training rank's bits."""
    return ((lora_b.float() @ lora_a.float()) * scale).to(dtype)


def init_a(key: str, rank: int, fan_in: int, seed: int, dtype: torch.dtype) -> Tensor:
    """The whole A [rank, fan_in] of the adapter named `key`: kaiming-uniform (bound 1 / sqrt(fan_in)) from a
    generator keyed by (seed, key), so every layout and stage draws the same matrix."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)


def targets(inner: nn.Module, names: list[str], experts=None) -> Iterator[tuple[str, str, nn.Module]]:
    """(global module name, local module name, module) of each dense attention or MLP linear named in
    `names` in one unwrapped GPTModel, and of each local expert's (megatron-core's SequentialMLP); layers
    numbered globally from their `layer_number`, experts by `experts` (an `ExpertShard`; None: as held)."""
    for i, layer in enumerate(inner.decoder.layers):
        top, here = f"decoder.layers.{layer.layer_number - 1}.", f"decoder.layers.{i}."
        for block in ("self_attention", "mlp"):
            for target in names:
                module = getattr(getattr(layer, block, None), target, None)
                if module is None or not hasattr(module, "weight"):
                    continue
                rest = f"{block}.{target}"
                yield top + rest, here + rest, module
        local_experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", None) or []
        for j, expert in enumerate(local_experts):
            for target in names:
                module = getattr(expert, target, None)
                if module is None or not hasattr(module, "weight"):
                    continue
                rest = f"mlp.experts.local_experts.{j}.{target}"
                key = top + rest if experts is None else experts.global_name(top + rest + ".weight")[:-len(".weight")]
                yield key, here + rest, module


def attach_lora(chunks: list[nn.Module], cfg: LoRAConfig, tp: int, tp_rank: int, seed: int, experts=None) -> LoRA:
    """Freeze every parameter of `chunks` (this rank's model chunks) and add trainable adapters to the
    linears `cfg.target_modules` names (`experts`: this rank's `ExpertShard`, naming its experts' adapters
    globally); ValueError when a name is not one of `LORA_TARGETS`, nothing on this rank matches, or an
    expert would be adapted at tp > 1."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.utils import unwrap_model

    unknown = sorted(set(cfg.target_modules) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"actor.lora.target_modules: {unknown} are not among {list(LORA_TARGETS)}")
    adapted: list[Adapted] = []
    vpp = len(chunks)
    for c, chunk in enumerate(chunks):
        chunk.requires_grad_(False)
        for key, local, module in targets(unwrap_model(chunk), cfg.target_modules, experts):
            if ".local_experts." in key and tp > 1:
                raise ValueError(f"actor.lora.target_modules: {cfg.target_modules} adapt the experts, which is "
                                 f"not built at tp = {tp} (tp = 1, any ep)")
            a = Adapted(key, chunk_name(c, local + ".weight", vpp), module, key.split(".")[-1] in COLUMN_TARGETS)
            out_local, in_local = module.weight.shape
            fan_in = in_local if a.column else in_local * tp
            full_a = init_a(key, cfg.rank, fan_in, seed, module.weight.dtype)
            lora_a = shard_tensor(full_a, a.a_spec, tp_rank, tp).contiguous()
            module.lora_A = nn.Parameter(lora_a.to(module.weight.device))
            module.lora_B = nn.Parameter(module.weight.new_zeros(out_local, cfg.rank))
            sp = bool(module.sequence_parallel)
            for param, spec in ((module.lora_A, a.a_spec), (module.lora_B, a.b_spec)):
                set_tensor_model_parallel_attributes(param, spec.dim is not None, spec.dim or 0, 1)
                # Replicated adapters whose gradient is a sum over this rank's tokens only.
                param.sequence_parallel = sp and spec.dim is None
                # An expert's adapters are reduced where its weight is: over the expert-data-parallel ranks.
                param.allreduce = getattr(module.weight, "allreduce", True)
            adapted.append(a)
    if not adapted:
        raise ValueError(f"actor.lora.target_modules: {cfg.target_modules} match no linear of this model stage")
    lora = LoRA(cfg, adapted, tp)
    for a in adapted:
        a.module.register_forward_hook(lora.hook(a))
    return lora


def trainable(params: dict[str, Tensor], lora: Optional[LoRA]) -> dict[str, Tensor]:
    """What a checkpoint of the engine holds: every parameter, or with LoRA only the adapters (the base
    comes back from `model.path`)."""
    if lora is None:
        return params
    return {name: params[name] for name in lora.adapter_names()}


class AdaptersOff:
    """The actor's LoRA engine as the KL reference (`reference.engine: adapters_off`): its forward with every
    adapter left out, which is the frozen base model, so no second copy of the model is built. Forward only
    (`optimizer` is None, as the `Reference` role asks); every other attribute is the engine's."""

    optimizer = None

    def __init__(self, engine):
        if engine.lora is None:
            raise ValueError("reference.engine=adapters_off needs an actor with LoRA adapters (actor.lora.rank > 0)")
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def run(self, micro_batches, step_fn, forward_only: bool = False, **options):
        if not forward_only:
            raise RuntimeError("the adapters-off reference is forward only")
        with self.engine.lora.disabled():
            return self.engine.run(micro_batches, step_fn, forward_only=True, **options)
