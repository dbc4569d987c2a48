"""A LoRA actor's weights on their way to the rollout: the merged W + s * B A, never the frozen base alone.

Two ways, chosen once when the run is built (`lora_generation`):

- merged (`MergedWeights`; views at tp = pp = 1, the `vanilla`/`full` groupings, pp > 1, vLLM): the routes read
  `AdapterMerge`, the engine with each adapted weight a persistent buffer holding this rank's shard of
  W + s * B A. The merge of a shard needs only that rank's pieces (`engine/lora.py`), so it moves no byte;
  what the route then moves is the merged tensors, as many bytes as full fine-tuning (at tp = pp = 1 the views
  move nothing either way).
- adapters only (`AdapterGatheredWeights`; the built-in generator at tp > 1, pp = 1, `hybridflow` grouping):
  the first sync gathers the frozen base into the generation shard, which keeps a copy of its adapted
  tensors; every later sync gathers only the split side of each adapter (B's rows on a column-parallel layer,
  A's columns on a row-parallel one: the other side is replicated) and merges base + s * B A there, each
  training piece's delta computed as its training rank computes it (`lora_delta`), so the weights are those
  of the merged sync bit for bit. Bytes per rank: docs/design.md, "LoRA weights and their bytes".
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.engine.lora import lora_delta
from hybridflow.hybrid_engine.generation import nbytes, transition_metrics
from hybridflow.hybrid_engine.reshard import GroupedWeights, generation_weights
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.models.sharding import unshard_tensor


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


class AdapterGatheredWeights(GroupedWeights):
    """The reshard plan's tg-way generation shard (`hybridflow` grouping, pp = 1) of a LoRA actor, refilled by
    its adapters alone after the first sync (module docstring). The shard is never released: it holds the
    base, which the adapters are merged onto at every sync (LoRA training holds no gradient or optimizer
    state of the base, which leaves room for it). `first` holds the first sync's figures."""

    def __init__(self, engine, tg: int, bucket_bytes: int):
        if engine.layout.pp > 1 or (engine.experts is not None and engine.experts.ep > 1):
            raise ValueError("adapter-only syncs are built for pp = 1 without expert parallelism")
        self.lora, self.base, self.first = engine.lora, None, None
        super().__init__(engine, tg, "hybridflow", bucket_bytes)  # its refresh: the first sync

    def release(self) -> None:
        """Nothing to free: the shard keeps the base until the next merge."""

    def split_pieces(self) -> list[Tensor]:
        """This rank's split side of each adapter, in `lora.adapted` order: B on a column-parallel layer (its
        rows of W's), A on a row-parallel one (its columns)."""
        params = self.engine.named_params()
        return [params[a.local[:-len("weight")] + ("lora_B" if a.column else "lora_A")].detach()
                for a in self.lora.adapted]

    def plan_bytes(self) -> int:
        """What a later sync's gather brings this rank: (k - 1) peers' split pieces, k = t / tg."""
        return (self.k - 1) * nbytes(self.split_pieces())

    def _gathered_pieces(self, traffic: Traffic) -> list[list[Tensor]]:
        """Each adapter's split side from the k ranks of this rank's gather group (one all-gather, of pieces
        that add up to a few megabytes at most), in group order."""
        mine = self.split_pieces()
        if self.k == 1:
            return [[t] for t in mine]
        flat = torch.cat([t.reshape(-1) for t in mine])
        gathered = [torch.empty_like(flat) for _ in range(self.k)]
        dist.all_gather(gathered, flat, group=self.gather_group)
        moved = flat.numel() * flat.element_size() * (self.k - 1)
        traffic.add(moved, moved)
        out, offset = [], 0
        for t in mine:
            out.append([g[offset:offset + t.numel()].view(t.shape) for g in gathered])
            offset += t.numel()
        return out

    @torch.no_grad()
    def merge_adapters(self, traffic: Traffic) -> None:
        """Each adapted generation weight := its base + s * B A, the delta of each training piece computed from
        that piece's adapters as its rank computes it, then laid out as the base shard is."""
        params, model = self.engine.named_params(), dict(self.model.named_parameters())
        for a, pieces in zip(self.lora.adapted, self._gathered_pieces(traffic)):
            whole = params[a.local[:-len("weight")] + ("lora_A" if a.column else "lora_B")].detach()
            weight = params[a.local]
            deltas = [lora_delta(whole, p, self.lora.scale, weight.dtype) if a.column
                      else lora_delta(p, whole, self.lora.scale, weight.dtype) for p in pieces]
            entry = self.entries[a.key + ".weight"]
            delta = unshard_tensor(deltas, entry.shard) if self.k > 1 else deltas[0]
            torch.add(self.base[entry.generation], delta, out=model[entry.generation])

    def refresh(self) -> dict[str, float]:
        """The first call gathers the base (every tensor, as `GroupedWeights`) and keeps its adapted tensors;
        every call then gathers the adapters and merges. `lora/*` figures: this sync's adapter bytes
        received and the plan's, the merge's time, the merged weights' bytes and the base copy held."""
        if self.base is not None:
            start, traffic = time.perf_counter(), Traffic()
            self.merge_adapters(traffic)
            metrics = transition_metrics(traffic, self.model, time.perf_counter() - start)
            metrics["reshard/own_shard_bytes"] = float(nbytes(self.engine.named_params().values()))
        else:
            metrics = super().refresh()  # the engine's parameters are the frozen base: the base is gathered
            names = [self.entries[a.key + ".weight"].generation for a in self.lora.adapted]
            model = dict(self.model.named_parameters())
            self.base = {name: model[name].detach().clone() for name in names}
            start, traffic = time.perf_counter(), Traffic()
            self.merge_adapters(traffic)
            for key, value in transition_metrics(traffic, self.model, 0.0).items():
                if key.endswith(("bytes_received", "bytes_sent", "collectives")):
                    metrics[key] += value
            metrics["reshard/time_s"] += time.perf_counter() - start
        metrics.update({"lora/adapter_bytes_received": float(traffic.bytes_received),
                        "lora/plan_bytes_received": float(self.plan_bytes()),
                        "lora/merge_time_s": time.perf_counter() - start,
                        # the adapted generation weights merged here, as many bytes as their base copy
                        "lora/merged_bytes": float(nbytes(self.base.values())),
                        "lora/base_copy_bytes": float(nbytes(self.base.values()))})
        if self.first is None:
            self.first = dict(metrics)
        return metrics


def lora_generation(engine, rollout):
    """A LoRA actor's colocated generation weights: adapters only where the bytes move and the built-in
    generator keeps the shard (tp > 1, pp = 1, `hybridflow` grouping, no expert parallelism or expert
    adapters), else the merged weights through the route `generation_weights` picks."""
    experts = engine.experts.ep > 1 or any(".experts." in a.key for a in engine.lora.adapted)
    if (rollout.engine == "builtin" and engine.layout.tp > 1 and engine.layout.pp == 1
            and rollout.grouping == "hybridflow" and not experts):
        return AdapterGatheredWeights(engine, rollout.tg, rollout.weight_bucket_mb * 2**20)
    return MergedWeights(engine, lambda source: generation_weights(source, rollout.tg, rollout.grouping))


def adapters_of(engine) -> bool:
    """Whether `engine` trains LoRA adapters (only the megatron-core engine builds them)."""
    return engine.kind == "megatron" and engine.lora is not None
