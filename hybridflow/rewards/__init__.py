"""Rule-based verifiers and the reward-function registry.

``get_reward_fn("gsm8k")`` or ``get_reward_fn("my_rewards.py:score")`` returns
a function ``fn(data_source, solution_str, ground_truth, extra_info=None) ->
float``; ``default_reward`` picks the verifier by ``data_source``.
"""
from hybridflow.rewards.registry import (
    DATA_SOURCE_REWARDS,
    RewardFn,
    default_reward,
    get_reward_fn,
    register_reward,
    registered_rewards,
)

__all__ = ["DATA_SOURCE_REWARDS", "RewardFn", "default_reward", "get_reward_fn", "register_reward",
           "registered_rewards"]
