"""reward.async_scoring: a rollout's chunks are scored while the next one generates, with the same result.

The rollout is the real one (the demo model on the built-in generator, chunks of
rollout.batch_size_per_device prompts); the reward fails on some rows (raising, or
sleeping past the time limit) so that the counts and the failure rule are compared too.
"""
import time
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.config.schema import DataConfig, JudgeConfig, RewardConfig, RolloutConfig
from hybridflow.config.validate_rewards import check_reward
from hybridflow.data import fields as F
from hybridflow.data.dataset import PromptDataset
from hybridflow.errors import ConfigError
from hybridflow.rewards.arithmetic import arithmetic_reward
from hybridflow.roles.rollout import Rollout
from hybridflow.roles.scoring import RewardError, RolloutScoring, build_scorer, overlaps
from hybridflow.utils import load_hf_model

ASSETS = Path(__file__).resolve().parents[2] / "hybridflow" / "assets"
DEMO, TEST = ASSETS / "demo_model", ASSETS / "arithmetic" / "test.parquet"


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    """Raises on answers ending in 1, sleeps past the test's time limit on those ending in 2."""
    if solution_str.endswith("1"):
        raise ValueError("no ones")
    if solution_str.endswith("2"):
        time.sleep(20.0)
    return arithmetic_reward(data_source, solution_str, ground_truth, extra_info)


@pytest.fixture(scope="module")
def demo():
    model = load_hf_model(DEMO)
    data = PromptDataset(DataConfig(max_prompt_length=16, apply_chat_template=False), model.tokenizer, [TEST])
    return model, data.collate([data[i] for i in range(10)])


def _rollout(model, generator=None, chunk=3):
    cfg = RolloutConfig(n=2, temperature=1.0, batch_size_per_device=chunk)
    return Rollout(cfg, 6, generator or model.generator, model.tokenizer, world_size=1)


def _scored(model, prompts, scorer, overlap, generator=None, events=None):
    scoring = RolloutScoring(scorer, "flaky", overlap, events)
    try:
        rollout = _rollout(model, generator)
        return scoring.finish(rollout.generate(prompts, seed=3, on_part=scoring.add if overlap else None))
    finally:
        scoring.close()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_async_scoring_equals_scoring_the_whole_batch(demo, workers):
    """10 prompts x 2 samples in chunks of 3 prompts (the last one shorter): every field, the failure and
    timeout counts, and the error past max_failure_fraction equal scoring after the rollout."""
    model, prompts = demo
    reward = RewardConfig(timeout_s=3.0, workers=workers, max_failure_fraction=1.0)
    scorer = build_scorer(reward, flaky)
    try:
        sync = _scored(model, prompts, scorer, overlap=False)
        async_ = _scored(model, prompts, scorer, overlap=True)
    finally:
        scorer.close()
    failed, timed_out = sync[F.REWARD_FAILED].sum().item(), sync[F.REWARD_TIMED_OUT].sum().item()
    assert 0 < failed < 20 and 0 < timed_out < failed, sync[F.RESPONSE_TEXT]  # every kind of row occurs
    assert sync.keys() == async_.keys()
    for key in sync.keys() - {F.RULE_REWARD_SECONDS}:
        if isinstance(sync[key], torch.Tensor):
            assert torch.equal(sync[key], async_[key]), key
        else:
            assert sync[key] == async_[key], key

    strict = build_scorer(RewardConfig(timeout_s=3.0, workers=workers, max_failure_fraction=0.0), flaky)
    errors = []
    try:
        for overlap in (False, True):
            with pytest.raises(RewardError) as info:
                _scored(model, prompts, strict, overlap)
            errors.append(str(info.value))
    finally:
        strict.close()
    assert errors[0] == errors[1]
    assert "more than reward.max_failure_fraction=0 of the batch" in errors[0]


class RecordedGenerator:
    """The demo model's generator, recording when each call starts and ends in `events`; the call for chunk
    `wait_in` waits (at most `wait_s`) until chunk 0's scoring started, so that with overlap the order of the
    events is fixed, and without it the wait runs out."""

    def __init__(self, generator, events, wait_in=1, wait_s=20.0):
        self.generator, self.events, self.wait_in, self.wait_s = generator, events, wait_in, wait_s
        self.calls = 0

    def generate(self, *args, **kwargs):
        k, self.calls = self.calls, self.calls + 1
        self.events.append(("generate_start", k))
        out = self.generator.generate(*args, **kwargs)
        if k == self.wait_in:
            deadline = time.monotonic() + self.wait_s
            while ("score_start", 0) not in self.events and time.monotonic() < deadline:
                time.sleep(0.01)
        self.events.append(("generate_end", k))
        return out


def test_chunk_0_is_scored_while_chunk_1_generates(demo):
    """Events, not timings: with overlap, chunk 0's scoring starts before chunk 1's generation ends (chunk 1
    waits for it, and it comes); without, every generation ends before any scoring starts."""
    model, prompts = demo
    scorer = build_scorer(RewardConfig(timeout_s=5.0, max_failure_fraction=1.0), arithmetic_reward)
    try:
        events: list = []
        _scored(model, prompts, scorer, True, RecordedGenerator(model.generator, events), events)
        assert events.index(("score_start", 0)) < events.index(("generate_end", 1)), events
        assert events.index(("generate_end", 0)) < events.index(("score_start", 0))
        assert [e for e in events if e[0] == "score_end"] == [("score_end", k) for k in range(4)]

        events = []
        _scored(model, prompts, scorer, False, RecordedGenerator(model.generator, events, wait_s=0.5), events)
        assert ("score_start", 0) not in events  # the whole batch is scored in one call, after the rollout
        assert events[-1] == ("generate_end", 3)
    finally:
        scorer.close()


def test_the_async_scoring_key():
    """"auto" (the default) overlaps for function and http rewards, not for a judge; anything but true, false
    or "auto", and true with a judge, are ConfigErrors naming the key, from YAML too."""
    assert overlaps(RewardConfig()) and overlaps(RewardConfig(kind="http"))
    assert not overlaps(RewardConfig(kind="judge")) and not overlaps(RewardConfig(async_scoring=False))
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="reward.async_scoring"):
            check_reward(RewardConfig(async_scoring=bad))
    with pytest.raises(ConfigError, match="reward.async_scoring.*judge"):
        check_reward(RewardConfig(kind="judge", async_scoring=True, judge=JudgeConfig(model_path="x")))
    check_reward(RewardConfig(kind="judge", judge=JudgeConfig(model_path="x")))
    root = ASSETS.parents[1]
    assert load_config(root / "configs" / "tiny-grpo.yaml", ["reward.async_scoring=false"],
                       validate_config=False).reward.async_scoring is False
    with pytest.raises(ConfigError, match="reward.async_scoring"):
        load_config(root / "configs" / "tiny-grpo.yaml", ["reward.async_scoring=maybe"], validate_config=False)
