"""Checks of the `reward` section that need no model or data: each a ConfigError naming the key.

Called from `validate.validate`; what needs the machine (a sandbox that cannot isolate, math-verify missing)
is checked here too, so the run stops before any worker starts.
"""
from __future__ import annotations

import math
from urllib.parse import urlparse

from hybridflow.config.schema import RewardConfig
from hybridflow.errors import ConfigError

__all__ = ["check_reward", "check_judge_placement"]


def _positive(key: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(key, f"must be a finite number > 0, got {value!r}")


def _check_limits(reward: RewardConfig) -> None:
    _positive("reward.timeout_s", reward.timeout_s)
    if reward.workers < 0:
        raise ConfigError("reward.workers", f"must be >= 0 (0: score in the scoring process), got {reward.workers}")
    if not 0.0 <= reward.max_failure_fraction <= 1.0:
        raise ConfigError("reward.max_failure_fraction", f"must be in [0, 1], got {reward.max_failure_fraction}")
    mode = reward.async_scoring
    if not (mode == "auto" or isinstance(mode, bool)):
        raise ConfigError("reward.async_scoring", f"must be true, false or 'auto', got {mode!r}")
    if mode is True and reward.kind == "judge":
        raise ConfigError("reward.async_scoring", "true scores with the judge model beside the rollout's "
                                                  "generation; the judge scores after the rollout: 'auto' or false")
    box = reward.sandbox
    for key in ("cpu_s", "wall_s", "memory_mb", "processes", "file_size_mb", "output_kb"):
        _positive(f"reward.sandbox.{key}", getattr(box, key))


def _check_function(reward: RewardConfig) -> None:
    if reward.function == "math":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise ConfigError("reward.function", "'math' needs the math-verify package: pip install "
                                                 "'math-verify>=0.9' (in hybridflow's dev extra)") from None
    if reward.function == "code":
        from hybridflow.rewards.sandbox import Sandbox, SandboxUnavailable

        try:
            Sandbox(reward.sandbox)
        except SandboxUnavailable as exc:
            raise ConfigError("reward.sandbox.allow_unisolated", str(exc)) from None


def _check_http(reward: RewardConfig) -> None:
    url = reward.http.url
    if not url or urlparse(url).scheme not in ("http", "https") or not urlparse(url).netloc:
        raise ConfigError("reward.http.url", f"reward.kind 'http' needs an http:// or https:// URL, got {url!r}")
    for key in ("batch_size", "max_in_flight"):
        if getattr(reward.http, key) < 1:
            raise ConfigError(f"reward.http.{key}", f"must be >= 1, got {getattr(reward.http, key)}")
    if reward.http.retries < 0 or reward.http.backoff_s < 0:
        raise ConfigError("reward.http.retries", "retries and backoff_s must be >= 0")


def _check_judge(reward: RewardConfig) -> None:
    judge = reward.judge
    if not judge.model_path:
        raise ConfigError("reward.judge.model_path", "reward.kind 'judge' needs the judge model's HF checkpoint")
    if "{response}" not in judge.template:
        raise ConfigError("reward.judge.template", "must contain {response}")
    try:
        judge.template.format(prompt="", response="", ground_truth="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError("reward.judge.template", f"only {{prompt}}, {{response}} and {{ground_truth}} may be "
                                                   f"filled in (write a literal brace as {{{{ or }}}}): {exc!r}")
    _positive("reward.judge.scale", judge.scale)
    for key in ("max_new_tokens", "batch_size"):
        if getattr(judge, key) < 1:
            raise ConfigError(f"reward.judge.{key}", f"must be >= 1, got {getattr(judge, key)}")


def check_judge_placement(cfg) -> None:
    """reward.judge.placement "reference" needs a reference (reference.enabled) to share processes with."""
    reward = cfg.reward
    if reward.kind == "judge" and reward.judge.placement == "reference" and not cfg.reference.enabled:
        raise ConfigError("reward.judge.placement", "'reference' runs the judge in the reference's processes, "
                                                    "and reference.enabled is false: use 'rollout' or 'reward'")


def check_reward(reward: RewardConfig) -> None:
    """ConfigError for the first impossible setting of `reward` (its kind's own section included)."""
    _check_limits(reward)
    {"function": _check_function, "http": _check_http, "judge": _check_judge}[reward.kind](reward)
