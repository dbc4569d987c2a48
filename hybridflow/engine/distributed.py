"""Process-group and Megatron parallel-state set-up for one SPMD process.

A process joins `torch.distributed` (gloo on CPU, NCCL on GPU) from the
usual torchrun / controller environment (`RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`), or as a world of one when none is set, and
then initialises megatron-core's model-parallel groups for a layout. Nothing
here assumes a world of one: the rank and sizes always come from the
process group.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.config.schema import ParallelConfig


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(device: str = "cpu") -> None:
    """Join the job's process group once (idempotent)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        return
    # A single process run directly (demo, tests): a world of one. The
    # address is not exported, so child processes cannot collide with it.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def init_model_parallel(parallel: ParallelConfig, device: str = "cpu") -> Layout:
    """Initialise megatron-core's TP/PP/CP/DP groups for `parallel` (idempotent per layout)."""
    from megatron.core import parallel_state as ps

    init_process_group(device)
    world = dist.get_world_size()
    size = parallel.tp * parallel.pp * parallel.cp
    if world % size:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {size}")
    if parallel.sequence_parallel and device == "cpu":
        raise ValueError("sequence_parallel is not supported on CPU (see DESIGN.md §4)")
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
