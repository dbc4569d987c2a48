"""The SPMD workers of a PPO/GRPO job, one class per process role: each hosts role objects and nothing else.

- `ActorRolloutRefWorker`: the hybrid layout (the default). The actor's
  engine, the generator and (optionally) the frozen reference live in one
  process. How the actor's weights reach the generator is the worker half of
  the run's weight route (`hybrid_engine/worker_weights.py`): its own
  generation weights (`ColocatedGeneration`), or, with a rollout group apart,
  its shards sent there (`ShardSender`). The rollout engine is the one
  `rollout.engine` names, built by `rollout.factory.build_backend`.
- `RolloutWorker`: rollout on devices apart from training, at any `rollout.tg`,
  on a generation shard the actor's ranks broadcast into (`ShardReceiver`).
- `CriticWorker`, `ReferenceWorker`, `RewardModelWorker`: the value model, a
  reference on devices of its own, a reward model.

Engines come from the table of engine kinds (`workers/engines.py`); what a
worker's answer leaves in the object store is `workers/driver_rows.py`'s rule.

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

from hybridflow.checkpoint.peft import export_peft
from hybridflow.config.schema import ModelConfig, ParallelConfig, RewardConfig
from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.group import RoleGroup, remote
from hybridflow.controller.worker import Worker
from hybridflow.data import fields as F
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.engine.lora import AdaptersOff
from hybridflow.hybrid_engine.lora_sync import apart_receiver, apart_sender
from hybridflow.hybrid_engine.worker_weights import ColocatedGeneration, ShardReceiver, ShardSender
from hybridflow.models.checkpoint import save_hf_checkpoint, save_hf_checkpoint_parts
from hybridflow.parallel.layout import ParallelDims
from hybridflow.parallel.process_group import free_port
from hybridflow.roles import Actor, Critic, Reference, Rollout
from hybridflow.roles.actor import LOG_PROB_FIELDS
from hybridflow.roles.actor import UPDATE_FIELDS as ACTOR_UPDATE_FIELDS
from hybridflow.roles.critic import UPDATE_FIELDS as CRITIC_UPDATE_FIELDS
from hybridflow.roles.critic import VALUE_FIELDS
from hybridflow.roles.preparation import TokenStage, prepare_tokens
from hybridflow.roles.scoring import RolloutScoring, overlaps
from hybridflow.roles.rollout import TRAIN
from hybridflow.rollout import RolloutBackend
from hybridflow.rollout.factory import build_backend
from hybridflow.workers.driver_rows import token_rows
from hybridflow.workers.engines import build_engine, model_config
from hybridflow.workers.specs import ActorWorkerSpec, CriticWorkerSpec, ReferenceWorkerSpec, RolloutWorkerSpec, Run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def read_tokenizer(model: ModelConfig) -> Tokenizer:
    """The run's tokenizer (model.tokenizer_path, else model.path), which the trainer checked
    (`config.inputs.load_tokenizer`) before any worker started."""
    return Tokenizer.from_path(model.tokenizer_path or model.path)


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
    """A worker owning a training engine (`self.engine`: a `MegatronEngine` or an `FSDPEngine`): each rank
    saves and loads its own shard under CHECKPOINT_NAME in a checkpoint directory."""

    CHECKPOINT_NAME: str

    @register(Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        self.engine.save(Path(directory) / self.CHECKPOINT_NAME)

    @register(Dispatch.ONE_TO_ALL)
    def load(self, directory: str) -> None:
        self.engine.load(Path(directory) / self.CHECKPOINT_NAME)


class _Generates(Worker):
    """A worker whose `self.rollout` generates this rank's share of the prompts, scored by `self.reward_fn`."""

    rollout: Rollout
    reward_fn: Any

    @register(Dispatch.DP_SPLIT, mesh="generation")
    def generate(self, prompts: dict[str, Any], seed: int, mode: str = TRAIN,
                 pad: bool = False) -> dict[str, Any]:
        """This generation replica's prompts -> the rollout batch (fields in `data.fields`); `mode`: "train",
        "validation" or "baseline" (the ReMax greedy rollout), `roles.rollout.MODES`.

        The "generation" mesh is the rollout layout: at tg > 1 the ranks of one
        generation TP group get the same prompts and its TP rank 0 answers, so
        the controller regroups prompts onto generation replicas and the
        responses back into one batch, which the training meshes then split.
        Each response is scored here with the rule reward (RULE_SCORES and the seconds it took, `roles.scoring`),
        and the token tensors and texts stay in the object store (`token_rows`): the
        groups that read them next fetch the rows from there, not from the driver.
        """
        if not self.mesh_coords()["generation"].answers:  # a TP peer: its answer is dropped, its copy unscored
            return self.rollout.generate(prompts, seed, mode, pad)
        # reward.async_scoring: each finished chunk scores while the next generates (`roles.scoring`)
        scoring = RolloutScoring(self.reward_fn, self.spec.reward.function, overlaps(self.spec.reward.config))
        try:
            out = self.rollout.generate(prompts, seed, mode, pad, on_part=scoring.add if scoring.overlap else None)
            return token_rows(scoring.finish(out), self.spec.run)
        finally:
            scoring.close()


