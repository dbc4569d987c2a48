"""`hybridflow bench moe`: an MoE model's update at ep 1 and 2 on 2 processes, and MoE decoding beside dense."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_moe  # noqa: E402


@pytest.mark.timeout(400)
def test_ep2_halves_each_ranks_experts_and_the_dispatcher_moves_what_the_formula_says(tmp_path):
    """Counted, not timed: at ep = 2 a rank's expert parameters and their Adam moments are half of ep = 1's
    (the issue's target: at most 0.55), the rest unchanged; the allgather dispatcher's bytes (megatron-core's
    all-gathers and reduce-scatters, counted as they run) equal `dispatch_bytes`, and none move at ep = 1."""
    bench_moe.main(["--tokens", "256", "--steps", "1", "--layers", "1", "--decode-tokens", "4", "--decode-batch", "2",
                    "--json", str(tmp_path / "moe.json")])
    one, two = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert (one["ep"], two["ep"]) == (1, 2)
    assert two["expert_ratio"] <= 0.55
    for a, b in zip(one["ranks"], two["ranks"]):
        assert b["expert_param_bytes"] * 2 == a["expert_param_bytes"]
        assert a["param_bytes"] - a["expert_param_bytes"] == b["param_bytes"] - b["expert_param_bytes"]
        assert a["dispatch_bytes"] == 0 and b["dispatch_bytes"] == two["formula_dispatch_bytes"]
