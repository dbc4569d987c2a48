"""The DAPO recipe end to end on the demo model: dynamic sampling with refill, overlong shaping and filtering in
the trainer's loop, in one process and on a Ray worker (the object-store data plane: the driver refills and
filters rows it holds only as placeholders), and resumed from a checkpoint where the prompt walk stands."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.config.loader import load_config
from hybridflow.trainer import read_metrics
from hybridflow.trainer.trainer import RLTrainer
from tests.trainer.test_trainer import DETERMINISTIC, in_repo

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 4 prompts a step, up to 2 batches; responses cut at 4 tokens (a 4-digit sum and its EOS do not fit), the
# last of them penalised: every DAPO piece acts within two steps.
DAPO = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
        "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_batches=2",
        "reward.overlong_buffer.length=1", "algorithm.mask_truncated=true", "actor.clip_ratio_high=0.28",
        "trainer.total_steps=2", "trainer.save_every=1", "data.val_files=[]"]


def learned(records: list[dict]) -> dict[int, dict]:
    """Each step's figures that a rerun must repeat: the learned ones and DAPO's."""
    return {r["step"]: {k: v for k, v in r.items() if k.startswith((*DETERMINISTIC, "dapo/"))} for r in records}


def fit(tmp_path: Path, *overrides: str, stop_after=None):
    cfg = in_repo(load_config(ROOT / "configs" / "tiny-grpo.yaml",
                              [f"trainer.output_dir={tmp_path}", *DAPO, *overrides]))
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.fit(stop_after=stop_after)
    finally:
        trainer.shutdown()
    return summary, learned(read_metrics(summary["run_dir"] / "metrics.jsonl"))


def assert_same_steps(got: dict, want: dict, steps) -> None:
    for step in steps:
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)


def test_dapo_steps_refill_resume_where_the_walk_stood_and_run_the_same_under_ray(tmp_path, ray_cluster):
    summary, whole = fit(tmp_path / "whole")
    for step in (1, 2):
        m = whole[step]
        assert 1 <= m["dapo/generated_batches"] <= 2 and m["dapo/kept_groups"] <= 4
        # A step that did not fill its 4 groups generated every batch it was allowed.
        assert m["dapo/filled"] == 1.0 or m["dapo/generated_batches"] == 2
        assert "dapo/truncated_fraction" in m and "dapo/overlong_fraction" in m
    assert sum(whole[s]["dapo/generated_batches"] for s in (1, 2)) > 2  # some step refilled
    assert any(whole[s]["dapo/truncated_fraction"] > 0 for s in (1, 2))
    # Checkpointed: where the walk over the epoch's order stands, past the refills' prompts.
    state = json.loads((summary["run_dir"] / "checkpoints/step_000001/trainer.json").read_text())
    assert state["sampler"]["step"] == 1 and state["sampler"]["at"] == 4 * whole[1]["dapo/generated_batches"]

    # Stopped after step 1 and resumed: step 2 draws the same prompts (the same figures and updates).
    fit(tmp_path / "part", stop_after=1)
    _, resumed = fit(tmp_path / "part", "trainer.resume=auto")
    assert_same_steps(resumed, whole, (2,))

    # On a Ray worker the driver holds placeholders of the token rows: the same steps.
    _, ray = fit(tmp_path / "ray", "trainer.launcher=ray")
    assert_same_steps(ray, whole, (1, 2))
