"""Expert parallelism in the engine: which of a layer's experts this rank holds, and the whole set gathered.

At `parallel.ep` = e, megatron-core gives each rank of an expert-parallel group (e ranks of the data-parallel
ranks: megatron-core's rank order) experts / e of every layer's experts, numbered from 0 on each rank
(`local_experts.J`); tokens reach them through the allgather dispatcher. The bridge, HF checkpoints and the
generation model number experts globally: rank r of the group holds experts r * (experts / e) onwards.
`ExpertShard` renames between the two; `exchange_experts` gives every rank of the group all of them (an export,
the generation model), one all-gather of each rank's experts: each rank receives (e - 1) / e of the model's
expert bytes (docs/design.md, "Expert parallelism").
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ExpertShard", "exchange_experts", "expert_of", "expert_rank", "first_holder"]

_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def expert_of(name: str) -> Optional[int]:
    """The expert index a megatron parameter name holds (`...local_experts.J....`), None for other tensors."""
    match = _EXPERT.search(name)
    return None if match is None else int(match[2])


def _renumbered(name: str, index: int) -> str:
    return _EXPERT.sub(lambda m: f"{m[1]}{index}{m[3]}", name, count=1)


def expert_rank(dp_rank: int, cp_rank: int, cp: int, ep: int) -> int:
    """The expert-parallel rank of the rank at (dp_rank, cp_rank) of a stage's data- x context-parallel ranks:
    megatron-core numbers those ranks c + cp * d and groups ep consecutive ones (its expert rank order
    "tp-ep-dp-pp", beside "tp-cp-dp-pp")."""
    return (cp_rank + cp * dp_rank) % ep


def first_holder(ep_rank: int, cp: int) -> tuple[int, int]:
    """(dp rank, cp rank) of the first rank holding expert-parallel rank `ep_rank`'s experts."""
    return divmod(ep_rank, cp)


class ExpertShard:
    """This rank's experts of every MoE layer: `count` of them from global index `first` (ep = 1: all)."""

    def __init__(self, experts: int, ep: int, rank: int):
        if ep > 1 and experts % ep:
            raise ValueError(f"ep={ep} does not divide the model's {experts} experts")
        self.experts, self.ep, self.rank = experts, ep, rank if ep > 1 else 0
        self.count = experts // ep if ep > 1 else experts
        self.first = self.rank * self.count

    def local(self, name: str) -> Optional[str]:
        """A global megatron name as this rank spells it; None for another rank's expert."""
        j = expert_of(name)
        if j is None or self.ep == 1:
            return name
        return _renumbered(name, j - self.first) if self.first <= j < self.first + self.count else None

    def global_name(self, name: str) -> str:
        """This rank's spelling of one of its experts' tensors -> the global name."""
        j = expert_of(name)
        return name if j is None or self.ep == 1 else _renumbered(name, j + self.first)

    def peer(self, rank: int) -> "ExpertShard":
        """The shard expert-parallel rank `rank` holds."""
        return ExpertShard(self.experts, self.ep, rank)


def exchange_experts(own: dict[str, Tensor], shard: ExpertShard, group, traffic=None) -> dict[str, Tensor]:
    """Every other expert-parallel rank's copy of this rank's expert tensors in `own` (global names, `shard`'s
    experts), under global names: one all-gather per tensor over `group`, in the order of the local names,
    which every rank of the group holds alike. `traffic` (a `TrafficCounter`) counts the bytes received and
    sent; `own`'s other tensors are left out."""
    if shard.ep == 1:
        return {}
    local = sorted(((shard.local(k), v) for k, v in own.items() if expert_of(k) is not None), key=lambda kv: kv[0])
    out: dict[str, Tensor] = {}
    for name, tensor in local:
        pieces = [torch.empty_like(tensor) for _ in range(shard.ep)]
        dist.all_gather(pieces, tensor.detach().contiguous(), group=group)
        size = tensor.numel() * tensor.element_size() * (shard.ep - 1)
        if traffic is not None:
            traffic.add(size, size)
        out.update({shard.peer(r).global_name(name): piece for r, piece in enumerate(pieces) if r != shard.rank})
    return out
