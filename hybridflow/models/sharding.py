"""The tensor-parallel sharding plan, as data (rule 2, docs/conventions.md).

One table says how each megatron-core parameter is split across a TP group;
training, the 3D-HybridEngine and the reshard tool all read it. Splitting and
joining are pure functions of (tensor, spec, rank, size).

- COLUMN: output features split along dim 0 (`linear_qkv`, `linear_fc1`).
  `blocks=2` marks a tensor made of equal sub-blocks that are split
  separately: Megatron's `linear_fc1` holds `[gate_r; up_r]` on rank r, not a
  slice of `[gate; up]`.
- ROW: input features split along dim 1 (`linear_proj`, `linear_fc2`).
- VOCAB: vocabulary rows split along dim 0 (embedding, output layer); the
  vocabulary is padded to a multiple of the TP size first.
- REPLICATE: every rank holds the whole tensor (norms, an MoE router).

An MoE layer's experts (`local_experts.J.linear_fc1`, `...linear_fc2`) and
shared expert split like a dense MLP: the table is keyed by the last two
name components.

Megatron's grouped QKV layout keeps each query group contiguous, so a plain
COLUMN split hands every rank whole groups (`num_kv_heads % tp == 0`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch


class Shard(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    REPLICATE = "replicate"


@dataclass(frozen=True)
class ShardSpec:
    kind: Shard
    blocks: int = 1  # equal sub-blocks along the split dim, each split on its own

    @property
    def dim(self) -> int | None:
        return {Shard.COLUMN: 0, Shard.VOCAB: 0, Shard.ROW: 1}.get(self.kind)


COLUMN, ROW = ShardSpec(Shard.COLUMN), ShardSpec(Shard.ROW)
VOCAB, REPLICATE = ShardSpec(Shard.VOCAB), ShardSpec(Shard.REPLICATE)

# Keyed by the last two components of a megatron-core GPTModel parameter name.
SHARDING_PLAN: dict[str, ShardSpec] = {
    "word_embeddings.weight": VOCAB,
    "output_layer.weight": VOCAB,
    "linear_qkv.weight": COLUMN,
    "linear_qkv.bias": COLUMN,
    "linear_proj.weight": ROW,
    "linear_fc1.weight": ShardSpec(Shard.COLUMN, blocks=2),
    "linear_fc2.weight": ROW,
    "q_layernorm.weight": REPLICATE,
    "k_layernorm.weight": REPLICATE,
    "router.weight": REPLICATE,  # MoE: every rank routes every token
    "shared_experts.gate_weight": REPLICATE,
    "input_layernorm.weight": REPLICATE,
    "pre_mlp_layernorm.weight": REPLICATE,
    "final_layernorm.weight": REPLICATE,
}


def spec_for(megatron_name: str) -> ShardSpec:
    """The plan entry for a full megatron-core parameter name."""
    key = ".".join(megatron_name.split(".")[-2:])
    if key not in SHARDING_PLAN:
        raise KeyError(f"no sharding rule for parameter {megatron_name!r} (looked up {key!r})")
    return SHARDING_PLAN[key]


def shard_tensor(t: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece of the full tensor `t` in a group of `size`.

    A view of `t` where the layout allows it (blocks == 1), else a new tensor.
    """
    if spec.kind is Shard.REPLICATE or size == 1:
        return t
    dim = spec.dim
    if t.shape[dim] % (size * spec.blocks):
        raise ValueError(
            f"dim {dim} of size {t.shape[dim]} does not split into {size} ranks x {spec.blocks} blocks")
    blocks = t.chunk(spec.blocks, dim=dim)
    pieces = [b.chunk(size, dim=dim)[rank] for b in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_tensor(pieces: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `shard_tensor` over all ranks' pieces, in rank order."""
    if spec.kind is Shard.REPLICATE or len(pieces) == 1:
        return pieces[0]
    dim = spec.dim
    per_rank = [p.chunk(spec.blocks, dim=dim) for p in pieces]
    return torch.cat([r[b] for b in range(spec.blocks) for r in per_rank], dim=dim)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
