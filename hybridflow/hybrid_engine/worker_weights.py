"""The worker-side half of each route the actor's weights take to the rollout (`rollout_weights.py` drives them).

- `ColocatedGeneration` (the actor's processes generate): the generation weights
  by engine kind (`GENERATION_WEIGHTS`: views at tp = pp = 1, the refilled tg-way
  shard of the reshard plan, or an FSDP actor's gathered model), switched to
  after each update and freed for training, and pushed into a rollout engine
  that keeps its own copy (vLLM).
- `ShardSender` (an actor rank, the rollout apart): its slices of the training
  shard broadcast into the rollout group as the apart plan lays out, now or
  from a snapshot staged as a weight version (off-policy: the rollout takes a
  version after the actor has trained past it).
- `ShardReceiver` (a rollout rank apart): an empty generation shard at `tg`,
  filled only by those broadcasts.

A worker builds the half its spec names and forwards its calls; it holds no weight-route logic itself.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from hybridflow.config.schema import ModelConfig, RolloutConfig
from hybridflow.hybrid_engine.apart import plan_apart
from hybridflow.hybrid_engine.fsdp_gather import FSDPGatheredWeights
from hybridflow.hybrid_engine.lora_weights import AdapterMerge, adapters_of, lora_generation
from hybridflow.hybrid_engine.plan import bridge_params
from hybridflow.hybrid_engine.reshard import generation_weights, new_groups
from hybridflow.hybrid_engine.tensor_parallel import GroupTensorParallel
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.hybrid_engine.weight_sync import SyncWorld, receive, send, sync_metrics
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import resolve_dtype
from hybridflow.models.config import DecoderConfig
from hybridflow.models.decoder import Decoder, rope_inv_freq
from hybridflow.parallel.layout import ParallelDims
from hybridflow.rollout import RolloutBackend, hf_named, sync_weights

def megatron_generation(engine, rollout: RolloutConfig):
    """Views at tp = pp = 1, else the reshard plan's shard at `rollout.tg`; where the engine trains LoRA
    adapters, `lora_weights.lora_generation` (merged weights, or adapters only after the first sync)."""
    return lora_generation(engine, rollout) if adapters_of(engine) else generation_weights(engine, rollout.tg,
                                                                                           rollout.grouping)


# Engine kind -> the actor's generation weights (refresh / release / model / mesh). FSDP generates at tg = 1:
# every rank gathers the whole model (the config checks refuse more).
GENERATION_WEIGHTS: dict[str, Callable] = {
    "megatron": megatron_generation,
    "fsdp": lambda engine, rollout: FSDPGatheredWeights(engine, rollout.weight_bucket_mb * 2**20),
}


class ColocatedGeneration:
    """The actor's own generation weights, and the push into a rollout engine with a copy of its own."""

    def __init__(self, engine, rollout: RolloutConfig, divisible_by: int):
        self.weights = GENERATION_WEIGHTS[engine.kind](engine, rollout)
        self.model = self.weights.model
        self.mesh: tuple[int, int, bool] = self.weights.mesh  # (replica, replicas, answers)
        self.divisible_by = divisible_by
        self.backend: Optional[RolloutBackend] = None

    def attach(self, backend: RolloutBackend) -> None:
        """Generate through `backend`; an engine with its own copy starts from placeholder weights: push them."""
        self.backend = backend
        self.push()

    def push(self) -> dict[str, float]:
        """The refilled generation weights into an engine that keeps its own copy (nothing for the built-in
        one, which generates from them); that copy made, the 3D-HybridEngine's is freed at once."""
        pushed = sync_weights(self.backend, self.model, self.divisible_by)
        if pushed:
            self.weights.release()
        return pushed

    def refresh(self) -> dict[str, float]:
        """Switch to generation: the weights brought up to the trained ones; the `reshard/*` figures (with the
        push into the rollout engine's own copy, where it keeps one, in its time)."""
        self.backend.resume()
        metrics = self.weights.refresh()
        pushed = self.push()
        if pushed:
            metrics.update(pushed)
            metrics["reshard/time_s"] += pushed["reshard/push_time_s"]
        return metrics

    def release(self) -> None:
        """Switch back to training: free the generation weights (nothing for views) and the engine's memory."""
        self.weights.release()
        self.backend.release()


