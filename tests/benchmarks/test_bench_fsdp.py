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
    # At two ranks the sharded reference peaks below the whole model on each rank (megatron-core at dp = 2):
    # measured 0.81x at this size (0.72x at the bench's default size, 0.48x at four ranks; docs/results.md,
    # "FSDP2 memory"). Resident marks are page-granular (KiB) and the machine's load does not move them;
    # the bound 0.9x leaves room for the allocator's slack. (The reward model's units are a whole layer, so
    # at this small size its peak at two ranks equals the whole model's: not asserted.)
    row = frozen["reference", 2]
    assert row["peak_mib"] < 0.9 * row["whole_model_peak_mib"], row
