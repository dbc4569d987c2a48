"""Building a run's worker groups from the config and its run plan: the one place its sections are handed out.

Each worker gets a spec holding only the sections it uses
(`hybridflow.workers.specs`) and the numbers the run plan (`config/plan.py`)
computed for it: its layout, its LR schedule's length. Which groups exist,
and which share processes, the plan says too: a critic only for GAE, a
reward-model group only with `reward.model_path`, a rollout group only when
rollout is placed apart from training under Ray. Nothing here derives
them again. The route the actor's weights take to the rollout is chosen
here too, once (`rollout_weights`). Checks of the config itself live in `config/validate.py` and
have run before this.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from hybridflow.checkpoint.format import model_table
from hybridflow.config.plan import RunPlan, reference_parallel, uses_ray
from hybridflow.config.schema import Config
from hybridflow.controller.local_group import LocalWorkerGroup
from hybridflow.controller.resource_pool import ResourcePool, pools_from_placement
from hybridflow.controller.transfer import fetch_remote_rows
from hybridflow.dataflow.off_policy import RolloutStream, Schedule
from hybridflow.hybrid_engine.apart_sync import ApartWeightSync
from hybridflow.hybrid_engine.rollout_weights import Apart, LockStep, StreamedApart
from hybridflow.models.config import DecoderConfig
from hybridflow.parallel.stages import layout_label
from hybridflow.workers.rl_workers import (ActorGroup, ActorRolloutRefWorker, CriticGroup, CriticWorker,
                                           ReferenceGroup, ReferenceWorker, RewardModelGroup, RewardModelWorker,
                                           RolloutGroup, RolloutWorker)
from hybridflow.workers.judge import JudgeGroup, JudgeWorker
from hybridflow.workers.specs import (ActorWorkerSpec, CriticWorkerSpec, ReferenceWorkerSpec, RolloutWorkerSpec,
                                      RuleReward, Run)


def _run(cfg: Config) -> Run:
    # Under Ray every device index is a process of the run (on CPU they share the node's cores).
    # Token tensors stay in the object store where the workers are Ray actors (in-process, there is no trip).
    ray = uses_ray(cfg)
    return Run(device=cfg.trainer.device, seed=cfg.trainer.seed, processes=cfg.trainer.n_devices if ray else 1,
               rows_in_object_store=ray and cfg.trainer.data_plane == "object_store")


def _rule_reward(cfg: Config) -> RuleReward:
    """reward.function for the generating workers: a registered name goes as the function this process has
    under it (it may have been registered here only); a "file.py:function" the worker loads by its path."""
    spec = cfg.reward.function
    if ":" in spec:  # the path as the driver resolved it (a worker may run in another directory)
        path, _, name = spec.rpartition(":")
        return RuleReward(spec, resolved=f"{Path(path).expanduser().resolve()}:{name}", config=cfg.reward)
    from hybridflow.rewards import get_reward_fn

    return RuleReward(spec, get_reward_fn(spec), config=cfg.reward)


def actor_spec(cfg: Config, plan: RunPlan) -> ActorWorkerSpec:
    reference = dataclasses.replace(cfg.reference, parallel=reference_parallel(cfg))
    return ActorWorkerSpec(run=_run(cfg), model=cfg.model, actor=cfg.actor, rollout=cfg.rollout,
                           reference=reference if plan.needs_reference and not plan.reference_apart else None,
                           max_response_length=cfg.data.max_response_length,
                           optimizer_steps=plan.optimizer_steps["actor"], layout=plan.layouts["training"],
                           generates=not plan.rollout_apart, old_log_probs=plan.needs_old_log_probs, env=cfg.env,
                           reward=_rule_reward(cfg))


def rollout_spec(cfg: Config, plan: RunPlan) -> RolloutWorkerSpec:
    return RolloutWorkerSpec(run=_run(cfg), model=cfg.model, rollout=cfg.rollout,
                             max_response_length=cfg.data.max_response_length,
                             train_layout=plan.layouts["training"], env=cfg.env, reward=_rule_reward(cfg),
                             lora=cfg.actor.lora if cfg.actor.engine == "megatron" and cfg.actor.lora.rank else None)


def reference_spec(cfg: Config, plan: RunPlan) -> ReferenceWorkerSpec:
    return ReferenceWorkerSpec(run=_run(cfg), model=cfg.model, reference=cfg.reference,
                               temperature=cfg.rollout.temperature, layout=plan.layouts["reference"])


def critic_spec(cfg: Config, plan: RunPlan) -> CriticWorkerSpec:
    return CriticWorkerSpec(run=_run(cfg), model=cfg.model, path=cfg.critic.model_path or cfg.model.path,
                            critic=cfg.critic, mini_batch_size=plan.mini_batch_responses,
                            optimizer_steps=plan.optimizer_steps["critic"], layout=plan.layouts["critic"])


def model_tensors(cfg: Config, plan: RunPlan, model: DecoderConfig,
                  critic_model: Optional[DecoderConfig] = None) -> dict[str, dict[str, list[int]]]:
    """Checkpoint name ("actor", "critic") -> the tensor table (`checkpoint.format.model_table`) of each model
    the run checkpoints; the layout is apart (`checkpoint_layouts`). Saved with each checkpoint and compared
    when a run resumes, so a model of another shape is refused before any worker reads a shard."""
    divisible_by = cfg.model.make_vocab_size_divisible_by
    tables = {"actor": model_table(model, divisible_by, value_head=False)}
    if plan.uses_critic:
        tables["critic"] = model_table(critic_model or model, divisible_by, value_head=True)
    return tables


def checkpoint_layouts(plan: RunPlan, cfg: Config) -> dict[str, str]:
    """Checkpoint name -> the layout its shards are written at, e.g. "p1-t2-d1" (one file per rank),
    "p2-t1-d1-v2" (two model chunks per stage), "p1-t1-d2-e2" (experts split over 2 ranks), or "fsdp-d2" (a
    torch DCP checkpoint FSDP2 wrote from 2 ranks)."""
    def layout(role: str, parallel) -> str:
        dims = plan.layouts[role]
        return (f"fsdp-d{dims.dp}" if plan.engines[role] == "fsdp"
                else layout_label(dims, parallel.virtual_pp or 1, parallel.ep))

    out = {"actor": layout("training", cfg.actor.parallel)}
    if plan.uses_critic:
        out["critic"] = layout("critic", cfg.critic.parallel)
    return out


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
    reference: Optional[ReferenceGroup] = None     # the reference on devices of its own (under FSDP)
    judge: Optional[JudgeGroup] = None             # reward.judge placed apart from the rollout (workers/judge.py)

    @property
    def generation(self) -> Union[ActorGroup, RolloutGroup]:
        """The group that generates: the separate rollout group, or the actor's."""
        return self.rollout or self.actor


