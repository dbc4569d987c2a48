"""The config checks of DAPO's pieces (`trainer/dapo.py`): each refusal a `ConfigError` naming the key.

Called by `validate` (config/validate.py) with the other checks that read the config alone.
"""
from __future__ import annotations

import math

from hybridflow.config.schema import Config
from hybridflow.errors import ConfigError


def check_dapo(cfg: Config) -> None:
    _check_dynamic_sampling(cfg)
    _check_overlong(cfg)


def _check_dynamic_sampling(cfg: Config) -> None:
    ds, key = cfg.algorithm.dynamic_sampling, "algorithm.dynamic_sampling"
    if ds.max_batches < 1:
        raise ConfigError(f"{key}.max_batches", f"must be >= 1 (batches a step may generate), got {ds.max_batches}")
    if not ds.enabled:
        return
    if cfg.rollout.n < 2:
        raise ConfigError(f"{key}.enabled", f"needs groups of samples (rollout.n >= 2, got {cfg.rollout.n}): it "
                                            "keeps the prompts whose samples scored differently")
    if cfg.algorithm.skip_uniform_groups:
        raise ConfigError("algorithm.skip_uniform_groups", f"and {key}.enabled both leave out the groups whose "
                          "samples all scored the same; dynamic sampling also refills the batch: set "
                          "skip_uniform_groups=false")
    if cfg.trainer.off_policy != "sync":
        raise ConfigError(f"{key}.enabled", f"with trainer.off_policy={cfg.trainer.off_policy}: a refill depends on "
                          "the scores of the step's batches, which a rollout generating ahead draws before they "
                          "are scored (use off_policy=sync)")


def _check_overlong(cfg: Config) -> None:
    buffer, limit = cfg.reward.overlong_buffer, cfg.data.max_response_length
    if not 0 <= buffer.length <= limit:
        raise ConfigError("reward.overlong_buffer.length", f"must be 0 (off) to data.max_response_length={limit} "
                                                          f"tokens, got {buffer.length}")
    if not (math.isfinite(buffer.penalty) and buffer.penalty >= 0):
        raise ConfigError("reward.overlong_buffer.penalty", "must be a finite number >= 0 (what a response of "
                          f"data.max_response_length tokens loses), got {buffer.penalty}")
    multi_turn = cfg.env.function is not None
    for key, on in (("reward.overlong_buffer.length", buffer.length > 0),
                    ("algorithm.mask_truncated", cfg.algorithm.mask_truncated)):
        if on and multi_turn:
            raise ConfigError(key, "with env.function: a trajectory's length limit counts the tool's tokens too, "
                                   "which a response's length (the model's tokens) does not")
    if buffer.length and cfg.algorithm.adv_estimator == "remax":
        raise ConfigError("reward.overlong_buffer.length", "with algorithm.adv_estimator=remax: the greedy "
                                                           "baseline's score would not carry the length penalty")
