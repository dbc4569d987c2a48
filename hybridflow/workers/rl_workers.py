"""The SPMD workers of a PPO/GRPO job, one class per process role.

- `ActorRolloutRefWorker`: the hybrid layout (the default). The actor's
  engine, the generator and (optionally) the frozen reference live in one
  process; the generator's weights are views of the engine's at tp = pp = 1,
  else the generation shard the 3D-HybridEngine refills after each update.
  The rollout engine is the one `rollout.engine` names, built by
  `rollout.factory.build_backend` (the worker never chooses); an engine with its own
  copy of the weights (vLLM) takes them by a push after each refill.
- `RolloutWorker`: rollout on devices apart from training, on a copy of the
  actor's weights that the controller refreshes after each update (each
  actor rank publishes its own shard to the object store; only handles pass
  through the controller).
- `CriticWorker`: the value model, colocated with the actor or on its own devices.

Each runs inside a worker group (`hybridflow.controller`): a Ray actor per
device, or in-process (`LocalWorkerGroup`), and is handed only its spec
(`workers/specs.py`). Methods take this rank's share of a batch (`DP_SPLIT`)
and return per-row fields or per-rank metrics; the controller never writes
communication code. The `*Group` classes at the end are the typed views the
trainer calls them through: each lists the methods the controller uses.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from hybridflow.config.schema import ModelConfig, OptimConfig, ParallelConfig, RewardConfig
from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.transfer import ObjectHandle
from hybridflow.controller.group import RoleGroup, remote
from hybridflow.controller.worker import Worker
from hybridflow.data import fields as F
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.engine import MegatronEngine
from hybridflow.hybrid_engine import generation_weights
from hybridflow.hybrid_engine.publish import assemble, training_shard
from hybridflow.models.checkpoint import load_decoder, save_hf_checkpoint, save_hf_checkpoint_parts
from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig
from hybridflow.parallel.layout import ParallelDims
from hybridflow.roles import Actor, Critic, Reference, Rollout
from hybridflow.roles.actor import LOG_PROB_FIELDS
from hybridflow.roles.actor import UPDATE_FIELDS as ACTOR_UPDATE_FIELDS
from hybridflow.roles.critic import UPDATE_FIELDS as CRITIC_UPDATE_FIELDS
from hybridflow.roles.critic import VALUE_FIELDS
from hybridflow.rollout import RolloutBackend, sync_weights
from hybridflow.rollout.factory import build_backend
from hybridflow.workers.specs import ActorWorkerSpec, CriticWorkerSpec, RolloutWorkerSpec, Run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def read_tokenizer(model: ModelConfig) -> Tokenizer:
    """The run's tokenizer (model.tokenizer_path, else model.path), which the trainer checked
    (`config.inputs.load_tokenizer`) before any worker started."""
    return Tokenizer.from_path(model.tokenizer_path or model.path)


def build_engine(run: Run, model: ModelConfig, path: str, optim: Optional[OptimConfig], parallel: ParallelConfig,
                 layout: ParallelDims, optimizer_steps: int = 1, value_head: bool = False) -> MegatronEngine:
    """An engine at the run plan's `layout`, loaded from the HF checkpoint at `path` (checked by the trainer);
    its LR schedule spans `optimizer_steps`."""
    engine = MegatronEngine(
        DecoderConfig.from_pretrained(path), parallel, optim,
        device=run.device, dtype=model.dtype, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        value_head=value_head, total_steps=optimizer_steps, seed=run.seed,
        fused_output=model.use_fused_kernels and not value_head, layer_kernels=model.cpu_layer_kernels,
        layout=layout)
    engine.load_hf_checkpoint(path)  # this rank's slices only
    return engine


def prepare_process(worker: Worker, processes: int = 1) -> None:
    """Per-process set-up of a worker: CPU threads, and quiet megatron-core.

    Torch threads become this rank's share of the node's cores (Ray starts
    actors with one): the cores over the run's processes (`Run.processes`), or
    over the group's when it has more. A group placed apart from another (the
    rollout beside training) is not alone on the cores: measured on 2 cores,
    each of two 1-process groups taking both made a split GRPO step ~40x slower
    (OpenMP threads of two processes contending; `hybridflow bench async`).
    megatron-core narrates its set-up at INFO and warns about deprecated calls
    it makes itself; a worker keeps its warnings and errors.
    """
    import logging
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"(megatron|torch\.distributed)(\..*)?")
    if worker.context.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, worker.world_size, processes)))


class EngineWorker(Worker):
    """A worker owning a `MegatronEngine` (`self.engine`): each rank saves and loads its own shard
    under CHECKPOINT_NAME in a checkpoint directory."""

    CHECKPOINT_NAME: str

    @register(Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        self.engine.save(Path(directory) / self.CHECKPOINT_NAME)

    @register(Dispatch.ONE_TO_ALL)
    def load(self, directory: str) -> None:
        self.engine.load(Path(directory) / self.CHECKPOINT_NAME)


class _Generates(Worker):
    """A worker whose `self.rollout` generates this rank's share of the prompts."""

    rollout: Rollout

    @register(Dispatch.DP_SPLIT, mesh="generation")
    def generate(self, prompts: dict[str, Any], seed: int, validation: bool = False,
                 pad: bool = False) -> dict[str, Any]:
        """This generation replica's prompts -> the rollout batch (fields in `data.fields`).

        The "generation" mesh is the rollout layout: at tg > 1 the ranks of one
        generation TP group get the same prompts and its TP rank 0 answers, so
        the controller regroups prompts onto generation replicas and the
        responses back into one batch, which the training meshes then split.
        """
        return self.rollout.generate(prompts, seed, validation, pad)


