"""Megatron parallel-state set-up for one SPMD process.

The process joins `torch.distributed` (`hybridflow.parallel.process_group`)
and then initialises megatron-core's model-parallel groups for a layout.
Nothing here assumes a world of one: the rank and sizes always come from the
process group. The layout was checked against the device count and the
model when the config was validated (`config/validate.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hybridflow.config.schema import ParallelConfig
from hybridflow.parallel.process_group import init_process_group

__all__ = ["Layout", "destroy", "init_model_parallel", "init_process_group"]


@dataclass(frozen=True)
class Layout:
    """Where this process sits: ranks and sizes of its Megatron groups."""

    world: int
    rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int


def init_model_parallel(parallel: ParallelConfig, device: str = "cpu") -> Layout:
    """Initialise megatron-core's TP/PP/CP/DP groups for `parallel` (idempotent per layout)."""
    from megatron.core import parallel_state as ps

    init_process_group(device)
    world = dist.get_world_size()
    size = parallel.tp * parallel.pp * parallel.cp
    if world % size:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {size}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size())
        if have != (parallel.tp, parallel.pp, parallel.cp):
            raise ValueError(f"this process already runs layout tp,pp,cp={have}; "
                             f"a second engine asked for {(parallel.tp, parallel.pp, parallel.cp)}")
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
            virtual_pipeline_model_parallel_size=parallel.virtual_pp)
    return Layout(world=world, rank=dist.get_rank(), tp=parallel.tp, pp=parallel.pp, cp=parallel.cp,
                  dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                  pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def destroy() -> None:
    """Tear down Megatron's groups and the process group (end of a job or test)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