class ShardSender:
    """A training rank's side of the sync into a rollout group apart (`weight_sync.py` runs the broadcasts)."""

    def __init__(self, engine, rank: int, device: str):
        # A LoRA actor sends its merged weights (merged afresh before each send or snapshot).
        self.merge: Optional[AdapterMerge] = AdapterMerge(engine) if adapters_of(engine) else None
        self.engine, self.rank, self.device = self.merge or engine, rank, device
        self.world: Optional[SyncWorld] = None
        self.staged: dict[int, dict[str, torch.Tensor]] = {}  # weight version -> shard copy (`stage`)
        self._lock = threading.Lock()  # `send_staged` runs aside, on another thread of this process

    def join(self, address: str, port: int, tg: int, rollout_world: int, bucket_bytes: int) -> None:
        """Join the sync world (sync ranks 0 .. N-1 are the training ranks), with the plan both sides build alike."""
        element = torch.empty((), dtype=self.engine.dtype).element_size()
        plan = plan_apart(bridge_params(self.engine.bridge, element), self.engine.layout, tg, rollout_world,
                          bucket_bytes, self.engine.virtual_pp, self.engine.experts.ep)
        self.world = SyncWorld(plan, self.rank, address, port, self.device)

    def training_shard(self) -> dict[str, torch.Tensor]:
        """Megatron global name -> this rank's training shard of it (views of the parameters)."""
        if self.merge is not None:
            self.merge.merge()
        params = self.engine.named_params()
        return {e.megatron: params[n].detach() for e, n in self.engine.stage_entries()}

    def stage(self, version: int) -> None:
        """Keep a copy of this rank's training shard as `version`, for a later `send_staged(version)`. Copies,
        not views: the optimizer steps the parameters in place."""
        copy = {name: t.clone() for name, t in self.training_shard().items()}
        with self._lock:
            self.staged[version] = copy

    def send(self) -> dict[str, float]:
        """Broadcast this rank's slices of its training shard now; what it moved (`sync/*`)."""
        return self._send(self.training_shard())

    def send_staged(self, version: int) -> dict[str, float]:
        """`send` of the copy staged as `version`, then drop it and older copies. It reads only that copy, so it
        may run while the actor trains."""
        with self._lock:
            shard = self.staged[version]
        out = self._send(shard)
        with self._lock:
            self.staged = {v: w for v, w in self.staged.items() if v > version}
        return out

    def _send(self, shard: dict[str, torch.Tensor]) -> dict[str, float]:
        start, traffic = time.perf_counter(), Traffic()
        send(self.world, shard, traffic)
        return sync_metrics(traffic, self.world.plan, self.rank, time.perf_counter() - start)


class ShardReceiver:
    """A rollout rank apart: one generation shard of `world / tg` replicas of `tg` consecutive ranks,
    allocated empty. Its weights come only from the actor's ranks, never from a checkpoint of its own, so a
    missed sync cannot pass for a fresh one (`syncs` counts them)."""

    def __init__(self, model: ModelConfig, train_layout: ParallelDims, tg: int, rank: int, world: int, device: str):
        self.model_cfg, self.tg, self.rank, self.world = model, tg, rank, world
        self.dtype = resolve_dtype(model.dtype)
        decoder_cfg = DecoderConfig.from_pretrained(model.path)
        # The actor's padded vocabulary: the shards it sends are cut from it.
        self.bridge = get_bridge(decoder_cfg, model.make_vocab_size_divisible_by, train_layout.tp)
        parallel = None
        if tg > 1:  # this group's own world holds the generation TP groups
            group = new_groups([list(range(q * tg, (q + 1) * tg)) for q in range(world // tg)])[rank]
            parallel = GroupTensorParallel(group, self.bridge.padded_vocab)
        with torch.device("meta"):
            decoder = Decoder(decoder_cfg, parallel) if parallel is not None else Decoder(decoder_cfg)
        self.model = decoder.to_empty(device=device).to(self.dtype).eval()
        self.model.inv_freq = rope_inv_freq(decoder_cfg).to(device)
        self.model.requires_grad_(False)
        self.mesh = (rank // tg, world // tg, rank % tg == 0)  # (replica, replicas, answers)
        self.device = device
        self.world_sync: Optional[SyncWorld] = None
        self.syncs = 0

    def join(self, address: str, port: int, train: ParallelDims, bucket_bytes: int, virtual_pp: int = 1,
             ep: int = 1) -> None:
        """Join the sync world as rank N + rank (`train`: the actor's layout, `virtual_pp` chunks a stage, the
        experts split over `ep` ranks)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        plan = plan_apart(bridge_params(self.bridge, element), train, self.tg, self.world, bucket_bytes, virtual_pp,
                          ep)
        self.world_sync = SyncWorld(plan, train.world_size + self.rank, address, port, self.device)

    def receive(self, backend: RolloutBackend) -> dict[str, float]:
        """This rank's generation shard from the actor's ranks, straight into the generator's parameters (an
        engine with its own copy then takes them by the usual bucketed push); `sync/*` figures."""
        start, traffic = time.perf_counter(), Traffic()
        params = dict(self.model.named_parameters())
        dest = {e.megatron: params[e.generation].data for e in self.bridge.entries()}
        backend.resume()
        receive(self.world_sync, dest, self.dtype, traffic)
        self.syncs += 1
        metrics = sync_metrics(traffic, self.world_sync.plan, self.world_sync.rank, time.perf_counter() - start)
        metrics.update(sync_weights(backend, self.model, self.model_cfg.make_vocab_size_divisible_by))
        return metrics

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The whole generation model under HF names (gathered over each TP group): for checks, not syncs."""
        return {name: t.clone() for name, t in hf_named(self.model, self.model_cfg.make_vocab_size_divisible_by)}
