"""trainer.off_policy on two Ray processes (1 training, 1 rollout apart): the schedules are exact.

Keyed sampling (step, prompt, sample) makes a rollout a function of its weights alone, so
- async with max_staleness 0 is sync's schedule: the same learned metrics and weights;
- one_step is the lock-step trainer whose rollout group is handed, before step t, the weights of
  version t - 2 (a push delayed by one update, built here by hand from the sync trainer's parts);
- a one_step run resumed from a mid-run checkpoint continues that schedule (the checkpoint holds the
  batch generated ahead).
Both sides run the same computations in one layout, so they agree to the last bit; the tests allow
1e-6 (the issue's bound) so that a reordering that stays within float noise would not fail them.
"""
import math
import shutil
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.trainer import read_metrics
from hybridflow.dataflow.off_policy import Schedule, staleness_metrics
from hybridflow.trainer.trainer import RLTrainer
from tests.trainer.test_trainer import in_repo, learned

ROOT = Path(__file__).resolve().parents[2]
APART = ["trainer.n_devices=2", "trainer.launcher=ray", "placement.training=[0]", "placement.reference=[0]",
         "placement.critic=[0]", "placement.rollout=[1]", "data.val_files=[]"]
GAP = ("offpolicy/is_weight_mean", "offpolicy/is_weight_max", "offpolicy/is_clipped_frac", "offpolicy/k3_kl")
STALENESS = ("offpolicy/staleness_mean", "offpolicy/staleness_max", "offpolicy/staleness_0",
             "offpolicy/staleness_1")


def _config(name: str, out: Path, *overrides: str):
    return in_repo(load_config(ROOT / "configs" / name, [f"trainer.output_dir={out}", *APART, *overrides]))


def _fit(name: str, out: Path, *overrides: str):
    trainer = RLTrainer(_config(name, out, *overrides))
    try:
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    return summary, read_metrics(summary["run_dir"] / "metrics.jsonl")


def _close(got: dict, want: dict, keys=None) -> None:
    for step, values in want.items():
        for key in keys or values:
            assert got[step][key] == pytest.approx(values[key], rel=1e-6, abs=1e-9), (step, key)


def _by_step(records: list[dict], keys) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in keys} for r in records if r["step"] > 0}


def _same_weights(a: Path, b: Path) -> None:
    from hybridflow.models.checkpoint import load_hf_state_dict

    got, want = load_hf_state_dict(a), load_hf_state_dict(b)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert (got[name] - value).abs().max().item() <= 1e-6 * max(1.0, value.abs().max().item()), name


# --------------------------------------------------------------------------- the schedule, no processes

def test_schedule_limits():
    """At the start of step t with version p pushed: one_step runs one batch ahead of the update, async
    up to k versions ahead of p (wait) or k steps ahead of t (drop), never past the last step."""
    one = Schedule("one_step", 1, 1, False, 10)
    assert [one.limit(t, t - 1) for t in (1, 2, 9, 10)] == [2, 3, 10, 10]
    k0 = Schedule("async", 0, 1, False, 10)
    assert [k0.limit(t, t - 1) for t in (1, 2, 5)] == [1, 2, 5]  # lock step
    k2 = Schedule("async", 2, 3, False, 20)
    assert k2.limit(4, 3) == 6 and k2.limit(6, 3) == 6 and k2.limit(7, 6) == 9
    drop = Schedule("async", 1, 4, True, 20)
    assert drop.limit(6, 4) == 7 and drop.limit(9, 4) == 10  # the pushed version does not hold it back
    assert [k2.pushes_after(v) for v in (1, 3, 6)] == [False, True, True]
    m = staleness_metrics(torch.tensor([0, 1, 1, 4, 3]))
    assert m["offpolicy/staleness_mean"] == pytest.approx(1.8) and m["offpolicy/staleness_max"] == 4  # float32 mean
    assert [m[f"offpolicy/staleness_{b}"] for b in ("0", "1", "2", "3plus")] == [1, 2, 0, 2]


