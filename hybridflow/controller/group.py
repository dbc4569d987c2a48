"""What every worker group shares, and typed views of a group for the controller.

`WorkerGroup` is the base of the two transports, which have one interface
(pick one when the flow is built):

- `RayWorkerGroup` (`ray_group.py`): one Ray actor per device of a pool;
- `LocalWorkerGroup` (`local_group.py`): no Ray; a world of one in-process, or
  this rank's share of a torchrun job.

`group.call(Worker.method, ...)` runs a method tagged `@register(mode)` on
every rank; it dispatches per `hybridflow.controller.dispatch`. A `RoleGroup`
subclass names the methods a controller calls as typed attributes
(`forward = remote(Doubler.forward)`), so `update_actor` can be followed from
the trainer to the worker.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Concatenate, Optional, ParamSpec, Sequence, TypeVar

from hybridflow.controller.dispatch import (Dispatch, MeshCoord, call_batch, check_mesh, flat_mesh, method_mesh,
                                            registered_methods, strip_padding, tensor_bytes)
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import DIED, Worker


class WorkerGroup:
    """What both groups share: calling registered worker methods under their dispatch modes."""

    world_size: int

    def __init__(self, worker_cls: type, pool: ResourcePool):
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"worker groups run subclasses of Worker, got {worker_cls!r}")
        self.worker_cls, self.pool = worker_cls, pool
        self.world_size = pool.world_size
        self._modes = registered_methods(worker_cls)
        self._meshes: dict[str, list[MeshCoord]] = {}
        self.shipped_bytes = 0  # tensor bytes the calls so far delivered to the ranks (each transport counts)
        self.received_bytes = 0  # tensor bytes the calls' answers brought back to the caller (the driver)

    def _set_meshes(self, per_rank: list[dict[str, MeshCoord]]) -> None:
        """Every rank's registered mesh coordinates (rank order), checked to form whole replicas."""
        names = {name for coords in per_rank for name in coords}
        for name in names:
            missing = [rank for rank, coords in enumerate(per_rank) if name not in coords]
            if missing:
                raise ValueError(f"{self.worker_cls.__name__}: rank(s) {missing} did not register mesh {name!r}")
            check_mesh(name, [coords[name] for coords in per_rank])
        self._meshes = {name: [coords[name] for coords in per_rank] for name in names}

    def mesh(self, name: str) -> list[MeshCoord]:
        """The ranks' coordinates in a registered mesh, in rank order."""
        if name not in self._meshes:
            raise KeyError(f"{self.worker_cls.__name__} registered no mesh {name!r} (has {sorted(self._meshes)}); "
                           "call self.register_mesh(name, dims) in its __init__")
        return self._meshes[name]

    def _mesh_of(self, name: str, mode: Dispatch) -> list[MeshCoord]:
        """The mesh a call follows: the method's, for DP_SPLIT; else every rank answers."""
        mesh = method_mesh(getattr(self.worker_cls, name))
        return self.mesh(mesh) if mode is Dispatch.DP_SPLIT and mesh is not None else flat_mesh(self.world_size)

    def call(self, method: Callable | str, *args, **kwargs) -> Any:
        """Run a `@register`-ed worker method on every rank, dispatched by its mode.

        `method` is the worker class's function (`group.call(Doubler.forward,
        batch)`: a reader and an IDE follow it to the code that runs) or its
        name.
        """
        name = method if isinstance(method, str) else method.__name__
        mode = self._modes.get(name)
        if mode is None:
            raise AttributeError(f"{self.worker_cls.__name__}.{name} is not a method registered with "
                                 f"@register(...); registered: {sorted(self._modes)}")
        if not isinstance(method, str) and getattr(self.worker_cls, name, None) is not method:
            raise TypeError(f"{method.__qualname__} is not a method of {self.worker_cls.__name__}")
        real = None
        if mode is Dispatch.DP_SPLIT:  # only the fields the method reads; padded to equal shares
            replicas = self._mesh_of(name, mode)[0].dp_size
            args, real = call_batch(getattr(self.worker_cls, name), tuple(args), replicas)
        out = strip_padding(self._call(name, mode, args, kwargs), real)
        self.received_bytes += tensor_bytes(out)
        return out

    def _call(self, name: str, mode: Dispatch, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError  # each transport implements it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_cls.__name__}, {self.pool!r})"


P = ParamSpec("P")
R = TypeVar("R")


class remote:  # noqa: N801 - used like a decorator-style descriptor, as `property` is
    """A worker method exposed on a typed group facade (`RoleGroup` subclass).

        class DoublerGroup(RoleGroup):
            forward = remote(Doubler.forward)

        DoublerGroup(RayWorkerGroup(Doubler, pool)).forward(batch)

    Calling it on a facade runs `group.call(Doubler.forward, ...)`; the facade
    lists, in one place a reader can see, which worker methods the
    controller calls, and `remote` keeps their signatures and docstrings.
    """

    def __init__(self, fn: Callable[Concatenate[Any, P], R]):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.fn.__name__:
            raise TypeError(f"{owner.__name__}.{name} exposes {self.fn.__qualname__}: use the same name")

    def __get__(self, facade: Optional["RoleGroup"], owner: type) -> Callable[P, Any]:
        if facade is None:
            return self  # type: ignore[return-value]
        return functools.partial(facade.group.call, self.fn)


class RoleGroup:
    """A typed view of one worker group: subclasses declare the methods the controller calls (`remote`)."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def shutdown(self) -> None:
        self.group.shutdown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.group!r})"


def run_together(*calls: Callable[[], Any], abort: Sequence[Any] = (), grace_s: float = 5.0) -> list[Any]:
    """Run group calls at the same time, one driver thread each; their results in order.

    For calls on *different* groups whose workers meet in one collective (a
    process group spanning both): run one after the other, the first would
    wait for the second forever. A group's failure tears its processes down,
    which breaks the other group's side of a collective in progress; but a
    side still waiting to meet the other (a rendezvous the failed side never
    served) would wait out its timeout. So when a call fails, the others get
    `grace_s` to end (or to show a process that died, the likelier cause),
    then the groups in `abort` still running are torn down (`abort(reason)`)
    and the first failure is raised: a process that died, else the first.
    """
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)  # pending left: one of them failed
        if pending and abort and wait(pending, timeout=grace_s).not_done:
            first = _cause([f.exception() for f in futures if f.done() and f.exception() is not None])
            for group in abort:
                group.abort(f"a group it met in one collective failed first: {first}".splitlines()[0])
            wait(futures)
            raise first
        errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise _cause(errors)
    return [f.result() for f in futures]


def _cause(errors: list[BaseException]) -> BaseException:
    """A rank whose process died, if one did (its peers' broken collectives follow from it), else the first."""
    return min(errors, key=lambda e: 0 if getattr(e, "reason", None) == DIED else 1)
