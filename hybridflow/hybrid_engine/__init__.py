"""The 3D-HybridEngine: the actor's weights in the generation layout (docs/design.md §3).

At tp = pp = 1 the generation model's parameters are views of the training
engine's parameters (`generation.py`): no copy, no communication, and every
optimizer step is visible to the next rollout. A sharded actor generates in
a `pg-tg` layout (`rollout.tg`, `rollout.grouping`) from a model the switch
refills after each update (`reshard.py`), as the reshard plan lays out
(`plan.py`, plain data), counting what each rank moves (`traffic.py`); the
tensor-parallel generator is the plain `Decoder` given its TP group
(`tensor_parallel.py`). Prompts reach the generation replicas, and responses
the training layout, through the worker's "generation" mesh
(`workers/rl_workers.py`). A rollout group placed apart is fed by the
training ranks' broadcasts over a process group spanning both groups, as
the sync plan lays out (`apart.py`, plain data; run by `weight_sync.py`).
"""
from hybridflow.hybrid_engine.generation import ViewWeights
from hybridflow.hybrid_engine.plan import GROUPINGS, GenLayout, ParamInfo, ReshardPlan, bridge_params, plan_reshard
from hybridflow.hybrid_engine.reshard import GroupedWeights, generation_weights
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.hybrid_engine.views import bind_parameters, generation_model

__all__ = ["GROUPINGS", "GroupedWeights", "GenLayout", "ParamInfo", "ReshardPlan", "Traffic", "ViewWeights",
           "bind_parameters", "bridge_params", "generation_model", "generation_weights", "plan_reshard"]