# --------------------------------------------------------------------------- on Ray



@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name, steps", [("tiny-grpo.yaml", 3), ("tiny-ppo.yaml", 2)])
def test_async_without_staleness_is_sync(tmp_path, name, steps):
    """async, max_staleness 0: every batch generates from the weights of the update just before, as in
    lock step. The learned metrics, the sampler-trainer gap and the exported weights equal the sync
    run's (GRPO three steps, two pushes; PPO, slower, two); every row's staleness is 0. GRPO also
    validates (before step 1, after step 2 and at the end: through the stream, with the trainer's
    weights of then), and its val/ metrics are among the learned ones compared."""
    steps = [f"trainer.total_steps={steps}", "trainer.save_every=0"]
    if name == "tiny-grpo.yaml":
        steps += ["data.val_files=[hybridflow/assets/arithmetic/test.parquet]", "data.val_max_samples=32"]
    sync_summary, sync = _fit(name, tmp_path / "sync", *steps)
    async_summary, lagged = _fit(name, tmp_path / "async", *steps, "trainer.off_policy=async",
                                 "trainer.max_staleness=0")
    _close(learned(lagged), learned(sync))
    _close(_by_step(lagged, GAP + STALENESS), _by_step(sync, GAP + STALENESS))
    assert all(r["offpolicy/staleness_max"] == 0 for r in lagged if r["step"])
    if name == "tiny-grpo.yaml":
        assert [r["step"] for r in lagged if "val/accuracy" in r] == [0, 2, 3]
    # The sampler's log-probs reached the batch: at equal weights they are the trainer's to float noise.
    assert all(abs(r["offpolicy/k3_kl"]) < 1e-6 and r["offpolicy/is_weight_max"] < 1.001 for r in lagged if r["step"])
    _same_weights(async_summary["hf_actor"], sync_summary["hf_actor"])


