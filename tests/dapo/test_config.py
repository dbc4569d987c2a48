"""DAPO's keys: the shipped recipe loads with every piece on, and each impossible combination is a ConfigError
naming the key, raised when the config loads (before any worker starts)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config.loader import load_config
from hybridflow.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model.path=/models/tiny", "data.train_files=[a.parquet]", "algorithm.adv_estimator=grpo", "rollout.n=4"]
ON = "algorithm.dynamic_sampling.enabled=true"


def test_the_dapo_demo_config_turns_on_the_whole_recipe():
    cfg = load_config(ROOT / "configs" / "dapo-demo.yaml", [])
    a, actor = cfg.algorithm, cfg.actor
    assert a.dynamic_sampling.enabled and a.dynamic_sampling.max_batches >= 2 and a.mask_truncated
    assert not a.skip_uniform_groups and not a.use_kl_in_reward and not actor.use_kl_loss
    assert cfg.reward.overlong_buffer.length > 0 and cfg.reward.overlong_buffer.penalty > 0
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert cfg.rollout.n >= 2 and a.adv_estimator == "grpo"


@pytest.mark.parametrize("overrides, path, fragment", [
    ([ON, "algorithm.adv_estimator=gae", "rollout.n=1"], "algorithm.dynamic_sampling.enabled", "needs groups of samples (rollout.n >= 2, got 1)"),
    ([ON, "algorithm.skip_uniform_groups=true"], "algorithm.skip_uniform_groups",
     "set skip_uniform_groups=false"),
    ([ON, "trainer.off_policy=one_step"], "algorithm.dynamic_sampling.enabled", "use off_policy=sync"),
    (["algorithm.dynamic_sampling.max_batches=0"], "algorithm.dynamic_sampling.max_batches", "must be >= 1"),
    (["reward.overlong_buffer.length=600"], "reward.overlong_buffer.length",
     "0 (off) to data.max_response_length=512 tokens, got 600"),
    (["reward.overlong_buffer.length=-1"], "reward.overlong_buffer.length", "got -1"),
    (["reward.overlong_buffer.length=8", "reward.overlong_buffer.penalty=-1"], "reward.overlong_buffer.penalty",
     "finite number >= 0"),
    (["reward.overlong_buffer.length=8", "env.function=calculator"], "reward.overlong_buffer.length",
     "counts the tool's tokens"),
    (["algorithm.mask_truncated=true", "env.function=calculator"], "algorithm.mask_truncated",
     "counts the tool's tokens"),
    (["reward.overlong_buffer.length=8", "algorithm.adv_estimator=remax"], "reward.overlong_buffer.length",
     "greedy baseline's score"),
])
def test_impossible_dapo_combinations_name_the_key(overrides, path, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + overrides)
    assert err.value.path == path
    assert fragment in str(err.value)


def test_a_misspelt_dapo_key_names_the_nearest_one():
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + ["algorithm.dynamic_sampling.max_batch=3"])
    assert "max_batches" in str(err.value)
