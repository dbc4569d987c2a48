"""The 3D-HybridEngine: the actor's weights in the generation layout (docs/design.md §3), and their one owner.

At tp = pp = 1 the generation model's parameters are views of the training
engine's parameters (`generation.py`): no copy, no communication, and every
optimizer step is visible to the next rollout. A sharded actor generates in
a `pg-tg` layout (`rollout.tg`, `rollout.grouping`) from a model the switch
refills after each update (`reshard.py`), as the reshard plan lays out
(`plan.py`, plain data), counting what each rank moves (`traffic.py`); the
tensor-parallel generator is the plain `Decoder` given its TP group
(`tensor_parallel.py`). A rollout group placed apart is fed by the training
ranks' broadcasts over a process group spanning both groups, as the sync
plan lays out (`apart.py`, plain data; run by `weight_sync.py`).

Which of these routes a run's weights take is one strategy object
(`rollout_weights.py`: lock step, apart, streamed off-policy), chosen when the
run is built; its worker-side half (`worker_weights.py`) runs in the ranks.

The names below load their module on first use, so the torch-free strategies
(`rollout_weights.py`) import without torch or megatron-core.
"""
from importlib import import_module

_HOMES = {"ViewWeights": "generation", "GROUPINGS": "plan", "GenLayout": "plan", "ParamInfo": "plan",
          "ReshardPlan": "plan", "bridge_params": "plan", "plan_reshard": "plan", "GroupedWeights": "reshard",
          "generation_weights": "reshard", "Traffic": "traffic", "bind_parameters": "views",
          "generation_model": "views"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
