"""`hybridflow bench trl`: the issue's tiny GRPO work, hybridflow's side (TRL is not a dependency)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_trl  # noqa: E402


@pytest.mark.timeout(300)
def test_hybridflow_side_runs_the_tiny_grpo_work(tmp_path, capsys):
    assert bench_trl.main(["--steps", "1", "--warmup", "1", "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "random Qwen2, 99,904 parameters" in out and "hybridflow" in out
    res = json.loads((tmp_path / "t.json").read_text())["hybridflow"]
    assert res["step_s"] > 0 and 1 <= res["answer_tokens"] <= bench_trl.NEW_TOKENS
    assert res["stages"]["rollout"] > 0 and res["stages"]["update"] > 0


@pytest.mark.timeout(300)
def test_a_python_without_trl_is_named():
    with pytest.raises(SystemExit, match=f"the TRL side failed .* in {sys.executable}"):
        bench_trl.main(["--steps", "1", "--warmup", "0", "--trl-python", sys.executable])
