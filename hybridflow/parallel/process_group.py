"""Joining the job's torch.distributed process group, once per process.

A process joins from the usual torchrun / worker-group environment (`RANK`,
`WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), or as a world of one when none
is set. The backend follows the device: gloo on CPU, NCCL on GPU.

Nothing listens beyond the machine unless the job spans machines: a world of
one keeps its rendezvous in memory (no store socket), and when MASTER_ADDR
is a loopback address (the local Ray cluster's workers) rank 0's store is
bound to that address instead of every interface, and gloo's connections
use the loopback interface. torchrun hosts its own store (`--master-addr`).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

# What leaves with the process group, newest first (`on_leave`): the engine's megatron-core groups, made inside
# this world, must go before it does.
_ON_LEAVE: list[Callable[[], None]] = []
# Why this process cannot join another world cleanly (`keeps_world_state`); emptied only by the process's end.
_KEPT_STATE: list[str] = []


def init_process_group(device: str = "cpu") -> None:
    """Join the job's process group once (idempotent)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        addr = os.environ.get("MASTER_ADDR", "")
        if not is_loopback(addr):
            dist.init_process_group(backend)
            return
        _gloo_on_loopback()
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent already hosts the store
            dist.init_process_group(backend)
            return
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _loopback_store(addr, int(os.environ["MASTER_PORT"]), rank, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        return
    # A single process run directly (demo, tests): a world of one, whose
    # rendezvous needs no socket at all.
    _gloo_on_loopback()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def on_leave(teardown: Callable[[], None]) -> None:
    """Run `teardown` when this process leaves its process group (`leave_process_group`); once per function."""
    if teardown not in _ON_LEAVE:
        _ON_LEAVE.append(teardown)


def keeps_world_state(reason: str) -> None:
    """Say that state this process cannot tear down holds this world's ranks, so it must not join another
    world (`leave_process_group` reports it). torch's DTensor caches its sharding decisions with the device
    mesh they were made on, and a mesh of a later world with the same shape compares equal to it: a process
    that built a device mesh and then joined a world at another rank took the old mesh's coordinate from
    the cache and wrote its shards at the other rank's offsets (seen: FSDP checkpoints with the halves
    swapped)."""
    if reason not in _KEPT_STATE:
        _KEPT_STATE.append(reason)


def leave_process_group() -> Optional[str]:
    """Tear down what was built on the process group (`on_leave`), then the group itself (idempotent): the
    end of a job, or a process kept for the next job (`controller.keep_processes_warm`), which joins a new
    world with a new rendezvous. Returns why this process must not join another world (`keeps_world_state`),
    or None when it may."""
    while _ON_LEAVE:
        _ON_LEAVE.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()
    return "; ".join(_KEPT_STATE) or None


def is_loopback(address: str) -> bool:
    """localhost, 127.x, ::1, or an IPv4-mapped IPv6 form of 127.x (as a dual-stack socket reports it)."""
    if address == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def _gloo_on_loopback() -> None:
    """gloo's pairs listen on the address its hostname resolves to unless told an interface;
    a job on one machine needs none but loopback (a user's GLOO_SOCKET_IFNAME wins)."""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _loopback_store(addr: str, port: int, rank: int, world: int) -> dist.TCPStore:
    """Rank 0 serves the rendezvous store on `addr` alone; a TCPStore left to itself listens on
    every interface, so it is handed a socket already bound here."""
    timeout = datetime.timedelta(minutes=30)  # torch's default process-group timeout
    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addr, port))
    listener.listen(128)
    # The store's server takes the descriptor over (and closes it with itself).
    return dist.TCPStore(addr, port, world, True, timeout=timeout, master_listen_fd=listener.detach())


def rendezvous_store(addr: str, port: int, rank: int, world: int) -> dist.TCPStore:
    """A TCP store shared by `world` processes, served by rank 0 at `addr:port` (on `addr` alone when it is
    a loopback address), for process groups that are not this process's default world (a group spanning
    two worker groups: `hybrid_engine/weight_sync.py`)."""
    if is_loopback(addr):
        _gloo_on_loopback()
        return _loopback_store(addr, port, rank, world)
    return dist.TCPStore(addr, port, world, rank == 0, timeout=datetime.timedelta(minutes=30))


def free_port(addr: str) -> int:
    """A TCP port free on `addr` now (a store's port, chosen where it will be served)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
