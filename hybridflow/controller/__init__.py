"""The single controller's machinery: Ray set-up, resource pools, SPMD worker groups and dispatch.

- ray_setup.py: `init_ray` with settings that fit 2-core machines, or joining a cluster;
- resource_pool.py: `ResourcePool` (one process per device), `pools_from_placement(placement, device)`
  (same device set = one shared pool, the hybrid layout; different sets = split placement);
- dispatch.py: the dispatch/collect modes (`Dispatch`) and `@register(mode)`;
- worker.py: `Worker`, the class a group runs on each device; `WorkerContext`, `WorkerError`;
- group.py: `WorkerGroup`, what both groups share (`call` under the dispatch modes, meshes);
  `RoleGroup` + `remote` for typed views of a group;
- ray_group.py: `RayWorkerGroup`, one Ray actor per device;
- ray_nodes.py: which Ray node each rank runs on; naming a node that left the cluster mid-run;
- local_group.py: `LocalWorkerGroup`, in-process or this rank's share under torchrun;
- warm_hosts.py: `keep_processes_warm`, worker processes of a group that shut down cleanly kept for the
  next group of the same kind (a driver running jobs in turn: sweeps, notebooks, tests);
- transfer.py: `ObjectHandle`, a value passed from one group to another through
  the object store by reference (e.g. actor weights to a separate rollout group).
"""
from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.group import RoleGroup, remote
from hybridflow.controller.local_group import LocalWorkerGroup
from hybridflow.controller.ray_group import RayWorkerGroup
from hybridflow.controller.ray_setup import init_ray
from hybridflow.controller.resource_pool import ResourcePool, pools_from_placement
from hybridflow.controller.transfer import ObjectHandle
from hybridflow.controller.warm_hosts import keep_processes_warm
from hybridflow.controller.worker import Worker, WorkerContext, WorkerError

__all__ = ["Dispatch", "LocalWorkerGroup", "ObjectHandle", "RayWorkerGroup", "ResourcePool", "RoleGroup", "Worker",
           "WorkerContext", "WorkerError", "init_ray", "keep_processes_warm", "pools_from_placement", "register",
           "remote"]
