"""The reshard benchmark runs end to end on 4 processes (quick sizes, in the suite's one 4-process launch,
tests/conftest.py); counts are checked, times are not."""
import pytest


@pytest.mark.timeout(600)
def test_bench_reshard_quick_prints_the_three_groupings(four_process_launch):
    out = four_process_launch["bench_reshard"].read_text()
    rows = {(r[0], r[1]): r for r in (line.split() for line in out.splitlines()) if r and r[0] in ("1", "2")}
    assert {name for _, name in rows} == {"hybridflow", "vanilla", "full"}, out
    # tg=2 at t=4: each rank receives (t - tg) / (tg * t) = 1/4 of the model, in one bucketed collective
    hybridflow = rows[("2", "hybridflow")]
    assert hybridflow[5] == "0.250" and hybridflow[7] == "1", out
    assert rows[("2", "full")][5] == rows[("2", "vanilla")][5] == "0.750", out
    assert all(row[6] == "yes" for row in rows.values()), out  # every executor moved the plan's bytes
    assert int(hybridflow[8]) < int(rows[("2", "vanilla")][8]), out  # no whole stage held before a cut
