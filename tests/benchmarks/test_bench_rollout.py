"""The rollout benchmark runs end to end (quick sizes); its timings are not asserted."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_rollout_quick_prints_both_engines(tmp_path):
    out = tmp_path / "rollout.json"
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "bench", "rollout", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ours tok/s" in proc.stdout and "HF tok/s" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "4", "1", "4"], proc.stdout  # greedy, then sampled
    assert "sampled (temperature 1)" in proc.stdout and "mean length ours" in proc.stdout
    assert "multi-turn agent episodes" in proc.stdout and "kept / re-prefill: prefill tokens" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r.get("batch")) for r in rows] == [("greedy", 1), ("greedy", 4), ("sampled", 1),
                                                               ("sampled", 4), ("turns", None)]
    for row in rows[:4]:  # both engines' peak memory, measured in the same run
        assert set(row["peak_mib"]) == {"ours", "hf"} and None not in row["peak_mib"].values(), row
    turns = rows[4]  # the kept cache and re-prefill on the same keyed episodes: the same tokens, less prefill
    assert turns["same"] == 1.0 and turns["prefill_ratio"] < 1, turns
