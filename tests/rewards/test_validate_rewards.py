"""The reward section's checks: a ConfigError naming the key before any worker starts."""
import pytest

from hybridflow.config.schema import HttpRewardConfig, RewardConfig, SandboxConfig
from hybridflow.config.validate_rewards import check_reward
from hybridflow.errors import ConfigError


@pytest.mark.parametrize("reward,key", [
    (RewardConfig(timeout_s=0), "reward.timeout_s"),
    (RewardConfig(workers=-1), "reward.workers"),
    (RewardConfig(max_failure_fraction=1.5), "reward.max_failure_fraction"),
    (RewardConfig(sandbox=SandboxConfig(memory_mb=0)), "reward.sandbox.memory_mb"),
    (RewardConfig(kind="http"), "reward.http.url"),
    (RewardConfig(kind="http", http=HttpRewardConfig(url="ftp://x")), "reward.http.url"),
    (RewardConfig(kind="http", http=HttpRewardConfig(url="http://127.0.0.1:1", max_in_flight=0)),
     "reward.http.max_in_flight"),
])
def test_a_bad_reward_setting_names_its_key(reward, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_reward(reward)


def test_good_settings_pass():
    check_reward(RewardConfig())
    check_reward(RewardConfig(kind="http", http=HttpRewardConfig(url="https://rm.example/score")))
