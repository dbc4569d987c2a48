"""Cross-field checks: combinations of values that cannot run.

Single values are type-checked by the loader; here live the rules that tie
sections together (layouts vs. device counts, batch sizes vs. each other).
Each failure names the key path that has to change.
"""
from __future__ import annotations

from hybridflow.config.loader import ConfigError
from hybridflow.config.schema import Config, ParallelConfig


def devices_for(cfg: Config, role: str) -> list[int]:
    """Device indices a role runs on: its placement, or every device."""
    placed = getattr(cfg.placement, role)
    return list(placed) if placed else list(range(cfg.trainer.n_devices))


def _check_layout(par: ParallelConfig, n: int, path: str, device: str) -> None:
    for key in ("tp", "pp", "cp"):
        if getattr(par, key) < 1:
            raise ConfigError(f"{path}.{key}", f"must be >= 1, got {getattr(par, key)}")
    model_parallel = par.tp * par.pp * par.cp
    if n % model_parallel:
        raise ConfigError(
            path, f"tp*pp*cp = {par.tp}*{par.pp}*{par.cp} = {model_parallel} does not divide "
            f"the {n} device(s) this role runs on")
    if par.virtual_pp is not None and (par.pp < 2 or par.virtual_pp < 1):
        raise ConfigError(f"{path}.virtual_pp", "needs pp >= 2 and a value >= 1")
    if par.sequence_parallel and device == "cpu":
        raise ConfigError(f"{path}.sequence_parallel", "is not supported on CPU (see DESIGN.md section 4)")


def _check_placement(cfg: Config) -> None:
    n = cfg.trainer.n_devices
    if n < 1:
        raise ConfigError("trainer.n_devices", f"must be >= 1, got {n}")
    for role in ("rollout", "reward", "training", "reference", "critic"):
        devices = getattr(cfg.placement, role)
        if len(set(devices)) != len(devices):
            raise ConfigError(f"placement.{role}", f"lists a device twice: {devices}")
        bad = [d for d in devices if not 0 <= d < n]
        if bad:
            raise ConfigError(
                f"placement.{role}", f"device(s) {bad} do not exist: trainer.n_devices is {n} "
                f"(valid indices 0..{n - 1})")


def _check_generation_layout(cfg: Config) -> None:
    tp, pp = cfg.actor.parallel.tp, cfg.actor.parallel.pp
    ro = cfg.rollout
    if ro.tg < 1 or tp % ro.tg:
        raise ConfigError("rollout.tg", f"must divide actor.parallel.tp={tp}, got {ro.tg}")
    if ro.pg < 1 or pp % ro.pg:
        raise ConfigError("rollout.pg", f"must divide actor.parallel.pp={pp}, got {ro.pg}")


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


def _check_batches(cfg: Config) -> None:
    data, actor = cfg.data, cfg.actor
    for path, value in (("data.train_batch_size", data.train_batch_size),
                        ("data.val_batch_size", data.val_batch_size),
                        ("data.max_prompt_length", data.max_prompt_length),
                        ("data.max_response_length", data.max_response_length),
                        ("actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
                        ("actor.ppo_micro_batch_size", actor.ppo_micro_batch_size),
                        ("actor.ppo_epochs", actor.ppo_epochs),
                        ("trainer.total_steps", cfg.trainer.total_steps)):
        if value < 1:
            raise ConfigError(path, f"must be >= 1, got {value}")
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


def validate(cfg: Config) -> Config:
    """Raise ConfigError for the first impossible combination found."""
    if not cfg.model.path:
        raise ConfigError("model.path", "is required: a directory holding an HF config.json and weights")
    _check_placement(cfg)
    for role, par, path in (("training", cfg.actor.parallel, "actor.parallel"),
                            ("critic", cfg.critic.parallel, "critic.parallel"),
                            ("reference", cfg.reference.parallel, "reference.parallel")):
        _check_layout(par, len(devices_for(cfg, role)), path, cfg.trainer.device)
    _check_generation_layout(cfg)
    _check_sampling(cfg)
    _check_batches(cfg)
    return cfg
