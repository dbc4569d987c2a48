"""Expert parallelism in the engine: which of a layer's experts this rank holds, and the whole set gathered.

At `parallel.ep` = e, megatron-core gives each rank of an expert-parallel group (e ranks of the data-parallel
ranks: megatron-core's rank order) experts / e of every layer's experts, numbered from 0 on each rank
(`local_experts.J`); tokens reach them through the allgather dispatcher. The bridge, HF checkpoints and the
generation model number experts globally: rank r of the group holds experts r * (experts / e) onwards.
`ExpertShard` renames between the two; `gather_experts` gives every rank of the group all of them (an export,
the generation model), one all-gather of each rank's experts: each rank receives (e - 1) / e of the model's
expert bytes (docs/design.md, "Expert parallelism").
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ExpertShard", "expert_of", "gather_experts"]

_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def expert_of(name: str) -> Optional[int]:
    """The expert index a megatron parameter name holds (`...local_experts.J....`), None for other tensors."""
    match = _EXPERT.search(name)
    return None if match is None else int(match[2])


def _renumbered(name: str, index: int) -> str:
    return _EXPERT.sub(lambda m: f"{m[1]}{index}{m[3]}", name, count=1)


class ExpertShard:
    """This rank's experts of every MoE layer: `count` of them from global index `first` (ep = 1: all)."""

    def __init__(self, experts: int, ep: int, rank: int):
        if ep > 1 and experts % ep:
            raise ValueError(f"ep={ep} does not divide the model's {experts} experts")
        self.ep, self.count = ep, (experts // ep if ep > 1 else experts)
        self.first = rank * self.count if ep > 1 else 0

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


def gather_experts(mine: dict[str, Tensor], group, traffic=None) -> dict[str, Tensor]:
    """`mine` (global names; this rank's experts and every other tensor) with every expert-parallel peer's
    experts added: each rank's expert tensors all-gathered over `group` (None: ep = 1, `mine` itself), one
    object collective. `traffic`
    (a `TrafficCounter`) counts the bytes received and sent."""
    if group is None or dist.get_world_size(group) == 1:
        return mine
    own = {k: v.detach().cpu() for k, v in mine.items() if expert_of(k) is not None}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, own, group=group)
    out = dict(mine)
    me = dist.get_rank(group)
    for rank, part in enumerate(everyone):
        if rank != me:
            out.update({k: v.to(_device(mine)) for k, v in part.items()})
            if traffic is not None:
                traffic.add(sum(t.numel() * t.element_size() for t in part.values()))
    if traffic is not None:
        traffic.add(0, sum(t.numel() * t.element_size() for t in own.values()) * (len(everyone) - 1))
    return out


def _device(state: dict[str, Tensor]) -> torch.device:
    return next(iter(state.values())).device if state else torch.device("cpu")
