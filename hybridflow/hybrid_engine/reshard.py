"""The 3D-HybridEngine's switch to generation: the paper's grouped gather into a tg-way generator.

`GroupedWeights(engine, tg)` holds a tensor-parallel `Decoder` (this rank's
generation shard, `tensor_parallel.py`) and refills it from the training
engine with the `hybridflow` grouping of `plan.py`:

1. inside each micro-DP group's share of one pipeline stage (the `k = t/tg`
   consecutive TP ranks whose training shards make up one generation
   shard), one all-gather per *bucket* of parameters: the local shards are
   flattened into a buffer of at most `bucket_bytes`, so a model with many
   tensors costs few collectives;
2. the pieces are re-laid with the sharding plan's own `unshard_tensor`
   (whole query groups for QKV, `[gate...; up...]` for SwiGLU);
3. at pp > 1 (generation runs at pg = 1), each stage's generation shard is
   broadcast over megatron-core's pipeline group, whose members share the
   same generation TP rank.

A rank receives exactly `(t*p - tg) / (tg * t*p) * M` bytes, what the plan
counts (tested). The generation buffer is a separate tensor, into which the
rank's own training shard is copied rather than aliased: megatron-core's DDP
owns the training storage and may move it, and an alias that silently went
stale is how verl and Megatron-LM shipped stale-weight bugs. The copy costs
`M / (t*p)` of memory (`reshard/own_shard_bytes`), no communication.

Not built yet: generation pipelining (pg > 1), and using this in the trainer
(`rollout.tg > 1` is still refused by the config checks).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridflow.engine.megatron import MegatronEngine, Traffic
from hybridflow.hybrid_engine.generation import nbytes, transition_metrics
from hybridflow.hybrid_engine.plan import GenLayout, bridge_params, plan_reshard
from hybridflow.hybrid_engine.tensor_parallel import GroupTensorParallel
from hybridflow.models.decoder import Decoder
from hybridflow.models.sharding import unshard_tensor
from hybridflow.parallel.layout import Coord, ParallelDims

DEFAULT_BUCKET_BYTES = 64 * 2**20


def _new_groups(groups: list[list[int]]):
    """Every rank creates every group, in one order (torch.distributed requires it); returns rank -> group."""
    mine = {}
    for ranks in groups:
        handle = dist.new_group(ranks)
        for r in ranks:
            mine[r] = handle
    return mine


class GroupedWeights:
    """A tg-way generation model (pg = 1), refilled from `engine` by micro-DP all-gathers."""

    def __init__(self, engine: MegatronEngine, tg: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        lay = engine.layout
        self.engine, self.tg, self.bucket_bytes = engine, tg, bucket_bytes
        self.dims = ParallelDims(tp=lay.tp, pp=lay.pp, dp=lay.dp)
        element = torch.empty((), dtype=engine.dtype).element_size()
        self.plan = plan_reshard(bridge_params(engine.bridge, element), self.dims, GenLayout(tg=tg), "hybridflow")
        me = self.plan.gen_coords[lay.rank]
        self.tg_rank, self.k = me.tg_rank, lay.tp // tg
        # The k consecutive TP ranks of one stage that gather among themselves, and the generation TP groups.
        gather = [[self.dims.rank(Coord(tp=j * self.k + i, cp=0, dp=d, pp=s)) for i in range(self.k)]
                  for d in range(lay.dp) for s in range(lay.pp) for j in range(tg)]
        self.gather_group = _new_groups(gather)[lay.rank]
        gen_tp = _new_groups([list(g) for g in self.plan.gen_tp_groups])[lay.rank]
        parallel = GroupTensorParallel(gen_tp, engine.bridge.padded_vocab) if tg > 1 else None
        model = Decoder(engine.cfg, parallel) if parallel is not None else Decoder(engine.cfg)
        self.model = model.to(device=engine._torch_device(), dtype=engine.dtype).eval()
        self.model.requires_grad_(False)
        self.refresh()

    def _buckets(self) -> list[list]:
        """This stage's (entry, local name) pairs in buckets of at most `bucket_bytes` local bytes."""
        params, buckets, size = self.engine._named_params(), [[]], 0
        for entry, local in self.engine._stage_entries():
            nbytes = params[local].numel() * params[local].element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((entry, local))
            size += nbytes
        return [b for b in buckets if b]

    def _stage_shard(self, traffic: Traffic) -> dict[str, torch.Tensor]:
        """This stage's generation shard (generation names): bucketed all-gathers of the TP pieces."""
        params, out = self.engine._named_params(), {}
        for bucket in self._buckets():
            sharded = [(e, n) for e, n in bucket if e.shard.dim is not None and self.k > 1]
            for e, n in bucket:
                if (e, n) not in sharded:
                    out[e.generation] = params[n].detach().clone()  # replicated, or already whole (k = 1)
            if not sharded:
                continue
            flat = torch.cat([params[n].detach().reshape(-1) for _, n in sharded])
            gathered = [torch.empty_like(flat) for _ in range(self.k)]
            dist.all_gather(gathered, flat, group=self.gather_group)
            traffic.add(flat.numel() * flat.element_size() * (self.k - 1))
            offset = 0
            for e, n in sharded:
                shape, count = params[n].shape, params[n].numel()
                pieces = [g[offset:offset + count].view(shape) for g in gathered]
                out[e.generation] = unshard_tensor(pieces, e.shard)
                offset += count
        return out

    @torch.no_grad()
    def refresh(self) -> dict[str, float]:
        """Copy the engine's current weights into the generation shard; the transition's figures."""
        start, traffic = time.perf_counter(), Traffic()
        shard: dict[str, torch.Tensor] = {}
        for part in self.engine.each_stage(self._stage_shard(traffic), traffic):  # generation runs at pg = 1
            shard.update(part)
        if self.tg == 1:  # the whole model: drop the vocabulary padding, as the one-rank generator has none
            vocab = {e.generation for e in self.engine.bridge.entries() if e.vocab}
            shard = {name: t[: self.engine.cfg.vocab_size] if name in vocab else t for name, t in shard.items()}
        params = dict(self.model.named_parameters())
        for name, value in shard.items():
            params[name].copy_(value)
        metrics = transition_metrics(traffic, self.model, time.perf_counter() - start)
        metrics["reshard/own_shard_bytes"] = float(nbytes(self.engine._named_params().values()))
        return metrics
