"""A LoRA actor's weights into a rollout group apart: the base once, then the adapters alone.

The base is frozen, so the rollout needs it once. The first sync runs the apart plan (`apart.py`) over the
training shards of the base (W, not the merged W + s * B A) and the rollout rank keeps a copy of its adapted
tensors; every sync (the first included) then broadcasts the adapters by `plan_adapters` and the rollout rank
merges base + s * B A in its own generation layout:

- every rollout rank receives every adapter whole, as its TP pieces: the split side (B's rows of a
  column-parallel layer, A's columns of a row-parallel one) from each training TP rank, the replicated
  side once. That is `r * (d_in + d_out)` elements per adapted matrix, whatever the layouts.
- the delta of each training piece is computed as its training rank computes it (`lora_delta`), laid out as
  the weight is (`unshard_tensor`) and cut to the generation shard (`shard_tensor`), so the merged weights
  equal, bit for bit, those of the merged-tensor sync (which sends W_i + delta_i and cuts the same way).

`AdapterSender` and `AdapterReceiver` answer the calls of `worker_weights.ShardSender` and `ShardReceiver`;
`apart_sender` / `apart_receiver` pick the pair when a worker is built.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from hybridflow.config.schema import LoRAConfig, ModelConfig
from hybridflow.engine.lora import lora_delta
from hybridflow.hybrid_engine.apart import ApartPlan, Slice, add_broadcasts, holders_of, plan_apart
from hybridflow.hybrid_engine.lora_weights import adapters_of
from hybridflow.hybrid_engine.plan import bridge_params
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.hybrid_engine.weight_sync import SyncWorld, pack, unpack
from hybridflow.hybrid_engine.worker_weights import ShardReceiver, ShardSender
from hybridflow.models.config import DecoderConfig
from hybridflow.models.sharding import shard_tensor, spec_for, unshard_tensor
from hybridflow.parallel.layout import ParallelDims
from hybridflow.parallel.stages import param_stage
from hybridflow.rollout import RolloutBackend, sync_weights

DENSE = re.compile(r"^decoder\.layers\.\d+\.(self_attention|mlp)\.(\w+)\.weight$")
COLUMN = ("linear_qkv", "linear_fc1")


@dataclass(frozen=True)
class AdaptedMatrix:
    """One adapted weight `W [d_out, d_in]` (global megatron name), column-parallel or row-parallel."""

    weight: str
    column: bool
    d_out: int
    d_in: int

    def pieces(self, rank: int, tp: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the adapter's pieces: the split side's `.{i}` for each training TP rank i, then
        the replicated side (whole)."""
        if self.column:
            split = {f"{self.weight}.lora_B.{i}": (self.d_out // tp, rank) for i in range(tp)}
            return {**split, f"{self.weight}.lora_A": (rank, self.d_in)}
        split = {f"{self.weight}.lora_A.{i}": (rank, self.d_in // tp) for i in range(tp)}
        return {**split, f"{self.weight}.lora_B": (self.d_out, rank)}


def adapted_matrices(bridge, target_modules: list[str]) -> list[AdaptedMatrix]:
    """The dense linears `target_modules` names, in bridge order: the ones `engine/lora.attach_lora` adapts."""
    out = []
    for name, shape in bridge.megatron_shapes().items():
        match = DENSE.match(name)
        if match and match[2] in target_modules:
            out.append(AdaptedMatrix(name, match[2] in COLUMN, shape[0], shape[1]))
    return out


def plan_adapters(matrices: list[AdaptedMatrix], rank: int, element: int, train: ParallelDims, layers: int,
                  rollout_world: int, bucket_bytes: int, virtual_pp: int = 1) -> ApartPlan:
    """The broadcasts of one adapter sync: each piece (`AdaptedMatrix.pieces`) from a training rank of its
    stage that holds it (the split side's piece i: TP rank i; the replicated side: TP rank `index % t`; among
    the d replicas the one with the fewest bytes so far) to every rollout rank, packed per sender into
    buckets of at most `bucket_bytes`. `needed_bytes`: r * (d_in + d_out) elements per adapted matrix."""
    t, n = train.tp, train.world_size
    dsts = tuple(range(n, n + rollout_world))
    load = {r: 0 for r in range(n)}
    by_group: dict[tuple[int, tuple[int, ...]], list[Slice]] = {}
    for index, m in enumerate(matrices):
        stage = param_stage(m.weight, layers, train.pp, virtual_pp)
        for name, shape in m.pieces(rank, t).items():
            tp_rank = int(name.rsplit(".", 1)[1]) if name[-1].isdigit() else index % t
            src = min(holders_of(train, tp_rank, stage), key=lambda h: (load[h], h))
            nbytes = shape[0] * shape[1] * element
            load[src] += nbytes
            by_group.setdefault((src, dsts), []).append(Slice(name, None, 1, 0, 0, 0, nbytes))
    plan = ApartPlan(train, 1, rollout_world, bucket_bytes)
    add_broadcasts(plan, by_group)
    needed = sum(rank * (m.d_in + m.d_out) * element for m in matrices)
    plan.needed_bytes = {i: needed for i in range(rollout_world)}
    return plan


class AdapterPlans:
    """The two plans of a LoRA sync (the base's, the adapters') and the sync world that runs both."""

    def __init__(self, bridge, lora: LoRAConfig, element: int, train: ParallelDims, tg: int, rollout_world: int,
                 bucket_bytes: int, virtual_pp: int, ep: int = 1):
        self.matrices = adapted_matrices(bridge, lora.target_modules)
        self.base = plan_apart(bridge_params(bridge, element), train, tg, rollout_world, bucket_bytes, virtual_pp,
                               ep)
        self.adapters = plan_adapters(self.matrices, lora.rank, element, train, bridge.cfg.num_layers,
                                      rollout_world, bucket_bytes, virtual_pp)
        self.both = ApartPlan(train, tg, rollout_world, bucket_bytes,
                              [*self.base.broadcasts, *self.adapters.broadcasts])

    def join(self, rank: int, address: str, port: int, device: str) -> SyncWorld:
        return SyncWorld(self.both, rank, address, port, device)

    def metrics(self, plans: list[ApartPlan], total: Traffic, adapters: Traffic, rank: int,
                seconds: float) -> dict[str, float]:
        """`weight_sync.sync_metrics` over the plans one sync ran, with its adapters' own counted bytes."""
        formula = sum(p.needed_bytes.get(rank - p.train_world, 0) for p in plans)
        return {"sync/formula_bytes_received": float(formula), "sync/bytes_received": float(total.bytes_received),
                "sync/bytes_sent": float(total.bytes_sent), "sync/collectives": float(total.collectives),
                "sync/plan_collectives": float(sum(p.collectives(rank) for p in plans)),
                "sync/plan_bytes_received": float(sum(p.bytes_received(rank) for p in plans)),
                "sync/plan_bytes_sent": float(sum(p.bytes_sent(rank) for p in plans)), "sync/time_s": seconds,
                "lora/adapter_bytes_received": float(adapters.bytes_received),
                "lora/adapter_bytes_sent": float(adapters.bytes_sent)}


def run_plan(world: SyncWorld, plan: ApartPlan, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
             traffic: Traffic, sender: bool) -> None:
    """This rank's broadcasts of `plan`, in plan order: packed from `tensors` (a sender) or unpacked into them."""
    for b in plan.broadcasts:
        if world.rank not in b.group:
            continue
        if sender:
            buffer = pack(b, tensors)
            world.broadcast(b, buffer)
            traffic.add(0, buffer.numel() * buffer.element_size() * len(b.dsts))
        else:
            device = next(iter(tensors.values())).device
            buffer = torch.empty(b.nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
            world.broadcast(b, buffer)
            unpack(b, buffer, tensors)
            traffic.add(b.nbytes)


class AdapterSender:
    """A LoRA actor rank's side of the sync apart: its base shard in the first sync, its adapters in each."""

    def __init__(self, engine, rank: int, device: str):
        self.engine, self.rank, self.device = engine, rank, device
        self.plans: Optional[AdapterPlans] = None
        self.world: Optional[SyncWorld] = None
        self.base_sent = False
        self.staged: dict[int, dict[str, torch.Tensor]] = {}  # weight version -> adapter copy (`stage`)
        self._lock = threading.Lock()  # `send_staged` runs aside, on another thread of this process

    def join(self, address: str, port: int, tg: int, rollout_world: int, bucket_bytes: int) -> None:
        e = self.engine
        element = torch.empty((), dtype=e.dtype).element_size()
        self.plans = AdapterPlans(e.bridge, e.lora.cfg, element, e.layout, tg, rollout_world, bucket_bytes,
                                  e.virtual_pp, e.experts.ep)
        mine = {a.key + ".weight" for a in e.lora.adapted}
        stage = {m.weight for m in self.plans.matrices
                 if param_stage(m.weight, e.cfg.num_layers, e.layout.pp, e.virtual_pp) == e.coord.pp}
        if mine != stage:
            raise ValueError(f"adapter-only sync: this stage adapts {sorted(mine - stage)[:3]} beyond the dense "
                             f"linears it plans for, or misses {sorted(stage - mine)[:3]}")
        self.world = self.plans.join(self.rank, address, port, self.device)

    def adapters(self) -> dict[str, torch.Tensor]:
        """Piece name (`AdaptedMatrix.pieces`) -> this rank's adapter tensor (views of the parameters)."""
        tp_rank, out = self.engine.coord.tp, {}
        for a in self.engine.lora.adapted:
            w, lora_a, lora_b = a.key + ".weight", a.module.lora_A.detach(), a.module.lora_B.detach()
            out.update({f"{w}.lora_B.{tp_rank}": lora_b, f"{w}.lora_A": lora_a} if a.column
                       else {f"{w}.lora_A.{tp_rank}": lora_a, f"{w}.lora_B": lora_b})
        return out

    def stage(self, version: int) -> None:
        """Keep a copy of this rank's adapters as `version` (the base does not change)."""
        copy = {name: t.clone() for name, t in self.adapters().items()}
        with self._lock:
            self.staged[version] = copy

    def send(self) -> dict[str, float]:
        return self._send(self.adapters())

    def send_staged(self, version: int) -> dict[str, float]:
        with self._lock:
            adapters = self.staged[version]
        out = self._send(adapters)
        with self._lock:
            self.staged = {v: w for v, w in self.staged.items() if v > version}
        return out

    def _send(self, adapters: dict[str, torch.Tensor]) -> dict[str, float]:
        start, total, moved = time.perf_counter(), Traffic(), Traffic()
        plans = [self.plans.adapters]
        if not self.base_sent:
            params = self.engine.named_params()
            base = {e.megatron: params[n].detach() for e, n in self.engine.stage_entries()}
            run_plan(self.world, self.plans.base, base, self.engine.dtype, total, sender=True)
            plans.insert(0, self.plans.base)
            self.base_sent = True
        run_plan(self.world, self.plans.adapters, adapters, self.engine.dtype, moved, sender=True)
        total.bytes_sent += moved.bytes_sent
        total.collectives += moved.collectives
        return self.plans.metrics(plans, total, moved, self.rank, time.perf_counter() - start)


class AdapterReceiver(ShardReceiver):
    """A rollout rank apart for a LoRA actor: the base once, kept for its adapted tensors, then each sync's
    adapters merged onto it (module docstring)."""

    def __init__(self, model: ModelConfig, train_layout: ParallelDims, tg: int, rank: int, world: int, device: str,
                 lora: LoRAConfig):
        super().__init__(model, train_layout, tg, rank, world, device)
        self.lora, self.scale = lora, lora.alpha / lora.rank
        self.base: Optional[dict[str, torch.Tensor]] = None  # generation name -> the base shard's copy
        self.plans: Optional[AdapterPlans] = None
        self.pieces: dict[str, torch.Tensor] = {}

    def join(self, address: str, port: int, train: ParallelDims, bucket_bytes: int, virtual_pp: int = 1,
             ep: int = 1) -> None:
        element = torch.empty((), dtype=self.dtype).element_size()
        self.train = train
        self.plans = AdapterPlans(self.bridge, self.lora, element, train, self.tg, self.world, bucket_bytes,
                                  virtual_pp, ep)
        self.pieces = {name: torch.empty(shape, dtype=self.dtype, device=self.device)
                       for m in self.plans.matrices for name, shape in m.pieces(self.lora.rank, train.tp).items()}
        self.world_sync = self.plans.join(train.world_size + self.rank, address, port, self.device)

    @torch.no_grad()
    def merge(self) -> None:
        """Each adapted generation weight := its base + the delta of the received adapters, computed per
        training piece, joined as the weight's TP shards join and cut to this rank's generation shard."""
        params, t, entries = dict(self.model.named_parameters()), self.train.tp, self.bridge.entries()
        generation = {e.megatron: e.generation for e in entries}
        for m in self.plans.matrices:
            split, whole = ("lora_B", "lora_A") if m.column else ("lora_A", "lora_B")
            other = self.pieces[f"{m.weight}.{whole}"]
            deltas = []
            for i in range(t):
                piece = self.pieces[f"{m.weight}.{split}.{i}"]
                a, b = (other, piece) if m.column else (piece, other)
                deltas.append(lora_delta(a, b, self.scale, self.dtype))
            spec = spec_for(m.weight)
            delta = unshard_tensor(deltas, spec) if t > 1 else deltas[0]
            delta = shard_tensor(delta, spec, self.rank % self.tg, self.tg) if self.tg > 1 else delta
            name = generation[m.weight]
            torch.add(self.base[name], delta, out=params[name].data)

    def receive(self, backend: RolloutBackend) -> dict[str, float]:
        start, total, moved = time.perf_counter(), Traffic(), Traffic()
        params = dict(self.model.named_parameters())
        backend.resume()
        plans = [self.plans.adapters]
        if self.base is None:
            dest = {e.megatron: params[e.generation].data for e in self.bridge.entries()}
            run_plan(self.world_sync, self.plans.base, dest, self.dtype, total, sender=False)
            generation = {e.megatron: e.generation for e in self.bridge.entries()}
            self.base = {generation[m.weight]: params[generation[m.weight]].detach().clone()
                         for m in self.plans.matrices}
            plans.insert(0, self.plans.base)
        run_plan(self.world_sync, self.plans.adapters, self.pieces, self.dtype, moved, sender=False)
        self.merge()
        self.syncs += 1
        total.bytes_received += moved.bytes_received
        total.collectives += moved.collectives
        metrics = self.plans.metrics(plans, total, moved, self.world_sync.rank, time.perf_counter() - start)
        metrics["lora/base_copy_bytes"] = float(sum(t.numel() * t.element_size() for t in self.base.values()))
        metrics.update(sync_weights(backend, self.model, self.model_cfg.make_vocab_size_divisible_by))
        return metrics


def adapters_only(model_cfg, lora: Optional[LoRAConfig]) -> bool:
    """Whether a sync apart moves adapters alone: LoRA on the dense linears only (a mixture-of-experts model
    whose experts take adapters syncs merged tensors)."""
    if lora is None or lora.rank == 0:
        return False
    return not (model_cfg.num_experts and {"linear_fc1", "linear_fc2"} & set(lora.target_modules))


def apart_sender(engine, rank: int, device: str):
    """A training rank's side of the sync apart: adapters only after the first sync for a LoRA megatron actor
    (`adapters_only`), else the training shard (merged or not) each time."""
    if adapters_of(engine) and adapters_only(engine.cfg, engine.lora.cfg):
        return AdapterSender(engine, rank, device)
    return ShardSender(engine, rank, device)


def apart_receiver(model: ModelConfig, train_layout: ParallelDims, tg: int, rank: int, world: int, device: str,
                   lora: Optional[LoRAConfig]):
    """The rollout rank's side, matching `apart_sender` (`lora`: the megatron actor's adapters, else None)."""
    if adapters_only(DecoderConfig.from_pretrained(model.path), lora):
        return AdapterReceiver(model, train_layout, tg, rank, world, device, lora)
    return ShardReceiver(model, train_layout, tg, rank, world, device)
