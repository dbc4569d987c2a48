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


@pytest.mark.timeout(600)
def test_bench_reshard_quick_prints_the_apart_syncs_against_the_formula(four_process_launch):
    """The apart case: ranks 0-1 train, 2-3 roll out. Every sync receives exactly the formula's bytes (the
    generation shard: half the model at tg = 2, all of it at tg = 1) and the plan's, over real gloo broadcasts,
and ends up holding exactly that shard of the training ranks' model."""
    out = four_process_launch["bench_reshard"].read_text()
    rows = {(r[0], r[1]): r for r in (line.split() for line in out.splitlines()) if r and r[0].startswith("apart-")}
    assert set(rows) == {(f"apart-{t}", tg) for t in ("t2d1", "t1d2") for tg in ("1", "2")}, out
    assert all(row[6] == "yes" and row[4] == row[5] for row in rows.values()), out  # received = formula = plan
    assert all(row[9] == "yes" for row in rows.values()), out  # each rollout rank holds its generation shard
    for t in ("t2d1", "t1d2"):
        # tg=2 receives about half of tg=1 (the norms are whole on both ranks: a little more than half)
        half, whole = float(rows[(f"apart-{t}", "2")][4]), float(rows[(f"apart-{t}", "1")][4])
        assert 0.5 <= half / whole < 0.52, out
    # at d = 2 into one tg = 2 replica the two training replicas share the sending: the busiest training rank
    # sends about half the model (one replica alone would send all of it)
    assert float(rows[("apart-t1d2", "2")][7]) < 0.6 * float(rows[("apart-t1d2", "1")][4]), out


@pytest.mark.timeout(600)
def test_bench_reshard_quick_prints_the_expert_parallel_switch_against_the_formula(four_process_launch):
    """The MoE case: at t2 x ep2 a switch receives the grouped gather's bytes plus the other DP rank's experts
    at its TP shard, half of the experts' TP shard (the formula, equal to the count); the generation model is
    the ep1 one's bit for bit."""
    out = four_process_launch["bench_reshard"].read_text()
    rows = {(r[0], r[1]): r for r in (line.split() for line in out.splitlines()) if r and r[0].startswith("t2-ep")}
    assert set(rows) == {(f"t2-ep{ep}", tg) for ep in ("1", "2") for tg in ("1", "2")}, out
    assert all(row[6] == "yes" and row[4] == row[5] and row[8] == "yes" for row in rows.values()), out
    for tg in ("1", "2"):
        extra = float(rows[("t2-ep2", tg)][4]) - float(rows[("t2-ep1", tg)][4])
        assert extra == pytest.approx(float(rows[("t2-ep2", tg)][7]) / 2, abs=0.01), out  # printed to 0.01 MiB