def _local_pool(plan: RunPlan) -> ResourcePool:
    """This job's devices without Ray: one per process (torchrun's WORLD_SIZE), of the configured type.

    The pool's type decides the workers' backend (NCCL or gloo) and whether CUDA stays visible to them.
    """
    return ResourcePool(list(range(plan.job_world)), plan.device)


def role_pools(plan: RunPlan) -> dict[str, ResourcePool]:
    """Placement role -> its pool under Ray; roles placed on one device set share one pool."""
    return pools_from_placement(plan.devices, plan.device)


def build_groups(cfg: Config, plan: RunPlan) -> Groups:
    """The run's worker groups. Under Ray a critic on the actor's devices in the actor's megatron-core layout
    (`plan.colocate_critic`: a process holds one layout) and a reward model on the actor's devices
    (`plan.colocate_reward_model`: an HF classifier holds none) join the actor's processes, one process per
    device as under torchrun and in verl's colocated workers; otherwise a role gets processes of its own."""
    if not plan.uses_ray:
        def local(worker_cls: type, spec) -> LocalWorkerGroup:
            return LocalWorkerGroup(worker_cls, _local_pool(plan), spec)

        return Groups(ActorGroup(local(ActorRolloutRefWorker, actor_spec(cfg, plan))),
                      CriticGroup(local(CriticWorker, critic_spec(cfg, plan))) if plan.uses_critic else None,
                      RewardModelGroup(local(RewardModelWorker, cfg.reward)) if plan.uses_reward_model else None,
                      judge=JudgeGroup(local(JudgeWorker, cfg.reward)) if judge_apart(cfg) else None)
    from hybridflow.controller.ray_setup import init_ray
    from hybridflow.controller.ray_group import RayWorkerGroup

    init_ray(address=cfg.trainer.ray_address)
    pools = role_pools(plan)
    # With the rollout apart the actor broadcasts staged weight copies to it on an aside lane, while it trains
    # (`send_staged`); colocated, its processes (and a vLLM engine in them) keep one thread for calls.
    start = RayWorkerGroup.with_aside_lane if plan.rollout_apart else RayWorkerGroup
    actor = start(ActorRolloutRefWorker, pools["training"], actor_spec(cfg, plan))

    def beside_actor(worker_cls: type, role: str, spec, colocate: bool) -> RayWorkerGroup:
        """`role`'s group: in the actor's processes, or in processes of its own on its pool."""
        return RayWorkerGroup.colocated(actor, worker_cls, spec) if colocate else RayWorkerGroup(worker_cls, pools[role], spec)

    groups = Groups(
        ActorGroup(actor),
        CriticGroup(beside_actor(CriticWorker, "critic", critic_spec(cfg, plan), plan.colocate_critic))
        if plan.uses_critic else None,
        RewardModelGroup(beside_actor(RewardModelWorker, "reward", cfg.reward, plan.colocate_reward_model))
        if plan.uses_reward_model else None,
        RolloutGroup(RayWorkerGroup(RolloutWorker, pools["rollout"], rollout_spec(cfg, plan))) if plan.rollout_apart else None,
        reference=ReferenceGroup(RayWorkerGroup(ReferenceWorker, pools["reference"], reference_spec(cfg, plan)))
        if plan.reference_apart else None)
    if judge_apart(cfg):  # placement.reward's processes (the actor's on its devices), or the reference's
        judge = cfg.reward.judge.placement
        if judge == "reward" and not plan.colocate_reward_model:
            groups.judge = JudgeGroup(RayWorkerGroup(JudgeWorker, pools["reward"], cfg.reward))
        else:
            beside = groups.actor if judge == "reward" else (groups.reference or groups.actor)
            groups.judge = JudgeGroup(RayWorkerGroup.colocated(beside.group, JudgeWorker, cfg.reward))
    return groups


