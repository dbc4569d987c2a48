"""`hybridflow bench fsdp`: peak memory per rank of frozen models and of the actor's update under FSDP2."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fsdp  # noqa: E402


@pytest.mark.timeout(400)
def test_quick_run_tables_every_span_at_one_and_two_ranks(tmp_path, capsys):
    bench_fsdp.main(["--quick", "--json", str(tmp_path / "f.json")])
    out = capsys.readouterr().out
    assert "frozen models" in out and "actor update" in out and "target" in out
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    frozen = {(r["model"], r["world"]): r for r in rows if r["model"] != "actor"}
    actor = {r["world"]: r for r in rows if r["model"] == "actor"}
    assert set(frozen) == {(m, n) for m in ("reference", "reward") for n in (1, 2)} and set(actor) == {1, 2}
    for row in rows:
        assert all(v > 0 for k, v in row.items() if k.endswith("_mib")), row
    # Tensor bytes are counted, not sampled: the same code gives the same figures. At two ranks the sharded
    # reference peaks below the whole model on each rank (megatron-core at dp = 2).
    assert frozen["reference", 2]["peak_mib"] < frozen["reference", 2]["whole_model_peak_mib"]
    # At one rank FSDP shards nothing: its weights are the whole model's.
    assert frozen["reference", 1]["peak_mib"] >= frozen["reference", 1]["whole_mib"]
