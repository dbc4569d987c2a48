"""Building a run's worker groups from the config: the one place its sections are handed out.

Each worker gets a spec holding only the sections it uses
(`hybridflow.workers.specs`); numbers several sections decide together are
computed here once. Which groups exist follows from the config: a critic
only for GAE, a reward-model group only with `reward.model_path`, a rollout
group only when `placement.rollout` differs from `placement.training` under
Ray. Checks of the config itself live in `config/validate.py` and have run
before this.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional, Union

from hybridflow.config.schema import Config
from hybridflow.config.validate import (PROCESS_LAYOUT_KEYS, ROLES, devices_for, reference_parallel, role_layout,
                                        rollout_apart, uses_critic, uses_ray)
from hybridflow.controller.local_group import LocalWorkerGroup
from hybridflow.controller.resource_pool import ResourcePool, pools_from_placement
from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig
from hybridflow.workers.rl_workers import (ActorGroup, ActorRolloutRefWorker, CriticGroup, CriticWorker,
                                           RewardModelGroup, RewardModelWorker, RolloutGroup, RolloutWorker)
from hybridflow.workers.specs import ActorWorkerSpec, CriticWorkerSpec, RolloutWorkerSpec, Run


def needs_reference(cfg: Config) -> bool:
    """KL against the initial policy, in the reward or as a loss."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def needs_old_log_probs(cfg: Config) -> bool:
    """Whether the old log-probs need a forward pass of their own.

    They are the log-probs of the policy that generated the batch. When the
    update makes one optimizer step (one epoch, the whole batch one
    mini-batch), that policy is still the current one while the loss is
    computed, so the update's own log-probs, detached, are the old ones (TRL
    skips the pass the same way; verl does not). KL in the reward reads them
    before the update, so it keeps the pass.
    """
    a = cfg.actor
    one_step = a.ppo_epochs == 1 and cfg.data.train_batch_size <= a.ppo_mini_batch_size
    return not (a.skip_old_log_probs and one_step and not cfg.algorithm.use_kl_in_reward)


def optimizer_steps(cfg: Config) -> int:
    """Optimizer steps of the whole run: the LR schedule's length."""
    a, n = cfg.actor, cfg.rollout.n
    rows = cfg.data.train_batch_size * n
    return cfg.trainer.total_steps * a.ppo_epochs * -(-rows // max(1, a.ppo_mini_batch_size * n))


def _run(cfg: Config) -> Run:
    return Run(device=cfg.trainer.device, seed=cfg.trainer.seed)


def actor_spec(cfg: Config) -> ActorWorkerSpec:
    reference = dataclasses.replace(cfg.reference, parallel=reference_parallel(cfg))
    return ActorWorkerSpec(run=_run(cfg), model=cfg.model, actor=cfg.actor, rollout=cfg.rollout,
                           reference=reference if needs_reference(cfg) else None,
                           max_response_length=cfg.data.max_response_length, optimizer_steps=optimizer_steps(cfg),
                           layout=role_layout(cfg, "training"), generates=not rollout_apart(cfg))


def rollout_spec(cfg: Config) -> RolloutWorkerSpec:
    return RolloutWorkerSpec(run=_run(cfg), model=cfg.model, rollout=cfg.rollout,
                             max_response_length=cfg.data.max_response_length)


def critic_spec(cfg: Config) -> CriticWorkerSpec:
    return CriticWorkerSpec(run=_run(cfg), model=cfg.model, path=cfg.critic.model_path or cfg.model.path,
                            critic=cfg.critic, mini_batch_size=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                            optimizer_steps=optimizer_steps(cfg), layout=role_layout(cfg, "critic"))


def model_tensors(cfg: Config, model: DecoderConfig,
                  critic_model: Optional[DecoderConfig] = None) -> dict[str, dict[str, list[int]]]:
    """Checkpoint name ("actor", "critic") -> {Megatron parameter: full shape} of each model the run
    checkpoints, from the bridge as the engines build them (vocabulary padded for the role's TP; the critic's
    output layer is its one-value head). Saved with each checkpoint and compared when a run resumes, so a
    model of another shape is refused before any worker reads a shard."""
    def table(decoder: DecoderConfig, role: str, value_head: bool) -> dict[str, list[int]]:
        bridge = get_bridge(decoder, cfg.model.make_vocab_size_divisible_by, role_layout(cfg, role).tp)
        shapes = bridge.megatron_shapes()
        if value_head:
            shapes["output_layer.weight"] = (1, decoder.hidden_size)
        return {name: list(shape) for name, shape in shapes.items()}

    tables = {"actor": table(model, "training", value_head=False)}
    if uses_critic(cfg):
        tables["critic"] = table(critic_model or model, "critic", value_head=True)
    return tables


def weights_bytes(cfg: Config, tables: dict[str, dict[str, list[int]]]) -> int:
    """The least a checkpoint of these models (`model_tensors`) takes on disk: their weights in model.dtype.
    Adam's state, saved beside them once the optimizer has stepped, comes on top."""
    per_value = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]
    return per_value * sum(math.prod(shape) for table in tables.values() for shape in table.values())


