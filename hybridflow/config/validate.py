"""The config checks that read only values: combinations that cannot run, each a `ConfigError`.

Single values are type-checked by the loader; here live the rules that tie
keys together, each failure a `ConfigError` naming the key path to change.
Nothing here touches the machine (no sockets, files or CUDA) and nothing
downstream re-checks these. What the config implies (devices, layouts,
replicas, multiples) is not computed here but in the run plan
(`config/plan.py`), which the later checks are handed.

The config package's ConfigErrors live in three modules, by what they read:

- here, `validate(cfg)`: the config alone (placement, layouts, batch sizes,
  sampling, registry names). `load_config` calls it. And `check_plan(cfg,
  plan, model)`: what also needs the run plan and the model's own shape
  (heads, layers) against the layouts, and settings this trainer cannot run
  yet (a config for them still loads and prints).
- `config/preflight.py`, `check_runnable`: `check_plan`, then the world
  outside the config (paths, the run directory, the Ray address, vLLM, CUDA).
  The trainer calls it once it has read the model's config.json.
- `config/inputs.py`: what the trainer reads at build time, checked as it
  is read (the model's config.json, the tokenizer, the prompt count, the
  reward function).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Optional

from hybridflow.config.plan import (PROCESS_LAYOUT_KEYS, RunPlan, devices_for, engine_parallel, role_world, uses_ray,
                                   rollout_apart)
from hybridflow.config.schema import Config, LogProbConfig, ParallelConfig, TrainedRoleConfig
from hybridflow.config.validate_lora import check_lora, check_lora_model
from hybridflow.config.validate_moe import check_expert_parallel, check_routing_replay
from hybridflow.config.validate_dapo import check_dapo
from hybridflow.config.validate_rewards import check_judge_placement, check_reward
from hybridflow.errors import ConfigError
from hybridflow.parallel.layout import ParallelDims

if TYPE_CHECKING:
    from hybridflow.models.config import DecoderConfig


# --------------------------------------------------------------------------- config alone

def _check_placement(cfg: Config) -> None:
    n = cfg.trainer.n_devices
    if n < 1:
        raise ConfigError("trainer.n_devices", f"must be >= 1, got {n}")
    for role, devices in dataclasses.asdict(cfg.placement).items():
        if len(set(devices)) != len(devices):
            raise ConfigError(f"placement.{role}", f"lists a device twice: {devices}")
        bad = [d for d in devices if not 0 <= d < n]
        if bad:
            raise ConfigError(
                f"placement.{role}", f"device(s) {bad} do not exist: trainer.n_devices is {n} "
                f"(valid indices 0..{n - 1})")
    if sorted(devices_for(cfg, "reference")) != sorted(devices_for(cfg, "training")):
        if cfg.reference.engine != "fsdp":
            raise ConfigError("placement.reference", "must equal placement.training with reference.engine="
                              f"{cfg.reference.engine!r}: a megatron-core reference shares the actor's processes "
                              "and layout (reference.engine=fsdp runs it on devices of its own); rollout, critic "
                              "and reward may be placed apart")
        if not uses_ray(cfg):
            raise ConfigError("placement.reference", "a reference on devices of its own is a worker group of "
                              "its own: it needs trainer.launcher=ray")


def _check_layout(par: ParallelConfig, n: int, path: str) -> None:
    for key, value in (("tp", par.tp), ("pp", par.pp), ("cp", par.cp)):
        if value < 1:
            raise ConfigError(f"{path}.{key}", f"must be >= 1, got {value}")
    if ParallelDims.data_parallel_size(n, tp=par.tp, pp=par.pp, cp=par.cp) is None:
        raise ConfigError(path, f"tp*pp*cp = {par.tp}*{par.pp}*{par.cp} = {par.tp * par.pp * par.cp} does not "
                          f"divide the {n} device(s) this role runs on")
    if par.virtual_pp is not None and (par.pp < 2 or par.virtual_pp < 1):
        raise ConfigError(f"{path}.virtual_pp", "needs pp >= 2 and a value >= 1")
    if par.sequence_parallel and par.tp < 2:
        raise ConfigError(f"{path}.sequence_parallel", "needs tp >= 2: it splits each sequence over the "
                          f"tensor-parallel ranks (tp here is {par.tp})")


def _check_reference_layout(cfg: Config) -> None:
    """The reference lives in the actor's processes, and megatron-core holds one layout per process."""
    a, r = cfg.actor.parallel, cfg.reference.parallel
    if r is None:
        return
    for key, mine, actor in (("tp", r.tp, a.tp), ("pp", r.pp, a.pp), ("cp", r.cp, a.cp),
                             ("virtual_pp", r.virtual_pp or 1, a.virtual_pp or 1)):
        if mine != actor:
            raise ConfigError(f"reference.parallel.{key}", f"must equal actor.parallel.{key}={actor}, got {mine}: "
                              "the reference shares the actor's processes and their megatron-core layout")


