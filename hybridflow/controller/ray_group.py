"""`RayWorkerGroup`: a worker class run as one Ray actor per device of a resource pool.

Tensors in arguments and results travel as numpy views
(`hybridflow.controller.transfer`), which Ray writes straight into the call or
the object store: a rank's DP_SPLIT chunk leaves the driver without a copy (a
pickled torch view would ship the whole batch's storage, and a clone costs a
copy) and the receiver copies it once out of the read-only object store.
DP_SPLIT results are concatenated straight from the object store, so the
driver's one copy of a gathered batch is the concatenation itself. An argument
several ranks receive is `ray.put` once and every rank gets the ref (resolved
by Ray); a rank's own chunk goes by value — Ray inlines small ones (cheaper
than a put) and stores large ones itself.

Failures surface as `WorkerError` naming the rank and method: a raising
method carries the worker's traceback text; a dying process (crash, SIGKILL,
OOM) is reported as soon as Ray notices, and `call_timeout` (seconds, default
None = wait) bounds a hung call. A group is SPMD — when one rank fails the
others are stuck in collectives — so any failure kills every actor of the
group before `WorkerError` is raised. Each rank's Ray node is recorded (and
logged) at start; when a call fails because a node left the cluster, the error
names that node and the ranks and roles it held (`ray_nodes.py`).
"""
from __future__ import annotations

import gc
import os
import re
import socket
import threading
import time
import traceback
import weakref
from typing import Any, Optional

from hybridflow.controller import warm_hosts
from hybridflow.controller.dispatch import (Dispatch, PerRank, answering, collect, dispatch, flat_mesh, method_aside,
                                           shipped_bytes)
from hybridflow.controller.group import WorkerGroup
from hybridflow.controller.ray_nodes import NodeOf, describe_lost, log_placement, lost_nodes
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.transfer import fetch_remote_rows, pack, unpack, unpack_results
from hybridflow.controller.worker import DIED, Worker, WorkerContext, WorkerError, construct_worker, first_os_error

STARTUP_TIMEOUT_S = 600.0  # actor start plus the worker's __init__ (model build, checkpoint load)
ASIDE = "aside"  # the Ray concurrency group of methods registered aside
RESET_TIMEOUT_S = 60.0  # a process kept warm must have let go of its job's workers and world within this
DEATH_GRACE_S = 5.0  # after a rank fails, how long to wait for news that a peer's process died
_DIED = DIED  # WorkerError.reason of a rank whose process is gone
# Ray worker id (hex) -> (its host set, rank): whose process owned rows a failed fetch could not read.
_PROCESSES: dict[str, tuple[weakref.ref, int]] = {}
_PROCESSES_LOCK = threading.Lock()  # groups may start from several threads (an async DataFlow's stages)
_OWNER = re.compile(r"Owner worker ID: ([0-9a-f]+)")


def _split_kw(kw_names: tuple, values: tuple) -> tuple[tuple, dict]:
    cut = len(values) - len(kw_names)
    return values[:cut], dict(zip(kw_names, values[cut:]))