def judge_apart(cfg: Config) -> bool:
    """Whether the judge runs on a group of its own (`reward.judge.placement`), not in the rollout's worker."""
    return cfg.reward.kind == "judge" and cfg.reward.judge.placement != "rollout"


def rollout_weights(cfg: Config, plan: RunPlan, groups: Groups, inputs: Callable[[int], Any],
                    generate: Callable[[Any, int], Any], ready: Callable[[Any], Any]):
    """The one owner of the rollout's weights for this run (`hybrid_engine/rollout_weights.py`), chosen here
    once: the actor's processes generate (lock step, refreshed after each update), or a rollout group apart
    is fed by collectives in lock step (`trainer.off_policy: sync`) or generates ahead from staged versions.

    `inputs(step)`: the step's prompt chunks; `generate(chunks, version)`: a rollout group's batches of them
    (off-policy, on the stream's thread); `ready(batches)`: batches restored from a checkpoint made ready.
    """
    if groups.rollout is None:
        return LockStep(inputs, refresh=groups.actor.refresh_generation, release=groups.actor.release_generation)
    sync = ApartWeightSync(groups.actor, groups.rollout, plan.layouts["training"], cfg.rollout.tg,
                           cfg.rollout.weight_bucket_mb * 2**20, cfg.actor.parallel.virtual_pp or 1,
                           cfg.actor.parallel.ep)
    if cfg.trainer.off_policy == "sync":
        return Apart(sync, inputs)
    schedule = Schedule.of(cfg.trainer)
    return StreamedApart(sync, lambda publish, load: RolloutStream(schedule, generate, load, publish, inputs,
                                                                  portable=fetch_remote_rows), ready)
