"""The run plan: every quantity a run derives from its config, computed once (`RunPlan.from_config`).

A config says what the user asked for; the plan says what follows from it:
which devices and how many processes each role has, each engine role's
`ParallelDims`, whether Ray launches the groups, whether rollout has a group
of its own, which groups share processes, how many generation replicas the
prompts split over, and the batch arithmetic (prompt and row multiples, the
rollout chunk, the LR schedule's length). `trainer/build.py`, the trainer and
the worker specs read it; none of them redo the arithmetic.

The plan assumes a config that `validate` accepted (layouts divide their
roles' processes, placements exist); the checks that need its numbers
(`check_runnable`) take it as given. It reads the environment once, when it
is built: torchrun's `WORLD_SIZE` decides whether this job is one rank of
several without Ray. `hybridflow config CONFIG` prints it.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from hybridflow.config.schema import Config, ParallelConfig, PlacementConfig
from hybridflow.parallel.layout import ParallelDims

ROLES = tuple(f.name for f in dataclasses.fields(PlacementConfig))  # rollout, reward, training, ...
ENGINE_ROLES = ("training", "critic", "reference")  # the placement roles that run a training engine
# What one process's megatron-core layout fixes: roles sharing a process (the critic with the actor,
# under torchrun always, under Ray when their devices and these degrees agree) must agree on these.
PROCESS_LAYOUT_KEYS = ("tp", "pp", "cp", "virtual_pp")  # what megatron-core holds once per process


# --------------------------------------------------------------------------- from the config alone
# The few derivations `validate` needs before a plan can be built (the devices and process count
# each layout is checked against); the plan is made of the same functions.

def devices_for(cfg: Config, role: str) -> list[int]:
    """Device indices a role runs on: its placement, or every device.

    An empty `placement.reference` means `placement.training`'s devices: the reference shares the actor's
    processes unless it runs under FSDP on devices of its own (`reference_apart`).
    """
    placed = dataclasses.asdict(cfg.placement)
    if role not in placed:
        raise ValueError(f"unknown role {role!r}; placement roles are {list(ROLES)}")
    if placed[role]:
        return list(placed[role])
    if role == "reference":
        return devices_for(cfg, "training")
    return list(range(cfg.trainer.n_devices))


def job_world() -> int:
    """Processes of this job outside Ray: torchrun's WORLD_SIZE, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def uses_ray(cfg: Config) -> bool:
    """Whether worker groups run as Ray actors (else in-process, or this rank's share under torchrun)."""
    t = cfg.trainer
    if t.launcher != "auto":
        return t.launcher == "ray"
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: every rank drives its own share
        return False
    return t.n_devices > 1 or t.ray_address is not None


def rollout_apart(cfg: Config) -> bool:
    """Rollout has a group of its own, on other devices than training (under Ray; elsewhere every role runs
    on every rank)."""
    return uses_ray(cfg) and sorted(devices_for(cfg, "rollout")) != sorted(devices_for(cfg, "training"))


def reference_apart(cfg: Config) -> bool:
    """The reference has a group of its own on other devices than training (under Ray, reference.engine=fsdp:
    a megatron-core reference lives in the actor's processes, `config/validate.py`)."""
    return uses_ray(cfg) and sorted(devices_for(cfg, "reference")) != sorted(devices_for(cfg, "training"))


def role_world(cfg: Config, role: str) -> int:
    """Processes of a role's worker group: its placement under Ray, the job's ranks otherwise."""
    return len(devices_for(cfg, role)) if uses_ray(cfg) else job_world()


def reference_parallel(cfg: Config) -> ParallelConfig:
    """The reference's parallel section: the actor's unless given (and then checked to be equal); none of
    its own under FSDP (data parallel over its processes)."""
    if cfg.reference.engine == "fsdp":
        return ParallelConfig()
    return cfg.reference.parallel or cfg.actor.parallel


def engine_parallel(cfg: Config) -> dict[str, tuple[str, ParallelConfig]]:
    """Engine role -> (key path, parallel section) of each placement role that runs a training engine (an FSDP
    role's section is tp = pp = cp = 1: `config/validate.py`)."""
    return {"training": ("actor.parallel", cfg.actor.parallel), "critic": ("critic.parallel", cfg.critic.parallel),
            "reference": ("reference.parallel", reference_parallel(cfg))}


