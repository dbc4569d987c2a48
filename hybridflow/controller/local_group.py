"""`LocalWorkerGroup`: the Ray-free worker group.

In a plain process it is a world of one that calls the worker in-process (for
debugging: breakpoints work). Launched by `torchrun`, every rank runs the
controller code itself (SPMD driver) and holds one worker: rank and world come
from RANK / WORLD_SIZE, a call runs this rank's share (its DP_SPLIT chunk, its
ALL_TO_ALL element) and the results of all ranks are gathered with
`all_gather_object`, so every rank gets what a Ray controller would. A failing
rank raises on its own; torchrun then stops the others. Call `shutdown()` on
every rank before exiting.
"""
from __future__ import annotations

import os
import threading
import traceback
from typing import Any, Callable, Optional

from hybridflow.controller.dispatch import Dispatch, collect, dispatch, shipped_bytes
from hybridflow.controller.group import WorkerGroup
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import Worker, WorkerContext, WorkerError, construct_worker, first_os_error


def _context_from_env(pool: ResourcePool) -> WorkerContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != pool.world_size:
        raise ValueError(f"{pool!r} has {pool.world_size} device(s) but this job runs {world} process(es) "
                         "(WORLD_SIZE); launch one process per device, e.g. torchrun --nproc-per-node "
                         f"{pool.world_size}")
    rank = int(os.environ.get("RANK", "0"))
    return WorkerContext(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", str(rank))),
                         master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         master_port=int(os.environ.get("MASTER_PORT", "0")), device=pool.device)


# One worker call at a time in this process, as a Ray actor runs its calls: the async DataFlow's stage
# threads take turns on the models here (generation and log-probs never run at once on one model).
_LOCAL_CALLS = threading.RLock()


class LocalWorkerGroup(WorkerGroup):
    """The Ray-free group: a world of one in-process, or this rank's share of a torchrun job.

    pool: the devices of the job (default: one per WORLD_SIZE process, on CPU);
        its size must equal WORLD_SIZE (1 when unset).
    """

    def __init__(self, worker_cls: type, pool: Optional[ResourcePool] = None, *args, **kwargs):
        if pool is None:
            pool = ResourcePool(list(range(int(os.environ.get("WORLD_SIZE", "1")))), "cpu")
        self._process_group = None
        self._owns_process_group = False
        self._worker: Optional[Worker] = None
        super().__init__(worker_cls, pool)
        self._context = _context_from_env(pool)
        if pool.device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if self.world_size > 1:  # results are all-gathered over the job's world
            import torch.distributed as dist

            from hybridflow.parallel.process_group import init_process_group

            self._owns_process_group = not dist.is_initialized()
            init_process_group(pool.device)
            self._process_group = dist.group.WORLD
        self._worker = self._run("__init__", lambda: construct_worker(worker_cls, self._context, args, kwargs))
        self._set_meshes(self._all_ranks(self._worker.mesh_coords()))

    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def alive(self) -> bool:
        return self._worker is not None

    def _run(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise WorkerError(self.rank, name, f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                              first_os_error(exc)) from exc

    def _all_ranks(self, value: Any) -> list:
        """`value` from every rank of the job, in rank order (a world of one: just this one)."""
        if self._process_group is None:
            return [value]
        import torch.distributed as dist

        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, value, group=self._process_group)
        return results

    def _call(self, name: str, mode: Dispatch, args: tuple, kwargs: dict) -> Any:
        if self._worker is None:
            raise RuntimeError(f"{self!r} has been shut down")
        mesh = self._mesh_of(name, mode)
        per_rank = dispatch(mode, self.world_size, args, kwargs, mesh)
        self.shipped_bytes += shipped_bytes(per_rank)
        rank_args, rank_kwargs = per_rank[self.rank]
        with _LOCAL_CALLS:
            out = self._run(name, lambda: getattr(self._worker, name)(*rank_args, **rank_kwargs))
        if not mesh[self.rank].answers:
            out = None  # a peer of the answering rank: its copy is not sent
        return collect(mode, self._all_ranks(out), mesh)

    def shutdown(self) -> None:
        """Drop the worker; tear down the process group if this group created it.

        Under torchrun call it on every rank before exiting: a rank that exits
        with gloo still connected to a peer can abort the peer.
        """
        self._worker = None
        if self._owns_process_group:
            import torch.distributed as dist

            dist.barrier(group=self._process_group)
            dist.destroy_process_group()
            self._owns_process_group, self._process_group = False, None
