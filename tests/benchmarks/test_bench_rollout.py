"""The rollout benchmark runs end to end (quick sizes); its figures are not asserted."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_rollout_quick_prints_both_engines():
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "bench", "rollout", "--quick"],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ours tok/s" in proc.stdout and "HF tok/s" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "4", "1", "4"], proc.stdout  # greedy, then sampled
    assert "sampled (temperature 1)" in proc.stdout and "mean length ours" in proc.stdout
