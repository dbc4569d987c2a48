"""The off-policy iteration model (`planner/overlap.py`): hand-computed cases, and the planner's split-all
candidates costed in every mode (`hybridflow plan` prints them)."""
import pytest

from hybridflow.errors import ConfigError
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner import cli, overlap
from hybridflow.planner.overlap import SplitStages, iteration_seconds

# Binary fractions: every sum and max below is exact in floating point, so == compares like with like.
SPLIT = ["placement.training=[0]", "placement.reference=[0]", "placement.critic=[0]", "placement.rollout=[1]"]
UPDATE_BOUND = SplitStages(rollout=0.25, sync=0.125, prep=0.75, update=1.0, stage=0.0625)
ROLLOUT_BOUND = SplitStages(rollout=4.0, sync=0.5, prep=0.75, update=1.0, stage=0.25)


def test_lock_step_is_the_serial_sum_and_skips_what_only_off_policy_adds():
    # sync + rollout + prep + update = 0.125 + 0.25 + 0.75 + 1.0 (no staged copy)
    assert iteration_seconds("sync", UPDATE_BOUND) == 2.125
    assert iteration_seconds("sync", ROLLOUT_BOUND) == 0.5 + 4.0 + 0.75 + 1.0


def test_one_step_is_the_sync_plus_the_slower_side():
    # update-bound: 0.125 + max(0.25, 0.75 + 1.0 + 0.0625) = 0.125 + 1.8125, against 2.125 lock step: the
    # rollout hidden, less the staged copy
    assert iteration_seconds("one_step", UPDATE_BOUND) == 1.9375
    # rollout-bound: 0.5 + max(4.0, 0.75 + 1.0 + 0.25) = 4.5, against 6.25 lock step
    assert iteration_seconds("one_step", ROLLOUT_BOUND) == 4.5
    # one_step ignores async's settings (it is k = 1, pushed every update)
    assert iteration_seconds("one_step", ROLLOUT_BOUND, max_staleness=5, sync_every=3) == 4.5


def test_async_is_one_step_at_sync_every_1_amortises_the_sync_beyond_and_is_lock_step_at_k_0():
    for s in (UPDATE_BOUND, ROLLOUT_BOUND):
        for k in (1, 2, 4):
            assert iteration_seconds("async", s, k) == iteration_seconds("one_step", s)
    # k = 2, every 2 updates: 0.5 / 2 + max(4.0, 0.75 + 1.0 + 0.25 / 2) = 0.25 + 4.0
    assert iteration_seconds("async", ROLLOUT_BOUND, 2, 2) == 4.25
    # update-bound, every 2: 0.125 / 2 + max(0.25, 1.75 + 0.0625 / 2) = 0.0625 + 1.78125
    assert iteration_seconds("async", UPDATE_BOUND, 2, 2) == 1.84375
    # k = 0: the lock step's schedule, with the staged copy: 0.5 + 4.0 + 0.75 + 1.0 + 0.25
    assert iteration_seconds("async", ROLLOUT_BOUND, 0) == 6.5


def test_bad_input_names_what_is_wrong():
    with pytest.raises(ValueError, match="mode must be one of"):
        iteration_seconds("overlap", UPDATE_BOUND)
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0, got -1"):
        iteration_seconds("async", UPDATE_BOUND, -1)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1, got 0"):
        iteration_seconds("async", UPDATE_BOUND, 2, 0)
    with pytest.raises(ValueError, match="SplitStages.sync must be >= 0 seconds, got -0.1"):
        SplitStages(rollout=1.0, sync=-0.1, prep=0.0, update=1.0)
    with pytest.raises(ValueError, match="SplitStages.rollout must be >= 0 seconds, got nan"):
        SplitStages(rollout=float("nan"), sync=0.0, prep=0.0, update=1.0)
    assert overlap.mode_label("async", 3) == "async k=3" and overlap.mode_label("one_step") == "one_step"


def test_the_planner_costs_a_rollout_apart_in_every_mode_and_ranks_the_runs_own(capsys):
    from hybridflow.config.loader import load_config
    from hybridflow.planner.devices import get_device
    from hybridflow.planner.roles import Workload
    from hybridflow.planner.search import Planner

    model = cli.resolve_model("hybridflow/assets/demo_model", "model.path")
    one = ParallelDims(tp=1, pp=1, dp=1)
    plans = {}
    for mode in ("sync", "one_step"):
        wl = Workload.from_config(load_config("configs/demo.yaml", [f"trainer.off_policy={mode}",
                                                                    *SPLIT,
                                                                    "trainer.n_devices=2"]))
        plans[mode] = Planner(model, wl, get_device("cpu")).split("split-all", {"rollout": 1, "actor": 1}, one,
                                                                 None, 1)
    sync, off = plans["sync"], plans["one_step"]
    assert list(sync.modes) == ["sync", "one_step", "async k=2"] and sync.mode == "sync"
    s = sync.split_stages
    # the demo's GRPO skips the old log-prob pass (one epoch, one mini-batch), off-policy as at lock step
    assert s.prep == 0 and s.stage > 0
    assert sync.iteration_s == sync.modes["sync"] == s.sync + s.rollout + s.prep + s.update
    assert sync.modes["one_step"] == s.sync + max(s.rollout, s.prep + s.update + s.stage)
    # a one_step run is ranked by its own mode, over the same stages
    assert off.mode == "one_step" and off.iteration_s == off.modes["one_step"] == sync.modes["one_step"]
    assert off.split_stages == s

    # `hybridflow plan` prints the column and the modes of the best candidate with its rollout apart
    assert cli.main(["configs/demo.yaml", "trainer.n_devices=2", "--gpus", "2", "--device", "cpu",
                     "--no-dry-run", "--top", "8"]) == 0
    out = capsys.readouterr().out
    assert "s: sync/1-step/k=2" in out and "off-policy modes with the rollout apart (split-all" in out
    assert "one_step" in out and "x lock step" in out
    # an off-policy run is planned on split-all alone (colocated cannot run it), and refused without it
    assert cli.main(["configs/demo.yaml", "trainer.n_devices=2", "trainer.off_policy=one_step", "--gpus", "2",
                     "--device", "cpu", "--no-dry-run"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert table and all("split-all" in line for line in table), out
    assert "<- the run's" in out and "'iter s' is the run's own (one_step)" in out
    with pytest.raises(ConfigError, match="trainer.off_policy: 'one_step' needs the rollout placed apart"):
        cli.main(["configs/demo.yaml", "trainer.off_policy=one_step", "--gpus", "2", "--placements", "colocated"])