def run_dir(cfg: Config) -> Path:
    """Where a run writes its metrics, checkpoints and exports: trainer.output_dir / trainer.experiment."""
    return Path(cfg.trainer.output_dir) / cfg.trainer.experiment


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class RunPlan:
    """What a valid config implies for the run, computed once (`from_config`)."""

    device: str  # "cpu" | "cuda"
    uses_ray: bool  # worker groups are Ray actors; else in-process, or this rank's share under torchrun
    job_world: int  # this job's processes outside Ray (torchrun's WORLD_SIZE, else 1)
    devices: dict[str, tuple[int, ...]]  # placement role -> its device indices (used under Ray)
    worlds: dict[str, int]  # placement role -> processes of its worker group
    layouts: dict[str, ParallelDims]  # engine role ("training", "critic", "reference") -> its p-t-d layout
    engines: dict[str, str]  # engine role -> its training engine ("megatron" or "fsdp": dp = its world)
    uses_critic: bool  # GAE: a critic group exists
    uses_reward_model: bool  # reward.model_path: a reward-model group exists
    rollout_apart: bool  # rollout has a group of its own, on other devices than training (Ray only)
    reference_apart: bool  # the reference (under FSDP) has a group of its own, on other devices (Ray only)
    colocate_critic: bool  # under Ray, the critic's workers join the actor's processes
    colocate_reward_model: bool  # under Ray, the reward model's workers join the actor's processes
    generation_replicas: int  # the prompts split over these (each generates its own share)
    row_multiple: int  # training rows come in multiples of this (actor and critic DP shares)
    prompt_multiple: int  # prompts come in multiples of this (generation and training shares)
    chunk_prompts: int  # prompts per rollout chunk of the DataFlow
    needs_reference: bool  # KL against the initial policy, in the reward or as a loss
    needs_old_log_probs: bool  # the old log-probs need a forward pass of their own
    needs_greedy_baseline: bool  # ReMax: one greedy rollout per prompt, its score the advantage's baseline
    mini_batch_responses: int  # responses per optimizer step: actor.ppo_mini_batch_size * rollout.n
    optimizer_steps: dict[str, int]  # "actor", "critic" -> the LR schedule's length
    run_dir: Path  # trainer.output_dir / trainer.experiment

    @classmethod
    def from_config(cls, cfg: Config) -> "RunPlan":
        """The plan of a config `validate` accepted (under the environment this process runs in)."""
        ray, world = uses_ray(cfg), job_world()
        devices = {role: tuple(devices_for(cfg, role)) for role in ROLES}
        worlds = {role: len(devices[role]) if ray else world for role in ROLES}
        layouts = {role: ParallelDims.for_world(worlds[role], tp=par.tp, pp=par.pp, cp=par.cp)
                   for role, (_, par) in engine_parallel(cfg).items()}
        critic = cfg.algorithm.adv_estimator == "gae"
        apart = rollout_apart(cfg)
        needs_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
        on_actor_devices = {role: sorted(devices[role]) == sorted(devices["training"]) for role in ROLES}
        a, c = cfg.actor.parallel, cfg.critic.parallel
        same_process_layout = all((getattr(a, k) or 1) == (getattr(c, k) or 1) for k in PROCESS_LAYOUT_KEYS)
        # Generation replicas: the rollout group's processes, or the actor's when it is not apart, over the
        # generation layout's tg * pg.
        replicas = worlds["rollout" if apart else "training"] // (cfg.rollout.tg * cfg.rollout.pg)
        rows = math.lcm(layouts["training"].dp, layouts["critic"].dp if critic else 1)
        prompts = math.lcm(rows, replicas)
        return cls(
            device=cfg.trainer.device, uses_ray=ray, job_world=world, devices=devices, worlds=worlds,
            layouts=layouts, engines={"training": cfg.actor.engine, "critic": cfg.critic.engine,
                                      "reference": cfg.reference.engine}, uses_critic=critic, uses_reward_model=cfg.reward.model_path is not None,
            rollout_apart=apart, reference_apart=reference_apart(cfg) and needs_ref, colocate_critic=on_actor_devices["critic"] and same_process_layout,
            colocate_reward_model=on_actor_devices["reward"], generation_replicas=replicas, row_multiple=rows,
            prompt_multiple=prompts, chunk_prompts=chunk_prompts(cfg, prompts),
            needs_reference=needs_ref,
            needs_old_log_probs=needs_old_log_probs(cfg),
            needs_greedy_baseline=cfg.algorithm.adv_estimator == "remax",
            mini_batch_responses=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
            optimizer_steps={"actor": optimizer_steps(cfg, cfg.actor.ppo_epochs),
                             "critic": optimizer_steps(cfg, cfg.critic.ppo_epochs)}, run_dir=run_dir(cfg))

    def describe(self) -> dict:
        """The plan as plain YAML-able data (what `hybridflow config` prints)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "layouts":
                value = {role: str(dims) for role, dims in value.items()}
            elif f.name == "devices":
                value = {role: list(devices) for role, devices in value.items()}
            elif isinstance(value, Path):
                value = str(value)
            out[f.name] = value
        return out


def chunk_prompts(cfg: Config, multiple: int) -> int:
    """Prompts per rollout chunk: dataflow.min_batch_for_reward responses (whole prompts, rounded up to a
    multiple of `multiple` for equal shares), or the whole batch."""
    size, want = cfg.data.train_batch_size, cfg.dataflow.min_batch_for_reward
    if want > 0:
        per_prompt = -(-want // cfg.rollout.n)
        size = -(-per_prompt // multiple) * multiple
    return size


def needs_old_log_probs(cfg: Config) -> bool:
    """Whether the old log-probs need a forward pass of their own.

    They are the log-probs of the policy that generated the batch. When the
    update makes one optimizer step (one epoch, the whole batch one
    mini-batch), that policy is still the current one while the loss is
    computed, so the update's own log-probs, detached, are the old ones (TRL
    skips the pass the same way; verl does not). KL in the reward reads them
    before the update, so it keeps the pass.

    Off-policy training (trainer.off_policy) and the sampler-trainer correction skip it on the same
    terms: the batch was sampled by other weights, but the proximal policy the correction weighs them
    against is the trainer's weights at the start of the update, which for one optimizer step are the
    weights the loss runs. The update then reports the sampler-trainer gap from its own pass
    (`roles/actor.py`) instead of the driver from the recomputed log-probs.
    """
    a = cfg.actor
    one_step = a.ppo_epochs == 1 and cfg.data.train_batch_size <= a.ppo_mini_batch_size
    if a.moe.routing_replay == "old":  # the update replays the routes that pass records
        return True
    return not (a.skip_old_log_probs and one_step and not cfg.algorithm.use_kl_in_reward)


def optimizer_steps(cfg: Config, epochs: int) -> int:
    """Optimizer steps of the whole run for a role taking `epochs` passes per update, its LR schedule's
    length: epochs x mini-batches per step (at most: dropped uniform groups leave fewer rows)."""
    n = cfg.rollout.n
    rows = cfg.data.train_batch_size * n
    return cfg.trainer.total_steps * epochs * -(-rows // max(1, cfg.actor.ppo_mini_batch_size * n))
