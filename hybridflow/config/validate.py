"""Every cross-field check of a config: combinations of values that cannot run.

Single values are type-checked by the loader; here live the rules that tie
keys together, each failure a `ConfigError` naming the key path to change.
This module is the one home of such checks (docs/architecture.md, "Where a
change goes"); nothing downstream re-checks them.

Two entry points, both run before any worker starts:

- `validate(cfg)`: the config alone (placement, layouts, batch sizes,
  sampling, registry names). `load_config` calls it.
- `check_runnable(cfg, model)`: what also needs the world outside the
  config: the model's own shape (heads, layers) against the layouts, paths
  that must exist, the launcher, whether torch can reach the device, and
  settings this trainer cannot run yet (a config for them still loads and
  prints). The trainer calls it once it has read the model's config.json.

It also resolves the derived quantities those checks rely on, so other code
asks here instead of redoing the arithmetic: which devices a role runs on
(`devices_for`), whether Ray launches the groups (`uses_ray`), and how many
processes and data-parallel replicas each role has (`role_layout`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hybridflow.config.errors import ConfigError
from hybridflow.config.schema import Config, ParallelConfig, PlacementConfig
# A module reference, not the class: `parallel.layout` imports ConfigError from this package, so
# importing `hybridflow.parallel` first must find this module importable while layout is half-done.
from hybridflow.parallel import layout as _layout

RAY_ADDRESS_TIMEOUT_S = 5.0

if TYPE_CHECKING:
    from hybridflow.models.config import DecoderConfig

ROLES = tuple(f.name for f in dataclasses.fields(PlacementConfig))  # rollout, reward, training, ...


# --------------------------------------------------------------------------- derived

def run_dir(cfg: Config) -> Path:
    """Where a run writes its metrics, checkpoints and exports: trainer.output_dir / trainer.experiment."""
    return Path(cfg.trainer.output_dir) / cfg.trainer.experiment


def placement(cfg: Config) -> dict[str, list[int]]:
    """role -> its listed devices (an empty list meaning every device)."""
    return dataclasses.asdict(cfg.placement)


def devices_for(cfg: Config, role: str) -> list[int]:
    """Device indices a role runs on: its placement, or every device.

    The reference always shares the actor's processes, so an empty
    `placement.reference` means `placement.training`'s devices.
    """
    placed = placement(cfg)
    if role not in placed:
        raise ValueError(f"unknown role {role!r}; placement roles are {list(ROLES)}")
    if placed[role]:
        return list(placed[role])
    if role == "reference":
        return devices_for(cfg, "training")
    return list(range(cfg.trainer.n_devices))


def uses_ray(cfg: Config) -> bool:
    """Whether worker groups run as Ray actors (else in-process, or this rank's share under torchrun)."""
    t = cfg.trainer
    if t.launcher != "auto":
        return t.launcher == "ray"
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: every rank drives its own share
        return False
    return t.n_devices > 1 or t.ray_address is not None


def role_world(cfg: Config, role: str) -> int:
    """Processes of a role's worker group: its placement under Ray, the job's ranks otherwise."""
    if uses_ray(cfg):
        return len(devices_for(cfg, role))
    return int(os.environ.get("WORLD_SIZE", "1"))


def engine_roles(cfg: Config) -> dict[str, tuple[str, ParallelConfig]]:
    """Placement role -> (key path, parallel section) of each role that runs a Megatron engine."""
    return {"training": ("actor.parallel", cfg.actor.parallel), "critic": ("critic.parallel", cfg.critic.parallel),
            "reference": ("reference.parallel", reference_parallel(cfg))}


def reference_parallel(cfg: Config) -> ParallelConfig:
    """The reference's layout: the actor's unless given (and then checked to be equal)."""
    return cfg.reference.parallel or cfg.actor.parallel


def role_layout(cfg: Config, role: str) -> "_layout.ParallelDims":
    """The p-t-d(-c) layout of an engine role ("training", "critic" or "reference")."""
    path, par = engine_roles(cfg)[role]
    return _layout.ParallelDims.for_world(role_world(cfg, role), tp=par.tp, pp=par.pp, cp=par.cp, key=path)


def rollout_apart(cfg: Config) -> bool:
    """Rollout has its own worker group (placed on other devices than training)."""
    return sorted(devices_for(cfg, "rollout")) != sorted(devices_for(cfg, "training")) and uses_ray(cfg)


def uses_critic(cfg: Config) -> bool:
    return cfg.algorithm.adv_estimator == "gae"


def row_multiple(cfg: Config) -> int:
    """Training rows must come in multiples of this: equal shares for the actor's and critic's DP replicas."""
    return math.lcm(role_layout(cfg, "training").dp, role_layout(cfg, "critic").dp if uses_critic(cfg) else 1)


def rollout_replicas(cfg: Config) -> int:
    """Generation replicas, each generating its own share of the prompts: the rollout group's processes
    when it is apart (tg = 1), else the actor's processes over the generation layout's `tg * pg`."""
    if rollout_apart(cfg):
        return role_world(cfg, "rollout")
    return role_world(cfg, "training") // (cfg.rollout.tg * cfg.rollout.pg)


def prompt_multiple(cfg: Config) -> int:
    """Prompts must come in multiples of this: equal shares for the generation and training replicas."""
    return math.lcm(row_multiple(cfg), rollout_replicas(cfg))


def chunk_prompts(cfg: Config) -> int:
    """Prompts per rollout chunk: dataflow.min_batch_for_reward responses (whole prompts), or the whole batch."""
    size, want = cfg.data.train_batch_size, cfg.dataflow.min_batch_for_reward
    if want > 0:
        multiple = prompt_multiple(cfg)
        per_prompt = -(-want // cfg.rollout.n)
        size = -(-per_prompt // multiple) * multiple  # equal shares for the ranks
    return size


# --------------------------------------------------------------------------- config alone

def _check_placement(cfg: Config) -> None:
    n = cfg.trainer.n_devices
    if n < 1:
        raise ConfigError("trainer.n_devices", f"must be >= 1, got {n}")
    for role, devices in placement(cfg).items():
        if len(set(devices)) != len(devices):
            raise ConfigError(f"placement.{role}", f"lists a device twice: {devices}")
        bad = [d for d in devices if not 0 <= d < n]
        if bad:
            raise ConfigError(
                f"placement.{role}", f"device(s) {bad} do not exist: trainer.n_devices is {n} "
                f"(valid indices 0..{n - 1})")
    if sorted(devices_for(cfg, "reference")) != sorted(devices_for(cfg, "training")):
        raise ConfigError("placement.reference", "must equal placement.training: the reference shares the "
                          "actor's processes; rollout, critic and reward may be placed apart")


def _check_layout(par: ParallelConfig, n: int, path: str, device: str) -> None:
    for key, value in (("tp", par.tp), ("pp", par.pp), ("cp", par.cp)):
        if value < 1:
            raise ConfigError(f"{path}.{key}", f"must be >= 1, got {value}")
    _layout.ParallelDims.for_world(n, tp=par.tp, pp=par.pp, cp=par.cp, key=path)
    if par.virtual_pp is not None and (par.pp < 2 or par.virtual_pp < 1):
        raise ConfigError(f"{path}.virtual_pp", "needs pp >= 2 and a value >= 1")
    if par.sequence_parallel and device == "cpu":
        raise ConfigError(f"{path}.sequence_parallel", "is not supported on CPU: megatron-core's sequence "
                          "parallelism needs CUDA collectives (docs/megatron-on-cpu.md)")


def _check_reference_layout(cfg: Config) -> None:
    """The reference lives in the actor's processes, and megatron-core holds one layout per process."""
    a, r = cfg.actor.parallel, cfg.reference.parallel
    if r is None:
        return
    for key, mine, actor in (("tp", r.tp, a.tp), ("pp", r.pp, a.pp), ("cp", r.cp, a.cp)):
        if mine != actor:
            raise ConfigError(f"reference.parallel.{key}", f"must equal actor.parallel.{key}={actor}, got {mine}: "
                              "the reference shares the actor's processes and their megatron-core layout")


def _check_generation_layout(cfg: Config) -> None:
    tp, pp = cfg.actor.parallel.tp, cfg.actor.parallel.pp
    ro = cfg.rollout
    if ro.tg < 1 or tp % ro.tg:
        raise ConfigError("rollout.tg", f"must divide actor.parallel.tp={tp}, got {ro.tg}")
    if ro.pg < 1 or pp % ro.pg:
        raise ConfigError("rollout.pg", f"must divide actor.parallel.pp={pp}, got {ro.pg}")


def _check_not_built(cfg: Config) -> None:
    """Settings the schema accepts but this trainer cannot run yet."""
    ro = cfg.rollout
    if ro.pg > 1:
        raise ConfigError("rollout.pg", f"{ro.pg}: generation pipelining is not built yet; the 3D-HybridEngine "
                          "merges the actor's pipeline stages into one generation stage (pg = 1)")
    if ro.tg > 1 and rollout_apart(cfg):
        raise ConfigError("rollout.tg", f"{ro.tg}: a rollout group placed apart from training generates at "
                          "tg = 1 (each rollout process reassembles the whole model from the actor's shards); "
                          "tg > 1 is the colocated 3D-HybridEngine layout")
    train = role_layout(cfg, "training")
    if ro.grouping == "full" and train.dp > 1 and train.model_parallel_size > 1:
        raise ConfigError("rollout.grouping", f"'full' (the DeepSpeed-Chat baseline) gathers within one training "
                          f"replica and is built for one (the actor has {train.dp}); use "
                          "'hybridflow' or 'vanilla'")
    for path, par in engine_roles(cfg).values():
        if par.virtual_pp is not None:
            raise ConfigError(f"{path}.virtual_pp", "the interleaved pipeline schedule is not built yet")
        if par.cp > 1:
            raise ConfigError(f"{path}.cp", "context parallelism needs Transformer Engine's attention, which "
                              "the engine's local layer spec does not use")
    if cfg.rollout.engine != "builtin":
        raise ConfigError("rollout.engine", f"{cfg.rollout.engine!r} is not wired into the trainer yet; it "
                          "generates with the built-in engine ('builtin')")


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
                        ("rollout.log_prob_micro_batch_size", cfg.rollout.log_prob_micro_batch_size),
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


# What one process's megatron-core layout fixes: roles sharing a process (the critic with the actor,
# under torchrun always, under Ray when trainer/build.py colocates them) must agree on these.
PROCESS_LAYOUT_KEYS = ("tp", "pp", "cp")


def _check_one_process_layout(cfg: Config) -> None:
    """Without Ray the actor's and critic's groups live in the same processes, which hold one megatron-core layout."""
    if uses_ray(cfg) or not uses_critic(cfg):
        return
    a, c = cfg.actor.parallel, cfg.critic.parallel
    for key in PROCESS_LAYOUT_KEYS:
        mine, actor = getattr(c, key), getattr(a, key)
        if mine != actor:
            raise ConfigError(f"critic.parallel.{key}", f"must equal actor.parallel.{key}={actor} without Ray "
                              f"(trainer.launcher=local or torchrun): the critic then shares the actor's processes "
                              f"and their megatron-core layout; got {mine}")


def _check_async_ranks(cfg: Config) -> None:
    """The async DataFlow runs a stage per thread. Under Ray the controller sends each call to all ranks
    before the next; torchrun ranks each run their own threads, whose calls (and so collectives) could
    interleave in a different order on each rank."""
    if cfg.dataflow.async_execution and not uses_ray(cfg) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("dataflow.async_execution", "needs trainer.launcher=ray with several processes: "
                          "under torchrun each rank would order the stages' collectives on its own")


def _check_mini_batches(cfg: Config) -> None:
    """A mini-batch (in responses) splits evenly over the DP replicas that each take a share of it."""
    responses = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    roles = [("training", "actor")] + ([("critic", "critic")] if uses_critic(cfg) else [])
    for role, name in roles:
        dp = role_layout(cfg, role).dp
        if responses % dp:
            raise ConfigError("actor.ppo_mini_batch_size", f"{cfg.actor.ppo_mini_batch_size} prompts x rollout.n="
                              f"{cfg.rollout.n} = {responses} responses per mini-batch do not split over the "
                              f"{name}'s {dp} data-parallel replicas")


def _check_shares(cfg: Config) -> None:
    """Prompts split evenly over the ranks: per step and per rollout chunk."""
    multiple, batch = prompt_multiple(cfg), cfg.data.train_batch_size
    if batch % multiple:
        raise ConfigError("data.train_batch_size", f"{batch} prompts do not split evenly over the {rollout_replicas(cfg)} "
                          f"generation replicas and the data-parallel replicas (need a multiple of {multiple})")
    size = chunk_prompts(cfg)
    if batch % size:
        raise ConfigError("dataflow.min_batch_for_reward", f"{cfg.dataflow.min_batch_for_reward} responses make "
                          f"chunks of {size} prompts, which do not divide data.train_batch_size={batch}")


def validate(cfg: Config) -> Config:
    """Raise ConfigError for the first impossible combination found in the config alone."""
    if not cfg.model.path:
        raise ConfigError("model.path", "is required: a directory holding an HF config.json and weights")
    _check_placement(cfg)
    for role, (path, par) in engine_roles(cfg).items():
        _check_layout(par, role_world(cfg, role), path, cfg.trainer.device)
    _check_reference_layout(cfg)
    _check_generation_layout(cfg)
    _check_sampling(cfg)
    _check_algorithm(cfg)
    _check_coefficients(cfg)
    _check_batches(cfg)
    _check_optim(cfg)
    return cfg


# --------------------------------------------------------------------------- with the world outside

def _check_previous_run(cfg: Config) -> None:
    """Starting afresh where a previous run lives would truncate its metrics and prune its checkpoints."""
    t, where = cfg.trainer, run_dir(cfg)
    if t.resume == "auto" or t.overwrite:
        return
    metrics = where / "metrics.jsonl"
    steps = sorted(p.name for p in (where / "checkpoints").glob("step_*")) if (where / "checkpoints").is_dir() else []
    found = ([f"metrics.jsonl ({metrics.stat().st_size} bytes)"] if metrics.is_file() and metrics.stat().st_size
             else []) + ([f"checkpoints {steps[0]}..{steps[-1]}"] if steps else [])
    if found:
        raise ConfigError("trainer.resume", f"{where} holds a previous run ({', '.join(found)}); set "
                          "trainer.resume=auto to continue it, or trainer.overwrite=true to start over there "
                          "(or choose another trainer.output_dir / trainer.experiment)")


def _check_output_dir(cfg: Config) -> None:
    """The run directory can be created and written: its nearest existing ancestor is a writable directory.

    Tried, not only asked (os.access): root passes every permission check, yet cannot create a directory on
    a read-only mount or under /proc.
    """
    where = run_dir(cfg).absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError("trainer.output_dir", f"{existing} is a file, so {where} cannot be created")
    why = None if os.access(existing, os.W_OK | os.X_OK) else "permission denied"
    if why is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hybridflow-write-test-", dir=existing))
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why is not None:
        raise ConfigError("trainer.output_dir", f"{existing} is not writable ({why}), so {where} cannot be created")


def _check_packing(cfg: Config, model: "DecoderConfig") -> None:
    """Packed micro-batches (use_dynamic_bsz): one row per micro-batch with a block-diagonal mask, which
    needs pp = 1 (the pipeline sends fixed shapes) and full attention (a sliding window rebuilds its mask).
    Shared-prompt rows (share_prompts) need the same, and cp = 1 (their positions are not the row's)."""
    windowed = any(w is not None for w in model.layer_windows)
    roles = [  # (section, its dynamic-batch-size switch, token budget and shared-prompt switch, its layout)
        ("actor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "share_prompts", cfg.actor.parallel),
        ("rollout", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "log_prob_share_prompts",
         cfg.actor.parallel),
        ("reference", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "log_prob_share_prompts",
         cfg.reference.parallel or cfg.actor.parallel),
        ("critic", "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "share_prompts", cfg.critic.parallel)]
    for section, dynamic, budget, _, parallel in roles:
        role, key = getattr(cfg, section), f"{section}.{dynamic}"
        if not getattr(role, dynamic):
            continue
        if getattr(role, budget) < 1:
            raise ConfigError(f"{section}.{budget}", f"must be >= 1 token, got {getattr(role, budget)}")
        if parallel.pp > 1:
            raise ConfigError(key, f"packed micro-batches need pipeline size 1, the layout has pp = {parallel.pp}")
        if windowed:
            raise ConfigError(key, "packed micro-batches need full attention; the model has sliding-window layers")
    for section, dynamic, _, share, parallel in roles:
        role, share_key = getattr(cfg, section), f"{section}.{share}"
        if getattr(role, share):
            if getattr(role, dynamic):
                raise ConfigError(share_key, f"shared-prompt rows and packed micro-batches ({section}.{dynamic}) are "
                                             "two layouts; choose one")
            for name, size in (("pipeline", parallel.pp), ("context-parallel", parallel.cp)):
                if size > 1:
                    raise ConfigError(share_key, f"shared-prompt rows need {name} size 1, the layout has {size}")
            if windowed:
                raise ConfigError(share_key, "shared-prompt rows need full attention; the model has sliding-window "
                                             "layers")


def _check_ray_address(cfg: Config) -> None:
    """A cluster address nothing answers at: Ray would retry for minutes before failing; one TCP connect says so
    in seconds. ("auto" finds the cluster through Ray's own files and is left to Ray.)"""
    address = cfg.trainer.ray_address
    if address is None or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("trainer.ray_address", f"expected 'auto' or host:port, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_ADDRESS_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError("trainer.ray_address", f"nothing answers at {address} "
                          f"({exc.strerror or type(exc).__name__}); is the cluster's head node running?") from None


def check_runnable(cfg: Config, model: "DecoderConfig", critic_model: Optional["DecoderConfig"] = None) -> None:
    """ConfigError for what the config and the models' own config.json / the machine cannot run together.

    critic_model: the config.json at critic.model_path, when one is given (else the actor's model).
    """
    _check_not_built(cfg)
    for role, (path, par) in engine_roles(cfg).items():
        if role == "critic" and not uses_critic(cfg):
            continue  # no critic in this run
        shape = critic_model if role == "critic" and critic_model is not None else model
        role_layout(cfg, role).check_model(path, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                          num_layers=shape.num_layers, ffn_size=shape.intermediate_size,
                                          virtual_pp=par.virtual_pp)
    _check_one_process_layout(cfg)
    _check_async_ranks(cfg)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > model.max_position_embeddings:
        raise ConfigError("data.max_response_length", f"data.max_prompt_length + data.max_response_length = "
                          f"{longest} exceeds the model's max_position_embeddings ({model.max_position_embeddings})")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files", "is empty: give at least one .parquet or .jsonl file of prompts")
    _check_output_dir(cfg)
    _check_ray_address(cfg)
    _check_previous_run(cfg)
    _check_shares(cfg)
    _check_mini_batches(cfg)
    _check_packing(cfg, model)
    if cfg.reward.model_path is not None and not Path(cfg.reward.model_path).exists():
        raise ConfigError("reward.model_path", f"reward model path does not exist: {cfg.reward.model_path}")
    if cfg.reward.model_path is not None and not (Path(cfg.reward.model_path) / "config.json").is_file():
        raise ConfigError("reward.model_path", f"no config.json in {cfg.reward.model_path}: not a Hugging Face "
                          "model directory")
    if cfg.critic.model_path is not None and not Path(cfg.critic.model_path).exists():
        raise ConfigError("critic.model_path", f"critic model path does not exist: {cfg.critic.model_path}")
    # In-process and torchrun workers run here; Ray workers may sit on other nodes (their pools check).
    if cfg.trainer.device == "cuda" and not uses_ray(cfg):
        import torch

        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError("trainer.device", f"'cuda' but {why} (torch {torch.__version__}); use cpu")