def _check_generation_layout(cfg: Config) -> None:
    tp, pp = cfg.actor.parallel.tp, cfg.actor.parallel.pp
    ro = cfg.rollout
    if rollout_apart(cfg):  # its own group: the actor's layout does not bound it
        world = role_world(cfg, "rollout")
        if ro.tg < 1 or world % ro.tg:
            raise ConfigError("rollout.tg", f"must divide the rollout group's {world} devices "
                              f"(placement.rollout), got {ro.tg}")
    elif ro.tg < 1 or tp % ro.tg:
        raise ConfigError("rollout.tg", f"must divide actor.parallel.tp={tp}, got {ro.tg}")
    if ro.pg < 1 or pp % ro.pg:
        raise ConfigError("rollout.pg", f"must divide actor.parallel.pp={pp}, got {ro.pg}")


def _check_not_built(cfg: Config, plan: RunPlan) -> None:
    """Settings the schema accepts but this trainer cannot run yet."""
    ro = cfg.rollout
    if ro.pg > 1:
        raise ConfigError("rollout.pg", f"{ro.pg}: generation pipelining is not built yet; the 3D-HybridEngine "
                          "merges the actor's pipeline stages into one generation stage (pg = 1)")
    train = plan.layouts["training"]
    if ro.grouping == "full" and train.dp > 1 and train.model_parallel_size > 1:
        raise ConfigError("rollout.grouping", f"'full' (the DeepSpeed-Chat baseline) gathers within one training "
                          f"replica and is built for one (the actor has {train.dp}); use "
                          "'hybridflow' or 'vanilla'")
    if cfg.trainer.off_policy != "sync" and not plan.rollout_apart:
        raise ConfigError("trainer.off_policy", f"{cfg.trainer.off_policy!r} overlaps a rollout group placed apart "
                          "from training; this run has none (under Ray, give placement.rollout devices other "
                          "than placement.training's)")
    _check_engine(cfg)
    _check_train_engines(cfg, plan)


def _check_train_engines(cfg: Config, plan: RunPlan) -> None:
    """What FSDP2 (a role's `engine: fsdp`) runs with: data parallelism only, the actor generating at tg = 1
    in its own processes, a reference under FSDP beside it. Each other combination names both keys."""
    a, ref = cfg.actor, cfg.reference
    roles = [("actor", a)] + ([("critic", cfg.critic)] if plan.uses_critic else [])
    for name, role in roles + ([("reference", ref)] if plan.needs_reference else []):
        if role.fsdp.offload and cfg.trainer.device == "cpu":
            raise ConfigError(f"{name}.fsdp.offload", "moves parameters and Adam state from a GPU to the CPU; with "
                              "trainer.device=cpu they are there already")
        if role.fsdp.offload and role.engine != "fsdp":
            raise ConfigError(f"{name}.fsdp.offload", f"applies to {name}.engine=fsdp; {name}.engine is {role.engine!r}")
        if role.fsdp.modeling != "hybridflow" and role.engine != "fsdp":
            raise ConfigError(f"{name}.fsdp.modeling", f"{role.fsdp.modeling} applies to {name}.engine=fsdp; "
                              f"{name}.engine is {role.engine!r} (megatron-core runs its own GPTModel)")
        world = plan.worlds["training" if name == "actor" else name]  # the actor's placement role is "training"
        if role.fsdp.offload and world > 1:
            raise ConfigError(f"{name}.fsdp.offload", f"on {world} processes is not built yet: with the shards in CPU "
                              "memory, the gather into the generator, the gradient norm and the export would run "
                              "collectives on CPU tensors over NCCL (no multi-GPU run has checked it); it runs on "
                              "one GPU")
    for name, role in roles:
        if role.engine != "fsdp":
            continue
        par = role.parallel
        for key in ("tp", "pp", "cp"):
            if getattr(par, key) != 1:
                raise ConfigError(f"{name}.parallel.{key}", f"{getattr(par, key)} with {name}.engine=fsdp: FSDP2 "
                                  "shards every tensor over data-parallel ranks only (use engine megatron for "
                                  "tensor, pipeline or context parallelism)")
    if a.engine == "fsdp":
        if cfg.rollout.tg != 1:
            raise ConfigError("rollout.tg", f"{cfg.rollout.tg} with actor.engine=fsdp: the FSDP actor gathers the "
                              "whole model into each rank's generator (tg = 1); a tg-way split is built for "
                              "megatron-core's tensor-parallel shards")
        if plan.rollout_apart:
            raise ConfigError("actor.engine", "fsdp with placement.rollout apart from placement.training: the "
                              "broadcast into a rollout group apart is planned from megatron-core shards; "
                              "colocate the rollout, or use actor.engine=megatron")
        if plan.needs_reference and ref.engine == "megatron":
            raise ConfigError("reference.engine", "megatron with actor.engine=fsdp: the reference's megatron-core "
                              "layout is the actor's, and an FSDP actor has none; set reference.engine=fsdp")
    if plan.needs_reference and ref.engine == "fsdp" and ref.parallel is not None:
        raise ConfigError("reference.parallel", "is a megatron-core layout; with reference.engine=fsdp the "
                          "reference is sharded over all of the actor's processes: leave it unset")