class ActorRolloutRefWorker(EngineWorker, _Generates):
    """Actor training, its rollout (or its shards' sends to a rollout apart), and the reference: one process."""

    CHECKPOINT_NAME = "actor"

    def __init__(self, spec: ActorWorkerSpec):
        self.init_process_group()
        prepare_process(self, spec.run.processes)
        torch.manual_seed(spec.run.seed)
        self.spec = spec
        self.model_cfg = model_config(spec.model.path, spec.actor.engine, spec.actor.fsdp)
        self.tokenizer = read_tokenizer(spec.model)
        self.engine = build_engine(spec.run, spec.model, spec.model.path, spec.actor.optim, spec.actor.parallel,
                                   spec.layout, spec.optimizer_steps, kind=spec.actor.engine, fsdp=spec.actor.fsdp,
                                   moe=spec.actor.moe, lora=spec.actor.lora)
        self.register_mesh("actor", spec.layout)
        self.actor = Actor(spec.actor, self.engine, samples_per_prompt=spec.rollout.n,
                           temperature=spec.rollout.temperature, seed=spec.run.seed, old_log_probs=spec.old_log_probs)
        self.reference = None
        if spec.reference is not None:
            ref = spec.reference
            if ref.engine == "adapters_off":  # the actor's own engine, its LoRA adapters left out: the base
                engine = AdaptersOff(self.engine)
            elif ref.engine == "fsdp":  # sharded over all of this group's processes, whatever the actor's layout
                engine = build_engine(spec.run, spec.model, spec.model.path, None, ParallelConfig(),
                                      ParallelDims(dp=self.world_size), kind="fsdp", fsdp=ref.fsdp)
            else:
                engine = build_engine(spec.run, spec.model, spec.model.path, None, ref.parallel, spec.layout)
            self.reference = Reference(spec.reference, engine, temperature=spec.rollout.temperature)
        # The weights' route to the rollout, worker side: this group generates from its own generation
        # weights, or its ranks send their shards to a rollout group apart.
        self.generation: Optional[ColocatedGeneration] = None
        self.sender: Optional[ShardSender] = None
        if not spec.generates:
            self.sender = apart_sender(self.engine, self.rank, self.context.device)  # a LoRA actor: adapters
            return
        self.generation = ColocatedGeneration(self.engine, spec.rollout, spec.model.make_vocab_size_divisible_by)
        replica, replicas, answers = self.generation.mesh
        self.register_replica("generation", replica, replicas, answers)
        backend = build_backend(spec.rollout, self.generation.model, self.tokenizer, spec.model.path,
                                seed=spec.run.seed, device=spec.run.device)
        self.generation.attach(backend)
        self.reward_fn = spec.reward.load()
        self.rollout = Rollout(spec.rollout, spec.max_response_length, backend, self.tokenizer, replicas, env=spec.env)

    @register(Dispatch.RANK_ZERO)
    def refresh_generation(self) -> dict[str, float]:
        """Switch to generation (`ColocatedGeneration.refresh`): the `reshard/*` figures; {} without one."""
        return self.generation.refresh() if self.generation is not None else {}

    @register(Dispatch.ONE_TO_ALL)
    def release_generation(self) -> None:
        """Switch back to training: free the generation weights and the rollout engine's memory."""
        if self.generation is not None:
            self.generation.release()

    @register(Dispatch.RANK_ZERO)
    def sync_address(self) -> tuple[str, int]:
        """Where training rank 0 will serve the weight-sync store: its group's master address, a free port."""
        return self.context.master_addr, free_port(self.context.master_addr)

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_sync(self, address: str, port: int, tg: int, rollout_world: int, bucket_bytes: int) -> None:
        """Join the process group spanning this group and a rollout group apart (`ShardSender.join`); the
        rollout group joins at once."""
        self.sender.join(address, port, tg, rollout_world, bucket_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def stage_weights(self, version: int) -> None:
        """Keep a copy of this rank's training shard as weight `version`, for a later `send_staged(version)`."""
        self.sender.stage(version)

    @register(Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict[str, float]:
        """Broadcast this rank's slices of its training shard now to the rollout ranks that need them (`sync/*`)."""
        return self.sender.send()

    @register(Dispatch.ONE_TO_ALL, aside=True)
    def send_staged(self, version: int) -> dict[str, float]:
        """`send_weights` of the copy staged as `version`, run aside: it reads only that copy, so the broadcast
        goes on while the actor trains (a rollout generating ahead does not wait for the update to end)."""
        return self.sender.send_staged(version)

    @register(Dispatch.DP_SPLIT, mesh="actor", reads=LOG_PROB_FIELDS)
    def compute_log_probs(self, batch: dict[str, Any], old: bool = True,
                          reference: bool = False) -> dict[str, torch.Tensor]:
        """OLD_LOG_PROBS and ENTROPY under the current weights (old), REF_LOG_PROBS under the reference
        (reference): one call, one shipment of the rows, when both are wanted."""
        out = self.reference.compute_ref_log_probs(batch) if reference else {}
        if old:
            r = self.spec.actor
            out.update(self.actor.compute_log_probs(
                batch, r.log_prob_micro_batch_size,
                r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else 0, r.log_prob_share_prompts))
        return token_rows(out, self.spec.run, self.mesh_coords()["actor"].answers)

    @register(Dispatch.ALL_TO_ALL)
    def prepare_tokens(self, batch: Optional[dict[str, Any]], stage: TokenStage,
                       kl_coef: float = 0.0) -> Optional[tuple[dict[str, Any], dict[str, float]]]:
        """The token-level preparation of the whole step's batch (`roles.preparation.prepare_tokens`): its
        rows come from the object store to this rank and its advantages go back there, so no token tensor
        passes the driver. Rank 0 alone computes it (`batch` None elsewhere: `ActorGroup.prepare_tokens`)."""
        if batch is None:
            return None
        fields, metrics = prepare_tokens(batch, stage, kl_coef)
        return token_rows(fields, self.spec.run), metrics

    @register(Dispatch.DP_SPLIT, mesh="actor", reads=ACTOR_UPDATE_FIELDS)
    def update_actor(self, rows: dict[str, Any], steps: list[torch.Tensor]) -> dict[str, float]:
        """The actor's update on this replica's `rows` (passed `PerReplica`, with its `steps`: the
        trainer's `actor_update_plan`)."""
        return self.actor.update_share(rows, steps)

    @register(Dispatch.RANK_ZERO)
    def export_hf(self, path: str) -> str:
        """The actor as an HF checkpoint, streamed stage by stage (every rank gathers; rank 0 writes); a LoRA
        actor's is the merged model, with its adapters as a PEFT directory in `peft/` beside the weights."""
        parts = self.engine.hf_stage_parts()
        written = path
        if self.rank != 0:
            for _ in parts:  # take part in each stage's gather
                pass
        else:
            model = self.spec.model
            tok_dir = Path(model.tokenizer_path or model.path)
            extra = tuple(tok_dir / f for f in TOKENIZER_FILES if (tok_dir / f).is_file())
            hf_config = self.model_cfg.to_hf_dict()
            hf_config["torch_dtype"] = model.dtype
            stages = self.engine.layout.pp
            written = str(save_hf_checkpoint(next(parts), hf_config, path, extra_files=extra) if stages == 1
                          else save_hf_checkpoint_parts(parts, stages, hf_config, path, extra_files=extra))
        if self.engine.lora is not None:  # after: the save replaces `path`
            export_peft(self.engine, Path(path) / "peft", self.spec.model.path)
        return written


class RolloutWorker(_Generates):
    """Rollout on devices of its own (placement.rollout apart from placement.training), at `rollout.tg`, on
    a generation shard that only the actor's broadcasts fill (`ShardReceiver`; generating before the first
    one is refused)."""

    def __init__(self, spec: RolloutWorkerSpec):
        self.init_process_group()  # this group's world: the generation TP groups at tg > 1
        prepare_process(self, spec.run.processes)
        self.spec = spec
        self.tokenizer = read_tokenizer(spec.model)
        self.receiver: ShardReceiver = apart_receiver(spec.model, spec.train_layout, spec.rollout.tg, self.rank,
                                                      self.world_size, spec.run.device, spec.lora)
        replica, replicas, answers = self.receiver.mesh
        self.register_replica("generation", replica, replicas, answers)
        self.backend: RolloutBackend = build_backend(spec.rollout, self.receiver.model, self.tokenizer,
                                                     spec.model.path, seed=spec.run.seed, device=spec.run.device)
        self.reward_fn = spec.reward.load()
        self.rollout = Rollout(spec.rollout, spec.max_response_length, self.backend, self.tokenizer, replicas,
                               env=spec.env)

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_sync(self, address: str, port: int, train: ParallelDims, bucket_bytes: int,
                         virtual_pp: int = 1, ep: int = 1) -> None:
        """Join the process group spanning the actor's group (`train` with `virtual_pp` model chunks a stage and
        its experts split over `ep` ranks, sync ranks 0 .. N-1) and this one (N + rank)."""
        self.receiver.join(address, port, train, bucket_bytes, virtual_pp, ep)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict[str, float]:
        """This rank's generation shard from the actor's ranks (`ShardReceiver.receive`); `sync/*` figures."""
        return self.receiver.receive(self.backend)

    @register(Dispatch.DP_SPLIT, mesh="generation")
    def generate(self, prompts: dict[str, Any], seed: int, mode: str = TRAIN,
                 pad: bool = False) -> dict[str, Any]:
        """As the actor's `generate`, from the weights the actor's ranks broadcast into this group."""
        if self.receiver.syncs == 0:
            raise RuntimeError("the rollout group apart has no weights yet: the actor's are broadcast into it "
                               "(receive_weights) before its first rollout")
        return super().generate(prompts, seed, mode, pad)

    @register(Dispatch.RANK_ZERO)
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The whole generation model under HF names (gathered over each TP group): for checks, not syncs."""
        return self.receiver.hf_weights()


class CriticWorker(EngineWorker):
    """The value model: per-token values and the clipped value update."""

    CHECKPOINT_NAME = "critic"

    def __init__(self, spec: CriticWorkerSpec):
        self.init_process_group()
        prepare_process(self, spec.run.processes)
        torch.manual_seed(spec.run.seed)
        self.engine = build_engine(spec.run, spec.model, spec.path, spec.critic.optim, spec.critic.parallel,
                                   spec.layout, spec.optimizer_steps, value_head=True, kind=spec.critic.engine,
                                   fsdp=spec.critic.fsdp, moe=spec.critic.moe)
        self.register_mesh("critic", spec.layout)
        self.run = spec.run
        self.critic = Critic(spec.critic, self.engine, mini_batch_size=spec.mini_batch_size, seed=spec.run.seed)

    @register(Dispatch.DP_SPLIT, mesh="critic", reads=VALUE_FIELDS)
    def compute_values(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return token_rows(self.critic.compute_values(batch), self.run, self.mesh_coords()["critic"].answers)

    @register(Dispatch.DP_SPLIT, mesh="critic", reads=CRITIC_UPDATE_FIELDS)
    def update_critic(self, rows: dict[str, Any], steps: list[torch.Tensor]) -> dict[str, float]:
        """The critic's update on this replica's `rows` (`PerReplica`, with the trainer's
        `critic_update_plan` share `steps`)."""
        return self.critic.update_share(rows, steps)


class ReferenceWorker(Worker):
    """The frozen reference on devices of its own (placement.reference apart from training), sharded over its
    processes under FSDP2: each holds 1/N of it, and the actor's processes hold none."""

    def __init__(self, spec: ReferenceWorkerSpec):
        self.init_process_group()
        prepare_process(self, spec.run.processes)
        ref = spec.reference
        engine = build_engine(spec.run, spec.model, spec.model.path, None, ParallelConfig(), spec.layout,
                              kind="fsdp", fsdp=ref.fsdp)
        self.register_mesh("reference", spec.layout)
        self.run = spec.run
        self.reference = Reference(ref, engine, temperature=spec.temperature)

    @register(Dispatch.DP_SPLIT, mesh="reference", reads=LOG_PROB_FIELDS)
    def compute_ref_log_probs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """REF_LOG_PROBS of this replica's rows."""
        return token_rows(self.reference.compute_ref_log_probs(batch), self.run,
                          self.mesh_coords()["reference"].answers)


class RewardModelWorker(Worker):
    """An HF sequence classifier scoring (prompt, response) pairs, on the devices of placement.reward:
    whole on every rank (reward.engine "hf"), or sharded over the group by FSDP2 ("fsdp"), where every
    rank scores its share in step with the others (idle passes where it has fewer micro-batches)."""

    def __init__(self, cfg: RewardConfig):
        prepare_process(self)
        self.cfg = cfg
        if cfg.engine == "fsdp":
            from hybridflow.engine.fsdp_frozen import load_sharded_classifier

            self.init_process_group()
            self.model = load_sharded_classifier(cfg.model_path, device=self.context.device)
        else:
            from hybridflow.rollout.hf import load_hf_model

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
    sync_address = remote(ActorRolloutRefWorker.sync_address)
    join_weight_sync = remote(ActorRolloutRefWorker.join_weight_sync)
    stage_weights = remote(ActorRolloutRefWorker.stage_weights)
    send_weights = remote(ActorRolloutRefWorker.send_weights)
    send_staged = remote(ActorRolloutRefWorker.send_staged)
    compute_log_probs = remote(ActorRolloutRefWorker.compute_log_probs)

    def prepare_tokens(self, batch: dict[str, Any], stage: TokenStage,
                       kl_coef: float = 0.0) -> tuple[dict[str, Any], dict[str, float]]:
        """`ActorRolloutRefWorker.prepare_tokens` on rank 0 (the others get None and return at once)."""
        world = self.world_size
        return self.group.call(ActorRolloutRefWorker.prepare_tokens, [batch] + [None] * (world - 1),
                               [stage] * world, [kl_coef] * world)[0]

    update_actor = remote(ActorRolloutRefWorker.update_actor)
    export_hf = remote(ActorRolloutRefWorker.export_hf)
    save = remote(ActorRolloutRefWorker.save)
    load = remote(ActorRolloutRefWorker.load)


class RolloutGroup(RoleGroup):
    """Rollout apart from training."""

    generate = remote(RolloutWorker.generate)
    join_weight_sync = remote(RolloutWorker.join_weight_sync)
    receive_weights = remote(RolloutWorker.receive_weights)
    hf_weights = remote(RolloutWorker.hf_weights)


class ReferenceGroup(RoleGroup):
    """The reference on devices of its own."""

    compute_ref_log_probs = remote(ReferenceWorker.compute_ref_log_probs)


class CriticGroup(RoleGroup):
    compute_values = remote(CriticWorker.compute_values)
    update_critic = remote(CriticWorker.update_critic)
    save = remote(CriticWorker.save)
    load = remote(CriticWorker.load)


class RewardModelGroup(RoleGroup):
    score = remote(RewardModelWorker.score)
