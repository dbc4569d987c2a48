"""A LoRA actor's weights on their way to the rollout: the merged W + s * B A, never the frozen base alone.

Every route to the rollout reads the training engine's parameters (views at tp = pp = 1, the reshard
plan's gather, the apart sync's sends, the push into vLLM). With LoRA those routes read `AdapterMerge`
instead: the engine as it is, except that each adapted weight is a persistent buffer holding this rank's
shard of W + s * B A. The merge of a shard needs only that rank's pieces (`engine/lora.py`), so it moves
no byte; what the routes then move is the merged tensors, as many bytes as full fine-tuning moves
(docs/design.md, "LoRA"). `MergedWeights` is the generation weights of a LoRA actor: merge, then the
route's own refresh.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from hybridflow.hybrid_engine.generation import nbytes


class AdapterMerge:
    """`engine` (a `MegatronEngine` with `lora`) whose `named_params` hold the merged adapted weights.

    The buffers are allocated once, so views bound to them (`ViewWeights`) follow every `merge()`. Any other
    attribute is the engine's own.
    """

    def __init__(self, engine):
        if engine.lora is None:
            raise ValueError("AdapterMerge needs an engine with LoRA adapters (actor.lora.rank > 0)")
        self.engine = engine
        params = engine.named_params()
        self.buffers: dict[str, Tensor] = {a.local: torch.empty_like(params[a.local]).requires_grad_(False)
                                           for a in engine.lora.adapted}
        self.merge()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @torch.no_grad()
    def merge(self) -> float:
        """Each buffer := this rank's W + s * B A, from the current adapters; the seconds it took."""
        start, params = time.perf_counter(), self.engine.named_params()
        for a in self.engine.lora.adapted:
            self.buffers[a.local].copy_(params[a.local]).add_(self.engine.lora.delta(a))
        return time.perf_counter() - start

    def named_params(self) -> dict[str, Tensor]:
        return {**self.engine.named_params(), **self.buffers}

    def generation_state(self) -> dict[str, Tensor]:
        """As `MegatronEngine.generation_state` (tp = pp = 1), the adapted weights the merged buffers."""
        if self.engine.layout.tp > 1 or self.engine.layout.pp > 1:
            raise NotImplementedError("a sharded engine has no whole-model views; gather it (full_state)")
        return self.engine.bridge.megatron_to_generation(self.named_params())


class MergedWeights:
    """The generation weights of a LoRA actor: `inner(AdapterMerge(engine))` (views or the reshard plan's
    refilled shard), the merge run before each of its refreshes. `lora/merge_time_s` and `lora/merged_bytes`
    (this rank's merged shards) join its `reshard/*` figures."""

    def __init__(self, engine, inner):
        self.source = AdapterMerge(engine)
        self.inner = inner(self.source)
        self.model, self.mesh = self.inner.model, self.inner.mesh

    def release(self) -> None:
        self.inner.release()

    def refresh(self) -> dict[str, float]:
        seconds = self.source.merge()
        metrics = self.inner.refresh()
        metrics["reshard/time_s"] += seconds
        metrics.update({"lora/merge_time_s": seconds, "lora/merged_bytes": float(nbytes(self.source.buffers.values()))})
        return metrics


def adapters_of(engine) -> bool:
    """Whether `engine` trains LoRA adapters (only the megatron-core engine builds them)."""
    return engine.kind == "megatron" and engine.lora is not None
