"""The actor's weights for a rollout group placed apart from training: shard by shard, never whole.

Each rank of the first training replica offers only its own training shard
(`training_shard`: this stage's tensors under megatron names, with its TP
rank; replicated tensors from TP rank 0 alone); the rollout worker, which
generates at tg = 1, reassembles the whole model from all of them
(`assemble`). No training rank gathers, or ever holds, more than its shard;
under Ray each shard goes into the object store from the rank that holds it.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from hybridflow.models.bridge import LlamaBridge
from hybridflow.models.sharding import unshard_tensor


def training_shard(engine) -> Optional[dict[str, Any]]:
    """{"tp_rank", "tp", "tensors": global megatron name -> this rank's piece}; None outside replica 0
    (the other replicas hold the same pieces)."""
    here = engine.coord
    if here.dp != 0:
        return None
    params = engine.named_params()
    tensors = {e.megatron: params[local].detach().cpu() for e, local in engine.stage_entries()
               if here.tp == 0 or e.shard.dim is not None}
    return {"tp_rank": here.tp, "tp": engine.layout.tp, "tensors": tensors}


def assemble(shards: Iterable[Optional[dict[str, Any]]], bridge: LlamaBridge) -> dict[str, torch.Tensor]:
    """The whole generation model (vocabulary unpadded) from every training rank's `training_shard`."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    tp = 1
    for shard in shards:
        if shard is None:
            continue
        tp = shard["tp"]
        for name, tensor in shard["tensors"].items():
            pieces.setdefault(name, {})[shard["tp_rank"]] = tensor
    full = {}
    for e in bridge.entries():
        got = pieces.get(e.megatron, {})
        want = [0] if e.shard.dim is None else list(range(tp))
        if sorted(got) != want:
            raise KeyError(f"{e.megatron}: shards from TP ranks {sorted(got)} arrived, {want} are needed")
        full[e.megatron] = unshard_tensor([got[r] for r in want], e.shard)
    return bridge.megatron_to_generation(full)
