"""`hybridflow bench fsdp`: peak memory per rank of frozen models and of the actor's update under FSDP2."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fsdp  # noqa: E402


@pytest.mark.timeout(400)
def test_quick_run_tables_every_span_at_two_ranks(tmp_path, capsys):
    """One launch (the N = 1 one is left to the bench itself: the suite's time)."""
    bench_fsdp.main(["--quick", "--ranks", "2", "--json", str(tmp_path / "f.json")])
    out = capsys.readouterr().out
    assert "frozen models" in out and "actor update" in out and "target" in out
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    frozen = {(r["model"], r["world"]): r for r in rows if r["model"] != "actor"}
    actor = {r["world"]: r for r in rows if r["model"] == "actor"}
    assert set(frozen) == {(m, 2) for m in ("reference", "reward")} and set(actor) == {2}
    for row in rows:
        assert all(v > 0 for k, v in row.items() if k.endswith("_mib")), row
    # At two ranks the sharded models peak well below the whole model on each rank (megatron-core at dp = 2;
    # the HF classifier): measured 0.62x (reference) and 0.60x (reward) at this size, each unit gathered once
    # into its parameters (engine/fsdp_comm.py); before, 0.81x and about 1.0x (units a whole MLP or layer,
    # held two or three times while gathered). Resident marks are page-granular (KiB) and the machine's load does not
    # move them; the bounds leave room for the allocator's slack. The reward model is within its target
    # (1.1/N + one layer) by 1.9 MiB here; the reference by 0.2 MiB only, so that is not asserted.
    reference, reward = frozen["reference", 2], frozen["reward", 2]
    assert reference["peak_mib"] < 0.7 * reference["whole_model_peak_mib"], reference
    assert reward["peak_mib"] < 0.7 * reward["whole_model_peak_mib"] and reward["within"], reward
