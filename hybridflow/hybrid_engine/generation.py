"""The actor's generation model at tg = pg = 1, and how it follows the training weights.

Two ways, chosen by the training layout:

- `ViewWeights` (tp = pp = 1): the generation model's parameters *are* views
  of the engine's parameters. No transfer; every optimizer step is visible
  to the next rollout.
- `GatheredWeights` (tp or pp > 1): every rank holds the whole model in the
  generation layout, refreshed after each update by a full gather of the
  training shards (`MegatronEngine.full_state`: TP all-gathers, then one
  broadcast per pipeline stage). This is the DeepSpeed-Chat-style baseline:
  each rank receives `(t*p - 1) / (t*p)` of the model and holds all of it;
  the 3D-HybridEngine's grouped reshard replaces it.

Both answer `refresh()` with the transition's figures (`reshard/*` metrics),
so the trainer reports them the same way whichever runs.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from hybridflow.engine.megatron import MegatronEngine, Traffic
from hybridflow.hybrid_engine.views import generation_model
from hybridflow.models.decoder import Decoder


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def transition_metrics(traffic: Traffic, model: nn.Module, seconds: float) -> dict[str, float]:
    """The `reshard/*` figures of one switch to generation: what this rank received, the collectives it
    joined, the generation weights it holds, and the wall time."""
    return {"reshard/bytes_received": float(traffic.bytes_received), "reshard/collectives": float(traffic.collectives),
            "reshard/peak_bytes": float(nbytes(model.parameters())), "reshard/time_s": seconds}


class ViewWeights:
    """Generation weights that are views of a tp = pp = 1 engine."""

    def __init__(self, engine: MegatronEngine):
        self.model = generation_model(engine)

    def refresh(self) -> dict[str, float]:
        """Nothing to move: the views already hold the trained weights."""
        return transition_metrics(Traffic(), self.model, 0.0)


class GatheredWeights:
    """A whole generation model on every rank, refilled from a sharded engine by a full gather."""

    def __init__(self, engine: MegatronEngine):
        self.engine = engine
        self.model = Decoder(engine.cfg).to(device=engine._torch_device(), dtype=engine.dtype).eval()
        self.model.requires_grad_(False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> dict[str, float]:
        """Copy the engine's current weights in (every rank of the engine must call it)."""
        start = time.perf_counter()
        traffic = Traffic()
        weights = self.engine.bridge.megatron_to_generation(self.engine.full_state(traffic))
        for name, param in self.model.named_parameters():
            param.copy_(weights[name])
        return transition_metrics(traffic, self.model, time.perf_counter() - start)


def generation_weights(engine: MegatronEngine) -> ViewWeights | GatheredWeights:
    """Views at tp = pp = 1, else the full gather."""
    if engine.layout.tp == 1 and engine.parallel.pp == 1:
        return ViewWeights(engine)
    return GatheredWeights(engine)