def _check_engine(cfg: Config) -> None:
    """The rollout engine can run this layout (whether vLLM is installed is the preflight's question)."""
    ro = cfg.rollout
    if ro.weight_bucket_mb < 1:
        raise ConfigError("rollout.weight_bucket_mb", f"must be >= 1 (MiB per weight push), got "
                          f"{ro.weight_bucket_mb}")
    if ro.engine != "vllm":
        return
    if ro.tg > 1 and ro.tg < cfg.actor.parallel.tp and ro.grouping == "hybridflow" and not rollout_apart(cfg):
        # vLLM's tensor-parallel groups (distributed_executor_backend="external_launcher") are blocks of tg
        # consecutive ranks of the job's world; the paper's grouping puts a generation group's ranks at
        # stride t/tg, so vLLM would pair ranks that do not share a generation shard. A rollout group apart
        # has its own world, whose generation groups are consecutive ranks.
        raise ConfigError("rollout.grouping", f"'hybridflow' at tg={ro.tg} < actor.parallel.tp="
                          f"{cfg.actor.parallel.tp} puts a generation group's ranks {cfg.actor.parallel.tp // ro.tg}"
                          " apart; the vLLM engine's tensor-parallel groups are consecutive ranks. Use "
                          "rollout.grouping=vanilla, rollout.tg=actor.parallel.tp, or rollout.engine=builtin")


