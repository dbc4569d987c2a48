"""Reward registry: names, file specs, errors, and the data_source dispatcher."""
from __future__ import annotations

import pickle

import pytest

from hybridflow.rewards import default_reward, get_reward_fn, register_reward, registered_rewards, registry
from hybridflow.rewards.arithmetic import arithmetic_reward
from hybridflow.rewards.gsm8k import gsm8k_reward


def test_builtin_names():
    assert {"gsm8k", "gsm8k_flexible", "arithmetic", "default"} <= set(registered_rewards())
    assert get_reward_fn("gsm8k") is gsm8k_reward
    assert get_reward_fn(" arithmetic ") is arithmetic_reward
    assert get_reward_fn("gsm8k")("openai/gsm8k", "#### 7", "7") == 1.0
    assert get_reward_fn("gsm8k_flexible")("openai/gsm8k", "it is 7", "7") == 1.0


def test_register_custom_and_conflicts(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # keep the global clean

    @register_reward("test_registry_constant")
    def constant(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    assert get_reward_fn("test_registry_constant") is constant
    register_reward("test_registry_constant")(constant)  # same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_registry_constant")(lambda d, s, g, e=None: 1.0)
    with pytest.raises(TypeError, match="must accept"):
        register_reward("test_registry_two_args")(lambda solution, truth: 1.0)
    with pytest.raises(ValueError, match="without ':'"):
        register_reward("a:b")


def test_unknown_name_suggests_nearest():
    with pytest.raises(ValueError, match="unknown reward 'gsm8kk'; did you mean 'gsm8k'"):
        get_reward_fn("gsm8kk")
    with pytest.raises(ValueError, match="did you mean 'arithmetic'"):
        get_reward_fn("arithmetik")
    with pytest.raises(ValueError, match="known: .*gsm8k"):
        get_reward_fn("zzzzzz")


def test_load_from_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def length_bonus(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str)) + (extra_info or {}).get('bonus', 0)\n"
        "def scorer_two(solution_str, ground_truth):\n"
        "    return 1.0\n"
        "NOT_A_FUNCTION = 3\n")
    fn = get_reward_fn(f"{path}:length_bonus")
    assert fn("x", "abc", "", {"bonus": 1}) == 4.0
    assert pickle.loads(pickle.dumps(fn)) is fn  # importable by reference in this process
    with pytest.raises(ValueError, match="no function 'length_bonu'; did you mean 'length_bonus'"):
        get_reward_fn(f"{path}:length_bonu")
    with pytest.raises(TypeError, match="must accept"):
        get_reward_fn(f"{path}:scorer_two")
    with pytest.raises(TypeError, match="not callable"):
        get_reward_fn(f"{path}:NOT_A_FUNCTION")


def test_missing_file_and_bad_specs(tmp_path):
    missing = tmp_path / "absent.py"
    with pytest.raises(FileNotFoundError, match="absent.py"):
        get_reward_fn(f"{missing}:score")
    with pytest.raises(ValueError, match="path/to/file.py:function"):
        get_reward_fn(f"{missing}:")
    with pytest.raises(ValueError, match="non-empty"):
        get_reward_fn("")
    text = tmp_path / "rewards.txt"
    text.write_text("def f(a, b, c, d=None): return 1.0\n")
    with pytest.raises(ValueError, match="not a Python source file"):
        get_reward_fn(f"{text}:f")


def test_file_errors_propagate(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(RuntimeError, match="boom at import"):
        get_reward_fn(f"{path}:f")


def test_default_dispatches_on_data_source():
    assert default_reward("openai/gsm8k", "so #### 1,000", "1000") == 1.0
    assert default_reward("openai/gsm8k", "so #### 999", "1000") == 0.0
    assert default_reward("arithmetic", "0959<eos>", "0959") == 1.0
    assert default_reward("arithmetic", "959<eos>", "0959") == 0.0
    assert get_reward_fn("default") is default_reward
    with pytest.raises(ValueError, match="data_source 'openai/gsm8kk'; did you mean 'openai/gsm8k'"):
        default_reward("openai/gsm8kk", "#### 1", "1")
