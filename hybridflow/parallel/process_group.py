"""Joining the job's torch.distributed process group, once per process.

A process joins from the usual torchrun / worker-group environment (`RANK`,
`WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), or as a world of one when none
is set. The backend follows the device: gloo on CPU, NCCL on GPU.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
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
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
