"""The generation model's tensor-parallel group: a `models.decoder.TensorParallel` over torch.distributed.

The plain `Decoder` knows nothing of processes; this context gives it the two
collectives it needs at tg > 1, and `generation_shard` cuts the whole model's
weights into one rank's generation shard (the layout a reshard must produce).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.models.bridge import LlamaBridge
from hybridflow.models.sharding import shard_tensor


class GroupTensorParallel:
    """Rank `dist.get_rank(group)` of `group`; sums and vocabulary gathers run over it."""

    def __init__(self, group, padded_vocab: int):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if padded_vocab % self.size:
            raise ValueError(f"a padded vocabulary of {padded_vocab} does not split over {self.size} ranks")
        self.padded_vocab = padded_vocab

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def generation_shard(bridge: LlamaBridge, full: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Generation-layout names -> rank `rank`'s shard (of `size`) of the whole model `full`
    (global megatron names, padded vocabulary, as `MegatronEngine.full_state` returns it).

    At size 1 this is `bridge.megatron_to_generation(full)` (vocabulary unpadded);
    above, the vocabulary stays padded so that it splits evenly.
    """
    if size == 1:
        return bridge.megatron_to_generation(full)
    return {e.generation: shard_tensor(full[e.megatron], e.shard, rank, size) for e in bridge.entries()}
