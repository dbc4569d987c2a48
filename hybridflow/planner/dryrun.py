"""Dry-run at full scale without weights: the real models on the meta device, the real reshard plan.

The cost model counts parameters and transition bytes by formula; here the same figures come from the
objects a run builds: the plain `Decoder` (the generation model, built on `torch.device("meta")` with
one rank's tensor-parallel shapes, so no memory is allocated) and the 3D-HybridEngine's `plan_reshard`
over megatron-core's parameter shapes (`LlamaBridge.megatron_shapes`). `hybridflow plan` prints both
side by side; a 70B model on 64 ranks takes seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import re

import torch

from hybridflow.hybrid_engine.plan import GenLayout, bridge_params, plan_reshard
from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig
from hybridflow.models.decoder import Decoder
from hybridflow.models.sharding import padded_vocab_size
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner import cost


class _MetaTP:
    """A tensor-parallel context that only gives shapes (rank 0 of `size`): nothing runs on meta tensors."""

    def __init__(self, size: int, padded_vocab: int):
        self.rank, self.size, self.padded_vocab = 0, size, padded_vocab

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called on meta
        raise RuntimeError("a meta model is for counting, not running")

    gather_vocab = all_reduce


def meta_decoder(cfg: DecoderConfig, tp: int = 1, divisible_by: int = 128) -> Decoder:
    """One tensor-parallel rank's generation model, on the meta device (shapes only, no memory)."""
    parallel = _MetaTP(tp, padded_vocab_size(cfg.vocab_size, divisible_by, tp)) if tp > 1 else None
    with torch.device("meta"):
        return Decoder(cfg, parallel) if parallel else Decoder(cfg)


_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


def stage_numel(model: Decoder, stage: int, pp: int, ep: int = 1, vocab_rows: Optional[int] = None) -> int:
    """Parameters of pipeline stage `stage` of `pp`: the embedding first, whole layers, norm and head last.
    At `ep` > 1 an MoE layer keeps only the first expert-parallel rank's routed experts (the first
    experts / ep: megatron-core's block of rank 0), as a training rank holds them. `vocab_rows`: the
    embedding's and head's rows as a training rank holds them (megatron-core pads the vocabulary, which the
    generation model at one rank does not); default the model's own."""
    per = model.full_cfg.num_layers // pp
    held = model.full_cfg.num_experts // ep if ep > 1 else None

    def kept(name: str) -> bool:
        match = _EXPERT.match(name)
        return held is None or match is None or int(match[1]) < held
    total = sum(p.numel() for i, layer in enumerate(model.layers) if i // per == stage
                for name, p in layer.named_parameters() if kept(name))
    def rows(weight: torch.Tensor) -> int:
        return weight.numel() if vocab_rows is None else vocab_rows * weight.shape[1]
    if stage == 0:
        total += rows(model.embed.weight)
    if stage == pp - 1:
        total += model.norm.weight.numel() + (rows(model.lm_head.weight) if model.lm_head is not None else 0)
    return total


@dataclass(frozen=True)
class DryRun:
    layout: ParallelDims
    tg: int
    exact_params: list[int]  # per pipeline stage, on each TP rank (meta model)
    model_params: list[int]  # the cost model's figures for the same
    exact_transition: int  # the most bytes any rank receives in the reshard plan
    model_transition: float  # the cost model's formula
    plan_ranks: int
    ep: int = 1
    exact_expert_transition: float = 0.0  # ep > 1: (ep - 1) / ep of the bridge's expert tensors' bytes / tp
    model_expert_transition: float = 0.0  # the cost model's formula for the same

    def lines(self, dtype_bytes: int) -> list[str]:
        gib = 1024 ** 3
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        out = [f"dry-run, actor {self.layout}{ep} -> generation tg{self.tg} (meta-device Decoder"
               + (f", experts / {self.ep} per rank" if self.ep > 1 else "")
               + f", plan_reshard over {self.plan_ranks} ranks):"]
        for s, (exact, model) in enumerate(zip(self.exact_params, self.model_params)):
            out.append(f"  stage {s}: params per rank exact {exact:,} ({exact * dtype_bytes / gib:.2f} GiB), "
                       f"cost model {model:,} (diff {model - exact:+,})")
        out.append(f"  transition bytes per rank: exact {self.exact_transition:,} "
                   f"({self.exact_transition / gib:.2f} GiB), cost model {self.model_transition:,.0f} "
                   f"(ratio {self.model_transition / max(1, self.exact_transition):.4f})")
        if self.ep > 1:
            out.append(f"  expert-parallel gather before it, bytes per rank: from the bridge's expert tensors "
                       f"{self.exact_expert_transition:,.0f} ({self.exact_expert_transition / gib:.2f} GiB), "
                       f"cost model {self.model_expert_transition:,.0f}")
        return out


def dry_run(cfg: DecoderConfig, layout: ParallelDims, tg: int, dtype_bytes: int, divisible_by: int = 128,
            ep: int = 1) -> DryRun:
    """Exact parameter counts per rank and transition bytes per rank for the actor's layout (at `ep` > 1 the
    routed experts of one expert-parallel rank, and the experts' gather before the dense one).

    The plan is built for one training replica (dp = 1): with the paper's grouping a rank gathers only
    within its replica, so the bytes per rank do not depend on dp.
    """
    model = meta_decoder(cfg, layout.tp, divisible_by)
    rows = padded_vocab_size(cfg.vocab_size, divisible_by, layout.tp) // layout.tp
    exact = [stage_numel(model, s, layout.pp, ep, rows) for s in range(layout.pp)]
    estimate = [cost.stage_params(cfg, s, layout.tp, layout.pp, divisible_by, ep=ep) for s in range(layout.pp)]
    params = bridge_params(get_bridge(cfg, divisible_by, layout.tp), dtype_bytes)
    plan = plan_reshard(params, ParallelDims(tp=layout.tp, pp=layout.pp, dp=1), GenLayout(tg=tg))
    moved = max(plan.bytes_received(r) for r in range(plan.train.world_size))
    total = cost.total_params(cfg, divisible_by) * dtype_bytes
    experts = sum(p.nbytes for p in params if ".local_experts." in p.name) // layout.pp
    return DryRun(layout=layout, tg=tg, exact_params=exact, model_params=estimate, exact_transition=moved,
                  model_transition=cost.transition_bytes(total, layout.tp, layout.pp, tg),
                  plan_ranks=plan.train.world_size, ep=ep,
                  exact_expert_transition=(ep - 1) / ep * experts / layout.tp if ep > 1 else 0.0,
                  model_expert_transition=cost.expert_transition_bytes(cfg, layout.tp, ep, dtype_bytes, layout.pp))
