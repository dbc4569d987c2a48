"""The cost model's seconds per step of every placement `bench async` runs (the rollout apart in each off-policy
mode, and colocated DP2), against a run recorded on this machine: the calibration (the demo's PPO step on 2
processes, and on one of them alone) and the runs were measured together by `hybridflow bench async --record`
(tests/planner/data/async_cpu_2proc.json). The test times nothing itself: it predicts from the recorded
calibration and compares with the recorded measurement."""
import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_async  # noqa: E402
import bench_calibrate  # noqa: E402

RECORDED = Path(__file__).with_name("data") / "async_cpu_2proc.json"


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RECORDED.read_text())


def predictions(recorded: dict, fitted, out: Path) -> dict[str, float]:
    args = argparse.Namespace(**recorded["args"])
    return {name: bench_async.predict_model(bench_async.run_config(name, bench_async.RUNS[name], args, out), r, fitted)
            for name, r in recorded["results"].items()}


@pytest.mark.xfail(strict=True, reason="recorded on a quiet machine (load 0.3-8): lock step with the rollout apart "
                   "within 1%, but the overlapped modes are predicted 26-35% fast (the model does not slow the "
                   "trainer while the rollout decodes beside it on the same cores) and colocated DP2 36% slow "
                   "(the fitted share, 0.38, slows both ranks' passes more than they slow): the model's next term")
def test_every_placement_is_predicted_within_15_percent_of_the_recorded_run(recorded, tmp_path):
    fitted = bench_calibrate.fitted_device(recorded["calibration"])
    assert set(recorded["results"]) == set(bench_async.RUNS)  # every placement and mode the bench runs
    got = predictions(recorded, fitted, tmp_path)
    # against the median step, as the bench reports it (the calibration's figures are stage medians too)
    errors = {name: got[name] / r["step_s"] - 1 for name, r in recorded["results"].items()}
    # 15%: the bound; what is left is the load's drift between the calibration and the runs, the
    # driver's share of a step and the weight sync's stalls, none of which the model sees
    assert all(abs(e) < 0.15 for e in errors.values()), errors


def test_the_split_runs_need_the_processes_shared_compute(recorded, tmp_path):
    """The term the split placements were missing: two processes on this machine's cores each compute slower
    while both do (the colocated DP2 update the calibration fits) than one alone (the rollout apart's trainer).
    The calibration measures the share from its one-process run; without it the split runs are predicted
    far slower than measured."""
    fitted = bench_calibrate.fitted_device(recorded["calibration"])
    assert fitted.device.compute_share < 0.8
    calibration = {k: v for k, v in recorded["calibration"].items() if k != "single"}
    unshared = bench_calibrate.fitted_device(calibration)  # fitted as before the one-process run existed
    assert unshared.device.compute_share == 1.0
    got = predictions(recorded, unshared, tmp_path)
    split = recorded["results"]["split sync"]["step_s"]
    assert got["split sync"] / split - 1 > 0.3


def test_the_share_slows_only_a_busy_node_and_bad_values_name_the_key():
    from hybridflow.errors import ConfigError
    from hybridflow.planner.devices import get_device, load_devices, parse_device

    cpu = get_device("cpu").with_efficiency(compute_share=0.5)
    assert cpu.busy_factor(1) == 1.0 and cpu.busy_factor(2) == 0.5 and cpu.busy_factor(8) == 0.5
    assert all(d.compute_share == 1.0 and d.busy_factor(d.devices_per_node) == 1.0 for d in load_devices().values())
    four = parse_device("x", {**_entry(), "devices_per_node": 4, "compute_share": 0.25})
    assert four.busy_factor(4) == 0.25 and four.busy_factor(2) == pytest.approx(1 / (1 + 1 / 3 * 3))
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ConfigError, match="x.compute_share"):
            parse_device("x", {**_entry(), "compute_share": bad})


def _entry() -> dict:
    return {"peak_tflops": 1, "memory_gib": 1, "memory_gbps": 1, "intra_gbps": 1, "inter_gbps": 1,
            "link_latency_us": 1, "layer_overhead_us": 1, "devices_per_node": 2,
            "efficiency": {"gemm": 0.5, "attention": 0.5, "decode": 0.5, "comm": 0.5}}