def _check_sampling(cfg: Config) -> None:
    ro = cfg.rollout
    if ro.n < 1:
        raise ConfigError("rollout.n", f"must be >= 1, got {ro.n}")
    if ro.temperature < 0:
        raise ConfigError("rollout.temperature", f"must be >= 0, got {ro.temperature}")
    if not 0 < ro.top_p <= 1:
        raise ConfigError("rollout.top_p", f"must be in (0, 1], got {ro.top_p}")
    if ro.top_k == 0 or ro.top_k < -1:
        raise ConfigError("rollout.top_k", f"must be -1 (off) or >= 1, got {ro.top_k}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and ro.n < 2:
        raise ConfigError(
            "rollout.n", f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples "
            f"of the same prompt and needs n >= 2, got {ro.n}")


def _check_env(cfg: Config) -> None:
    """A multi-turn rollout's limits; its environment is loaded by the preflight (`config/preflight.py`)."""
    env = cfg.env
    if env.function is None:
        return
    if env.max_turns < 1:
        raise ConfigError("env.max_turns", f"must be >= 1, got {env.max_turns}")
    if not 1 <= env.max_turn_tokens <= cfg.data.max_response_length:
        raise ConfigError("env.max_turn_tokens", f"must be in [1, data.max_response_length = "
                          f"{cfg.data.max_response_length}] (the whole trajectory's budget), got {env.max_turn_tokens}")
    if not cfg.data.apply_chat_template:
        raise ConfigError("data.apply_chat_template", "env.function needs the chat template: tool results are "
                          "rendered as its tool turns")


def _check_algorithm(cfg: Config) -> None:
    """Names the registries must know (built-in or registered by the user before loading)."""
    from hybridflow.algos import get_adv_estimator, get_policy_loss

    for path, name, lookup in (("algorithm.adv_estimator", cfg.algorithm.adv_estimator, get_adv_estimator),
                               ("actor.policy_loss", cfg.actor.policy_loss, get_policy_loss)):
        try:
            lookup(name)
        except KeyError as exc:
            raise ConfigError(path, exc.args[0]) from None
    needs_reference = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
    if needs_reference and not cfg.reference.enabled:
        raise ConfigError("reference.enabled", "KL (algorithm.use_kl_in_reward or actor.use_kl_loss) needs "
                          "the reference policy")


def _check_coefficients(cfg: Config) -> None:
    """Loss and reward coefficients: a NaN or a wrong sign trains silently wrong, or fails steps later."""
    a, kl = cfg.algorithm, cfg.algorithm.kl_ctrl
    for path, value in (("algorithm.gamma", a.gamma), ("algorithm.lam", a.lam)):
        if not 0 <= value <= 1:
            raise ConfigError(path, f"must be in [0, 1], got {value}")
    for path, value in (("algorithm.kl_ctrl.kl_coef", kl.kl_coef), ("actor.kl_loss_coef", cfg.actor.kl_loss_coef),
                        ("critic.cliprange_value", cfg.critic.cliprange_value)):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(path, f"must be a finite number >= 0, got {value}")
    if not math.isfinite(kl.target_kl) or kl.target_kl <= 0:
        raise ConfigError("algorithm.kl_ctrl.target_kl", f"must be a finite number > 0, got {kl.target_kl}")
    if kl.horizon < 1:
        raise ConfigError("algorithm.kl_ctrl.horizon", f"must be >= 1, got {kl.horizon}")
    for path, value in (("actor.entropy_coeff", cfg.actor.entropy_coeff),
                        ("reward.rule_weight", cfg.reward.rule_weight),
                        ("reward.model_weight", cfg.reward.model_weight)):
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {value}")


def _check_batches(cfg: Config) -> None:
    data, actor = cfg.data, cfg.actor
    for path, value in (("data.train_batch_size", data.train_batch_size),
                        ("data.val_batch_size", data.val_batch_size),
                        ("data.max_prompt_length", data.max_prompt_length),
                        ("data.max_response_length", data.max_response_length),
                        ("actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
                        ("actor.ppo_micro_batch_size", actor.ppo_micro_batch_size),
                        ("actor.ppo_epochs", actor.ppo_epochs),
                        ("actor.log_prob_micro_batch_size", actor.log_prob_micro_batch_size),
                        ("reference.log_prob_micro_batch_size", cfg.reference.log_prob_micro_batch_size),
                        ("critic.ppo_micro_batch_size", cfg.critic.ppo_micro_batch_size),
                        ("reward.micro_batch_size", cfg.reward.micro_batch_size),
                        ("rollout.batch_size_per_device", 1 if cfg.rollout.batch_size_per_device is None
                         else cfg.rollout.batch_size_per_device),
                        ("model.make_vocab_size_divisible_by", cfg.model.make_vocab_size_divisible_by),
                        ("trainer.total_steps", cfg.trainer.total_steps)):
        if value < 1:
            raise ConfigError(path, f"must be >= 1, got {value}")
    for path, value, zero in (("data.val_max_samples", data.val_max_samples, "all prompts"),
                              ("data.skip_uniform_passes", data.skip_uniform_passes, "no prompt skipped"),
                              ("trainer.val_every", cfg.trainer.val_every, "never"),
                              ("trainer.save_every", cfg.trainer.save_every, "only at the end")):
        if value < 0:
            raise ConfigError(path, f"must be >= 0 (0: {zero}), got {value}")
    if data.seed < 0:  # numpy's generators take no negative seed
        raise ConfigError("data.seed", f"must be >= 0, got {data.seed}")
    floor = data.skip_uniform_min_score
    if floor is not None and not math.isfinite(floor):
        raise ConfigError("data.skip_uniform_min_score", f"must be a finite number or null, got {floor}")
    if data.skip_uniform_passes and cfg.rollout.n < 2:
        raise ConfigError("data.skip_uniform_passes", f"{data.skip_uniform_passes} needs groups of samples "
                          f"(rollout.n >= 2): with rollout.n={cfg.rollout.n} every group is uniform")
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            "actor.ppo_mini_batch_size", f"{actor.ppo_mini_batch_size} does not divide "
            f"data.train_batch_size={data.train_batch_size}")
    rollout_size = data.train_batch_size * cfg.rollout.n
    if cfg.dataflow.min_batch_for_reward > rollout_size:
        raise ConfigError(
            "dataflow.min_batch_for_reward", f"{cfg.dataflow.min_batch_for_reward} exceeds the "
            f"{rollout_size} responses of one rollout (data.train_batch_size * rollout.n)")
    for path, value in (("actor.clip_ratio_low", actor.clip_ratio_low),
                        ("actor.clip_ratio_high", actor.clip_ratio_high)):
        if value < 0:
            raise ConfigError(path, f"must be >= 0, got {value}")
    if actor.clip_ratio_c <= 1:
        raise ConfigError("actor.clip_ratio_c", f"dual-clip bound must be > 1, got {actor.clip_ratio_c}")


def _check_optim(cfg: Config) -> None:
    """Optimizer values that would otherwise fail (or silently do nothing useful) inside a worker."""
    for path, optim in (("actor.optim", cfg.actor.optim), ("critic.optim", cfg.critic.optim)):
        for key, value in (("lr", optim.lr), ("min_lr", optim.min_lr), ("weight_decay", optim.weight_decay),
                           ("grad_clip", optim.grad_clip)):
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{path}.{key}", f"must be a finite number >= 0, got {value}")
        if not math.isfinite(optim.eps) or optim.eps <= 0:
            raise ConfigError(f"{path}.eps", f"must be a finite number > 0, got {optim.eps}")
        if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
            raise ConfigError(f"{path}.betas", f"must be two numbers in [0, 1), got {optim.betas}")
        if optim.warmup_steps < 0:
            raise ConfigError(f"{path}.warmup_steps", f"must be >= 0, got {optim.warmup_steps}")


def _check_one_process_layout(cfg: Config, plan: RunPlan) -> None:
    """Without Ray the actor's and critic's groups live in the same processes, which hold one megatron-core layout."""
    if plan.uses_ray or not plan.uses_critic:
        return
    if cfg.critic.engine == "fsdp":  # an FSDP critic takes no part in the processes' megatron-core layout
        return
    a, c = cfg.actor.parallel, cfg.critic.parallel
    for key in PROCESS_LAYOUT_KEYS:
        mine, actor = getattr(c, key), getattr(a, key)
        if (mine or 1) != (actor or 1):  # virtual_pp: None is 1
            raise ConfigError(f"critic.parallel.{key}", f"must equal actor.parallel.{key}={actor} without Ray "
                              f"(trainer.launcher=local or torchrun): the critic then shares the actor's processes "
                              f"and their megatron-core layout; got {mine}")


def _check_async_ranks(cfg: Config, plan: RunPlan) -> None:
    """The async DataFlow runs a stage per thread. Under Ray the controller sends each call to all ranks
    before the next; torchrun ranks each run their own threads, whose calls (and so collectives) could
    interleave in a different order on each rank."""
    if cfg.dataflow.async_execution and not plan.uses_ray and plan.job_world > 1:
        raise ConfigError("dataflow.async_execution", "needs trainer.launcher=ray with several processes: "
                          "under torchrun each rank would order the stages' collectives on its own")


def _check_mini_batches(cfg: Config, plan: RunPlan) -> None:
    """A mini-batch (in responses) splits evenly over the DP replicas that each take a share of it."""
    responses = plan.mini_batch_responses
    roles = [("training", "actor")] + ([("critic", "critic")] if plan.uses_critic else [])
    for role, name in roles:
        dp = plan.layouts[role].dp
        if responses % dp:
            raise ConfigError("actor.ppo_mini_batch_size", f"{cfg.actor.ppo_mini_batch_size} prompts x rollout.n="
                              f"{cfg.rollout.n} = {responses} responses per mini-batch do not split over the "
                              f"{name}'s {dp} data-parallel replicas")


def _check_shares(cfg: Config, plan: RunPlan) -> None:
    """Prompts split evenly over the ranks: per step and per rollout chunk."""
    multiple, batch = plan.prompt_multiple, cfg.data.train_batch_size
    if batch % multiple:
        raise ConfigError("data.train_batch_size", f"{batch} prompts do not split evenly over the "
                          f"{plan.generation_replicas} generation replicas and the data-parallel replicas (need a multiple of {multiple})")
    size = plan.chunk_prompts
    if batch % size:
        raise ConfigError("dataflow.min_batch_for_reward", f"{cfg.dataflow.min_batch_for_reward} responses make "
                          f"chunks of {size} prompts, which do not divide data.train_batch_size={batch}")


def validate(cfg: Config) -> Config:
    """Raise ConfigError for the first impossible combination found in the config alone."""
    if not cfg.model.path:
        raise ConfigError("model.path", "is required: a directory holding an HF config.json and weights")
    _check_placement(cfg)
    for role, (path, par) in engine_parallel(cfg).items():
        _check_layout(par, role_world(cfg, role), path)
        if par.sequence_parallel and cfg.trainer.device == "cpu" and not cfg.model.cpu_layer_kernels:
            raise ConfigError("model.cpu_layer_kernels", f"must be true for {path}.sequence_parallel on CPU: "
                              "without apex, megatron-core's own norm does not support sequence parallelism")
    _check_reference_layout(cfg)
    _check_generation_layout(cfg)
    _check_sampling(cfg)
    _check_env(cfg)
    _check_algorithm(cfg)
    _check_coefficients(cfg)
    check_reward(cfg.reward)
    check_judge_placement(cfg)
    _check_batches(cfg)
    _check_optim(cfg)
    _check_off_policy(cfg)
    check_lora(cfg)
    check_dapo(cfg)
    return cfg


def _check_off_policy(cfg: Config) -> None:
    """The overlap's bounds (trainer.off_policy) and the correction's threshold, whichever mode is set."""
    t, a = cfg.trainer, cfg.actor
    if t.max_staleness < 0:
        raise ConfigError("trainer.max_staleness", f"must be >= 0 (updates a sample may lag), got {t.max_staleness}")
    if t.sync_every < 1:
        raise ConfigError("trainer.sync_every", f"must be >= 1 (updates between weight pushes), got {t.sync_every}")
    if t.off_policy == "async" and t.stale_samples == "wait" and t.sync_every > t.max_staleness + 1:
        raise ConfigError("trainer.sync_every", f"{t.sync_every} with trainer.max_staleness={t.max_staleness} and "
                          "trainer.stale_samples=wait: weights pushed that rarely leave the rollout waiting for a "
                          f"version it never gets (use at most {t.max_staleness + 1}, or stale_samples=drop)")
    if t.off_policy != "sync" and cfg.data.skip_uniform_passes:
        raise ConfigError("data.skip_uniform_passes", f"{cfg.data.skip_uniform_passes} with trainer.off_policy="
                          f"{t.off_policy}: skipped prompts depend on the batches trained before, which a "
                          "rollout generating ahead has not seen yet (use 0, or off_policy=sync)")
    if t.off_policy != "sync" and cfg.algorithm.adv_estimator == "remax":
        raise ConfigError("trainer.off_policy", f"{t.off_policy!r} with algorithm.adv_estimator=remax: the greedy "
                          "baseline rollout is not generated ahead with the samples yet (use off_policy=sync)")
    c = a.off_policy_correction_threshold
    if not math.isfinite(c) or c < 1:
        raise ConfigError("actor.off_policy_correction_threshold", f"must be a finite number >= 1 (the largest "
                          f"importance weight kept), got {c}")


# --------------------------------------------------------------------------- with the run plan and the model

@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How one forward pass lays out its micro-batches' rows, and the keys that ask for it (for messages)."""

    packed_key: str  # packed rows: one per micro-batch, up to `token_budget` real tokens
    packed: bool
    budget_key: str
    token_budget: int
    shared_key: str  # shared-prompt rows: a prompt's samples in one row
    shared: bool
    parallel: ParallelConfig  # the layout the pass runs at


def _update_rows(name: str, role: TrainedRoleConfig) -> RowLayout:
    return RowLayout(f"{name}.use_dynamic_bsz", role.use_dynamic_bsz, f"{name}.ppo_max_token_len_per_gpu",
                     role.ppo_max_token_len_per_gpu, f"{name}.share_prompts", role.share_prompts, role.parallel)


def _log_prob_rows(name: str, role: LogProbConfig, parallel: ParallelConfig) -> RowLayout:
    return RowLayout(f"{name}.log_prob_use_dynamic_bsz", role.log_prob_use_dynamic_bsz,
                     f"{name}.log_prob_max_token_len_per_gpu", role.log_prob_max_token_len_per_gpu,
                     f"{name}.log_prob_share_prompts", role.log_prob_share_prompts, parallel)


def row_layouts(cfg: Config) -> list[RowLayout]:
    """The row layout of each pass through the engine's forward: the actor's update and old log-probs, the
    reference's log-probs, the critic's update (and values)."""
    return [_update_rows("actor", cfg.actor),
            _log_prob_rows("actor", cfg.actor, cfg.actor.parallel),
            _log_prob_rows("reference", cfg.reference, cfg.reference.parallel or cfg.actor.parallel),
            _update_rows("critic", cfg.critic)]


def _check_packing(cfg: Config, model: "DecoderConfig") -> None:
    """Packed micro-batches (use_dynamic_bsz): one row per micro-batch with a block-diagonal mask, which
    needs pp = 1 (the pipeline sends fixed shapes), cp = 1 (CP splits padded rows) and full attention (a sliding
    window rebuilds its mask).
    Shared-prompt rows (share_prompts) need the same, and cp = 1 (their positions are not the row's)."""
    windowed = any(w is not None for w in model.layer_windows)
    rows = row_layouts(cfg)
    for r in rows:
        if not r.packed:
            continue
        if r.token_budget < 1:
            raise ConfigError(r.budget_key, f"must be >= 1 token, got {r.token_budget}")
        if r.parallel.pp > 1:
            raise ConfigError(r.packed_key, f"packed micro-batches need pipeline size 1, the layout has "
                                            f"pp = {r.parallel.pp}")
        if r.parallel.cp > 1:
            raise ConfigError(r.packed_key, f"packed micro-batches need context-parallel size 1, the layout has "
                                            f"cp = {r.parallel.cp} (the engine splits padded rows over the CP ranks)")
        if windowed:
            raise ConfigError(r.packed_key, "packed micro-batches need full attention; the model has sliding-window "
                                            "layers")
    for r in rows:
        if not r.shared:
            continue
        if r.packed:
            raise ConfigError(r.shared_key, f"shared-prompt rows and packed micro-batches ({r.packed_key}) are two "
                                            "layouts; choose one")
        for name, size in (("pipeline", r.parallel.pp), ("context-parallel", r.parallel.cp)):
            if size > 1:
                raise ConfigError(r.shared_key, f"shared-prompt rows need {name} size 1, the layout has {size}")
        if windowed:
            raise ConfigError(r.shared_key, "shared-prompt rows need full attention; the model has sliding-window "
                                            "layers")


def check_model_split(dims: ParallelDims, key: str, *, num_heads: int, num_kv_heads: int, num_layers: int,
                      virtual_pp: Optional[int] = None, mlp_splits: tuple[tuple[str, int], ...] = ()) -> None:
    """ConfigError naming `key`.tp / .pp where the model cannot be split at the degrees of `dims`;
    mlp_splits: (what, features) of each MLP TP splits (`DecoderConfig.mlp_splits`).

    TP splits whole attention heads and whole KV-head groups (Megatron's
    grouped QKV keeps each group on one rank), so it divides both; PP
    splits whole layers, evenly (and `virtual_pp` chunks per stage). The
    vocabulary is padded to a multiple of `make_vocab_size_divisible_by *
    tp`, so it always splits.
    """
    if num_heads % dims.tp:
        raise ConfigError(f"{key}.tp", f"{dims.tp} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % dims.tp:
        raise ConfigError(f"{key}.tp", f"{dims.tp} does not divide the model's {num_kv_heads} KV heads "
                          "(each rank holds whole query groups)")
    for what, size in mlp_splits:
        if size % dims.tp:
            raise ConfigError(f"{key}.tp", f"{dims.tp} does not divide the model's {size} {what}")
    chunks = dims.pp * (virtual_pp or 1)
    if num_layers % chunks:
        what = f"pp*virtual_pp = {dims.pp}*{virtual_pp}" if virtual_pp else f"pp = {dims.pp}"
        raise ConfigError(f"{key}.pp", f"{what} does not divide the model's {num_layers} layers")


def needs_decoder(cfg: Config, plan: RunPlan, critic_model: bool = False) -> Optional[str]:
    """The first setting of this run that needs hybridflow's own model code (decoder, bridge, megatron-core)
    for model.path (critic_model: for critic.model_path), as "key=value"; None when every role loading that
    model runs under FSDP on `transformers` and (the actor's) rollout is the built-in engine, which then
    generates with the model's own code (`rollout/hf_generate.py`). A model only transformers builds is
    loaded only then (`inputs.load_model_config`)."""
    if critic_model:
        roles = [("critic", cfg.critic)]
    else:
        roles = [("actor", cfg.actor)] + ([("reference", cfg.reference)] if plan.needs_reference else [])
        if plan.uses_critic and not cfg.critic.model_path:
            roles.append(("critic", cfg.critic))
    for name, role in roles:
        if role.engine != "fsdp":
            return f"{name}.engine={role.engine}"
        if role.fsdp.modeling != "transformers":
            return f"{name}.fsdp.modeling={role.fsdp.modeling}"
    if not critic_model and cfg.rollout.engine != "builtin":
        return f"rollout.engine={cfg.rollout.engine}"
    return None


def _check_moe_losses(cfg: Config, plan: RunPlan, model: "DecoderConfig", critic_model: "DecoderConfig") -> None:
    """Router-loss coefficients only where megatron-core trains a model with experts, and never negative."""
    roles = [("actor", "training", cfg.actor, model)] + (
        [("critic", "critic", cfg.critic, critic_model)] if plan.uses_critic else [])
    for role, engine, section, shape in roles:
        for name, value in (("aux_loss_coeff", section.moe.aux_loss_coeff), ("z_loss_coeff", section.moe.z_loss_coeff)):
            key = f"{role}.moe.{name}"
            if value < 0:
                raise ConfigError(key, f"{value} is negative")
            if value and not shape.is_moe:
                raise ConfigError(key, f"{value}: the {role}'s model has no experts (a dense {shape.model_type})")
            if value and plan.engines[engine] != "megatron":
                raise ConfigError(key, f"{value}: only the megatron engine adds router losses; {role}.engine is "
                                       f"{plan.engines[engine]!r}")


def check_plan(cfg: Config, plan: RunPlan, model: "DecoderConfig",
               critic_model: Optional["DecoderConfig"] = None) -> None:
    """ConfigError for what the config, its run plan and the models' own config.json cannot run together.

    critic_model: the config.json at critic.model_path, when one is given (else the actor's model).
    """
    _check_not_built(cfg, plan)
    for role, (path, par) in engine_parallel(cfg).items():
        if role == "critic" and not plan.uses_critic:
            continue  # no critic in this run
        shape = critic_model if role == "critic" and critic_model is not None else model
        if role == "reference" and not plan.needs_reference:
            continue  # no reference in this run
        if plan.engines[role] == "megatron" and len(set(shape.layer_windows)) > 1:
            key = "critic.model_path" if role == "critic" and critic_model is not None else "model.path"
            raise ConfigError(key, f"its layers mix attention windows {sorted(map(str, set(shape.layer_windows)))} "
                              f"(e.g. Qwen2's max_window_layers): megatron-core's layer spec takes one window for "
                              f"every layer; {path.split('.')[0]}.engine=fsdp runs it")
        check_model_split(plan.layouts[role], path, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                          num_layers=shape.num_layers, virtual_pp=par.virtual_pp, mlp_splits=tuple(shape.mlp_splits))
        if (shape.is_moe and plan.engines[role] == "megatron" and role != "reference"
                and plan.layouts[role].tp > 1 and not par.sequence_parallel):
            raise ConfigError(f"{path}.sequence_parallel", "megatron-core trains a mixture-of-experts model at "
                              f"tp > 1 only with sequence parallelism: set {path}.sequence_parallel=true")
    if plan.rollout_apart:  # its tg-way generator splits heads, KV groups and MLP features like TP does
        for what, size in (("attention heads", model.num_heads), ("KV heads", model.num_kv_heads),
                           *model.mlp_splits):
            if size % cfg.rollout.tg:
                raise ConfigError("rollout.tg", f"{cfg.rollout.tg} does not divide the model's {size} {what}")
    _check_one_process_layout(cfg, plan)
    _check_async_ranks(cfg, plan)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > model.max_position_embeddings:
        raise ConfigError("data.max_response_length", f"data.max_prompt_length + data.max_response_length = "
                          f"{longest} exceeds the model's max_position_embeddings ({model.max_position_embeddings})")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files", "is empty: give at least one .parquet or .jsonl file of prompts")
    _check_moe_losses(cfg, plan, model, critic_model or model)
    check_routing_replay(cfg, plan, model)
    check_expert_parallel(cfg, plan, model)
    _check_shares(cfg, plan)
    _check_mini_batches(cfg, plan)
    _check_packing(cfg, model)
    check_lora_model(cfg, model)
