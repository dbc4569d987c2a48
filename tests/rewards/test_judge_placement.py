"""reward.judge.placement: the judge in the rollout's worker, on a worker group of its own, or in the
reference's processes gives the same scores (the same model answering the same rows greedily)."""
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.data import fields as F
from hybridflow.errors import ConfigError
from hybridflow.trainer.trainer import RLTrainer

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "hybridflow" / "assets" / "demo_model"

# The demo model (a 3-digit adder) as a "number" judge of "{response}": it continues each response with
# digits, its last number read as the score (scaled by 2000).
JUDGE = [f"reward.judge.model_path={DEMO}", "reward.kind=judge", "reward.judge.template={response}",
         "reward.judge.verdict=number", "reward.judge.scale=2000", "reward.judge.max_new_tokens=6",
         "reward.judge.batch_size=4", "reward.max_failure_fraction=1.0"]


def _config(tmp_path, *overrides):
    cfg = load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.val_every=0", "trainer.save_every=0", *JUDGE, *overrides])
    cfg.trainer.plot = False
    cfg.model.path = str(ROOT / cfg.model.path)
    cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
    cfg.data.val_files = [str(ROOT / f) for f in cfg.data.val_files]
    return cfg


def _step(cfg):
    trainer = RLTrainer(cfg)
    try:
        apart = trainer.judge is not None
        batch, metrics, _ = trainer.prepare(1)
    finally:
        trainer.shutdown()
    return apart, batch, {k: v for k, v in metrics.items() if not k.startswith("timing/")}


def _same(runs):
    (_, one, one_metrics), *others = runs
    assert one[F.SCORES].unique().numel() > 2  # the verdicts differ from row to row
    for _, batch, metrics in others:
        assert torch.equal(batch[F.SCORES], one[F.SCORES])
        assert metrics == one_metrics


def test_the_judges_scores_are_the_same_on_every_placement(tmp_path):
    """One process (local launcher): the judge group is a group of its own even there, called from the driver
    after the rollout; "reference" needs a reference to share processes with."""
    runs = [_step(_config(tmp_path / p, f"reward.judge.placement={p}", "reference.enabled=true"))
            for p in ("rollout", "reward", "reference")]
    assert [apart for apart, _, _ in runs] == [False, True, True]
    _same(runs)
    with pytest.raises(ConfigError, match="reward.judge.placement"):
        _config(tmp_path / "x", "reward.judge.placement=reference", "reference.enabled=false")


@pytest.mark.slow
@pytest.mark.timeout(600)  # three Ray runs
def test_the_judges_scores_are_the_same_in_processes_of_its_own_and_beside_the_reference(tmp_path):
    """Under Ray on 3 devices, training on [0, 1]: the judge in a process of its own (placement "reward",
    placement.reward [2]) and in the actor's 2 processes, which hold the reference (placement "reference"),
    score as the judge in the rollout's worker."""
    ray = ["trainer.n_devices=3", "trainer.launcher=ray", "reference.enabled=true", "placement.training=[0,1]",
           "placement.rollout=[0,1]", "placement.reward=[2]"]
    runs = [_step(_config(tmp_path / p, f"reward.judge.placement={p}", *ray))
            for p in ("rollout", "reward", "reference")]
    assert [apart for apart, _, _ in runs] == [False, True, True]
    _same(runs)