class ActorRolloutRefWorker(EngineWorker, _Generates):
    """Actor training, rollout from views of its weights, and the reference policy: one process."""

    CHECKPOINT_NAME = "actor"

    def __init__(self, spec: ActorWorkerSpec):
        self.init_process_group()
        prepare_process(self, spec.run.processes)
        torch.manual_seed(spec.run.seed)
        self.spec = spec
        self.model_cfg = DecoderConfig.from_pretrained(spec.model.path)
        self.tokenizer = read_tokenizer(spec.model)
        self.engine = build_engine(spec.run, spec.model, spec.model.path, spec.actor.optim, spec.actor.parallel,
                                   spec.layout, spec.optimizer_steps)
        self.register_mesh("actor", spec.layout)
        self.actor = Actor(spec.actor, self.engine, samples_per_prompt=spec.rollout.n,
                           temperature=spec.rollout.temperature, seed=spec.run.seed)
        self.reference = None
        if spec.reference is not None:
            engine = build_engine(spec.run, spec.model, spec.model.path, None, spec.reference.parallel, spec.layout)
            self.reference = Reference(spec.reference, engine, temperature=spec.rollout.temperature)
        # Generation: views of the engine at tp = pp = 1, else a tg-way model the 3D-HybridEngine refills;
        # none when a rollout group apart generates.
        self.generation = None
        if spec.generates:
            self.generation = generation_weights(self.engine, spec.rollout.tg, spec.rollout.grouping)
            replica, replicas, answers = self.generation.mesh
            self.register_replica("generation", replica, replicas, answers)
            self.backend = build_backend(spec.rollout, self.generation.model, self.tokenizer, spec.model.path,
                                         seed=spec.run.seed, device=spec.run.device)
            self._push_generation()  # an engine with its own copy starts from placeholder weights
            self.rollout = Rollout(spec.rollout, spec.max_response_length, self.backend, self.tokenizer, replicas,
                                   env=spec.env)

    def _push_generation(self) -> dict[str, float]:
        """The refilled generation weights into an engine that keeps its own copy (nothing for the built-in
        one, which generates from them); that copy made, the 3D-HybridEngine's is freed at once."""
        pushed = sync_weights(self.backend, self.generation.model, self.spec.model.make_vocab_size_divisible_by)
        if pushed:
            self.generation.release()
        return pushed

    @register(Dispatch.RANK_ZERO)
    def refresh_generation(self) -> dict[str, float]:
        """Switch to generation: bring its weights up to the trained ones; the `reshard/*` figures (with the
        push into the rollout engine's own copy, where it keeps one, in its time)."""
        if self.generation is None:
            return {}
        self.backend.resume()
        metrics = self.generation.refresh()
        pushed = self._push_generation()
        if pushed:
            metrics.update(pushed)
            metrics["reshard/time_s"] += pushed["reshard/push_time_s"]
        return metrics

    @register(Dispatch.ONE_TO_ALL)
    def release_generation(self) -> None:
        """Switch back to training: free the generation weights (nothing to free for views) and the rollout
        engine's memory where it can."""
        if self.generation is not None:
            self.generation.release()
            self.backend.release()

    @register(Dispatch.ONE_TO_ALL)
    def publish_weights(self) -> Optional[ObjectHandle]:
        """This rank's training shard, left in the object store for a rollout group apart (None outside
        the first DP replica): no rank gathers the whole model; only handles reach the controller."""
        shard = training_shard(self.engine)
        # Under Ray the tensors are written into the object store once: a snapshot.
        return None if shard is None else ObjectHandle(shard)

    @register(Dispatch.DP_SPLIT, mesh="actor", reads=LOG_PROB_FIELDS)
    def compute_log_probs(self, batch: dict[str, Any], old: bool = True,
                          reference: bool = False) -> dict[str, torch.Tensor]:
        """OLD_LOG_PROBS and ENTROPY under the current weights (old), REF_LOG_PROBS under the reference
        (reference): one call, one shipment of the rows, when both are wanted."""
        out = self.reference.compute_ref_log_probs(batch) if reference else {}
        if old:
            r = self.spec.rollout
            out.update(self.actor.compute_log_probs(
                batch, r.log_prob_micro_batch_size,
                r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else 0, r.log_prob_share_prompts))
        return out

    @register(Dispatch.DP_SPLIT, mesh="actor", reads=ACTOR_UPDATE_FIELDS)
    def update_actor(self, rows: dict[str, Any], steps: list[torch.Tensor]) -> dict[str, float]:
        """The actor's update on this replica's `rows` (passed `PerReplica`, with its `steps`: the
        trainer's `actor_update_plan`)."""
        return self.actor.update_share(rows, steps)

    @register(Dispatch.RANK_ZERO)
    def export_hf(self, path: str) -> str:
        """The actor as an HF checkpoint, streamed stage by stage (every rank gathers; rank 0 writes)."""
        parts = self.engine.hf_stage_parts()
        if self.rank != 0:
            for _ in parts:  # take part in each stage's gather
                pass
            return path
        model = self.spec.model
        tok_dir = Path(model.tokenizer_path or model.path)
        extra = tuple(tok_dir / f for f in TOKENIZER_FILES if (tok_dir / f).is_file())
        hf_config = self.model_cfg.to_hf_dict()
        hf_config["torch_dtype"] = model.dtype
        stages = self.engine.layout.pp
        if stages == 1:
            return str(save_hf_checkpoint(next(parts), hf_config, path, extra_files=extra))
        return str(save_hf_checkpoint_parts(parts, stages, hf_config, path, extra_files=extra))


