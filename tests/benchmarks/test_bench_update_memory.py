"""`hybridflow bench update_memory`: the actor's old log-probs and update, output layer unfused vs fused."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_update_memory  # noqa: E402


@pytest.mark.timeout(300)
def test_both_variants_run_in_processes_of_their_own_and_agree(tmp_path, capsys):
    bench_update_memory.main(["--layers", "1", "--batch", "2", "--micro", "1", "--prompt", "8", "--response", "8",
                              "--vocab", "3000", "--hidden", "112", "--json", str(tmp_path / "m.json")])
    assert "fused / unfused" in capsys.readouterr().out
    unfused, fused = json.loads((tmp_path / "m.json").read_text())
    assert (unfused["fused"], fused["fused"]) == (False, True)
    for row in (unfused, fused):
        assert row["old_log_probs_mib"] >= 0 and row["update_mib"] >= 0 and row["update_s"] > 0
    # The same seeded model in both processes: the fused output layer gives the same log-probs.
    assert fused["old_log_prob_mean"] == pytest.approx(unfused["old_log_prob_mean"], abs=1e-5)


@pytest.mark.timeout(300)
def test_padded_and_packed_micro_batches_on_a_long_tail_agree(tmp_path, capsys):
    bench_update_memory.main(["--layers", "1", "--batch", "6", "--micro", "2", "--prompt", "8", "--response", "24",
                              "--vocab", "3000", "--hidden", "112", "--compare", "packing", "--long-tail",
                              "--json", str(tmp_path / "p.json")])
    assert "packed / padded" in capsys.readouterr().out
    padded, packed = json.loads((tmp_path / "p.json").read_text())
    assert (padded["variant"], packed["variant"]) == ("fused", "packed")
    assert padded["real_tokens"] == packed["real_tokens"] < 6 * (8 + 24)  # the tail left padding to skip
    assert packed["old_log_prob_mean"] == pytest.approx(padded["old_log_prob_mean"], abs=1e-5)
