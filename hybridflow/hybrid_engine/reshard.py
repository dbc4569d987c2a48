"""The 3D-HybridEngine's switch to generation: the actor's weights into a tg-way generator, per grouping.

`GroupedWeights(engine, tg, grouping)` holds a tensor-parallel `Decoder` (this
rank's generation shard, `tensor_parallel.py`) and refills it from the
training engine as the reshard plan of `plan.py` lays out:

- `hybridflow` (the paper's grouping, the default): inside each micro-DP
  group's share of one pipeline stage (the `k = t/tg` consecutive TP ranks
  whose training shards make up one generation shard), one all-gather per
  *bucket* of parameters. The local shards are flattened into a buffer of at
  most `bucket_bytes`, so a model with many tensors costs few collectives;
  the pieces are re-laid with the sharding plan's own `unshard_tensor`
  (whole query groups for QKV, `[gate...; up...]` for SwiGLU). A rank
  receives exactly `(t*p - tg) / (tg * t*p) * M` bytes.
- `vanilla` (HybridFlow-V): generation TP groups of consecutive ranks, so a
  rank's generation shard is not made of its micro-DP group's pieces: the
  replica gathers every TP piece of each stage (the same buckets, over the
  whole TP group), then each rank cuts its shard out. `(t*p - 1)/(t*p) * M`.
- `full` (DeepSpeed-Chat): the whole model gathered one collective per
  tensor (`MegatronEngine.full_state`), then cut. Built for one training
  replica (d = 1), where its bytes are the plan's `(t*p - 1)/(t*p) * M`; at
  d > 1 DeepSpeed-Chat spreads the gather over the replicas, which this
  baseline does not (refused).

At pp > 1 (generation runs at pg = 1) each stage's part is then broadcast over
megatron-core's pipeline group, whose members share a TP rank, hence a
generation TP rank under `hybridflow`.

The generation buffer is a separate tensor, into which the rank's own
training shard is copied rather than aliased: megatron-core's DDP owns the
training storage and may move it, and an alias that silently went stale is
how verl and Megatron-LM shipped stale-weight bugs. The copy costs
`M / (t*p)` of memory (`reshard/own_shard_bytes`), no communication.
Switching back to training frees the generation weights (`release`); the
next `refresh` allocates them again.

Generation pipelining (pg > 1) is not built: `rollout.pg > 1` is refused by the config checks.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridflow.engine import MegatronEngine
from hybridflow.hybrid_engine.generation import ViewWeights, nbytes, transition_metrics
from hybridflow.hybrid_engine.plan import GenLayout, bridge_params, plan_reshard
from hybridflow.hybrid_engine.tensor_parallel import GroupTensorParallel
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.models.decoder import Decoder
from hybridflow.models.sharding import shard_tensor, unshard_tensor
from hybridflow.parallel.layout import Coord

DEFAULT_BUCKET_BYTES = 64 * 2**20


def new_groups(groups: list[list[int]]):
    """Every rank creates every group, in one order (torch.distributed requires it); returns rank -> group."""
    mine = {}
    for ranks in groups:
        handle = dist.new_group(ranks)
        for r in ranks:
            mine[r] = handle
    return mine


class GroupedWeights:
    """A tg-way generation model (pg = 1), refilled from `engine` by the plan of `grouping`."""

    def __init__(self, engine: MegatronEngine, tg: int, grouping: str = "hybridflow",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        train, rank = engine.layout, engine.rank  # the training layout, as the engine (and the run plan) hold it
        self.engine, self.tg, self.grouping, self.bucket_bytes = engine, tg, grouping, bucket_bytes
        if grouping == "full" and train.dp > 1:
            raise ValueError("the 'full' baseline gathers within one training replica; it is built for d = 1, "
                             f"got d = {train.dp}")
        element = torch.empty((), dtype=engine.dtype).element_size()
        self.plan = plan_reshard(bridge_params(engine.bridge, element), train, GenLayout(tg=tg), grouping,
                                 engine.virtual_pp)
        me = self.plan.gen_coords[rank]
        self.tg_rank = me.tg_rank
        index, count = self.plan.generation_replica(rank)
        self.mesh = (index, count, me.tg_rank == 0)  # the generation replica this rank serves; who answers
        self.entries = {e.megatron: e for e in engine.bridge.entries()}
        # k consecutive TP ranks of one stage gather among themselves: a micro-DP group (hybridflow), or
        # the whole TP group (vanilla: everything, then cut); `full` uses megatron's TP group per tensor.
        self.k = train.tp // tg if grouping == "hybridflow" else train.tp
        # Each CP rank holds its replica's whole shards, so it gathers with its own CP index's TP peers.
        gather = [[train.rank(Coord(tp=j * self.k + i, cp=c, dp=d, pp=s)) for i in range(self.k)]
                  for d in range(train.dp) for c in range(train.cp) for s in range(train.pp)
                  for j in range(train.tp // self.k)]
        self.gather_group = new_groups(gather)[rank]
        gen_tp = new_groups([list(g) for g in self.plan.gen_tp_groups])[rank]
        parallel = GroupTensorParallel(gen_tp, engine.bridge.padded_vocab) if tg > 1 else None
        model = Decoder(engine.cfg, parallel) if parallel is not None else Decoder(engine.cfg)
        self.model = model.to(device=engine.torch_device, dtype=engine.dtype).eval()
        self.model.requires_grad_(False)
        self.shapes = {name: p.shape for name, p in self.model.named_parameters()}
        self._released = None  # the forward hook that refuses to generate from released weights
        self.refresh()

    def release(self) -> None:
        """Switch back to training: free the generation weights until the next `refresh`.

        Generating from released weights raises instead of running on empty tensors.
        """
        if self._released is not None:
            return
        for p in self.model.parameters():
            p.data = p.data.new_empty(0)
        self._released = self.model.register_forward_pre_hook(refuse_released)
        self.model.forward_cached = refuse_released  # the generator's entry point (an instance attribute)

    def _buckets(self) -> list[list]:
        """This stage's (entry, local name) pairs in buckets of at most `bucket_bytes` local bytes."""
        params, buckets, size = self.engine.named_params(), [[]], 0
        for entry, local in self.engine.stage_entries():
            nbytes = params[local].numel() * params[local].element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((entry, local))
            size += nbytes
        return [b for b in buckets if b]

    def _gathered(self, traffic: Traffic) -> dict[str, torch.Tensor]:
        """This stage's tensors (megatron names), each the union of its gather group's TP pieces:
        bucketed all-gathers, one per bucket."""
        params, out = self.engine.named_params(), {}
        for bucket in self._buckets():
            sharded = [(e, n) for e, n in bucket if e.shard.dim is not None and self.k > 1]
            for e, n in bucket:
                if (e, n) not in sharded:
                    out[e.megatron] = params[n].detach().clone()  # replicated, or already whole (k = 1)
            if not sharded:
                continue
            flat = torch.cat([params[n].detach().reshape(-1) for _, n in sharded])
            gathered = [torch.empty_like(flat) for _ in range(self.k)]
            dist.all_gather(gathered, flat, group=self.gather_group)
            moved = flat.numel() * flat.element_size() * (self.k - 1)
            traffic.add(moved, moved)  # the own bucket out to k - 1 peers, theirs in
            offset = 0
            for e, n in sharded:
                shape, count = params[n].shape, params[n].numel()
                out[e.megatron] = unshard_tensor([g[offset:offset + count].view(shape) for g in gathered], e.shard)
                offset += count
        return out

    def _generation_part(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One stage's gathered tensors -> this rank's generation shard of them (megatron names)."""
        if self.grouping == "hybridflow":  # its gather already is the generation shard
            return part
        return {name: shard_tensor(t, self.entries[name].shard, self.tg_rank, self.tg) for name, t in part.items()}

    @torch.no_grad()
    def refresh(self) -> dict[str, float]:
        """Copy the engine's current weights into the generation shard; the transition's figures.

        Every rank of the engine must call it. `reshard/peak_bytes` is the most
        generation-weight bytes held at once: the shard, plus, for `vanilla`
        and `full`, one whole stage before it is cut.
        """
        start, traffic = time.perf_counter(), Traffic()
        mine = self.engine.stage_state(traffic) if self.grouping == "full" else self._gathered(traffic)
        shard: dict[str, torch.Tensor] = {}
        peak = 0
        for part in self.engine.each_stage(mine, traffic):  # generation runs at pg = 1
            peak = max(peak, nbytes(shard.values()) + nbytes(part.values()))
            shard.update(self._generation_part(part))
        if self.tg == 1:  # the whole model: the one-rank generator has no vocabulary padding
            shard = self.engine.bridge.megatron_to_generation(shard)
        else:
            shard = {self.entries[name].generation: t for name, t in shard.items()}
        params = dict(self.model.named_parameters())
        if self._released is not None:  # allocate again what `release` freed
            for name, p in params.items():
                p.data = p.data.new_empty(self.shapes[name])
            self._released.remove()
            del self.model.forward_cached  # the class's method again
            self._released = None
        for name, value in shard.items():
            params[name].copy_(value)
        metrics = transition_metrics(traffic, self.model, time.perf_counter() - start)
        metrics["reshard/peak_bytes"] = float(max(peak, metrics["reshard/peak_bytes"]))
        metrics["reshard/own_shard_bytes"] = float(nbytes(self.engine.named_params().values()))
        return metrics


def refuse_released(*args, **kwargs):
    raise RuntimeError("the generation weights were released for training: refresh them (the switch to "
                       "generation, RLTrainer.transition) before generating")


def generation_weights(engine: MegatronEngine, tg: int = 1, grouping: str = "hybridflow"):
    """The actor's generation weights: views at tp = pp = 1 (the other expert-parallel ranks' experts gathered
    at ep > 1), else a `GroupedWeights` at `tg`."""
    if getattr(engine, "experts", None) is not None and engine.experts.ep > 1:
        from hybridflow.hybrid_engine.expert_weights import ExpertGatheredWeights
        return ExpertGatheredWeights(engine, lambda source: generation_weights(source, tg, grouping))
    if engine.layout.tp == 1 and engine.layout.pp == 1:
        return ViewWeights(engine)
    return GroupedWeights(engine, tg, grouping)
