"""`hybridflow eval` and the re-scoring of a restored rollout batch score through the reward guard: a reward
that hangs (or raises) on some rows scores those rows 0 and counts them, and neither stops nor stalls."""
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.data import fields as F
from hybridflow.rewards.arithmetic import compute_score
from hybridflow.trainer.evaluate import evaluate, report
from hybridflow.trainer.trainer import RLTrainer

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "hybridflow" / "assets"
DEMO, TEST = ASSETS / "demo_model", ASSETS / "arithmetic" / "test.parquet"

# Hangs on answers ending in `hang` while the file HANG exists, raises on those ending in `fail`; else the
# arithmetic reward.
REWARD = '''import os, time
from hybridflow.rewards.arithmetic import arithmetic_reward

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.endswith({hang!r}) and os.path.exists({flag!r}):
        time.sleep(60)
    if solution_str.endswith({fail!r}):
        raise ValueError("no threes")
    return arithmetic_reward(data_source, solution_str, ground_truth, extra_info)
'''


def _reward_file(tmp_path, hang, fail, armed=True):
    flag = tmp_path / "HANG"
    if armed:
        flag.write_text("")
    path = tmp_path / "hangs.py"
    path.write_text(REWARD.format(flag=str(flag), hang=hang, fail=fail))
    return f"{path}:hangs", flag


def test_eval_scores_a_hanging_or_raising_row_0_and_counts_it(tmp_path):
    spec, _ = _reward_file(tmp_path, "1", "3")
    result = evaluate(DEMO, [TEST], [spec, "arithmetic"], limit=20, max_new_tokens=6, batch_size=8, timeout_s=1.0)
    ends = [r[-1:] for r in result.responses]
    assert "1" in ends and "3" in ends, result.responses  # both kinds of failing row occur
    expected = [0.0 if e in "13" else s for e, s in zip(ends, result.scores["arithmetic"])]
    assert result.scores[spec] == expected
    assert result.failures[spec] == sum(e in "13" for e in ends)
    assert result.timeouts[spec] == ends.count("1")
    assert result.failures["arithmetic"] == 0
    assert result.scores["arithmetic"] == [float(compute_score(r, t)) for r, t in
                                           zip(result.responses, [row for row in _truths(20)])]
    text = report([result])
    assert f"{spec}: {result.failures[spec]} rows scored 0 for a failure ({result.timeouts[spec]} past" in text
    assert "did not return within reward.timeout_s=1 s" in text or "raised ValueError: no threes" in text


def _truths(n):
    from hybridflow.data.dataset import read_rows

    return [row["reward_model"]["ground_truth"] for _, row in read_rows(TEST)][:n]


def test_a_restored_batch_is_rescored_through_the_guard(tmp_path, caplog):
    """A batch restored from a checkpoint without its scores (`RLTrainer._scored_here`) is scored by the
    reward section's scorer: rows whose reward hangs time out after reward.timeout_s, score 0 and are counted,
    as the rollout's own scoring counts them."""
    spec, flag = _reward_file(tmp_path, "7", "x", armed=False)
    cfg = load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path}", f"reward.function={spec}", "reward.timeout_s=1.0", "reward.workers=2",
        "reward.max_failure_fraction=1.0", "trainer.val_every=0", "trainer.save_every=0"])
    cfg.trainer.plot = False
    cfg.model.path = str(ROOT / cfg.model.path)
    cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
    cfg.data.val_files = [str(ROOT / f) for f in cfg.data.val_files]
    trainer = RLTrainer(cfg)
    try:
        made = trainer.rollout(trainer.prompts(1), 0)  # scored by the rollout, nothing hangs yet
        flag.write_text("")
        old = {k: v for k, v in made.items() if k not in (F.RULE_SCORES, F.RESPONSE_LENGTH, F.REWARD_FAILED,
                                                           F.REWARD_TIMED_OUT, F.RULE_REWARD_SECONDS)}
        again = trainer._scored_here(old)
    finally:
        trainer.shutdown()
    ends = torch.tensor([r[-1:] == "7" for r in made[F.RESPONSE_TEXT]])
    assert ends.any(), made[F.RESPONSE_TEXT]
    assert torch.equal(again[F.REWARD_TIMED_OUT], ends.float())
    assert torch.equal(again[F.REWARD_FAILED], made[F.REWARD_FAILED] + ends.float())
    assert torch.equal(again[F.RULE_SCORES], torch.where(ends, 0.0, made[F.RULE_SCORES]))
    assert "did not return within reward.timeout_s=1 s" in caplog.text  # the section's limit, not a default
