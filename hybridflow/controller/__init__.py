"""The single controller's machinery: Ray set-up, resource pools, SPMD worker groups and dispatch.

- ray_setup.py: `init_ray` with settings that fit 2-core machines, or joining a cluster;
- resource_pool.py: `ResourcePool` (one process per device), `pools_from_placement(cfg)`
  (same device set = one shared pool, the hybrid layout; different sets = split placement);
- dispatch.py: the dispatch/collect modes (`Dispatch`) and `@register(mode)`;
- worker_group.py: `Worker`, `RayWorkerGroup` (Ray actors), `LocalWorkerGroup` (in-process
  or torchrun), `WorkerError`; `RoleGroup` + `remote` for typed views of a group;
- transfer.py: `ObjectHandle`, a value passed from one group to another through
  the object store by reference (e.g. actor weights to a separate rollout group).
"""
from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.ray_setup import init_ray
from hybridflow.controller.resource_pool import ResourcePool, pools_from_placement
from hybridflow.controller.transfer import ObjectHandle
from hybridflow.controller.worker_group import (LocalWorkerGroup, RayWorkerGroup, RoleGroup, Worker,
                                                WorkerContext, WorkerError, remote)

__all__ = ["Dispatch", "LocalWorkerGroup", "ObjectHandle", "RayWorkerGroup", "ResourcePool", "RoleGroup", "Worker",
           "WorkerContext", "WorkerError", "init_ray", "pools_from_placement", "register", "remote"]
