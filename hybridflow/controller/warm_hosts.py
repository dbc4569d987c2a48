"""Worker processes kept for the next worker group (opt-in): `keep_processes_warm(True)`.

A Ray worker process costs seconds before its worker does anything: Python, torch and megatron-core imports,
then torch's dynamo and inductor on the first optimizer. A driver that runs jobs in turn (a sweep, a
notebook, a test session) pays that for every rank of every job. With warm processes on, a group
whose workers all shut down cleanly does not kill its processes: each drops its workers, leaves the process
group (and megatron-core's groups: `parallel.process_group.leave_process_group`) and waits here; the next
group that asks for processes of the same kind takes them and joins a new world (new master port, new
rendezvous) as a fresh process would.

Only CPU processes are kept (a GPU process keeps its CUDA context and allocator cache, and its placement
group belongs to the pool that reserved it). A group that failed, whose processes did not reset in time, or
that left state behind it cannot tear down (an FSDP engine's device mesh, held by torch's DTensor caches:
`parallel.process_group.keeps_world_state`) never comes back here: its processes are killed as before.
What is kept is keyed by the Ray session and job, the process's CPU share and its lanes, so a process only
serves a group that would have started it the same way. Idle processes hold their Ray CPU reservation; a start
that must start processes kills idle ones of other kinds, oldest first, until the cluster's free CPUs hold the
new ones, so they never stand in the way of a group's placement (and a driver alternating two kinds of groups
keeps both where the cluster has room).
"""
from __future__ import annotations

import threading
from typing import Any, Iterable, NamedTuple

MAX_IDLE = 8  # processes kept at most; beyond it a released one is killed
PING_TIMEOUT_S = 30.0  # an idle process that does not answer in this time is treated as gone

_enabled = False
_idle: list[tuple["Kind", Any]] = []  # (key, Ray actor handle), oldest first
_lock = threading.Lock()


def keep_processes_warm(on: bool = True) -> None:
    """Keep CPU worker processes of groups that shut down cleanly for the next group of the same kind
    (`on=False`: stop, and kill those kept)."""
    global _enabled
    _enabled = on
    if not on:
        clear()


def warm_enabled() -> bool:
    return _enabled


def session_key() -> tuple:
    """The Ray session and job this driver runs in: processes of another (a `ray.shutdown` and a new
    `ray.init` in between) are gone."""
    import ray

    context = ray.get_runtime_context()
    return context.get_session_name(), context.get_job_id()


def put(kept: Iterable[tuple["Kind", Any]]) -> None:
    """Keep each (key, host) pair (the host reset, alive) for a later `take` under its key; the oldest beyond
    `MAX_IDLE` are killed."""
    with _lock:
        _idle.extend(kept)
        excess = len(_idle) - MAX_IDLE
        dropped = [host for _, host in _idle[:max(0, excess)]]
        del _idle[:max(0, excess)]
    kill(dropped)


class Kind(NamedTuple):
    """What a kept process can serve: a group of the same Ray session and job (`session_key`), whose rank
    reserves the same `cpus` and runs methods on an aside lane or not (`aside`)."""
    session: tuple
    cpus: float
    aside: bool


def take(key: Kind, count: int) -> list:
    """Up to `count` kept processes of kind `key`, each answering. When fewer than `count` are kept, the
    group starts the rest, each reserving `key.cpus`: kept processes of other kinds are killed, oldest
    first, only until the cluster's free CPUs can hold those (their reservations make room); the others
    stay for a later group of their kind, so a driver alternating two layouts reuses both."""
    with _lock:
        mine = [host for k, host in _idle if k == key][:count]
        others = [(k, host) for k, host in _idle if k != key] if len(mine) < count else []
        others = others[:_to_free((count - len(mine)) * key.cpus, [k.cpus for k, _ in others])]
        doomed = [host for _, host in others]
        _idle[:] = [(k, host) for k, host in _idle if not any(host is h for h in (*mine, *doomed))]
    kill(doomed)
    return _answering(mine)


def _to_free(needed: float, held: list[float]) -> int:
    """How many kept processes holding `held` CPUs each (oldest first) to kill so that `needed` CPUs are
    free in the cluster."""
    if needed <= 0 or not held:
        return 0
    import ray

    free = ray.available_resources().get("CPU", 0.0)
    count = 0
    while free < needed - 1e-9 and count < len(held):
        free += held[count]
        count += 1
    return count


def idle_count() -> int:
    with _lock:
        return len(_idle)


def clear() -> None:
    """Kill every kept process."""
    with _lock:
        hosts = [host for _, host in _idle]
        _idle.clear()
    kill(hosts)


def _answering(hosts: list) -> list:
    """The hosts that answer a ping within `PING_TIMEOUT_S`; the others are killed."""
    if not hosts:
        return []
    import ray

    pings = [host.pid.remote() for host in hosts]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_TIMEOUT_S)
    alive, dead = [], []
    for host, ping in zip(hosts, pings):
        ok = False
        if ping in ready:
            try:
                ray.get(ping)
                ok = True
            except ray.exceptions.RayError:
                pass
        (alive if ok else dead).append(host)
    kill(dead)
    return alive


def kill(hosts: list) -> None:
    """`ray.kill` each host; one already gone is skipped."""
    if not hosts:
        return
    import ray

    for host in hosts:
        try:
            ray.kill(host, no_restart=True)
        except Exception:  # already gone
            pass
