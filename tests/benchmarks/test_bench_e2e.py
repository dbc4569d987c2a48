"""`hybridflow bench e2e`: one GRPO and one PPO step on the demo, split by stage, with --json."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_e2e  # noqa: E402


@pytest.mark.timeout(300)
def test_bench_e2e_splits_a_grpo_and_a_ppo_step_into_its_stages(tmp_path, capsys):
    assert bench_e2e.main(["--steps", "1", "--warmup", "1", "--json", str(tmp_path / "e2e.json")]) == 0
    out = capsys.readouterr().out
    assert "grpo step" in out and "ppo step" in out and "tokens/s" in out
    results = json.loads((tmp_path / "e2e.json").read_text())["results"]
    grpo, ppo = results["grpo"], results["ppo"]
    for res in (grpo, ppo):
        assert res["rollout"] > 0 and res["update"] > 0 and res["tokens_per_s"] > 0
        # The stages add up to the step ("other" is the remainder, small and never hidden work).
        assert sum(res[name] for name in bench_e2e.STAGES) == pytest.approx(res["step"])
        assert 0 <= res["other"] < 0.2 * res["step"]
    assert grpo["values"] == 0 and ppo["values"] > 0 and ppo["log_probs"] > 0  # PPO has a critic and a reference
    assert grpo["log_probs"] == 0  # one epoch, one mini-batch: skipped (the pass would change nothing)
    assert 0 < grpo["shipped_mb"] < ppo["shipped_mb"]  # PPO also ships rows to its critic and reference
    # The process's resident peak over the timed steps: at least torch, megatron-core and the demo model.
    assert grpo["peak_mib"] > 200 and ppo["peak_mib"] > 200 and "peak RSS MiB" in out


def test_baseline_and_candidate_take_turns_and_are_summarised_over_rounds(monkeypatch, capsys):
    """--baseline runs in ABBA order (a drifting machine falls on both alike); each figure is the median over
    rounds of the rounds' figures. The runs themselves are stubbed here: the test above runs a real one."""
    order, step = [], iter([1.0, 2.0, 9.0])  # the candidate's three rounds: median 2.0
    figures = lambda seconds: {**{name: 0.0 for name in bench_e2e.STAGES}, "update": seconds, "step": seconds,
                               "tokens": 10.0, "answer_tokens": 5.0, "tokens_per_s": 10.0 / seconds, "code": "x",
                               "shipped_mb": 1.0, "peak_mib": 100.0 * seconds}
    monkeypatch.setattr(bench_e2e, "run_baseline", lambda rev, argv: order.append("base") or {"grpo": figures(4.0)})
    monkeypatch.setattr(bench_e2e, "measure", lambda algo, *a: order.append("ours") or figures(next(step)))
    assert bench_e2e.main(["--algo", "grpo", "--baseline", "REV", "--rounds", "3"]) == 0
    assert order == ["base", "ours", "ours", "base", "base", "ours"]
    out = capsys.readouterr().out.splitlines()
    line = next(row for row in out if row.strip().startswith("step"))
    assert line.split()[1:4] == ["4.0000", "2.0000", "0.50x"]
    peak = next(row for row in out if row.strip().startswith("peak RSS MiB"))
    assert peak.split()[3:6] == ["400", "200", "0.50x"]  # the peak, side by side, over the rounds too