def _delayed_push_schedule(name: str, out: Path, steps: int, *overrides: str) -> tuple[dict, Path]:
    """The sync trainer stepped by hand with its rollout group one weight push behind: before step t it
    holds version max(0, t - 2) (the actor's weights published after update t - 2). Returns each step's
    metrics and the exported weights."""
    trainer = RLTrainer(_config(name, out, f"trainer.total_steps={steps}", "trainer.save_every=0", *overrides))
    records = {}
    try:
        for step in range(1, steps + 1):
            if step == 1:
                trainer.weights.sync.push()  # version 0, the actor's weights now
            elif step >= 3:
                trainer.weights.sync.push(step - 2)  # the copy staged after update t - 2
            trainer.weights.stale = False  # keep what was pushed: the push is delayed, by hand
            records[step] = trainer.train_step(step)
            trainer.weights.sync.stage(step)
        return records, trainer.export_hf()
    finally:
        trainer.shutdown()


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(400)
def test_grpo_one_step_is_the_delayed_push_schedule_and_resumes_it(tmp_path):
    """one_step: batch t + 1 generates while update t runs, from the weights of before it. Three steps
    equal the hand-built schedule (learned metrics, the sampler-trainer gap, the weights); staleness is
    0 at step 1 (nothing to lag yet) and 1 after. Resumed from its step-2 checkpoint (step 3's batch,
    generated from version 1 before the save, is in it), step 3 is the same again."""
    common = ["trainer.save_every=1", "actor.off_policy_correction=tis", "actor.off_policy_correction_threshold=1.5"]
    summary, records = _fit("tiny-grpo.yaml", tmp_path / "one", "trainer.total_steps=3", "trainer.off_policy=one_step",
                            *common)
    hand, hand_hf = _delayed_push_schedule("tiny-grpo.yaml", tmp_path / "hand", 3, *common[1:])
    got = learned(records)
    _close(got, {step: {k: v for k, v in m.items() if k in got[step]} for step, m in hand.items()})
    assert all(key in got[3] for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean"))
    _close(_by_step(records, GAP), {step: {k: m[k] for k in GAP} for step, m in hand.items()})
    assert [r["offpolicy/staleness_max"] for r in records if r["step"]] == [0, 1, 1]
    assert records[3]["offpolicy/is_weight_max"] > 1.0  # two versions apart, the weights are not all 1
    _same_weights(summary["hf_actor"], hand_hf)

    shutil.copytree(tmp_path / "one", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "tiny-grpo" / "checkpoints" / "step_000003")
    assert (tmp_path / "resumed" / "tiny-grpo" / "checkpoints" / "step_000002" / "rollout_buffer.pt").is_file()
    again_summary, again = _fit("tiny-grpo.yaml", tmp_path / "resumed", "trainer.total_steps=3",
                                "trainer.off_policy=one_step", "trainer.resume=auto", *common)
    _close({3: learned(again)[3]}, {3: got[3]})
    _close(_by_step(again, GAP + STALENESS), {3: {k: records[3][k] for k in GAP + STALENESS}})
    _same_weights(again_summary["hf_actor"], summary["hf_actor"])


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(400)
def test_ppo_one_step_is_the_delayed_push_schedule(tmp_path):
    """PPO (critic, reference, KL in the reward and as a loss) under one_step with decoupled PPO: two
    steps (step 2 trains on version 0's batch with the trainer at version 1) equal the hand-built run."""
    common = ["actor.off_policy_correction=decoupled"]
    summary, records = _fit("tiny-ppo.yaml", tmp_path / "one", "trainer.total_steps=2", "trainer.save_every=0",
                            "trainer.off_policy=one_step", *common)
    hand, hand_hf = _delayed_push_schedule("tiny-ppo.yaml", tmp_path / "hand", 2, *common)
    got = learned(records)
    _close(got, {step: {k: v for k, v in m.items() if k in got[step]} for step, m in hand.items()})
    assert math.isfinite(got[2]["critic/vf_loss"]) and records[2]["offpolicy/staleness_max"] == 1
    _close(_by_step(records, GAP), {step: {k: m[k] for k in GAP} for step, m in hand.items()})
    _same_weights(summary["hf_actor"], hand_hf)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(300)
def test_killed_rollout_rank_under_one_step_stops_the_run_naming_it(tmp_path):
    """SIGKILL the rollout process while it generates ahead: the next step raises a WorkerError naming
    the rollout's rank and method, and the run does not hang. One mini-batch a step (no old log-prob pass):
    before that, a rollout answers with its token tensors (sampler log-probs, masks) left in the object store,
    as references the training workers fetch, and the first update measures the sampler-trainer gap from them."""
    import os
    import signal

    from hybridflow.controller import WorkerError
    from hybridflow.data.batch import RowsElsewhere
    from hybridflow.data import fields as F
    from hybridflow.roles.rollout import TRAIN

    trainer = RLTrainer(_config("tiny-grpo.yaml", tmp_path, "trainer.off_policy=one_step", "trainer.total_steps=5",
                                "actor.ppo_mini_batch_size=8"))
    try:
        out = trainer.rollout_group.generate(trainer.prompts(1), 0, TRAIN)  # the stream has submitted nothing yet
        assert all(isinstance(out[name], RowsElsewhere) for name in (F.ROLLOUT_LOG_PROBS, F.RESPONSE_MASK))
        assert torch.is_tensor(out[F.RESPONSE_LENGTH])  # what the driver reads of the tokens: a number a row
        assert "offpolicy/k3_kl" in trainer.train_step(1)  # batch 2 is being generated now
        os.kill(trainer.rollout_group.group.pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"rank 0 failed in (generate|receive_weights): its worker process died"):
            for step in range(2, 6):
                trainer.train_step(step)
    finally:
        trainer.shutdown()
