"""The 3D-HybridEngine: the actor's weights in the generation layout (docs/design.md §3).

At tp = pp = 1 the generation model's parameters are views of the training
engine's parameters: no copy, no communication, and every optimizer step is
visible to the next rollout. A sharded actor (tp or pp > 1) generates at
tg = pg = 1 from a whole model every rank gathers after each update
(`generation.py`, the full-gather baseline); the grouped reshard of the
3D-HybridEngine is to replace it. Built so far towards that: the reshard
plan as data (`plan.py`) and a tensor-parallel generator (`tensor_parallel.py`
gives the plain `Decoder` its TP group); the executor that gathers into
generation buffers, and the trainer at tg > 1, are not built yet.
"""
from hybridflow.hybrid_engine.generation import GatheredWeights, ViewWeights, generation_weights
from hybridflow.hybrid_engine.plan import GROUPINGS, GenLayout, ParamInfo, ReshardPlan, bridge_params, plan_reshard
from hybridflow.hybrid_engine.views import bind_parameters, generation_model

__all__ = ["GROUPINGS", "GatheredWeights", "GenLayout", "ParamInfo", "ReshardPlan", "ViewWeights", "bind_parameters",
           "bridge_params", "generation_model", "generation_weights", "plan_reshard"]