@dataclass
class Groups:
    """The worker groups of a run; None where the role is not used or shares the actor's group."""

    actor: ActorGroup                              # actor + reference, and rollout unless `rollout` is set
    critic: Optional[CriticGroup] = None
    reward_model: Optional[RewardModelGroup] = None
    rollout: Optional[RolloutGroup] = None         # rollout on devices apart from training

    @property
    def generation(self) -> Union[ActorGroup, RolloutGroup]:
        """The group that generates: the separate rollout group, or the actor's."""
        return self.rollout or self.actor


def _local_pool(cfg: Config) -> ResourcePool:
    """This job's devices without Ray: one per process (torchrun's WORLD_SIZE), of the configured type.

    The pool's type decides the workers' backend (NCCL or gloo) and whether CUDA stays visible to them.
    """
    return ResourcePool(list(range(int(os.environ.get("WORLD_SIZE", "1")))), cfg.trainer.device)


def role_pools(cfg: Config) -> dict[str, ResourcePool]:
    """Placement role -> its pool under Ray; roles placed on one device set share one pool."""
    return pools_from_placement({role: devices_for(cfg, role) for role in ROLES}, cfg.trainer.device)


def colocate_critic(cfg: Config, pools: dict[str, ResourcePool]) -> bool:
    """The critic's workers join the actor's processes (one process per device, as under torchrun and in
    verl's colocated workers) when it is placed on the actor's devices in the actor's megatron-core
    layout: a process holds one layout. Else it gets processes of its own."""
    a, c = cfg.actor.parallel, cfg.critic.parallel
    return pools["critic"] is pools["training"] and all(getattr(a, k) == getattr(c, k) for k in PROCESS_LAYOUT_KEYS)


def colocate_reward_model(pools: dict[str, ResourcePool]) -> bool:
    """The reward model's workers join the actor's processes when it is placed on the actor's devices: an
    HF classifier holds no megatron-core layout, so the actor's processes can hold it whatever theirs is."""
    return pools["reward"] is pools["training"]


def build_groups(cfg: Config) -> Groups:
    critic = uses_critic(cfg)
    reward_model = cfg.reward.model_path is not None
    if not uses_ray(cfg):
        return Groups(ActorGroup(LocalWorkerGroup(ActorRolloutRefWorker, _local_pool(cfg), actor_spec(cfg))),
                      CriticGroup(LocalWorkerGroup(CriticWorker, _local_pool(cfg), critic_spec(cfg))) if critic else None,
                      RewardModelGroup(LocalWorkerGroup(RewardModelWorker, _local_pool(cfg), cfg.reward)) if reward_model else None)
    from hybridflow.controller.ray_setup import init_ray
    from hybridflow.controller.ray_group import RayWorkerGroup

    init_ray(address=cfg.trainer.ray_address)
    pools = role_pools(cfg)
    actor = RayWorkerGroup(ActorRolloutRefWorker, pools["training"], actor_spec(cfg))

    def beside_actor(worker_cls: type, role: str, spec, colocate: bool) -> RayWorkerGroup:
        """`role`'s group: in the actor's processes, or in processes of its own on its pool."""
        return RayWorkerGroup.colocated(actor, worker_cls, spec) if colocate else RayWorkerGroup(worker_cls, pools[role], spec)

    return Groups(
        ActorGroup(actor),
        CriticGroup(beside_actor(CriticWorker, "critic", critic_spec(cfg), colocate_critic(cfg, pools)))
        if critic else None,
        RewardModelGroup(beside_actor(RewardModelWorker, "reward", cfg.reward, colocate_reward_model(pools)))
        if reward_model else None,
        RolloutGroup(RayWorkerGroup(RolloutWorker, pools["rollout"], rollout_spec(cfg))) if rollout_apart(cfg) else None)
