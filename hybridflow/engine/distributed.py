"""Megatron parallel-state set-up for one SPMD process.

The process joins `torch.distributed` (`hybridflow.parallel.process_group`)
and then initialises megatron-core's model-parallel groups for a layout.
Nothing here assumes a world of one: the rank and sizes always come from the
process group. The layout was checked against the device count and the
model when the config was validated (`config/validate.py`); the layout this
returns is the `ParallelDims` the rest of the run uses (the run plan's, when
one is given), so no second description of where a rank sits exists.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from hybridflow.config.schema import ParallelConfig
from hybridflow.parallel.layout import ParallelDims
from hybridflow.parallel.process_group import init_process_group, leave_process_group, on_leave

__all__ = ["destroy", "init_model_parallel", "init_process_group"]


def init_model_parallel(parallel: ParallelConfig, device: str = "cpu",
                        layout: Optional[ParallelDims] = None) -> ParallelDims:
    """Initialise megatron-core's TP/PP/CP/DP groups for `parallel` (idempotent per layout); returns the
    layout over the process group's world.

    layout: the run plan's layout for this role; it must be the one the world and `parallel`'s degrees
        make (else ValueError). This rank's coordinates in it are megatron-core's own ranks (checked).
    """
    from megatron.core import parallel_state as ps

    init_process_group(device)
    dims = ParallelDims.for_world(dist.get_world_size(), tp=parallel.tp, pp=parallel.pp, cp=parallel.cp)
    if layout is not None and layout != dims:
        raise ValueError(f"the run plan's layout {layout} is not the {dims} of this world and {parallel}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size())
        have += (ps.get_virtual_pipeline_model_parallel_world_size() or 1, ps.get_expert_model_parallel_world_size())
        want = (parallel.tp, parallel.pp, parallel.cp, parallel.virtual_pp or 1, parallel.ep)
        if have != want:
            raise ValueError(f"this process already runs layout tp,pp,cp,virtual_pp,ep={have}; a second engine "
                             f"asked for {want}")
    else:
        on_leave(_destroy_megatron_groups)  # a process kept for another job may get another layout
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
            virtual_pipeline_model_parallel_size=parallel.virtual_pp if (parallel.virtual_pp or 1) > 1 else None)
    here = dims.coord(dist.get_rank())
    megatron = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    if (here.tp, here.pp, here.dp, dims.dp) != megatron:
        raise RuntimeError(f"rank {dist.get_rank()} sits at {here} of {dims}, but megatron-core gives it "
                           f"tp, pp, dp rank and dp size {megatron}")
    return dims


def _destroy_megatron_groups() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def destroy() -> None:
    """Tear down Megatron's groups and the process group (end of a job or test)."""
    _destroy_megatron_groups()
    leave_process_group()


def expert_parallel_rank(ep: int) -> int:
    """This rank's place in its expert-parallel group (0 at ep = 1)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() if ep > 1 else 0


def expert_group(ep: int):
    """The expert-parallel group (ranks holding one layer's experts between them); None at ep = 1."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_group() if ep > 1 else None


def all_reduced(t, group, op=None):
    """`t` reduced over `group` (a sum unless `op` says otherwise), as a new tensor where the group has more
    than one rank; `t` itself where it has one."""
    if dist.get_world_size(group) == 1:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return t
