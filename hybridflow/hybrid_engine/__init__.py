"""The 3D-HybridEngine: the actor's weights in the generation layout (docs/design.md §3).

At tp = pp = 1 the generation model's parameters are views of the training
engine's parameters: no copy, no communication, and every optimizer step is
visible to the next rollout. Multi-rank layouts add the reshard plan here.
"""
from hybridflow.hybrid_engine.views import bind_parameters, generation_model

__all__ = ["bind_parameters", "generation_model"]
