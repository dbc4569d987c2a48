"""Training engines by kind (`<role>.engine`): the one table a worker builds an engine from.

    engine = build_engine(run, model, path, optim, parallel, layout, steps, kind="fsdp", fsdp=cfg.fsdp)

A new engine kind is a builder here and its name in `config.schema.TrainEngineName`; the workers and the
roles take the engine as given.
"""
from __future__ import annotations

from typing import Callable, Optional

from hybridflow.config.schema import FSDPConfig, LoRAConfig, ModelConfig, MoELossConfig, OptimConfig, ParallelConfig
from hybridflow.engine import MegatronEngine
from hybridflow.models.config import DecoderConfig
from hybridflow.parallel.layout import ParallelDims
from hybridflow.workers.specs import Run


def model_config(path: str, kind: str = "megatron", fsdp: Optional[FSDPConfig] = None) -> DecoderConfig:
    """The model's config as an engine of `kind` reads it: FSDP on transformers' code takes any architecture
    transformers builds; hybridflow's decoder only those it knows."""
    transformers_code = kind == "fsdp" and (fsdp or FSDPConfig()).modeling == "transformers"
    return DecoderConfig.from_pretrained(path, any_architecture=transformers_code)


def megatron_engine(run: Run, model: ModelConfig, path: str, optim: Optional[OptimConfig], parallel: ParallelConfig,
                    layout: ParallelDims, optimizer_steps: int, value_head: bool, fsdp: Optional[FSDPConfig],
                    moe: MoELossConfig, lora: Optional[LoRAConfig] = None):
    """megatron-core at `layout` (any TP/PP/CP/DP), with an MoE model's router losses weighted by `moe`, and
    with `lora` (rank > 0) its base frozen and adapters trained."""
    return MegatronEngine(
        model_config(path), parallel, optim,
        device=run.device, dtype=model.dtype, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        value_head=value_head, total_steps=optimizer_steps, seed=run.seed,
        fused_output=model.use_fused_kernels and not value_head, layer_kernels=model.cpu_layer_kernels,
        layout=layout, aux_loss_coeff=moe.aux_loss_coeff, z_loss_coeff=moe.z_loss_coeff, lora=lora)


def fsdp_engine(run: Run, model: ModelConfig, path: str, optim: Optional[OptimConfig], parallel: ParallelConfig,
                layout: ParallelDims, optimizer_steps: int, value_head: bool, fsdp: Optional[FSDPConfig],
                moe: MoELossConfig, lora: Optional[LoRAConfig] = None):
    """FSDP2 over the group's world, on hybridflow's decoder or transformers' code (`fsdp.modeling`), with
    `lora` (rank > 0) peft's adapters on its frozen base; the plan's layout must be dp = world, which the
    config checks made sure of. It adds no router loss (the
    config checks refuse `moe` coefficients for it)."""
    from hybridflow.engine.fsdp import FSDPEngine
    from hybridflow.engine.fsdp_hf import TransformersFSDPEngine

    fsdp = fsdp or FSDPConfig()
    options = dict(device=run.device, dtype=model.dtype,
                   make_vocab_size_divisible_by=model.make_vocab_size_divisible_by, value_head=value_head,
                   total_steps=optimizer_steps, seed=run.seed, offload=fsdp.offload, lora=lora)
    model_cfg = model_config(path, "fsdp", fsdp)
    engine = (TransformersFSDPEngine(path, model_cfg, optim, **options) if fsdp.modeling == "transformers"
              else FSDPEngine(model_cfg, optim, **options))
    if engine.layout != layout:
        raise ValueError(f"the run plan's layout {layout} is not FSDP's {engine.layout} over this group")
    return engine


ENGINE_KINDS: dict[str, Callable] = {"megatron": megatron_engine, "fsdp": fsdp_engine}


def build_engine(run: Run, model: ModelConfig, path: str, optim: Optional[OptimConfig], parallel: ParallelConfig,
                 layout: ParallelDims, optimizer_steps: int = 1, value_head: bool = False,
                 kind: str = "megatron", fsdp: Optional[FSDPConfig] = None, moe: Optional[MoELossConfig] = None,
                 lora: Optional[LoRAConfig] = None):
    """An engine of `kind` at the run plan's `layout`, loaded from the HF checkpoint at `path` (checked by the
    trainer; each rank reads only its own slices); its LR schedule spans `optimizer_steps`."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}: one of {sorted(ENGINE_KINDS)}")
    engine = ENGINE_KINDS[kind](run, model, path, optim, parallel, layout, optimizer_steps, value_head, fsdp,
                                moe or MoELossConfig(), lora)
    engine.load_hf_checkpoint(path)
    return engine
