"""The run plan: what a valid config implies, computed once (config/plan.py)."""
import pickle

import pytest

from hybridflow.config.loader import load_config
from hybridflow.config.plan import RunPlan
from hybridflow.parallel import ParallelDims

BASE = ["model.path=/models/tiny", "data.train_files=[a.parquet]"]


def plan(*overrides: str) -> RunPlan:
    return RunPlan.from_config(load_config(None, BASE + list(overrides)))


def test_one_process_without_ray(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = plan("algorithm.adv_estimator=grpo", "rollout.n=2")
    assert not p.uses_ray and p.job_world == 1 and p.worlds["training"] == 1
    assert p.layouts == {role: ParallelDims() for role in ("training", "critic", "reference")}
    assert not p.uses_critic and not p.rollout_apart and p.generation_replicas == 1
    assert p.row_multiple == p.prompt_multiple == 1 and p.chunk_prompts == 32  # the whole batch


def test_ray_layouts_replicas_and_multiples(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = plan("trainer.n_devices=4", "actor.parallel.tp=2", "critic.parallel.tp=4", "rollout.tg=1",
             "algorithm.adv_estimator=gae", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
             "trainer.total_steps=3", "critic.ppo_epochs=2")
    assert p.uses_ray and p.devices["training"] == (0, 1, 2, 3) and p.worlds["critic"] == 4
    assert p.layouts["training"] == ParallelDims(tp=2, dp=2) and p.layouts["critic"] == ParallelDims(tp=4)
    assert p.layouts["reference"] == p.layouts["training"]
    assert p.uses_critic and not p.colocate_critic  # another megatron-core layout: processes of its own
    assert p.colocate_reward_model  # the default placement: every device
    assert p.generation_replicas == 4 and p.row_multiple == 2 and p.prompt_multiple == 4
    assert p.mini_batch_responses == 4
    # steps x epochs x mini-batches per step: each role's own epochs
    assert p.optimizer_steps == {"actor": 3 * 1 * 2, "critic": 3 * 2 * 2}


def test_rollout_apart_and_chunks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = plan("trainer.n_devices=3", "placement.training=[0, 1]", "placement.reference=[0, 1]",
             "placement.rollout=[2]", "algorithm.adv_estimator=grpo", "rollout.n=2", "data.train_batch_size=8",
             "actor.ppo_mini_batch_size=8", "dataflow.min_batch_for_reward=6")
    assert p.rollout_apart and p.worlds["rollout"] == 1 and p.generation_replicas == 1
    assert p.layouts["training"].dp == 2 and p.prompt_multiple == 2
    assert p.chunk_prompts == 4  # 6 responses = 3 prompts, rounded up to equal shares of 2
    assert not p.needs_reference and not p.needs_old_log_probs  # one optimizer step: the update's own


def test_torchrun_worlds_follow_the_job(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    p = plan("actor.parallel.tp=2")
    assert not p.uses_ray and p.job_world == 2 and p.layouts["training"] == ParallelDims(tp=2)
    assert not p.rollout_apart and p.generation_replicas == 2  # tg = 1 on each of the 2 ranks


def test_the_plan_is_frozen_plain_data(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = plan(f"trainer.output_dir={tmp_path}", "trainer.experiment=e")
    with pytest.raises(AttributeError):
        p.uses_ray = True
    assert pickle.loads(pickle.dumps(p)) == p
    described = p.describe()
    assert described["layouts"]["training"] == "p1-t1-d1" and described["run_dir"] == str(tmp_path / "e")


def test_cli_config_prints_the_plan_as_comments(capsys):
    """`hybridflow config` shows the plan; its output still loads as the config it printed."""
    from pathlib import Path

    import yaml

    from hybridflow.cli import main

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny-grpo.yaml"
    assert main(["config", str(config), "trainer.n_devices=2", "trainer.launcher=ray"]) == 0
    out = capsys.readouterr().out
    assert "# run plan" in out and "#   layouts: {training: p1-t1-d2" in out and "#   generation_replicas: 2" in out
    assert yaml.safe_load(out) == yaml.safe_load(out.split("# run plan")[0])
