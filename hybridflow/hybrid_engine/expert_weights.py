"""The generation weights of an expert-parallel actor (parallel.ep > 1): every rank generates with
all of a layer's experts, but trains only its own (`engine/experts.py`).

`AllExperts` is the engine as if it held every expert: its own tensors as they are, the other expert-parallel
ranks' experts (at this rank's TP shard: a rank's expert-parallel peers share its TP rank) as buffers refilled
after each update by one all-gather per expert tensor over the expert-parallel group. `ExpertGatheredWeights`
runs a route's own generation weights on it: views at tp = pp = 1 (every tensor but the other ranks' experts is
a view of the training parameters, seen at once after an update), the 3D-HybridEngine's grouped gather at
tp > 1 or pp > 1 (each stage's experts gathered over its own expert-parallel group). A rank receives (ep - 1) / ep
of its TP shard of its stage's expert bytes before the route's own
transfer (docs/design.md, "Expert parallelism"; `reshard/bytes_received` counts both).
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from hybridflow.engine.experts import ExpertShard, expert_of
from hybridflow.hybrid_engine.generation import nbytes, transition_metrics
from hybridflow.hybrid_engine.traffic import Traffic

__all__ = ["AllExperts", "ExpertGatheredWeights"]


class AllExperts:
    """`engine` as if it held every expert: `named_params` under global names, another rank's experts as
    buffers (refilled by `gather`). Any other attribute is the engine's own."""

    def __init__(self, engine):
        self.engine, self.shard = engine, engine.experts
        self.experts = ExpertShard(engine.cfg.num_experts, 1, 0)  # holds every expert now (routes treat it so)
        self.buffers: dict[str, Tensor] = {}
        for name, p in engine.named_params().items():
            if expert_of(name) is not None:  # `name`: this rank's local spelling, the same on every peer
                for rank in range(self.shard.ep):
                    if rank != self.shard.rank:
                        self.buffers[self.shard.peer(rank).global_name(name)] = torch.empty_like(p)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def named_params(self) -> dict[str, Tensor]:
        own = {self.shard.global_name(k): v for k, v in self.engine.named_params().items()}
        return {**own, **self.buffers}

    def generation_state(self) -> dict[str, Tensor]:
        return self.engine.bridge.megatron_to_generation(self.named_params())

    def stage_entries(self) -> list[tuple[Any, str]]:
        """(bridge entry, name in `named_params`) of every tensor on this stage, every expert's included (layers
        numbered per stage, experts globally)."""
        return self.engine.stage_entries(self.named_params().keys(), self.experts)

    @torch.no_grad()
    def gather(self, traffic: Traffic) -> None:
        """Every other rank's experts into the buffers (`MegatronEngine.exchanged_experts`)."""
        own = {k: v for k, v in self.named_params().items() if k not in self.buffers}
        for name, piece in self.engine.exchanged_experts(own, traffic).items():
            self.buffers[name].copy_(piece)


class ExpertGatheredWeights:
    """Generation weights of an ep > 1 engine (module doc): `inner(AllExperts(engine))`, the route's own weights
    (views, or the grouped gather at tp > 1), after the experts' gather on each refresh."""

    def __init__(self, engine, inner):
        self.source = AllExperts(engine)
        self.source.gather(Traffic())
        self.inner = inner(self.source)
        self.model, self.mesh = self.inner.model, self.inner.mesh

    def release(self) -> None:
        """The route's own release (nothing for views; the experts' buffers stay, bound to the model)."""
        self.inner.release()

    def refresh(self) -> dict[str, float]:
        start, traffic = time.perf_counter(), Traffic()
        self.source.gather(traffic)
        seconds = time.perf_counter() - start
        metrics = self.inner.refresh()
        for key, value in transition_metrics(traffic, self.model, seconds).items():
            if key != "reshard/peak_bytes":
                metrics[key] = metrics.get(key, 0.0) + value
        metrics["reshard/expert_bytes_gathered"] = float(nbytes(self.source.buffers.values()))
        return metrics
