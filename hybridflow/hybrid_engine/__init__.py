"""The 3D-HybridEngine: the actor's weights in the generation layout (docs/design.md §3).

At tp = pp = 1 the generation model's parameters are views of the training
engine's parameters: no copy, no communication, and every optimizer step is
visible to the next rollout. A sharded actor (tp or pp > 1) generates at
tg = pg = 1 from a whole model every rank gathers after each update
(`generation.py`, the full-gather baseline); the grouped reshard plan of the
3D-HybridEngine is to replace it.
"""
from hybridflow.hybrid_engine.generation import GatheredWeights, ViewWeights, generation_weights
from hybridflow.hybrid_engine.views import bind_parameters, generation_model

__all__ = ["GatheredWeights", "ViewWeights", "bind_parameters", "generation_model", "generation_weights"]
