"""The reshard benchmark runs end to end on 4 processes (quick sizes); counts are checked, times are not."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bench_reshard_quick_prints_the_three_groupings():
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "bench", "reshard", "--quick", "--repeats", "1"],
                          capture_output=True, text=True, timeout=280, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r[0], r[1]): r for r in (line.split() for line in proc.stdout.splitlines())
            if r and r[0] in ("1", "2")}
    assert {name for _, name in rows} == {"hybridflow", "vanilla", "full"}, proc.stdout
    # tg=2 at t=4: each rank receives (t - tg) / (tg * t) = 1/4 of the model, in one bucketed collective
    hybridflow = rows[("2", "hybridflow")]
    assert hybridflow[5] == "0.250" and hybridflow[7] == "1", proc.stdout
    assert rows[("2", "full")][5] == rows[("2", "vanilla")][5] == "0.750", proc.stdout
    assert all(row[6] == "yes" for row in rows.values()), proc.stdout  # every executor moved the plan's bytes
    assert int(hybridflow[8]) < int(rows[("2", "vanilla")][8]), proc.stdout  # no whole stage held before a cut
