"""An MoE layer's experts as `transformers` holds them in memory and as its checkpoints store them.

`transformers` 5 builds a layer's experts as two fused parameters, `mlp.experts.gate_up_proj` [E, 2F, H]
(each expert's [gate; up]) and `mlp.experts.down_proj` [E, H, F], and Mixtral's router as `mlp.gate`; its
`save_pretrained` writes one tensor per expert under the family's names (`mlp.experts.J.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.J.w1.weight`), which is what the bridge maps. `InMemoryNames` reads a
checkpoint under the in-memory names (rows of a fused tensor are experts, so a rank reads only its experts'
tensors) and `to_checkpoint_names` turns in-memory tensors back into the stored ones, so a model trained on
`transformers`' own code loads and exports checkpoints exactly as `transformers` writes them.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from hybridflow.models.bridge import SliceReader
from hybridflow.models.config import DecoderConfig


def expert_layout(cfg: DecoderConfig) -> tuple[dict[str, list[tuple[str, ...]]], dict[str, str]]:
    """(fused: in-memory name -> each expert's stored tensors, in the order they are concatenated;
    renamed: in-memory name -> stored name of a tensor stored under another name)."""
    fused: dict[str, list[tuple[str, ...]]] = {}
    renamed: dict[str, str] = {}
    if not cfg.is_moe:
        return fused, renamed
    mixtral = cfg.model_type == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_layers):
        memory, stored = f"model.layers.{i}.mlp.", f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}."
        experts = [f"{stored}experts.{j}." for j in range(cfg.num_experts)]
        fused[memory + "experts.gate_up_proj"] = [(e + f"{gate}.weight", e + f"{up}.weight") for e in experts]
        fused[memory + "experts.down_proj"] = [(e + f"{down}.weight",) for e in experts]
        if mixtral:
            renamed[memory + "gate.weight"] = stored + "gate.weight"
    return fused, renamed


class InMemoryNames:
    """A `SliceReader` of stored (checkpoint) names seen under `transformers`' in-memory names."""

    def __init__(self, read: SliceReader, cfg: DecoderConfig):
        self.read = read
        self.fused, self.renamed = expert_layout(cfg)

    def keys(self) -> list[str]:
        parts = {name for experts in self.fused.values() for expert in experts for name in expert}
        back = {stored: memory for memory, stored in self.renamed.items()}
        stored = [back.get(name, name) for name in self.read.keys() if name not in parts]
        return stored + [name for name, experts in self.fused.items() if all(n in parts for e in experts for n in e)]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.fused:
            return tuple(self.read.shape(self.renamed.get(name, name)))
        first = [self.read.shape(n) for n in self.fused[name][0]]
        return (len(self.fused[name]), sum(s[0] for s in first), *first[0][1:])

    def __call__(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        if name not in self.fused:
            return self.read(self.renamed.get(name, name), rows=rows, cols=cols)
        if cols is not None:
            raise ValueError(f"{name}: fused experts are read by rows (experts) only")
        experts = self.fused[name][rows if rows is not None else slice(None)]
        if not experts:
            return torch.empty(0, *self.shape(name)[1:])
        return torch.stack([torch.cat([self.read(n) for n in expert]) for expert in experts])


def to_checkpoint_names(named: Iterable[tuple[str, torch.Tensor]],
                        cfg: DecoderConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(in-memory name, tensor) pairs -> the stored ones: each fused expert tensor split per expert."""
    fused, renamed = expert_layout(cfg)
    for name, tensor in named:
        if name not in fused:
            yield renamed.get(name, name), tensor
            continue
        for expert, parts in zip(tensor, fused[name]):
            sizes = [expert.shape[0] // len(parts)] * len(parts)
            yield from zip(parts, (p.contiguous() for p in expert.split(sizes)))