class RolloutWorker(_Generates):
    """Rollout on devices of its own (placement.rollout apart from placement.training).

    It holds a copy of the actor in the generation layout, loaded from
    model.path and replaced by `load_weights` with what the actor group
    publishes after each update. Generation needs no collectives, so it joins
    no process group.
    """

    def __init__(self, spec: RolloutWorkerSpec):
        prepare_process(self, spec.run.processes)
        model_cfg = DecoderConfig.from_pretrained(spec.model.path)
        self.tokenizer = read_tokenizer(spec.model)
        self.bridge = get_bridge(model_cfg, spec.model.make_vocab_size_divisible_by)
        model = load_decoder(spec.model.path, spec.model.dtype).to(spec.run.device).eval()
        self.register_replica("generation", self.rank, self.world_size, True)  # tg = 1: every rank a replica
        self.backend: RolloutBackend = build_backend(spec.rollout, model, self.tokenizer, spec.model.path,
                                                     seed=spec.run.seed, device=spec.run.device)
        sync_weights(self.backend, model, spec.model.make_vocab_size_divisible_by)  # vLLM: the checkpoint's
        self.rollout = Rollout(spec.rollout, spec.max_response_length, self.backend, self.tokenizer, self.world_size,
                               env=spec.env)

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, handles: list[Optional[ObjectHandle]]) -> None:
        """Copy in the actor's weights, reassembled from every training rank's shard (fetched from the
        object store), by HF name into the rollout engine."""
        state = assemble((h.get() for h in handles if h is not None), self.bridge)
        self.backend.load_weights(self.bridge.generation_to_hf(state).items())


