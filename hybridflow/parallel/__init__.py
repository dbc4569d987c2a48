"""Parallel layouts as plain data, and joining a process group.

A leaf package: the controller, the engine, the workers and the config checks
all import it, and it imports none of them. `ParallelDims` maps ranks to
coordinates and names the groups; `init_process_group` joins the job's
torch.distributed world (gloo on CPU, NCCL on GPU); `cp_split` holds context
parallelism's load-balanced sequence split (pure tensor functions).
"""
from hybridflow.parallel.layout import Coord, ParallelDims
from hybridflow.parallel.process_group import init_process_group

__all__ = ["Coord", "ParallelDims", "init_process_group"]
