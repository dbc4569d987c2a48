"""`hybridflow bench async` at a quick size: an off-policy run with the rollout apart, printed with the
planner's predicted seconds per step beside the measured ones. Columns and finiteness are checked, not times."""
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_async  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
def test_bench_async_quick_prints_the_planners_prediction_beside_each_measured_mode(tmp_path, capsys):
    path = tmp_path / "async.json"
    # 2 timed steps: the second submits the third batch, whose weight sync (version 1) falls in the timed steps
    recorded = Path(__file__).resolve().parents[1] / "planner" / "data" / "calibration_cpu_2proc.json"
    assert bench_async.main(["--steps", "2", "--warmup", "1", "--prompts", "8", "--val", "8",
                             "--only", "split one_step", "--json", str(path), "--calibration", str(recorded),
                             "--record", str(tmp_path / "record.json")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("run "))
    assert header.split()[-8:] == ["s/step", "median", "model", "s", "error", "stages", "s", "error"], header
    row = next(line for line in out.splitlines() if line.startswith("split one_step"))
    cells = row.split()
    assert len(cells) == 2 + 8 + 6, row  # the name, 8 measured columns, then s/step, its median and 4 predicted
    r = json.loads(path.read_text())["results"]["split one_step"]
    for key in ("mean_step_s", "step_s", "predicted_model_s", "predicted_stages_s", "error_model", "error_stages"):
        assert math.isfinite(r[key]), (key, r[key])
    assert r["predicted_model_s"] > 0 and r["predicted_stages_s"] > 0 and r["mean_step_s"] > 0
    # the errors are the printed predictions over the measured step, not numbers of their own
    assert r["error_model"] == r["predicted_model_s"] / r["step_s"] - 1
    assert r["error_model_mean"] == r["predicted_model_s"] / r["mean_step_s"] - 1
    assert r["error_stages"] == r["predicted_stages_s"] / r["mean_step_s"] - 1
    # an off-policy run's weight syncs are measured (the stages model takes them out of the rollout's time);
    # one optimizer step a batch: no proximal log-prob pass (the update's own log-probs are the proximal ones)
    assert r["sync_s"] > 0 and r["stages_s"].get("log_probs_s", 0.0) == 0.0
    # ... and the update, which fetches the sampler's log-probs from the object store (`driver_rows.token_rows`),
    # reports the sampler-trainer gap
    assert math.isfinite(r["k3_kl"]) and r["driver_received_bytes"] > 0
    # the record holds what the split-prediction test recomputes the model from
    rec = json.loads((tmp_path / "record.json").read_text())
    assert set(rec["calibration"]) == {"full", "half"} and set(rec["results"]) == {"split one_step"}
    assert rec["results"]["split one_step"]["mean_step_s"] == r["mean_step_s"] and rec["args"]["prompts"] == 8
