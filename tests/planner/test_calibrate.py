"""Calibration against measurement: fit the CPU spec to one `bench e2e` run on 2 processes, then predict
another run's stage times (half the batch) within 30%.

The figures are measured on this machine by `hybridflow bench calibrate --record` (both runs taking turns,
the load recorded beside them) and kept in data/calibration_cpu_2proc.json, so the test checks the cost
model against measurement without timing anything itself; the benchmark measures them again.
"""
import json
import sys
from pathlib import Path

import pytest

from hybridflow.errors import ConfigError
from hybridflow.planner import calibrate, cli
from hybridflow.planner.devices import get_device

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_calibrate  # noqa: E402
import bench_e2e  # noqa: E402

RECORDED = Path(__file__).with_name("data") / "calibration_cpu_2proc.json"
TWO_PROCESSES = bench_calibrate.TWO_PROCESSES


def test_a_fit_on_one_measured_run_predicts_another_within_30_percent():
    recorded = json.loads(RECORDED.read_text())
    fitted, predicted, errors = bench_calibrate.fit_and_predict(recorded)
    assert set(bench_calibrate.STAGES) <= set(errors)
    assert all(abs(e) < 0.3 for e in errors.values()), errors
    # The fit moved the factors off the file's placeholders (a fit that changed nothing would pass vacuously).
    assert fitted.device.efficiency["gemm"] != get_device("cpu").efficiency["gemm"]
    # The prediction is the model's, not the measurement read back: the half batch's update is predicted
    # from the full batch's fit, at about half its time.
    assert 0.3 < predicted["update"] / recorded["full"]["update"] < 0.7


def test_the_fit_reproduces_the_stages_it_was_fitted_to_and_the_cli_reports_it(tmp_path, capsys):
    """In-sample: after the fit, the update and rollout are the measured ones; `--calibrate` prints the table.
    (The figures are a bench file's shape with round numbers; the test above reads measured ones.)"""
    figures = {"rollout": 0.06, "reward": 0.001, "log_probs": 0.12, "values": 0.07, "advantages": 0.0,
               "update": 0.78, "transition": 0.003, "other": 0.002, "step": 1.0, "tokens": 7168.0,
               "answer_tokens": 5.0}
    planner = bench_calibrate.planner_for(TWO_PROCESSES, figures)
    fitted = calibrate.fit(bench_calibrate.evaluate(planner), get_device("cpu"), figures)
    predicted = fitted.scale(calibrate.bench_stages(bench_calibrate.evaluate(planner)(fitted.device)))
    for stage in ("rollout", "update", "log_probs", "values"):
        assert predicted[stage] == pytest.approx(figures[stage], rel=0.02), stage
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": {"ppo": figures}}))
    assert cli.main(["configs/demo.yaml", *bench_e2e.ALGOS["ppo"], *TWO_PROCESSES, "--gpus", "2", "--device", "cpu",
                     "--calibrate", str(path), "--no-dry-run", "--top", "1"]) == 0
    assert "calibrated on" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--calibrate-algo: .* holds \\['ppo'\\], not 'grpo'"):
        cli.main(["configs/demo.yaml", "--gpus", "2", "--calibrate", str(path), "--calibrate-algo", "grpo"])
    path.write_text("[]")
    with pytest.raises(ConfigError, match="not the JSON of `hybridflow bench e2e --json`"):
        cli.main(["configs/demo.yaml", "--gpus", "2", "--calibrate", str(path)])