def _flatten(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    # Ray resolves object refs only when they are top-level arguments, so
    # keyword values travel positionally after the names.
    return tuple(kwargs), (*args, *kwargs.values())


def uses_aside_lane(device: str) -> bool:
    """Whether hosts on `device` get the aside lane: on the CPU only. On a GPU, NCCL kernels of two
    communicators enqueued from two threads can be ordered differently on different ranks (each rank's threads
    take turns in their own order), and a rank then waits in one collective for a peer waiting in the other;
    gloo's collectives have no such order."""
    return device == "cpu"


class _Failure:
    """A worker-side exception, returned (not raised) so the controller sees rank, method and traceback."""

    def __init__(self, exc: BaseException):
        self.summary = f"{type(exc).__name__}: {exc}"
        self.traceback = traceback.format_exc()
        self.os_error = first_os_error(exc)


class _Host:
    """The Ray actor around one rank's workers: sets up its environment, then forwards calls.

    Each worker sits in a slot; groups colocated on one pool (`RayWorkerGroup.colocated`) put their
    workers into the same process, as the local (torchrun) mode does.
    """

    def __init__(self, device: str):
        if device == "cpu":  # before the worker's modules (torch, megatron) are imported
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        self.workers: dict[str, Worker] = {}

    def node_address(self) -> tuple[str, int, str, str]:
        """This node's IP, a port free on it now (rank 0's becomes the master port), its Ray node id and
        this process's Ray worker id."""
        import ray

        address = ray.util.get_node_ip_address()
        context = ray.get_runtime_context()
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
            return address, s.getsockname()[1], context.get_node_id(), context.get_worker_id()

    def pid(self) -> int:
        return os.getpid()

    def setup(self, slot: str, context: WorkerContext, cls_blob: bytes, kw_names: tuple, *values):
        from ray import cloudpickle

        os.environ.update(context.env())
        try:
            worker_cls = cloudpickle.loads(cls_blob)  # imports the worker's modules under that env
            args, kwargs = _split_kw(kw_names, unpack(values))
            self.workers[slot] = construct_worker(worker_cls, context, args, kwargs)
        except Exception as exc:
            return _Failure(exc)
        return None

    def meshes(self, slot: str) -> dict:
        return self.workers[slot].mesh_coords()

    def call(self, slot: str, name: str, reply: bool, kw_names: tuple, *values):
        """Run the method; a rank whose result the caller drops (a TP or earlier-stage peer) sends None.
        Rows another group left in the object store (`transfer.remote_fields`) are fetched here, not on the
        driver."""
        try:
            args, kwargs = _split_kw(kw_names, fetch_remote_rows(unpack(values)))
            out = getattr(self.workers[slot], name)(*args, **kwargs)
        except Exception as exc:
            return _Failure(exc)
        return pack(out) if reply else None

    def drop(self, slot: str) -> None:
        """Let go of one worker (its group shut down) while other slots' groups go on."""
        self.workers.pop(slot, None)
        gc.collect()

    def reset(self):
        """Let go of every worker and leave the process group (megatron-core's groups first), so this process
        can join the next job's world (`warm_hosts`). Returns None when it can; else why not (state it
        cannot tear down: `parallel.process_group.keeps_world_state`), or the failure."""
        try:
            from hybridflow.parallel.process_group import leave_process_group

            self.workers.clear()
            gc.collect()  # the workers' gloo groups close before the world they were made in
            kept = leave_process_group()
            gc.collect()
            _freeze_heap()
        except Exception as exc:
            return _Failure(exc)
        return kept  # None: clean; else why this process must end with its job


def _freeze_heap() -> None:
    """`gc.freeze()` what the process holds once a reset has let go of the job (imported modules, torch's and
    megatron-core's tables), which lives as long as the process, so full collections stop scanning it. Not
    at a job's start: its arguments and a worker class sent by value are live then, and a frozen object in
    a reference cycle is never freed."""
    gc.freeze()


def _aside_host() -> type:
    """`_Host` with `call_aside`, its calls on the "aside" concurrency group's thread (a class of its own:
    Ray refuses to start an actor whose methods name a group it was not given; `ray` is imported where it
    is used in this module, so the class is made here)."""
    import ray

    class _HostAside(_Host):
        @ray.method(concurrency_group=ASIDE)
        def call_aside(self, slot: str, name: str, reply: bool, kw_names: tuple, *values):
            """`call` beside a call in progress on the default lane (`dispatch.register(aside=True)`)."""
            return self.call(slot, name, reply, kw_names, *values)

    return _HostAside


class _HostSet:
    """One pool's Ray actors, a rank each, and what the groups sharing them share.

    lock: held while a call is submitted to every rank. Ray runs one caller's calls to an actor in
        submission order, so with the lock every rank runs the calls of all the set's groups in one
        order and their collectives pair up (the async DataFlow calls groups from a thread per stage).
    """

    def __init__(self, hosts: list, contexts: list[WorkerContext]):
        self.hosts: Optional[list] = hosts
        self.contexts = contexts
        self.lock = threading.Lock()
        self.slots: set[str] = set()
        self.dead: Optional[WorkerError] = None
        self.nodes: list[NodeOf] = []  # rank -> the Ray node its process runs on
        self.aside = False  # the hosts run methods registered aside on a second thread (`with_aside_lane`)
        self.keys: Optional[list] = None  # rank -> its process's kind, where it may be kept warm (`warm_hosts`)

    @property
    def roles(self) -> str:
        """The worker classes in these processes, for messages ("ActorRolloutRefWorker, CriticWorker")."""
        return ", ".join(sorted(self.slots)) or "no worker"

    def kill(self) -> None:
        """Kill every actor (idempotent). The pool's reservation stays for other groups."""
        if self.hosts is None:
            return
        warm_hosts.kill(self.hosts)
        self.hosts = None

    def release(self) -> None:
        """The last group on these processes shut down: keep them for the next group (`warm_hosts`) where
        that is on and they reset cleanly, else kill them."""
        if self.hosts is None:
            return
        if not (warm_hosts.warm_enabled() and self.keys is not None and self.dead is None):
            self.kill()
            return
        import ray

        resets = [host.reset.remote() for host in self.hosts]
        ready, _ = ray.wait(resets, num_returns=len(resets), timeout=RESET_TIMEOUT_S)
        try:
            clean = len(ready) == len(resets) and all(out is None for out in ray.get(resets))
        except ray.exceptions.RayError:
            clean = False
        if not clean:
            self.kill()
            return
        warm_hosts.put(zip(self.keys, self.hosts))
        self.hosts = None


def _with_lost_rows(error: WorkerError) -> WorkerError:
    """`error`, naming the rank and workers whose process owned rows the failed rank could not fetch.

    Rows a group left in the object store (`transfer.remote_fields`) live as long as the process that put
    them: when it has exited, the rank reading them next fails with Ray's OwnerDiedError, which names a
    worker id only. The rank at fault is the owner's, found here among the processes this driver started."""
    found = _OWNER.search(f"{error.reason}\n{error.traceback or ''}")
    with _PROCESSES_LOCK:
        owner = _PROCESSES.get(found.group(1)) if found else None
    host_set = owner[0]() if owner else None
    if host_set is None:
        return error
    rank = owner[1]
    where = f" (node {host_set.nodes[rank].ip})" if rank < len(host_set.nodes) else ""
    reason = (f"rows it read are lost: rank {rank} of {host_set.roles}{where}, whose process kept them in the "
              f"object store, has exited ({error.reason})")
    return WorkerError(error.rank, error.method, reason, error.traceback, error.os_error)


def _local_ranks(ips: list[str]) -> list[int]:
    seen: dict[str, int] = {}
    out = []
    for ip in ips:
        out.append(seen.get(ip, 0))
        seen[ip] = out[-1] + 1
    return out


def _check_fits(pool: ResourcePool) -> None:
    """Fail now, not after the start timeout, when the cluster can never hold the pool's CPU processes."""
    import ray

    if pool.device != "cpu":
        return  # GPU pools fail fast in their placement-group reservation
    needed = sum(pool.fraction(rank) for rank in range(pool.world_size))
    total = ray.cluster_resources().get("CPU", 0.0)
    if needed > total:
        raise RuntimeError(f"{pool!r} needs {needed:g} logical CPUs but the Ray cluster has {total:g}; "
                           "start Ray with more (init_ray(num_cpus=...)) or use fewer devices")


class RayWorkerGroup(WorkerGroup):
    """`worker_cls(*args, **kwargs)` on every device of `pool`, one Ray actor each.

    `RayWorkerGroup.colocated(group, worker_cls, ...)` puts another role's workers into `group`'s
    processes instead (one process per device, as verl's colocated worker classes do).

    call_timeout: seconds a call may take before the group is torn down with
        a WorkerError naming the ranks that did not answer (None: no bound;
        dead processes are still reported as soon as Ray notices).
    """

    def __init__(self, worker_cls: type, pool: ResourcePool, *args, **kwargs):
        self._start(worker_cls, pool, None, args, kwargs)

    @classmethod
    def with_aside_lane(cls, worker_cls: type, pool: ResourcePool, *args, **kwargs) -> "RayWorkerGroup":
        """As the constructor, with processes that run the methods registered aside (`dispatch.register`) on
        a second thread, beside the call in progress (a staged weight copy broadcast while the actor
        trains), where `uses_aside_lane(pool.device)`; elsewhere those methods run in line like any other.
        Ray then runs every call of these processes on pool threads, none on the main thread."""
        group = cls.__new__(cls)
        group._start(worker_cls, pool, None, args, kwargs, aside=uses_aside_lane(pool.device))
        return group

    @classmethod
    def colocated(cls, group: "RayWorkerGroup", worker_cls: type, *args, **kwargs) -> "RayWorkerGroup":
        """`worker_cls(*args, **kwargs)` in the processes of `group`, rank for rank: same ranks, same
        torch.distributed world, no process started. The processes end when every group on them has
        shut down, or at once when a call of any of them fails."""
        if group._set is None or group._set.hosts is None:
            raise RuntimeError(f"{group!r} has been shut down")
        self = cls.__new__(cls)
        self._start(worker_cls, group.pool, group._set, args, kwargs)
        return self

    def _start(self, worker_cls: type, pool: ResourcePool, host_set: Optional[_HostSet], args: tuple,
               kwargs: dict, aside: bool = False) -> None:
        from ray import cloudpickle

        self.call_timeout: Optional[float] = None
        self._dead: Optional[WorkerError] = None
        self._set: Optional[_HostSet] = None
        self._slot: Optional[str] = None
        super().__init__(worker_cls, pool)
        try:
            if host_set is None:
                host_set = self._start_hosts(pool, aside)
            self._set = host_set
            slot = worker_cls.__name__
            while slot in host_set.slots:
                slot += "'"
            self._slot = slot
            host_set.slots.add(slot)
            blob = cloudpickle.dumps(worker_cls)
            kw_names, values = _flatten(*self._put_once(self._pack_args([(args, kwargs)] * self.world_size))[0])
            self._gather([h.setup.remote(slot, ctx, blob, kw_names, *values)
                          for h, ctx in zip(host_set.hosts, host_set.contexts)], "__init__", STARTUP_TIMEOUT_S)
            self._set_meshes(self._gather([h.meshes.remote(slot) for h in host_set.hosts], "__init__",
                                          STARTUP_TIMEOUT_S))
            log_placement(slot, host_set.nodes)
        except BaseException:
            self.shutdown()
            raise

    def _start_hosts(self, pool: ResourcePool, aside: bool = False) -> _HostSet:
        """One Ray actor per rank of `pool`, each told its rank and the master's address."""
        import ray

        from hybridflow.controller.ray_setup import init_ray

        init_ray()
        _check_fits(pool)
        # With the aside lane, one more thread per actor for the methods registered aside; the rest run one
        # at a time, in the order they were sent.
        host = ray.remote(concurrency_groups={ASIDE: 1})(_aside_host()) if aside else ray.remote(_Host)
        self._set = _HostSet([], [])  # set first: a failure below kills what started (`_start` shuts down)
        self._set.aside = aside
        if pool.device == "cpu" and warm_hosts.warm_enabled():
            session = warm_hosts.session_key()
            self._set.keys = [warm_hosts.Kind(session, pool.fraction(rank), aside) for rank in range(self.world_size)]
            kept = {key: warm_hosts.take(key, self._set.keys.count(key)) for key in dict.fromkeys(self._set.keys)}
        for rank in range(self.world_size):
            if self._set.keys is not None and kept[self._set.keys[rank]]:
                self._set.hosts.append(kept[self._set.keys[rank]].pop())
                continue
            self._set.hosts.append(host.options(max_restarts=0, **pool.actor_options(rank)).remote(pool.device))
        addresses = self._gather([h.node_address.remote() for h in self._set.hosts], "start", STARTUP_TIMEOUT_S)
        master_addr, master_port, _, _ = addresses[0]
        self._set.nodes = [NodeOf(node_id, ip) for ip, _, node_id, _ in addresses]
        with _PROCESSES_LOCK:
            for worker_id in [w for w, (host_set, _) in _PROCESSES.items() if host_set() is None]:
                del _PROCESSES[worker_id]  # groups long gone
            for rank, (_, _, _, worker_id) in enumerate(addresses):
                _PROCESSES[worker_id] = (weakref.ref(self._set), rank)
        # On GPU, Ray shows each actor only its own GPU: that is local device 0.
        local_ranks = (_local_ranks([node.ip for node in self._set.nodes]) if pool.device == "cpu"
                       else [0] * self.world_size)
        self._set.contexts = [WorkerContext(rank, self.world_size, local, master_addr, master_port, pool.device)
                              for rank, local in enumerate(local_ranks)]
        return self._set

    @property
    def alive(self) -> bool:
        return (self._set is not None and self._set.hosts is not None and self._dead is None
                and self._set.dead is None)

    def pids(self) -> list[int]:
        """Process id of each rank's actor (debugging; tests kill one)."""
        return self._gather([h.pid.remote() for h in self._live_hosts()], "pid", self.call_timeout)

    def nodes(self) -> list[NodeOf]:
        """The Ray node (id and IP) each rank runs on, in rank order, as recorded when the processes started."""
        self._live_hosts()
        return list(self._set.nodes)

    def _call(self, name: str, mode: Dispatch, args: tuple, kwargs: dict) -> Any:
        hosts = self._live_hosts()
        mesh = self._mesh_of(name, mode)
        per_rank = dispatch(mode, self.world_size, args, kwargs, mesh)
        self.shipped_bytes += shipped_bytes(per_rank)
        per_rank = self._put_once(self._pack_args(per_rank))
        futures, aside = [], self._set.aside and method_aside(getattr(self.worker_cls, name))
        # A call goes out to every rank before another thread's call (to this group or one colocated
        # with it) does, so all ranks run them in one order (see _HostSet).
        with self._set.lock:
            for host, coord, (rank_args, rank_kwargs) in zip(hosts, mesh, per_rank):
                kw_names, values = _flatten(rank_args, rank_kwargs)
                call = host.call_aside if aside else host.call
                futures.append(call.remote(self._slot, name, coord.answers, kw_names, *values))
        results = self._gather(futures, name, self.call_timeout)
        if mode is Dispatch.DP_SPLIT:
            return collect(mode, unpack_results(answering(results, mesh)), flat_mesh(mesh[0].dp_size))
        return collect(mode, [unpack(out) for out in results])

    def _live_hosts(self) -> list:
        dead = self._dead or (self._set.dead if self._set is not None else None)
        if dead is not None:
            raise WorkerError(dead.rank, dead.method, f"this group was shut down after that failure: {dead.reason}")
        if self._set is None or self._set.hosts is None:
            raise RuntimeError(f"{self!r} has been shut down")
        return self._set.hosts

    @staticmethod
    def _pack_args(per_rank: PerRank) -> PerRank:
        """Each rank's arguments packed for the trip; an argument several ranks share stays one object."""
        packed: dict[int, Any] = {}

        def once(value):
            if id(value) not in packed:
                packed[id(value)] = pack(value)
            return packed[id(value)]

        return [(tuple(once(a) for a in args), {k: once(v) for k, v in kwargs.items()}) for args, kwargs in per_rank]

    @staticmethod
    def _put_once(per_rank: PerRank) -> PerRank:
        """Put each argument that several ranks receive into the object store once; they get the ref.

        An argument only one rank receives (its DP_SPLIT chunk) is passed by
        value: Ray inlines a small one in the call, which is faster than a
        trip through the object store, and stores a large one itself.
        """
        import ray

        uses: dict[int, int] = {}
        for args, kwargs in per_rank:
            for value in (*args, *kwargs.values()):
                uses[id(value)] = uses.get(id(value), 0) + 1
        refs: dict[int, Any] = {}

        def ref(value):
            if uses[id(value)] < 2 or value is None or isinstance(value, (bool, int, float, str)):
                return value
            if id(value) not in refs:
                refs[id(value)] = ray.put(value)
            return refs[id(value)]

        return [(tuple(ref(a) for a in args), {k: ref(v) for k, v in kwargs.items()}) for args, kwargs in per_rank]

    def _gather(self, futures: list, method: str, timeout: Optional[float]) -> list:
        """Results in rank order; on the first failure tear the group down and raise WorkerError."""
        import ray

        pending = {ref: rank for rank, ref in enumerate(futures)}
        results: list[Any] = [None] * len(futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(pending.values())
                self._fail(WorkerError(ranks[0], method, f"rank(s) {ranks} did not answer within {timeout}s"))
            for ref in ready:
                rank = pending.pop(ref)
                out = self._result(ref, rank, method)
                if isinstance(out, WorkerError):
                    self._fail(self._root_cause(out, pending, method))
                results[rank] = out
        return results

    @staticmethod
    def _result(ref, rank: int, method: str) -> Any:
        """What rank `rank` returned, or the WorkerError describing how it failed."""
        import ray

        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            return WorkerError(rank, method, _DIED, str(exc))
        except ray.exceptions.RayError as exc:
            return WorkerError(rank, method, type(exc).__name__, str(exc))
        if isinstance(out, _Failure):
            return WorkerError(rank, method, out.summary, out.traceback, out.os_error)
        return out

    def _root_cause(self, first: WorkerError, pending: dict, method: str) -> WorkerError:
        """A rank whose process died, if one did, rather than a peer that failed because of it.

        When a process dies mid-collective its peers' gloo calls fail at once,
        often before Ray reports the death; the ranks still pending get
        `DEATH_GRACE_S` to show whether one of them is the cause.
        """
        import ray

        if first.reason == _DIED:
            return first
        waiting, deadline = dict(pending), time.monotonic() + DEATH_GRACE_S
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            out = self._result(ready[0], waiting.pop(ready[0]), method)
            if isinstance(out, WorkerError) and out.reason == _DIED:
                return out
        return first

    def _fail(self, error: WorkerError) -> None:
        """Tear down the processes (and so every group on them) and raise `error`, naming any lost node."""
        error = _with_lost_rows(self._with_lost_nodes(error))
        self._dead = self._dead or error  # an `abort` that killed the processes keeps its reason
        if self._set is not None:
            self._set.dead = self._set.dead or error
            self._set.kill()
        raise error

    def _with_lost_nodes(self, error: WorkerError) -> WorkerError:
        """`error`, its reason extended with each node of this group's processes that has left the cluster.

        Whichever rank reported first (the lost one, or a peer whose collective broke), the node is what a
        user must act on. A cluster that cannot be asked leaves the error as it was."""
        host_set = self._set
        if host_set is None or not host_set.nodes:
            return error
        try:
            lost = lost_nodes(host_set.nodes)
        except Exception:  # the GCS itself is unreachable: the workers' own report is all there is
            return error
        if not lost:
            return error
        reason = f"{error.reason}; {describe_lost(host_set.roles, host_set.nodes, lost)}"
        return WorkerError(error.rank, error.method, reason, error.traceback, error.os_error)

    def abort(self, reason: str) -> None:
        """Kill this group's processes now, from any thread (a call blocked on them ends in a WorkerError;
        later calls raise one with `reason`). For a peer group's failure that leaves this one waiting."""
        host_set = self._set
        if host_set is None:
            return
        self._dead = self._dead or WorkerError(0, "abort", reason)
        host_set.dead = host_set.dead or self._dead
        host_set.kill()

    def shutdown(self) -> None:
        """Let go of this group's workers (idempotent); the processes end with the last group on them.
        The pool's reservation stays for other groups."""
        host_set, self._set = self._set, None
        if host_set is None or host_set.hosts is None:
            return
        host_set.slots.discard(self._slot)
        if not host_set.slots:
            host_set.release()
            return
        for host in host_set.hosts:
            host.drop.remote(self._slot)
