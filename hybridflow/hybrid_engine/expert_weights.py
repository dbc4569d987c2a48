"""The generation weights of an expert-parallel actor (parallel.ep > 1, tp = pp = 1): every rank generates with
all of a layer's experts, but trains only its own (`engine/experts.py`).

`ExpertGatheredWeights` builds the generation model once: every tensor but the experts, and this rank's own
experts, are views of the training parameters (an update is seen at once, as `ViewWeights`); the other ranks'
experts are buffers refilled after each update by one all-gather over the expert-parallel group. A rank then
receives (ep - 1) / ep of the model's expert bytes and sends its own to each of the ep - 1 peers
(docs/design.md, "Expert parallelism"; `reshard/bytes_received` counts it).
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.engine.distributed import expert_group
from hybridflow.engine.experts import expert_of
from hybridflow.hybrid_engine.generation import nbytes, transition_metrics
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.hybrid_engine.views import generation_model

__all__ = ["AllExperts", "ExpertGatheredWeights"]


class AllExperts:
    """`engine` as if it held every expert: `named_params` under global names, another rank's experts as
    buffers (refilled by `gather`). Any other attribute is the engine's own."""

    def __init__(self, engine):
        self.engine, self.shard = engine, engine.experts
        own = engine.named_params()
        self.buffers: dict[str, Tensor] = {}
        for name, p in own.items():
            j = expert_of(name)
            if j is None:
                continue
            for rank in range(self.shard.ep):
                if rank != self.shard.first // self.shard.count:
                    other = self.shard.global_name(name).replace(
                        f".local_experts.{j + self.shard.first}.", f".local_experts.{j + rank * self.shard.count}.")
                    self.buffers[other] = torch.empty_like(p).requires_grad_(False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def named_params(self) -> dict[str, Tensor]:
        own = {self.shard.global_name(k): v for k, v in self.engine.named_params().items()}
        return {**own, **self.buffers}

    def generation_state(self) -> dict[str, Tensor]:
        return self.engine.bridge.megatron_to_generation(self.named_params())

    @torch.no_grad()
    def gather(self, traffic: Traffic) -> None:
        """Every other rank's experts into the buffers: one all-gather per expert tensor over the group."""
        group = expert_group(self.shard.ep)
        ranks = self.shard.ep
        for name, p in self.engine.named_params().items():
            j = expert_of(name)
            if j is None:
                continue
            pieces = [torch.empty_like(p) for _ in range(ranks)]
            dist.all_gather(pieces, p.detach().contiguous(), group=group)
            size = p.numel() * p.element_size()
            traffic.add(size * (ranks - 1), size * (ranks - 1))
            for rank, piece in enumerate(pieces):
                other = self.shard.global_name(name).replace(
                    f".local_experts.{j + self.shard.first}.", f".local_experts.{j + rank * self.shard.count}.")
                if other in self.buffers:
                    self.buffers[other].copy_(piece)


class ExpertGatheredWeights:
    """Generation weights of an ep > 1 engine at tp = pp = 1 (module doc); every rank generates its own rows."""

    def __init__(self, engine):
        self.source = AllExperts(engine)
        self.source.gather(Traffic())
        self.model = generation_model(self.source)
        self.mesh = (engine.rank, engine.layout.world_size, True)  # (replica, replicas, answers)

    def release(self) -> None:
        """Nothing to free: the gathered experts stay bound to the generation model."""

    def refresh(self) -> dict[str, float]:
        start, traffic = time.perf_counter(), Traffic()
        self.source.gather(traffic)
        metrics = transition_metrics(traffic, self.model, time.perf_counter() - start)
        metrics["reshard/expert_bytes_gathered"] = float(nbytes(self.source.buffers.values()))
        return metrics