class CriticWorker(EngineWorker):
    """The value model: per-token values and the clipped value update."""

    CHECKPOINT_NAME = "critic"

    def __init__(self, spec: CriticWorkerSpec):
        self.init_process_group()
        prepare_process(self, spec.run.processes)
        torch.manual_seed(spec.run.seed)
        self.engine = build_engine(spec.run, spec.model, spec.path, spec.critic.optim, spec.critic.parallel,
                                   spec.layout, spec.optimizer_steps, value_head=True)
        self.register_mesh("critic", spec.layout)
        self.critic = Critic(spec.critic, self.engine, mini_batch_size=spec.mini_batch_size, seed=spec.run.seed)

    @register(Dispatch.DP_SPLIT, mesh="critic", reads=VALUE_FIELDS)
    def compute_values(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.critic.compute_values(batch)

    @register(Dispatch.DP_SPLIT, mesh="critic", reads=CRITIC_UPDATE_FIELDS)
    def update_critic(self, rows: dict[str, Any], steps: list[torch.Tensor]) -> dict[str, float]:
        """The critic's update on this replica's `rows` (`PerReplica`, with the trainer's
        `critic_update_plan` share `steps`)."""
        return self.critic.update_share(rows, steps)


class RewardModelWorker(Worker):
    """An HF sequence classifier scoring (prompt, response) pairs, on the devices of placement.reward."""

    def __init__(self, cfg: RewardConfig):
        from hybridflow.rollout.hf import load_hf_model

        prepare_process(self)
        self.cfg = cfg
        self.model = load_hf_model(cfg.model_path, device_map="auto")

    @register(Dispatch.DP_SPLIT)
    def score(self, pairs: dict[str, list]) -> dict[str, torch.Tensor]:
        """{PROMPT_TEXT: [...], RESPONSE_TEXT: [...]} -> {SCORES: FloatTensor[rows]}."""
        pairs = list(zip(pairs[F.PROMPT_TEXT], pairs[F.RESPONSE_TEXT]))
        scores = self.model.score(pairs, batch_size=self.cfg.micro_batch_size)
        return {F.SCORES: torch.tensor(scores, dtype=torch.float32)}


# --------------------------------------------------------------------------- typed group views

class ActorGroup(RoleGroup):
    """The actor/rollout/reference group, as the trainer calls it."""

    generate = remote(ActorRolloutRefWorker.generate)
    refresh_generation = remote(ActorRolloutRefWorker.refresh_generation)
    release_generation = remote(ActorRolloutRefWorker.release_generation)
    publish_weights = remote(ActorRolloutRefWorker.publish_weights)
    compute_log_probs = remote(ActorRolloutRefWorker.compute_log_probs)
    update_actor = remote(ActorRolloutRefWorker.update_actor)
    export_hf = remote(ActorRolloutRefWorker.export_hf)
    save = remote(ActorRolloutRefWorker.save)
    load = remote(ActorRolloutRefWorker.load)


class RolloutGroup(RoleGroup):
    """Rollout apart from training."""

    generate = remote(RolloutWorker.generate)
    load_weights = remote(RolloutWorker.load_weights)


class CriticGroup(RoleGroup):
    compute_values = remote(CriticWorker.compute_values)
    update_critic = remote(CriticWorker.update_critic)
    save = remote(CriticWorker.save)
    load = remote(CriticWorker.load)


class RewardModelGroup(RoleGroup):
    score = remote(RewardModelWorker.score)
