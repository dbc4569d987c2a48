"""`hybridflow bench all`: every benchmark of benchmarks/ in one run, with time and peak memory per benchmark."""
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_all  # noqa: E402


def test_the_suite_names_every_benchmark_or_says_why_not():
    scripts = {p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py")}
    assert scripts == set(bench_all.SUITE) | set(bench_all.LEFT_OUT)


@pytest.mark.timeout(300)
def test_quick_runs_write_each_figure_and_a_summary(tmp_path, capsys):
    assert bench_all.main(["--quick", "--only", "layers,trl", "--json", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "all.json").read_text())
    assert summary["quick"] and list(summary["results"]) == ["layers", "trl"]
    for name, result in summary["results"].items():
        assert result["exit"] == 0 and result["seconds"] > 0 and result["peak_mib"] > 50, name
        assert (tmp_path / f"{name}.json").is_file()  # each benchmark's own figures
    assert "peak MiB" in capsys.readouterr().out


def test_a_failing_benchmark_is_reported_and_the_rest_still_run(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(bench_all, "run_one", lambda name, argv: ran.append(name) or
                        {"seconds": 1.0, "peak_mib": 100.0, "exit": 3 if name == "kernels" else 0})
    assert bench_all.main(["--quick", "--only", "kernels,layers"]) == 1
    assert ran == ["kernels", "layers"] and "FAILED (exit 3)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_all.main(["--only", "csrc"])  # left out, with the reason
    assert "compares two builds" in capsys.readouterr().err
