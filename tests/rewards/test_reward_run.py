"""A training step with a reward that fails on some rows: the rollout's scorer (built from the reward section
and handed to the generating worker) scores them 0 and the driver reports reward/failures and
reward/timeouts; past reward.max_failure_fraction the step stops, naming the reward and the first row."""
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.trainer.trainer import RLTrainer, TrainingError

ROOT = Path(__file__).resolve().parents[2]

# Fails on responses starting with "1" (raising) or "2" (sleeping past the limit); otherwise the arithmetic
# reward. The demo model's answers to 3-digit sums start with 0 or 1, so some rows fail and most do not.
REWARD = '''import time
from hybridflow.rewards.arithmetic import arithmetic_reward

def flaky(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("1"):
        raise ValueError("no ones")
    if solution_str.startswith("2"):
        time.sleep(2)
    return arithmetic_reward(data_source, solution_str, ground_truth, extra_info)
'''


def _trainer(tmp_path, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "flaky.py"
    path.write_text(REWARD)
    cfg = load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path}", f"reward.function={path}:flaky", "reward.timeout_s=0.5",
        "trainer.val_every=0", "trainer.save_every=0", *overrides])
    cfg.trainer.plot = False
    cfg.model.path = str(ROOT / cfg.model.path)
    cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
    cfg.data.val_files = [str(ROOT / f) for f in cfg.data.val_files]
    return RLTrainer(cfg)


@pytest.mark.slow
def test_failing_rows_score_0_and_are_counted_in_a_step_and_too_many_stop_it(tmp_path):
    from hybridflow.data import fields as F

    trainer = _trainer(tmp_path / "a", "reward.max_failure_fraction=1.0")
    try:
        batch, metrics, _ = trainer.prepare(1)
    finally:
        trainer.shutdown()
    assert 0 < metrics["reward/failures"] < len(batch[F.UID])
    assert metrics["reward/timeouts"] <= metrics["reward/failures"]
    assert F.REWARD_FAILED not in batch

    trainer = _trainer(tmp_path / "b", "reward.max_failure_fraction=0.0")
    try:
        with pytest.raises(TrainingError, match=r"flaky.py:flaky' raised ValueError: no ones \(at .*flaky.py:6\); "
                                                r"on row \d+ .*more than reward.max_failure_fraction=0"):
            trainer.prepare(1)
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_a_step_with_async_scoring_equals_one_scored_after_the_rollout(tmp_path):
    """rollout.batch_size_per_device=2: the step's 8 prompts generate in 4 chunks per rank, each scored while
    the next generates (reward.async_scoring=true) or all after the rollout (false); the batch and every
    metric but the timings are equal, failing rows (the flaky reward's) included."""
    from hybridflow.data import fields as F

    runs = {}
    for mode in ("false", "true"):
        trainer = _trainer(tmp_path / mode, "reward.max_failure_fraction=1.0", "reward.timeout_s=5",
                           "rollout.batch_size_per_device=2", f"reward.async_scoring={mode}")
        try:
            runs[mode] = trainer.prepare(1)[:2]
        finally:
            trainer.shutdown()
    (sync, sync_metrics), (async_, async_metrics) = runs["false"], runs["true"]
    assert sync_metrics["reward/failures"] > 0
    assert {k: v for k, v in sync_metrics.items() if not k.startswith("timing/")} == \
        {k: v for k, v in async_metrics.items() if not k.startswith("timing/")}
    assert sync.keys() == async_.keys()
    for key in (F.SCORES, F.RULE_SCORES, F.RESPONSES, F.ADVANTAGES):
        if key in sync:
            assert torch.equal(sync[key], async_[key]), key
