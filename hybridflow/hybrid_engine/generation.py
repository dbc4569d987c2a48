"""The actor's generation model at tp = pp = 1, and the figures every switch to generation reports.

`ViewWeights` (tp = pp = 1): the generation model's parameters *are* views of
the engine's parameters. No transfer; every optimizer step is visible to the
next rollout. A sharded actor generates from a model the 3D-HybridEngine
refills after each update (`reshard.GroupedWeights`); both answer `refresh()`
with the transition's figures (`reshard/*` metrics), so the trainer reports
them the same way whichever runs, and both say which generation replica this
rank serves (`mesh`: replica index, replica count, whether it answers).
"""
from __future__ import annotations

from torch import nn

from hybridflow.engine import MegatronEngine
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.hybrid_engine.views import generation_model


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def transition_metrics(traffic: Traffic, model: nn.Module, seconds: float) -> dict[str, float]:
    """The `reshard/*` figures of one switch to generation: what this rank received and sent, the
    collectives it joined, the generation weights it holds, and the wall time."""
    return {"reshard/bytes_received": float(traffic.bytes_received), "reshard/bytes_sent": float(traffic.bytes_sent),
            "reshard/collectives": float(traffic.collectives),
            "reshard/peak_bytes": float(nbytes(model.parameters())), "reshard/time_s": seconds}


class ViewWeights:
    """Generation weights that are views of a tp = pp = 1 engine; every rank generates its own rows."""

    def __init__(self, engine: MegatronEngine):
        self.model = generation_model(engine)
        self.mesh = (engine.rank, engine.layout.world_size, True)  # (replica, replicas, answers)

    def release(self) -> None:
        """Nothing to free: the views are the training weights."""

    def refresh(self) -> dict[str, float]:
        """Nothing to move: the views already hold the trained weights."""
        return transition_metrics(Traffic(), self.model, 0.0)
