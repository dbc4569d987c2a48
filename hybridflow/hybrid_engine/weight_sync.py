"""Running the apart plan (`apart.py`): the actor's training shards into a rollout group's generation shards.

    world = SyncWorld(plan, rank, address, port, device)    # every rank of both groups, at once
    send(world, engine, traffic)                            # a training rank
    receive(world, generation_model, traffic)               # a rollout rank

The two worker groups each have their own torch.distributed default world
(megatron-core's parallel state lives on the actor's), so `new_group` cannot
span them. The sync world is therefore built beside the default one: one TCP
store (served by training rank 0, at an address the driver asked it for)
and, for each broadcast group of the plan, a process group of just its
members over a prefixed view of that store — what `new_group` would create
inside a spanning default world. gloo on CPU, NCCL on GPU; every member
creates its groups in plan order, so their rendezvous pair up.

A sync is the plan's broadcasts in plan order: the sender packs its slices
of a bucket (views of its training parameters, so the pack is the one copy)
into one flat buffer, the receivers unpack theirs straight into their
generation parameters. Nothing passes through the object store or the
driver; `Traffic` counts what each rank moved, which tests compare with the
plan's bytes.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.apart import ApartPlan, Broadcast, Slice
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.parallel.process_group import rendezvous_store

_TIMEOUT = datetime.timedelta(minutes=30)


def _process_group(store, rank: int, size: int, device: str):
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, _TIMEOUT)


class SyncWorld:
    """This process's part of the sync world of `plan`: its rank there and the broadcast groups it is in."""

    def __init__(self, plan: ApartPlan, rank: int, address: str, port: int, device: str = "cpu"):
        self.plan, self.rank, self.device = plan, rank, device
        self.store = rendezvous_store(address, port, rank, plan.world)  # kept: rank 0 serves it
        self.groups = {}
        for index, members in enumerate(plan.groups):
            if rank in members:
                prefixed = dist.PrefixStore(f"hybridflow-weight-sync/{index}/", self.store)
                self.groups[members] = _process_group(prefixed, members.index(rank), len(members), device)

    def mine(self) -> list[Broadcast]:
        """The plan's broadcasts this rank joins, in plan order."""
        return [b for b in self.plan.broadcasts if self.rank in b.group]

    def broadcast(self, b: Broadcast, buffer: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0  # the sender is the group's first member
        self.groups[b.group].broadcast([buffer], opts).wait()


def _blocks(tensor: torch.Tensor, s: Slice, start: int) -> list[torch.Tensor]:
    """The slice's part of each block of `tensor` (a shard along `s.dim`), `start` rows into the block."""
    if s.dim is None:
        return [tensor]
    size = tensor.shape[s.dim]
    per = size // s.blocks
    starts = [min(size, b * per + start) for b in range(s.blocks)]
    return [tensor.narrow(s.dim, lo, min(s.length, size - lo)) for lo in starts]


def pack(b: Broadcast, local: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sender's flat bucket: each slice's block parts in order (`local`: megatron name -> its shard)."""
    parts = [part.reshape(-1) for s in b.slices for part in _blocks(local[s.param], s, s.src_start)]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unpack(b: Broadcast, flat: torch.Tensor, dest: dict[str, torch.Tensor]) -> None:
    """Copy a received bucket into the receiver's generation shards (`dest`: megatron name -> shard). A
    destination shorter than the slice (the unpadded vocabulary of a one-rank generator) takes its rows."""
    offset = 0
    for s in b.slices:
        whole = s.nbytes // flat.element_size() // (s.blocks if s.dim is not None else 1)
        for part in _blocks(dest[s.param], s, s.dst_start):
            src = flat[offset:offset + whole].view(*_sent_shape(part, s))
            part.copy_(src.narrow(s.dim, 0, part.shape[s.dim]) if s.dim is not None else src)
            offset += whole
    if offset != flat.numel():
        raise AssertionError(f"bucket of {flat.numel()} elements unpacked {offset}")


def _sent_shape(part: torch.Tensor, s: Slice) -> tuple[int, ...]:
    if s.dim is None:
        return tuple(part.shape)
    shape = list(part.shape)
    shape[s.dim] = s.length
    return tuple(shape)


@torch.no_grad()
def send(world: SyncWorld, local: dict[str, torch.Tensor], traffic: Traffic) -> None:
    """A training rank's part of one sync (`local`: megatron global name -> this rank's training shard)."""
    for b in world.mine():
        buffer = pack(b, local)
        world.broadcast(b, buffer)
        traffic.add(0, buffer.numel() * buffer.element_size() * len(b.dsts))


@torch.no_grad()
def receive(world: SyncWorld, dest: dict[str, torch.Tensor], dtype: torch.dtype, traffic: Traffic) -> None:
    """A rollout rank's part of one sync (`dest`: megatron global name -> its generation shard)."""
    device = next(iter(dest.values())).device
    for b in world.mine():
        buffer = torch.empty(b.nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
        world.broadcast(b, buffer)
        unpack(b, buffer, dest)
        traffic.add(b.nbytes)


def sync_metrics(traffic: Traffic, plan: ApartPlan, rank: int, seconds: float) -> dict[str, float]:
    """What one rank moved in a sync, beside what the plan says it moves (and, for a rollout rank, the
    formula: its generation shard's bytes)."""
    formula = plan.needed_bytes.get(rank - plan.train_world, 0)
    return {"sync/formula_bytes_received": float(formula), "sync/bytes_received": float(traffic.bytes_received), "sync/bytes_sent": float(traffic.bytes_sent),
            "sync/collectives": float(traffic.collectives), "sync/plan_collectives": float(plan.collectives(rank)),
            "sync/plan_bytes_received": float(plan.bytes_received(rank)),
            "sync/plan_bytes_sent": float(plan.bytes_sent(rank)), "sync/time_s": seconds}
