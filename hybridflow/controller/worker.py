"""Workers: the plain classes a worker group runs, one per device, and how their failures are reported.

    class Doubler(Worker):
        def __init__(self, scale):
            self.init_process_group()          # one torch.distributed group per worker group
            self.scale = scale

        @register(Dispatch.DP_SPLIT)
        def forward(self, batch):              # sees only its rank's rows
            return {"y": batch["x"] * self.scale}

    group = RayWorkerGroup(Doubler, ResourcePool([0, 1], "cpu"), 2)
    out = group.call(Doubler.forward, {"x": torch.arange(8)})   # chunks out, results concatenated back
    group.shutdown()

`Worker` is a plain class. Before its `__init__` runs, the group hands it a
`WorkerContext` (rank, world size, master address and port) and exports it as
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, with
CUDA_VISIBLE_DEVICES="" on CPU, so `init_process_group()`
(`hybridflow.parallel.process_group`, which the engine uses too) forms the
group's process group (gloo on CPU, NCCL on GPU). Methods tagged
`@register(mode)` are what `group.call(Worker.method, ...)` may run
(`hybridflow.controller.group`).

A rank that fails surfaces on the controller as `WorkerError`, naming the rank
and method and carrying the worker's traceback text; `first_os_error` digs the
OSError (e.g. a full disk) out of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hybridflow.controller.dispatch import MeshCoord


DIED = "its worker process died"  # WorkerError.reason of a rank whose process is gone (ray_group.py)


class WorkerError(RuntimeError):
    """A rank of a worker group failed; `rank`, `method` and the worker-side `traceback` text.

    os_error: (errno, strerror, filename) of the first OSError in the worker's chain of causes, if any,
    so the controller can say "No space left on device: FILE" without parsing the traceback.
    """

    def __init__(self, rank: int, method: str, reason: str, traceback_text: str = "",
                 os_error: Optional[tuple] = None):
        self.rank, self.method, self.reason, self.traceback = rank, method, reason, traceback_text
        self.os_error = os_error
        message = f"rank {rank} failed in {method}: {reason}"
        if traceback_text:
            message += f"\n--- on rank {rank} ---\n{traceback_text.rstrip()}"
        super().__init__(message)

    def __reduce__(self):
        return WorkerError, (self.rank, self.method, self.reason, self.traceback, self.os_error)


def first_os_error(exc: Optional[BaseException], errnos: Optional[tuple] = None) -> Optional[tuple]:
    """(errno, strerror, filename) of the first OSError in `exc`'s chain of causes, or the first a WorkerError
    in it recorded from its worker; only errors whose errno is in `errnos`, when given."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = ((exc.errno, exc.strerror, None if exc.filename is None else str(exc.filename))
                 if isinstance(exc, OSError) else getattr(exc, "os_error", None))
        if found is not None and found[0] is not None and (errnos is None or found[0] in errnos):
            return found
        exc = exc.__cause__ or exc.__context__
    return None


@dataclass(frozen=True)
class WorkerContext:
    """Where one worker sits in its group; exported as the torchrun-style environment."""

    rank: int
    world_size: int
    local_rank: int  # on GPU always 0: Ray shows each actor only its own GPU
    master_addr: str
    master_port: int
    device: str  # "cpu" | "cuda"

    def env(self) -> dict[str, str]:
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # megatron-core on CPU must not see a GPU
        return env


class Worker:
    """Base of the classes a worker group runs; `context`, `rank`, `world_size` are set before `__init__`.

    (No `device` attribute here: role classes commonly keep their own torch device under that name.)
    """

    _context: Optional[WorkerContext] = None
    _meshes: Optional[dict[str, MeshCoord]] = None

    @property
    def context(self) -> WorkerContext:
        if self._context is None:
            raise RuntimeError(f"{type(self).__name__} was created outside a worker group: it has no rank; "
                               "create it through RayWorkerGroup or LocalWorkerGroup")
        return self._context

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def register_mesh(self, name: str, dims: Any) -> None:
        """Serve DP_SPLIT methods registered with `mesh=name` as this rank's place in layout `dims`.

        dims: a `hybridflow.parallel.ParallelDims` over this group's ranks;
        the rank gets the rows of its data-parallel replica, and the replica's
        last-stage TP-rank-0 answers for it.
        """
        if dims.world_size != self.world_size:
            raise ValueError(f"mesh {name!r}: layout {dims} has {dims.world_size} ranks, this group "
                             f"{self.world_size}")
        self.register_replica(name, dims.coord(self.rank).dp, dims.dp, dims.answers_for_replica(self.rank))

    def register_replica(self, name: str, replica: int, replicas: int, answers: bool) -> None:
        """Serve mesh `name` as a rank of replica `replica` (of `replicas`), answering for it or not:
        for meshes that are not a training layout (e.g. the generation layout of the 3D-HybridEngine)."""
        if self._meshes is None:
            self._meshes = {}
        self._meshes[name] = MeshCoord(replica, replicas, answers)

    def mesh_coords(self) -> dict[str, MeshCoord]:
        return dict(self._meshes or {})

    def init_process_group(self):
        """Join this group's torch.distributed world (idempotent); returns the WORLD group."""
        import torch.distributed as dist

        from hybridflow.parallel.process_group import init_process_group

        init_process_group(self.context.device)
        return dist.group.WORLD


def construct_worker(worker_cls: type, context: WorkerContext, args: tuple, kwargs: dict) -> Worker:
    """Instantiate with the context in place, so `__init__` can already use `self.rank`."""
    worker = worker_cls.__new__(worker_cls)
    worker._context = context
    worker.__init__(*args, **kwargs)
    return worker
